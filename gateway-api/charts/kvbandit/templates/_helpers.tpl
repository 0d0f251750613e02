{{/* The chart's name. */}}
{{- define "kvbandit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: the Deployment, Service, ConfigMap, Role. */}}
{{- define "kvbandit.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvbandit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvbandit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvbandit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvbandit.labels" -}}
helm.sh/chart: {{ include "kvbandit.chart" . }}
{{ include "kvbandit.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvbandit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvbandit.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvbandit.poolName" -}}
{{- default (include "kvbandit.fullname" .) .Values.pool.name }}
{{- end }}

{{- define "kvbandit.poolNamespace" -}}
{{- default .Release.Namespace .Values.pool.namespace }}
{{- end }}

{{/* Active-active sync over NATS: on with sync.nats.servers. */}}
{{- define "kvbandit.sync" -}}
{{- if .Values.sync.nats.servers }}true{{ end }}
{{- end }}

{{/* The Secret with the replicas' NATS credentials: the existing one, or the generated one. */}}
{{- define "kvbandit.natsSecret" -}}
{{- if eq .Values.sync.nats.auth "generated" }}{{ include "kvbandit.fullname" . }}-nats-auth{{ else }}{{ .Values.sync.nats.existingSecret }}{{ end }}
{{- end }}

{{/* The replicas' NATS subject prefix (routing/sync: kvbandit.<pool>, the pool's dots as _). */}}
{{- define "kvbandit.natsSubject" -}}
{{- if .Values.sync.nats.subjectPrefix }}{{ .Values.sync.nats.subjectPrefix }}
{{- else if .Values.pool.standalone }}kvbandit.default
{{- else }}kvbandit.{{ include "kvbandit.poolName" . | replace "." "_" }}
{{- end }}
{{- end }}

{{/* How the replicas pass their NATS credentials: userPassword (generated too), token, creds or none. */}}
{{- define "kvbandit.natsAuth" -}}
{{- if eq .Values.sync.nats.auth "generated" }}userPassword{{ else }}{{ .Values.sync.nats.auth }}{{ end }}
{{- end }}

{{/* Leader election: on with more than one replica and no sync, or when forced. */}}
{{- define "kvbandit.leaderElect" -}}
{{- if or (and (gt (int .Values.replicas) 1) (not (include "kvbandit.sync" .))) .Values.leaderElection.enabled }}true{{ end }}
{{- end }}

{{/* The --config file: .Values.config, plus sync.nats's files and names. */}}
{{- define "kvbandit.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- $n := .Values.sync.nats }}
{{- if include "kvbandit.sync" . }}
{{- $sync := deepCopy (default (dict) (get $cfg "sync")) }}
{{- $nats := deepCopy (default (dict) (get $sync "nats")) }}
{{- if eq $n.auth "creds" }}
{{- $_ := set $nats "creds_file" "/etc/kvbandit/nats-creds/creds" }}
{{- end }}
{{- if eq $n.auth "none" }}
{{- $_ := set $sync "allow_anonymous" true }}
{{- end }}
{{- if $n.tls.secretName }}
{{- $tls := dict "ca" "/etc/kvbandit/nats-tls/ca.crt" }}
{{- if $n.tls.mtls }}
{{- $_ := set $tls "cert" "/etc/kvbandit/nats-tls/tls.crt" }}
{{- $_ := set $tls "key" "/etc/kvbandit/nats-tls/tls.key" }}
{{- end }}
{{- with $n.tls.serverName }}
{{- $_ := set $tls "server_name" . }}
{{- end }}
{{- $_ := set $nats "tls" $tls }}
{{- end }}
{{- with $n.subjectPrefix }}
{{- $_ := set $nats "subject_prefix" . }}
{{- end }}
{{- if $nats }}
{{- $_ := set $sync "nats" $nats }}
{{- end }}
{{- if $sync }}
{{- $_ := set $cfg "sync" $sync }}
{{- end }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{- define "kvbandit.leaseName" -}}
{{- default (include "kvbandit.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* Checks that fail the render with a message instead of an invalid object. */}}
{{- define "kvbandit.validate" -}}
{{- if lt (int .Values.replicas) 1 }}
{{- fail "replicas must be at least 1" }}
{{- end }}
{{- if and .Values.tls.secretName .Values.tls.selfSigned }}
{{- fail "tls.secretName and tls.selfSigned are exclusive" }}
{{- end }}
{{- if and .Values.tls.clientCASecretName (not (or .Values.tls.secretName .Values.tls.selfSigned)) }}
{{- fail "tls.clientCASecretName needs TLS: set tls.secretName or tls.selfSigned" }}
{{- end }}
{{- if empty .Values.pool.selector }}
{{- fail "pool.selector needs at least one label" }}
{{- end }}
{{- if or (empty .Values.pool.targetPorts) (gt (len .Values.pool.targetPorts) 8) }}
{{- fail "pool.targetPorts needs 1 to 8 ports" }}
{{- end }}
{{- if not (has .Values.pool.failureMode (list "FailOpen" "FailClose")) }}
{{- fail "pool.failureMode is FailOpen or FailClose" }}
{{- end }}
{{- if and .Values.pool.create (not .Values.pool.standalone) (ne (include "kvbandit.poolNamespace" .) .Release.Namespace) }}
{{- fail "pool.create: the pool's endpointPickerRef is a local reference, so install the release in pool.namespace" }}
{{- end }}
{{- $n := .Values.sync.nats }}
{{- if not (has $n.auth (list "generated" "userPassword" "token" "creds" "none")) }}
{{- fail "sync.nats.auth is generated, userPassword, token, creds or none" }}
{{- end }}
{{- if and (not $n.servers) (or (not (has $n.auth (list "generated" "none"))) $n.existingSecret $n.tls.secretName $n.tls.mtls $n.subjectPrefix) }}
{{- fail "sync.nats.* needs sync.nats.servers" }}
{{- end }}
{{- if ne (has $n.auth (list "generated" "none")) (empty $n.existingSecret) }}
{{- fail "sync.nats.existingSecret goes with sync.nats.auth userPassword, token or creds (and only with them)" }}
{{- end }}
{{- if and (eq $n.auth "generated") (not (regexMatch "^[A-Za-z0-9_.-]{1,64}$" (toString $n.generatedUser))) }}
{{- fail "sync.nats.generatedUser: 1 to 64 letters, digits, _ . -" }}
{{- end }}
{{- if and $n.tls.mtls (not $n.tls.secretName) }}
{{- fail "sync.nats.tls.mtls needs sync.nats.tls.secretName (ca.crt, tls.crt, tls.key)" }}
{{- end }}
{{- if and .Values.httpRoute.enabled .Values.pool.standalone }}
{{- fail "httpRoute.enabled needs an InferencePool (pool.standalone is true)" }}
{{- end }}
{{- end }}
