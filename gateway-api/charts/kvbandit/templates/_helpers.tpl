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
{{- if not (has $n.auth (list "" "userPassword" "token" "creds")) }}
{{- fail "sync.nats.auth is \"\", userPassword, token or creds" }}
{{- end }}
{{- if and (not $n.servers) (or $n.auth $n.existingSecret $n.tls.secretName $n.tls.mtls $n.subjectPrefix) }}
{{- fail "sync.nats.* needs sync.nats.servers" }}
{{- end }}
{{- if ne (empty $n.auth) (empty $n.existingSecret) }}
{{- fail "sync.nats.auth and sync.nats.existingSecret go together" }}
{{- end }}
{{- if and $n.tls.mtls (not $n.tls.secretName) }}
{{- fail "sync.nats.tls.mtls needs sync.nats.tls.secretName (ca.crt, tls.crt, tls.key)" }}
{{- end }}
{{- if and .Values.httpRoute.enabled .Values.pool.standalone }}
{{- fail "httpRoute.enabled needs an InferencePool (pool.standalone is true)" }}
{{- end }}
{{- end }}
