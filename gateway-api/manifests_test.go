package gatewayapi_test

// The Gateway API manifests and the Helm chart, validated by a real API server
// (kubeenv: kube-apiserver on etcd, with the GIE v1.5.0 CRDs and the Gateway
// API HTTPRoute CRD installed) with server-side dry-run apply, and by real
// helm (lint, template). Nothing is skipped: a missing binary fails the test.

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"github.com/kvbandit/kvbandit/routing"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/kvbandit/kvbandit/internal/app"
	"github.com/kvbandit/kvbandit/internal/testenv"
	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
)

const (
	// gatewayAPIModule holds the Gateway API CRDs (HTTPRoute) at the version
	// GIE v1.5.0 validates its own manifests against (hack/verify-manifests.sh,
	// GATEWAY_API_VERSION); gatewayAPISum pins its content.
	gatewayAPIModule = "sigs.k8s.io/gateway-api@v1.3.0"
	gatewayAPISum    = "h1:q6okN+/UKDATola4JY7zXzx40WO4VISk7i9DIfOvr9M="
	// promOperatorModule holds the Prometheus Operator's PrometheusRule CRD
	// (the chart's monitoring.rules.prometheusRule); promOperatorSum pins it.
	promOperatorModule = "github.com/prometheus-operator/prometheus-operator@v0.79.2"
	promOperatorSum    = "h1:H/HCiMS4dXQyiFHw28PFlWMh15YUraL3MFe8u7k7dGA="

	testNS    = "kvbandit-manifests"
	chartDir  = "charts/kvbandit"
	release   = "kvb"
	applyWait = 30 * time.Second
)

func TestManifestsAndChart(t *testing.T) {
	c := kubeenv.Start(t)
	c.CreateNamespace(t, testNS)
	installGatewayAPICRDs(t, c)
	installPrometheusRuleCRD(t, c)

	t.Run("manifests", func(t *testing.T) {
		files, err := filepath.Glob("manifests/*.yaml")
		if err != nil {
			t.Fatal(err)
		}
		examples, _ := filepath.Glob("manifests/examples/*.yaml")
		files = append(files, examples...)
		for _, want := range []string{"manifests/inferencepool.yaml", "manifests/httproute.yaml", "manifests/kvbandit.yaml",
			"manifests/examples/vllm.yaml", "manifests/examples/sglang.yaml"} {
			if !slices.Contains(files, want) {
				t.Errorf("%s is missing", want)
			}
		}
		var all []object
		for _, f := range files {
			raw, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			objs := decode(t, f, raw)
			for i := range objs {
				objs[i].setNamespace(testNS)
			}
			all = append(all, objs...)
			t.Run(filepath.Base(f), func(t *testing.T) {
				serverDryRun(t, c, objs)
			})
		}
		checkPicker(t, all, "vllm-qwen3", "kvbandit", false)
		checkServeArgs(t, "manifests/kvbandit.yaml", containerArgs(t, find(all, "Deployment", "kvbandit")))
		checkImage(t, find(all, "Deployment", "kvbandit"), "ghcr.io/kvbandit/kvbandit:"+appVersion(t))
		checkExamples(t, all)
	})

	helm := testenv.Tool(t, "helm")
	t.Run("helm lint", func(t *testing.T) {
		run(t, helm, "lint", "--strict", chartDir)
		run(t, helm, "lint", "--strict", chartDir, "--set", "replicas=2,tls.secretName=kvb-tls,tls.clientCASecretName=kvb-ca")
		run(t, helm, "lint", "--strict", chartDir, "--set", "pool.standalone=true,tls.selfSigned=true")
		run(t, helm, "lint", "--strict", chartDir, "--set", "replicas=3,sync.nats.servers={nats://nats:4222},sync.nats.auth=token,sync.nats.existingSecret=kvb-nats")
		run(t, helm, "lint", "--strict", chartDir, "--set", "replicas=3,sync.nats.servers={nats://nats:4222}")
		run(t, helm, "lint", "--strict", chartDir, "--set", "replicas=3,sync.nats.servers={nats://nats:4222},sync.nats.auth=none")
		run(t, helm, "lint", "--strict", chartDir, "--set", "monitoring.dashboard.enabled=true,monitoring.rules.configMap=true,monitoring.rules.prometheusRule=true")
	})

	cases := []struct {
		name   string
		set    []string
		leader bool
		check  func(t *testing.T, args []string, objs []object)
	}{
		{name: "defaults", check: func(t *testing.T, args []string, objs []object) {
			for _, f := range []string{"--tls-cert", "--tls-self-signed", "--tls-client-ca", "--kube-selector"} {
				if hasFlag(args, f) {
					t.Errorf("default render has %s", f)
				}
			}
			if find(objs, "HTTPRoute", "") != nil {
				t.Error("default render has an HTTPRoute (httpRoute.enabled is false)")
			}
			if find(objs, "PrometheusRule", "") != nil || find(objs, "ConfigMap", release+"-kvbandit-dashboard") != nil ||
				find(objs, "ConfigMap", release+"-kvbandit-rules") != nil {
				t.Error("default render has monitoring objects (monitoring.* is off)")
			}
			checkImage(t, find(objs, "Deployment", ""), "ghcr.io/kvbandit/kvbandit:"+appVersion(t))
		}},
		{name: "replicas=2 tls", leader: true,
			set: []string{"replicas=2", "tls.secretName=kvb-tls", "tls.clientCASecretName=kvb-ca", "httpRoute.enabled=true",
				"config.router.block_size=64", "policy=kv"},
			check: func(t *testing.T, args []string, objs []object) {
				for _, f := range []string{"--tls-cert=/etc/kvbandit/tls/tls.crt", "--tls-key=/etc/kvbandit/tls/tls.key",
					"--tls-client-ca=/etc/kvbandit/client-ca/ca.crt", "--leader-elect-lease-name=" + release + "-kvbandit",
					"--leader-elect-namespace=$(POD_NAMESPACE)", "--policy=kv"} {
					if !slices.Contains(args, f) {
						t.Errorf("args lack %s: %q", f, args)
					}
				}
				d := find(objs, "Deployment", "")
				vols := fmt.Sprint(d.get("spec", "template", "spec", "volumes"))
				if !strings.Contains(vols, "secretName:kvb-tls") || !strings.Contains(vols, "secretName:kvb-ca") {
					t.Errorf("TLS secrets not mounted: %s", vols)
				}
				if cfg := configOf(t, objs); cfg.Router.BlockSize != 64 || cfg.PrefixState.MaxEntries != 100000 {
					t.Errorf("config.router.block_size=64 not merged into the defaults: %+v %+v", cfg.Router, cfg.PrefixState)
				}
				r := find(objs, "HTTPRoute", "")
				if r == nil {
					t.Fatal("no HTTPRoute with httpRoute.enabled")
				}
				checkRoute(t, r, release+"-kvbandit")
			}},
		{name: "standalone self-signed", set: []string{"pool.standalone=true", "pool.targetPorts={8000,8001}",
			"pool.selector.app=sglang", "pool.selector.tier=gpu", "tls.selfSigned=true", "leaderElection.enabled=true"}, leader: true,
			check: func(t *testing.T, args []string, objs []object) {
				for _, f := range []string{"--kube-selector=app=sglang,tier=gpu", "--kube-target-ports=8000,8001", "--tls-self-signed",
					"--tls-hosts=kvb-kvbandit,kvb-kvbandit." + testNS + ",kvb-kvbandit." + testNS + ".svc,kvb-kvbandit." + testNS + ".svc.cluster.local,localhost,127.0.0.1"} {
					if !slices.Contains(args, f) {
						t.Errorf("args lack %s: %q", f, args)
					}
				}
				if hasFlag(args, "--pool-name") || find(objs, "InferencePool", "") != nil {
					t.Error("standalone render names or creates an InferencePool")
				}
				if rules := fmt.Sprint(find(objs, "Role", release+"-kvbandit").get("rules")); strings.Contains(rules, "inferencepools") || strings.Contains(rules, "inferenceobjectives") {
					t.Error("standalone Role grants inferencepools or inferenceobjectives")
				}
			}},
		{name: "replicas=3 sync active-active", leader: false,
			set: []string{"replicas=3", "sync.nats.servers={nats://nats.nats:4222,nats://nats-2.nats:4222}", "sync.nats.auth=userPassword",
				"sync.nats.existingSecret=kvb-nats", "sync.nats.tls.secretName=kvb-nats-tls", "sync.nats.tls.mtls=true",
				"sync.nats.tls.serverName=nats.internal", "sync.nats.subjectPrefix=kvbandit.prod", "config.sync.peer_ttl_ms=5000"},
			check: func(t *testing.T, args []string, objs []object) {
				for _, f := range []string{"--sync-nats=nats://nats.nats:4222,nats://nats-2.nats:4222", "--replica-id=$(POD_NAME)"} {
					if !slices.Contains(args, f) {
						t.Errorf("args lack %s: %q", f, args)
					}
				}
				d := find(objs, "Deployment", "")
				c := fmt.Sprint(d.get("spec", "template", "spec", "containers"))
				for _, want := range []string{"name:KVBANDIT_SYNC_NATS_USER valueFrom:map[secretKeyRef:map[key:user name:kvb-nats]]",
					"name:KVBANDIT_SYNC_NATS_PASSWORD valueFrom:map[secretKeyRef:map[key:password name:kvb-nats]]",
					"mountPath:/etc/kvbandit/nats-tls"} {
					if !strings.Contains(c, want) {
						t.Errorf("container lacks %s: %s", want, c)
					}
				}
				if strings.Contains(c, "KVBANDIT_SYNC_NATS_TOKEN") {
					t.Error("userPassword render sets KVBANDIT_SYNC_NATS_TOKEN")
				}
				if vols := fmt.Sprint(d.get("spec", "template", "spec", "volumes")); !strings.Contains(vols, "secretName:kvb-nats-tls") {
					t.Errorf("NATS TLS secret not mounted: %s", vols)
				}
				cfg := configOf(t, objs)
				n := cfg.Sync.NATS
				if n.TLS.CA != "/etc/kvbandit/nats-tls/ca.crt" || n.TLS.Cert != "/etc/kvbandit/nats-tls/tls.crt" || n.TLS.Key != "/etc/kvbandit/nats-tls/tls.key" ||
					n.TLS.ServerName != "nats.internal" || n.SubjectPrefix != "kvbandit.prod" || cfg.Sync.PeerTTLMs != 5000 || n.Password != "" || len(n.Servers) != 0 {
					t.Errorf("config sync section: %+v", cfg.Sync)
				}
			}},
		{name: "sync generated credentials", leader: false,
			set: []string{"replicas=3", "sync.nats.servers={nats://nats.nats:4222}"},
			check: func(t *testing.T, args []string, objs []object) {
				sec := find(objs, "Secret", release+"-kvbandit-nats-auth")
				if sec == nil {
					t.Fatal("no generated NATS Secret")
				}
				user, pw := secretValue(t, sec, "user"), secretValue(t, sec, "password")
				if user != "kvbandit" || len(pw) != 32 {
					t.Errorf("generated Secret: user %q, a password of %d characters; want kvbandit and 32", user, len(pw))
				}
				d := find(objs, "Deployment", "")
				c := fmt.Sprint(d.get("spec", "template", "spec", "containers"))
				for _, want := range []string{"name:KVBANDIT_SYNC_NATS_USER valueFrom:map[secretKeyRef:map[key:user name:" + release + "-kvbandit-nats-auth]]",
					"name:KVBANDIT_SYNC_NATS_PASSWORD valueFrom:map[secretKeyRef:map[key:password name:" + release + "-kvbandit-nats-auth]]"} {
					if !strings.Contains(c, want) {
						t.Errorf("container lacks %s: %s", want, c)
					}
				}
				if hasFlag(args, "--sync-allow-anonymous") || configOf(t, objs).Sync.AllowAnonymous {
					t.Error("generated credentials render allows anonymous sync")
				}
				// Two renders without a cluster: two passwords (lookup finds
				// nothing); with the Secret in the cluster: its password.
				other := find(decode(t, "helm template", template(t, helm, "replicas=3", "sync.nats.servers={nats://nats.nats:4222}")), "Secret", release+"-kvbandit-nats-auth")
				if secretValue(t, other, "password") == pw {
					t.Error("two renders generated the same password")
				}
			}},
		{name: "sync anonymous", leader: false,
			set: []string{"replicas=2", "sync.nats.servers={nats://nats.nats:4222}", "sync.nats.auth=none"},
			check: func(t *testing.T, args []string, objs []object) {
				if !slices.Contains(args, "--sync-allow-anonymous") || !configOf(t, objs).Sync.AllowAnonymous {
					t.Errorf("auth none: args %q lack --sync-allow-anonymous, or the config lacks allow_anonymous", args)
				}
				if find(objs, "Secret", "") != nil {
					t.Error("auth none renders a Secret")
				}
				if c := fmt.Sprint(find(objs, "Deployment", "").get("spec", "template", "spec", "containers")); strings.Contains(c, "KVBANDIT_SYNC_NATS_") {
					t.Errorf("auth none sets NATS credentials: %s", c)
				}
			}},
		{name: "monitoring", set: []string{"monitoring.dashboard.enabled=true", "monitoring.dashboard.annotations.grafana_folder=kvbandit",
			"monitoring.rules.configMap=true", "monitoring.rules.prometheusRule=true", "monitoring.rules.labels.release=prometheus"},
			check: func(t *testing.T, args []string, objs []object) {
				checkMonitoring(t, objs)
			}},
		{name: "sync creds active-passive", leader: true,
			set: []string{"replicas=2", "leaderElection.enabled=true", "sync.nats.servers={tls://nats.nats:4222}", "sync.nats.auth=creds",
				"sync.nats.existingSecret=kvb-nats-creds", "sync.nats.tls.secretName=kvb-nats-ca"},
			check: func(t *testing.T, args []string, objs []object) {
				if !slices.Contains(args, "--sync-nats=tls://nats.nats:4222") {
					t.Errorf("args lack --sync-nats: %q", args)
				}
				d := find(objs, "Deployment", "")
				if c := fmt.Sprint(d.get("spec", "template", "spec", "containers")); strings.Contains(c, "KVBANDIT_SYNC_NATS_") || !strings.Contains(c, "mountPath:/etc/kvbandit/nats-creds") {
					t.Errorf("creds render: NATS env set or creds not mounted: %s", c)
				}
				if vols := fmt.Sprint(d.get("spec", "template", "spec", "volumes")); !strings.Contains(vols, "secretName:kvb-nats-creds") {
					t.Errorf("NATS creds secret not mounted: %s", vols)
				}
				cfg := configOf(t, objs)
				if n := cfg.Sync.NATS; n.CredsFile != "/etc/kvbandit/nats-creds/creds" || n.TLS.CA != "/etc/kvbandit/nats-tls/ca.crt" || n.TLS.Cert != "" {
					t.Errorf("config sync section: %+v", cfg.Sync)
				}
			}},
	}
	for _, tc := range cases {
		t.Run("helm template "+tc.name, func(t *testing.T) {
			out := template(t, helm, tc.set...)
			objs := decode(t, "helm template", out)
			serverDryRun(t, c, objs)
			if tc.name != "standalone self-signed" {
				checkPicker(t, objs, release+"-kvbandit", release+"-kvbandit", tc.leader)
			}
			d := find(objs, "Deployment", release+"-kvbandit")
			if d == nil {
				t.Fatal("no Deployment")
			}
			args := containerArgs(t, d)
			checkServeArgs(t, "helm template "+tc.name, args)
			if got := hasFlag(args, "--leader-elect"); got != tc.leader {
				t.Errorf("--leader-elect = %v, want %v (args %q)", got, tc.leader, args)
			}
			if got := find(objs, "Role", release+"-kvbandit-leader-election") != nil; got != tc.leader {
				t.Errorf("leader-election Role present = %v, want %v", got, tc.leader)
			}
			configOf(t, objs)
			tc.check(t, args, objs)
		})
	}

	t.Run("generated NATS password kept across upgrades", func(t *testing.T) {
		// An upgrade renders against the cluster: the Secret a previous
		// install made is looked up and its password kept.
		kc := c.Kubeconfig(t, "admin")
		sec := []byte(`{"apiVersion":"v1","kind":"Secret","metadata":{"name":"` + release + `-kvbandit-nats-auth","namespace":"` + testNS +
			`"},"type":"Opaque","stringData":{"user":"kvbandit","password":"the-password-of-the-first-install"}}`)
		if err := c.Apply(context.Background(), sec, false); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			out := run(t, helm, "template", release, chartDir, "-n", testNS, "--dry-run=server", "--kubeconfig", kc,
				"--set", "replicas=3", "--set", "sync.nats.servers={nats://nats.nats:4222}")
			got := find(decode(t, "helm template --dry-run=server", out), "Secret", release+"-kvbandit-nats-auth")
			if got == nil || secretValue(t, got, "password") != "the-password-of-the-first-install" {
				t.Fatalf("upgrade render: the existing password was not kept: %v", got)
			}
		}
	})

	t.Run("helm template image", func(t *testing.T) {
		objs := decode(t, "helm template", template(t, helm, "image.repository=registry.example/kvbandit", "image.tag=0.2.0-rc.1"))
		checkImage(t, find(objs, "Deployment", ""), "registry.example/kvbandit:0.2.0-rc.1")
	})

	t.Run("rendered RBAC and args run serve", func(t *testing.T) {
		objs := decode(t, "helm template", template(t, helm, "replicas=2", "pool.selector.app=sim"))
		serveWithRenderedObjects(t, c, objs)
	})

	t.Run("helm template refuses bad values", func(t *testing.T) {
		for _, set := range [][]string{
			{"tls.secretName=x", "tls.selfSigned=true"},
			{"tls.clientCASecretName=ca"},
			{"replicas=0"},
			{"pool.failureMode=Sometimes"},
			{"pool.targetPorts={1,2,3,4,5,6,7,8,9}"},
			{"pool.namespace=elsewhere"},
			{"pool.standalone=true", "httpRoute.enabled=true"},
			{"sync.nats.auth=token", "sync.nats.existingSecret=s"},
			{"sync.nats.servers={nats://n:4222}", "sync.nats.auth=password", "sync.nats.existingSecret=s"},
			{"sync.nats.servers={nats://n:4222}", "sync.nats.auth=token"},
			{"sync.nats.servers={nats://n:4222}", "sync.nats.existingSecret=s"},
			{"sync.nats.servers={nats://n:4222}", "sync.nats.tls.mtls=true"},
			{"sync.nats.servers={nats://n:4222}", "sync.nats.auth=none", "sync.nats.existingSecret=s"},
			{"sync.nats.servers={nats://n:4222}", "sync.nats.generatedUser=two words"},
		} {
			args := []string{"template", release, chartDir, "-n", testNS}
			for _, s := range set {
				args = append(args, "--set", s)
			}
			out, err := exec.Command(helm, args...).CombinedOutput()
			if err == nil {
				t.Errorf("helm template --set %v: rendered, want an error\n%s", set, out)
			}
		}
	})
}

// secretValue decodes one key of a rendered Secret's data.
func secretValue(t *testing.T, o *object, key string) string {
	t.Helper()
	v, _ := o.get("data", key).(string)
	b, err := base64.StdEncoding.DecodeString(v)
	if err != nil {
		t.Fatalf("Secret %s: data.%s: %v", o.name(), key, err)
	}
	return string(b)
}

// installGatewayAPICRDs applies the standard HTTPRoute (and Gateway) CRDs from
// the pinned Gateway API module and waits until an HTTPRoute can be applied.
// moduleDir downloads module (into the module cache, if needed), checks
// its sum and returns its directory.
func moduleDir(t *testing.T, module, sum string) string {
	t.Helper()
	cmd := exec.Command("go", "mod", "download", "-json", module)
	cmd.Dir = t.TempDir()
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var mod struct{ Dir, Sum, Error string }
	if err != nil || json.Unmarshal(out, &mod) != nil || mod.Dir == "" {
		t.Fatalf("go mod download %s: %v %s\n%s%s", module, err, mod.Error, out, stderr.String())
	}
	if mod.Sum != sum {
		t.Fatalf("%s: sum %s, want %s", module, mod.Sum, sum)
	}
	return mod.Dir
}

// installPrometheusRuleCRD installs the Prometheus Operator's PrometheusRule
// CRD, with its OpenAPI schema, so that the chart's PrometheusRule is
// validated like the other objects.
func installPrometheusRuleCRD(t *testing.T, c *kubeenv.Cluster) {
	t.Helper()
	dir := moduleDir(t, promOperatorModule, promOperatorSum)
	raw, err := os.ReadFile(filepath.Join(dir, "example", "prometheus-operator-crd", "monitoring.coreos.com_prometheusrules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Apply(context.Background(), raw, false); err != nil {
		t.Fatalf("install the PrometheusRule CRD: %v", err)
	}
	waitServed(t, c, "PrometheusRule", []byte(`{"apiVersion":"monitoring.coreos.com/v1","kind":"PrometheusRule","metadata":{"name":"probe","namespace":"`+
		testNS+`"},"spec":{}}`))
}

// waitServed waits until the API server accepts a dry-run apply of probe,
// an object of a CRD just installed.
func waitServed(t *testing.T, c *kubeenv.Cluster, kind string, probe []byte) {
	t.Helper()
	deadline := time.Now().Add(applyWait)
	for {
		err := c.Apply(context.Background(), probe, true)
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s CRD not served after %v: %v", kind, applyWait, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// checkMonitoring checks the dashboard and rules objects carry the chart's
// files unchanged, with the labels asked for.
func checkMonitoring(t *testing.T, objs []object) {
	t.Helper()
	dash := find(objs, "ConfigMap", release+"-kvbandit-dashboard")
	if dash == nil {
		t.Fatal("no dashboard ConfigMap")
	}
	if got, _ := dash.get("data", "kvbandit.json").(string); strings.TrimSpace(got) != strings.TrimSpace(readFile(t, dashboardFile)) {
		t.Errorf("dashboard ConfigMap's kvbandit.json differs from %s", dashboardFile)
	}
	if l := dash.get("metadata", "labels", "grafana_dashboard"); l != "1" {
		t.Errorf("dashboard ConfigMap label grafana_dashboard = %v, want \"1\"", l)
	}
	if a := dash.get("metadata", "annotations", "grafana_folder"); a != "kvbandit" {
		t.Errorf("dashboard ConfigMap annotation grafana_folder = %v, want kvbandit", a)
	}
	rules := find(objs, "ConfigMap", release+"-kvbandit-rules")
	if rules == nil {
		t.Fatal("no rules ConfigMap")
	}
	if got, _ := rules.get("data", "kvbandit-rules.yaml").(string); strings.TrimSpace(got) != strings.TrimSpace(readFile(t, rulesFile)) {
		t.Errorf("rules ConfigMap's kvbandit-rules.yaml differs from %s", rulesFile)
	}
	pr := find(objs, "PrometheusRule", release+"-kvbandit")
	if pr == nil {
		t.Fatal("no PrometheusRule")
	}
	if l := pr.get("metadata", "labels", "release"); l != "prometheus" {
		t.Errorf("PrometheusRule label release = %v, want prometheus", l)
	}
	var want map[string]any
	readYAML(t, rulesFile, &want)
	wantJSON, _ := json.Marshal(want)
	gotJSON, _ := json.Marshal(pr.get("spec"))
	if string(gotJSON) != string(wantJSON) {
		t.Errorf("PrometheusRule spec differs from %s:\n got %s\nwant %s", rulesFile, gotJSON, wantJSON)
	}
}

func installGatewayAPICRDs(t *testing.T, c *kubeenv.Cluster) {
	t.Helper()
	dir := moduleDir(t, gatewayAPIModule, gatewayAPISum)
	for _, f := range []string{"gateway.networking.k8s.io_gateways.yaml", "gateway.networking.k8s.io_httproutes.yaml"} {
		raw, err := os.ReadFile(filepath.Join(dir, "config", "crd", "standard", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Apply(context.Background(), raw, false); err != nil {
			t.Fatalf("install %s: %v", f, err)
		}
	}
	waitServed(t, c, "HTTPRoute", []byte(`{"apiVersion":"gateway.networking.k8s.io/v1","kind":"HTTPRoute","metadata":{"name":"probe","namespace":"`+
		testNS+`"},"spec":{}}`))
}

// object is one decoded manifest document.
type object struct {
	src string
	m   map[string]any
}

func (o object) kind() string { s, _ := o.m["kind"].(string); return s }
func (o object) name() string { s, _ := o.get("metadata", "name").(string); return s }

func (o object) get(path ...string) any {
	var v any = o.m
	for _, p := range path {
		mm, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = mm[p]
	}
	return v
}

func (o object) setNamespace(ns string) {
	md, _ := o.m["metadata"].(map[string]any)
	if md == nil {
		md = map[string]any{}
		o.m["metadata"] = md
	}
	if _, ok := md["namespace"]; !ok {
		md["namespace"] = ns
	}
}

func decode(t *testing.T, src string, raw []byte) []object {
	t.Helper()
	var objs []object
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096)
	for {
		var m map[string]any
		if err := dec.Decode(&m); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", src, err)
		}
		if len(m) > 0 {
			objs = append(objs, object{src: src, m: m})
		}
	}
	if len(objs) == 0 {
		t.Fatalf("%s: no objects", src)
	}
	return objs
}

// serverDryRun applies every object with server-side apply, dryRun=All: the
// API server validates and defaults (OpenAPI schemas, CEL rules of the CRDs,
// RBAC escalation checks) but stores nothing.
func serverDryRun(t *testing.T, c *kubeenv.Cluster, objs []object) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, o := range objs {
		raw, err := json.Marshal(o.m)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Apply(ctx, raw, true); err != nil {
			t.Errorf("%s: server-side dry-run apply of %s %s: %v", o.src, o.kind(), o.name(), err)
		}
	}
}

func find(objs []object, kind, name string) *object {
	for i := range objs {
		if objs[i].kind() == kind && (name == "" || objs[i].name() == name) {
			return &objs[i]
		}
	}
	return nil
}

func run(t *testing.T, bin string, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s%s", filepath.Base(bin), strings.Join(args, " "), err, out, stderr.String())
	}
	return out
}

func template(t *testing.T, helm string, set ...string) []byte {
	t.Helper()
	args := []string{"template", release, chartDir, "-n", testNS}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	return run(t, helm, args...)
}

func containerArgs(t *testing.T, d *object) []string {
	t.Helper()
	cs, _ := d.get("spec", "template", "spec", "containers").([]any)
	if len(cs) != 1 {
		t.Fatalf("%s: want 1 container, got %d", d.src, len(cs))
	}
	raw, _ := cs[0].(map[string]any)["args"].([]any)
	args := make([]string, len(raw))
	for i, a := range raw {
		args[i], _ = a.(string)
	}
	return args
}

// appVersion is the chart's appVersion: the release image's tag.
func appVersion(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var chart struct {
		AppVersion string `json:"appVersion"`
	}
	if err := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096).Decode(&chart); err != nil || chart.AppVersion == "" {
		t.Fatalf("Chart.yaml appVersion: %q %v", chart.AppVersion, err)
	}
	return chart.AppVersion
}

// checkImage checks the Deployment's image, and that its Pod runs as
// 65532, the image's user.
func checkImage(t *testing.T, d *object, want string) {
	t.Helper()
	if d == nil {
		t.Fatal("no Deployment")
	}
	cs, _ := d.get("spec", "template", "spec", "containers").([]any)
	if len(cs) != 1 {
		t.Fatalf("%s: want 1 container, got %d", d.src, len(cs))
	}
	if got := cs[0].(map[string]any)["image"]; got != want {
		t.Errorf("%s: image %v, want %s", d.src, got, want)
	}
	if u := fmt.Sprint(d.get("spec", "template", "spec", "securityContext", "runAsUser")); u != "65532" {
		t.Errorf("%s: runAsUser %s, want 65532 (the image's user)", d.src, u)
	}
}

func hasFlag(args []string, name string) bool {
	return slices.ContainsFunc(args, func(a string) bool { return a == name || strings.HasPrefix(a, name+"=") })
}

// checkServeArgs parses a Deployment's args with kvbandit serve's own flag
// set, so a misspelt or removed flag fails here rather than in a Pod.
func checkServeArgs(t *testing.T, src string, args []string) {
	t.Helper()
	if len(args) == 0 || args[0] != "serve" {
		t.Fatalf("%s: args do not start with serve: %q", src, args)
	}
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var o app.ServeOptions
	o.AddFlags(fs)
	if err := fs.Parse(args[1:]); err != nil {
		t.Errorf("%s: kvbandit serve rejects the args: %v (%q)", src, err, args)
	} else if fs.NArg() > 0 {
		t.Errorf("%s: kvbandit serve: unexpected arguments %q", src, fs.Args())
	}
}

// configOf parses the ConfigMap's config.yaml with kvbandit's own strict
// config loader, as serve --config does.
func configOf(t *testing.T, objs []object) *app.FileConfig {
	t.Helper()
	// The ConfigMap with config.yaml (the chart's monitoring ConfigMaps
	// hold other keys).
	var cm *object
	for i := range objs {
		if _, ok := objs[i].get("data", "config.yaml").(string); ok && objs[i].kind() == "ConfigMap" {
			cm = &objs[i]
			break
		}
	}
	if cm == nil {
		t.Fatal("no ConfigMap with config.yaml")
	}
	raw, _ := cm.get("data", "config.yaml").(string)
	cfg, err := app.ParseConfig([]byte(raw))
	if err != nil {
		t.Fatalf("%s: ConfigMap config.yaml is not a valid kvbandit config: %v\n%s", cm.src, err, raw)
	}
	return cfg
}

// checkPicker checks what the API server cannot: the pool, the Service, the
// Deployment and the RBAC agree with each other and with kvbandit's flags.
func checkPicker(t *testing.T, objs []object, pool, svcName string, leader bool) {
	t.Helper()
	p := find(objs, "InferencePool", pool)
	svc := find(objs, "Service", svcName)
	d := find(objs, "Deployment", svcName)
	if p == nil || svc == nil || d == nil {
		t.Fatalf("want InferencePool %s, Service and Deployment %s", pool, svcName)
	}
	ref, _ := p.get("spec", "endpointPickerRef").(map[string]any)
	port := fmt.Sprint(p.get("spec", "endpointPickerRef", "port", "number"))
	if ref["name"] != svcName || port != "9002" {
		t.Errorf("endpointPickerRef = %v, want Service %s port 9002", ref, svcName)
	}
	ports := map[string]map[string]any{}
	for _, sp := range svc.get("spec", "ports").([]any) {
		m := sp.(map[string]any)
		ports[m["name"].(string)] = m
	}
	if m := ports["grpc-ext-proc"]; m == nil || fmt.Sprint(m["port"]) != "9002" || m["appProtocol"] != "http2" {
		t.Errorf("Service port grpc-ext-proc = %v, want 9002 with appProtocol http2", m)
	}
	for name, want := range map[string]string{"grpc-health": "9003", "metrics": "9090"} {
		if m := ports[name]; m == nil || fmt.Sprint(m["port"]) != want {
			t.Errorf("Service port %s = %v, want %s", name, m, want)
		}
	}
	args := containerArgs(t, d)
	for _, f := range []string{"serve", "--grpc-addr=:9002", "--health-addr=:9003", "--metrics-addr=:9090",
		"--config=/etc/kvbandit/config.yaml", "--pool-name=" + pool, "--pool-namespace=$(POD_NAMESPACE)"} {
		if !slices.Contains(args, f) {
			t.Errorf("%s: args lack %s: %q", d.src, f, args)
		}
	}
	c := d.get("spec", "template", "spec", "containers").([]any)[0].(map[string]any)
	probes := fmt.Sprint(c["readinessProbe"], c["livenessProbe"])
	if !strings.Contains(probes, "grpc:map[port:9003 service:readiness]") || !strings.Contains(probes, "grpc:map[port:9003 service:liveness]") {
		t.Errorf("probes are not gRPC health on 9003 readiness/liveness: %s", probes)
	}
	if !strings.Contains(fmt.Sprint(c["env"]), "fieldPath:metadata.namespace") {
		t.Error("POD_NAMESPACE does not come from the downward API")
	}
	sc := fmt.Sprint(c["securityContext"], d.get("spec", "template", "spec", "securityContext"))
	for _, s := range []string{"readOnlyRootFilesystem:true", "allowPrivilegeEscalation:false", "runAsNonRoot:true"} {
		if !strings.Contains(sc, s) {
			t.Errorf("securityContext lacks %s: %s", s, sc)
		}
	}
	if fmt.Sprint(d.get("spec", "replicas")) == "1" && leader {
		t.Error("leader election with 1 replica was not asked for")
	}
	// The Role the ServiceAccount is bound to allows exactly the watch and, with
	// leader election, the Lease.
	var rules []string
	for _, o := range objs {
		if o.kind() == "Role" {
			for _, r := range o.get("rules").([]any) {
				rules = append(rules, fmt.Sprint(r))
			}
		}
	}
	all := strings.Join(rules, "\n")
	for _, want := range []string{"resources:[pods] verbs:[get list watch]", "resources:[inferencepools] verbs:[get list watch]",
		"apiGroups:[inference.networking.x-k8s.io] resources:[inferenceobjectives] verbs:[get list watch]"} {
		if !strings.Contains(all, want) {
			t.Errorf("RBAC lacks %q:\n%s", want, all)
		}
	}
	if leader && !strings.Contains(all, "resources:[leases] verbs:[get create update]") {
		t.Errorf("RBAC lacks leases for leader election:\n%s", all)
	}
	for _, bad := range []string{"*", "delete", "patch", "secrets"} {
		if strings.Contains(all, bad) {
			t.Errorf("RBAC grants %q:\n%s", bad, all)
		}
	}
	configOf(t, objs)
}

func checkRoute(t *testing.T, r *object, pool string) {
	t.Helper()
	got := fmt.Sprint(r.get("spec", "rules"))
	if !strings.Contains(got, "group:inference.networking.k8s.io kind:InferencePool name:"+pool) {
		t.Errorf("HTTPRoute backendRefs do not name InferencePool %s: %s", pool, got)
	}
}

// checkExamples: the route and the example model servers match the pool.
func checkExamples(t *testing.T, objs []object) {
	t.Helper()
	r := find(objs, "HTTPRoute", "vllm-qwen3")
	if r == nil {
		t.Fatal("no HTTPRoute vllm-qwen3")
	}
	checkRoute(t, r, "vllm-qwen3")
	p := find(objs, "InferencePool", "vllm-qwen3")
	sel := fmt.Sprint(p.get("spec", "selector", "matchLabels"))
	for _, name := range []string{"vllm-qwen3", "sglang-qwen3"} {
		d := find(objs, "Deployment", name)
		if d == nil {
			t.Errorf("no example Deployment %s", name)
			continue
		}
		ann, _ := d.get("spec", "template", "metadata", "annotations").(map[string]any)
		for _, k := range []string{"kvbandit.io/engine", "kvbandit.io/models", "kvbandit.io/block-size", "kvbandit.io/metrics-port"} {
			if _, ok := ann[k]; !ok {
				t.Errorf("%s: pod annotation %s missing", name, k)
			}
		}
		if name == "vllm-qwen3" {
			if got := fmt.Sprint(d.get("spec", "template", "metadata", "labels")); got != sel {
				t.Errorf("vLLM pod labels %s do not match the pool selector %s", got, sel)
			}
			args := strings.Join(containerArgs(t, d), " ")
			if !strings.Contains(args, `--kv-events-config {"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}`) {
				t.Errorf("vLLM args lack the KV-events config: %s", args)
			}
			if ann["kvbandit.io/kv-events-port"] != "5557" || ann["kvbandit.io/kv-events-replay-port"] != "5558" {
				t.Errorf("vLLM kv-events annotations do not match --kv-events-config: %v", ann)
			}
		}
	}
	checkPDExample(t, objs, sel)
}

// checkPDExample: the P/D example's Pods are in the pool (its selector's
// labels), carry llm-d's role label with a value routing.ParseRole takes,
// and the decode Pods put the pd-sidecar on the pool's target port in front
// of their vLLM.
func checkPDExample(t *testing.T, objs []object, sel string) {
	t.Helper()
	for _, tc := range []struct{ name, role string }{{"vllm-qwen3-prefill", "prefill"}, {"vllm-qwen3-decode", "decode"}} {
		d := find(objs, "Deployment", tc.name)
		if d == nil {
			t.Errorf("no example Deployment %s", tc.name)
			continue
		}
		labels, _ := d.get("spec", "template", "metadata", "labels").(map[string]any)
		if fmt.Sprint(map[string]any{"app": labels["app"]}) != sel {
			t.Errorf("%s: pod labels %v are not in the pool %s", tc.name, labels, sel)
		}
		if r, err := routing.ParseRole(fmt.Sprint(labels["llm-d.ai/role"])); err != nil || r.String() != tc.role {
			t.Errorf("%s: llm-d.ai/role %v parses as %v, %v; want %s", tc.name, labels["llm-d.ai/role"], r, err, tc.role)
		}
		args := fmt.Sprint(d.get("spec", "template", "spec", "containers"))
		if !strings.Contains(args, `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`) {
			t.Errorf("%s: vLLM has no NIXL KV transfer config", tc.name)
		}
		if tc.role == "decode" {
			for _, want := range []string{"--port=8000", "--vllm-port=8200", "--connector=nixlv2", "--port=8200"} {
				if !strings.Contains(args, want) {
					t.Errorf("%s: containers lack %s", tc.name, want)
				}
			}
		}
	}
}

// serveWithRenderedObjects proves the chart's Roles are enough: it applies
// the rendered Roles and InferencePool for real, binds the Roles to the
// kubeenv user "kvbandit" (a token user stands in for the ServiceAccount),
// adds one ready Pod, and runs kvbandit serve in-process with the rendered
// Deployment's args (ports moved to loopback, the rendered config file,
// $(POD_NAMESPACE) expanded as the kubelet does). Readiness turns SERVING only
// once discovery has synced and, with --leader-elect, this replica holds the
// Lease: RBAC missing anywhere would keep it NOT_SERVING or stop serve.
func serveWithRenderedObjects(t *testing.T, c *kubeenv.Cluster, objs []object) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var bindings []string
	for _, o := range objs {
		if o.kind() != "Role" && o.kind() != "InferencePool" {
			continue
		}
		raw, _ := json.Marshal(o.m)
		if err := c.Apply(ctx, raw, false); err != nil {
			t.Fatalf("apply %s %s: %v", o.kind(), o.name(), err)
		}
		if o.kind() == "Role" {
			bindings = append(bindings, fmt.Sprintf(`{"apiVersion":"rbac.authorization.k8s.io/v1","kind":"RoleBinding",
"metadata":{"name":%q,"namespace":%q},"roleRef":{"apiGroup":"rbac.authorization.k8s.io","kind":"Role","name":%q},
"subjects":[{"kind":"User","name":"kvbandit"}]}`, o.name()+"-test-user", testNS, o.name()))
		}
	}
	if len(bindings) != 2 {
		t.Fatalf("want the discovery Role and the leader-election Role, got %d Roles", len(bindings))
	}
	if err := c.Apply(ctx, []byte(strings.Join(bindings, "\n---\n")), false); err != nil {
		t.Fatal(err)
	}
	c.CreatePod(t, testNS, "sim-0", map[string]string{"app": "sim"}, map[string]string{"kvbandit.io/engine": "vllm"})
	c.SetPodStatus(t, testNS, "sim-0", "127.0.0.1", true)

	cfg := filepath.Join(t.TempDir(), "config.yaml")
	raw, _ := find(objs, "ConfigMap", "").get("data", "config.yaml").(string)
	if err := os.WriteFile(cfg, []byte(raw), 0o600); err != nil {
		t.Fatal(err)
	}
	healthAddr := freeAddr(t)
	var args []string
	for _, a := range containerArgs(t, find(objs, "Deployment", "")) {
		a = strings.ReplaceAll(a, "$(POD_NAMESPACE)", testNS)
		switch {
		case strings.HasPrefix(a, "--grpc-addr="):
			a = "--grpc-addr=" + freeAddr(t)
		case strings.HasPrefix(a, "--health-addr="):
			a = "--health-addr=" + healthAddr
		case strings.HasPrefix(a, "--metrics-addr="):
			a = "--metrics-addr="
		case strings.HasPrefix(a, "--config="):
			a = "--config=" + cfg
		}
		args = append(args, a)
	}
	args = append(args, "--kubeconfig="+c.Kubeconfig(t, "kvbandit"), "--scrape-interval=0", "--log-format=text")

	sctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	var logs lockedBuffer
	go func() { done <- app.Run(sctx, args, io.Discard, &logs) }()
	defer func() {
		stop()
		select {
		case err := <-done:
			if err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("serve: %v\n%s", err, logs.String())
			}
		case <-time.After(40 * time.Second):
			t.Errorf("serve did not stop\n%s", logs.String())
		}
	}()

	conn, err := grpc.NewClient(healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	deadline := time.Now().Add(20 * time.Second)
	for {
		select {
		case err := <-done:
			done <- err
			t.Fatalf("serve stopped with the rendered args %q: %v\n%s", args, err, logs.String())
		default:
		}
		cctx, ccancel := context.WithTimeout(ctx, time.Second)
		r, err := hc.Check(cctx, &healthpb.HealthCheckRequest{Service: "readiness"})
		ccancel()
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("readiness not SERVING after 20s (%v %v) with the rendered RBAC and args %q\n%s", r.GetStatus(), err, args, logs.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	lease, err := c.Client(t).CoordinationV1().Leases(testNS).Get(ctx, release+"-kvbandit", metav1.GetOptions{})
	if err != nil || lease.Spec.HolderIdentity == nil || *lease.Spec.HolderIdentity == "" {
		t.Errorf("Lease %s-kvbandit not held after readiness: %v %+v", release, err, lease)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// lockedBuffer collects serve's log output from its goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
