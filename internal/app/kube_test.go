package app

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
	"github.com/kvbandit/kvbandit/routing/discovery/kube"
	"github.com/kvbandit/kvbandit/routing/discovery/kube/objectives"
)

// TestServeKubeDiscovery: serve --pool-name follows an InferencePool on a
// real API server (as user kvbandit with a namespaced Role) and routes to
// the Pod it selects; the user nobody gets a clear start-up error.
func TestServeKubeDiscovery(t *testing.T) {
	c := kubeenv.Start(t)
	const ns = "kvbandit-kube"
	c.CreateNamespace(t, ns)
	cs := c.Client(t)
	_, err := cs.RbacV1().Roles(ns).Create(t.Context(), &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "discovery"},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
			{APIGroups: []string{"inference.networking.k8s.io"}, Resources: []string{"inferencepools"}, Verbs: []string{"get", "list", "watch"}},
			{APIGroups: []string{objectives.GVR.Group}, Resources: []string{"inferenceobjectives"}, Verbs: []string{"get", "list", "watch"}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = cs.RbacV1().RoleBindings(ns).Create(t.Context(), &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "discovery"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "discovery"},
		Subjects:   []rbacv1.Subject{{Kind: "User", Name: "kvbandit"}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	w := startWorker(t, worker.Config{})
	_, port, _ := net.SplitHostPort(w.Addr())
	pn, _ := strconv.Atoi(port)
	pool := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": "p", "namespace": ns},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": map[string]any{"app": "sim"}},
			"targetPorts":       []any{map[string]any{"number": int64(pn)}},
			"endpointPickerRef": map[string]any{"name": "kvbandit", "port": map[string]any{"number": int64(9002)}},
		},
	}}
	if _, err := c.Dynamic(t).Resource(kube.PoolGVR).Namespace(ns).Create(t.Context(), pool, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	obj := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
		"metadata": map[string]any{"name": "gold", "namespace": ns},
		"spec":     map[string]any{"poolRef": map[string]any{"name": "p"}, "priority": int64(10)},
	}}
	if _, err := c.Dynamic(t).Resource(objectives.GVR).Namespace(ns).Create(t.Context(), obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c.CreatePod(t, ns, "w0", map[string]string{"app": "sim"}, map[string]string{kube.AnnotationEngine: "vllm"})
	c.SetPodStatus(t, ns, "w0", "127.0.0.1", true)

	var metricsURL string
	serve := func(user string) (string, <-chan error, context.CancelFunc) {
		listen := func() net.Listener {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			return l
		}
		hl, ml := listen(), listen()
		metricsURL = "http://" + ml.Addr().String() + "/metrics"
		ls := &Listeners{GRPC: listen(), Health: listen(), HTTP: hl, Metrics: ml}
		o := ServeOptions{PoolName: "p", PoolNamespace: ns, Kubeconfig: c.Kubeconfig(t, user), Policy: "kv", MaxBodyBytes: 1 << 20, MaxInflight: 8,
			DecisionTimeout: time.Second, StopGrace: 100 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text"}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- Serve(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)), ls) }()
		return "http://" + hl.Addr().String(), done, cancel
	}

	// nobody: serve stops at once with the permissions it needs.
	_, done, cancel := serve("nobody")
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "forbidden") || !strings.Contains(err.Error(), "get/list/watch on pods and inferencepools") {
			t.Fatalf("serve as nobody: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve as nobody did not stop")
	}
	cancel()

	url, done, cancel := serve("kvbandit")
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := hc.Post(url+proxy.RoutePath, "application/json", strings.NewReader(`{"model":"test-model","messages":[{"role":"user","content":"hi"}]}`))
		if err == nil {
			var rr proxy.RouteResponse
			derr := json.NewDecoder(resp.Body).Decode(&rr)
			resp.Body.Close()
			if derr == nil && resp.StatusCode == 200 && rr.Endpoint == w.Addr() {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("route never reached the pod's endpoint %s (last err %v)", w.Addr(), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The pool's InferenceObjective is known; a request naming it gets its
	// priority (counted as found).
	metrics := func() string {
		resp, err := hc.Get(metricsURL)
		if err != nil {
			return ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	for !strings.Contains(metrics(), "\nkvbandit_inference_objectives 1\n") {
		if time.Now().After(deadline) {
			t.Fatalf("the InferenceObjective never became known:\n%s", metrics())
		}
		time.Sleep(50 * time.Millisecond)
	}
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(`{"model":"test-model","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Gateway-Inference-Objective", "gold")
	// serve's default --client-priority cap: the client's +1000 is lowered
	// to the objective's 10 (issue 23, item 19).
	req.Header.Set("X-Request-Priority", "1000")
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("chat through the proxy: %d %s", resp.StatusCode, body)
	}
	if m := metrics(); !strings.Contains(m, `kvbandit_proxy_inference_objective_requests_total{result="found"} 1`) ||
		!strings.Contains(m, "kvbandit_inference_objectives_available 1") ||
		!strings.Contains(m, `kvbandit_proxy_client_priorities_total{action="capped"} 1`) {
		t.Fatalf("objective metrics:\n%s", m)
	}
}

func TestServeKubeFlags(t *testing.T) {
	c := DefaultFileConfig()
	for name, o := range map[string]ServeOptions{
		"namespace alone": {PoolNamespace: "x"},
		"bad selector":    {KubeSelector: "app", KubeTargetPorts: "8000"},
		"bad port":        {KubeSelector: "app=x", KubeTargetPorts: "http"},
		"no ports":        {KubeSelector: "app=x"},
		"pool + selector": {PoolName: "p", KubeSelector: "app=x", Kubeconfig: "/nonexistent"},
	} {
		if _, _, _, err := discoverySources(o, &c, slog.New(slog.DiscardHandler)); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	cfg := FileConfig{Discovery: DiscoveryConfig{Kube: &KubeDiscoveryConfig{}}}
	if err := cfg.Discovery.validate(false); err == nil {
		t.Error("discovery.kube without pool or selector: no error")
	}
	cfg.Discovery.Etcd = nil
	cfg.Discovery.File = &FileDiscoveryConfig{Path: "x"}
	cfg.Discovery.Kube.Pool = "p"
	if err := cfg.Discovery.validate(false); err == nil {
		t.Error("discovery.kube and discovery.file: no error")
	}
}

func TestStaticLinkLocalNeedsTheOption(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	c := DefaultFileConfig()
	_, _, _, err := discoverySources(ServeOptions{Endpoints: "10.0.0.1:8000,http://169.254.169.254:80"}, &c, log)
	if err == nil || !strings.Contains(err.Error(), "--discovery-allow-link-local") {
		t.Fatalf("link-local in --endpoints: err = %v", err)
	}
	static, _, _, err := discoverySources(ServeOptions{Endpoints: "http://169.254.10.1:8000", DiscoveryAllowLinkLocal: true}, &c, log)
	if err != nil || static == nil || static.Endpoints[0].Key != "169.254.10.1:8000" {
		t.Fatalf("allowed: %+v, %v", static, err)
	}
	c.Discovery.AllowLinkLocal = true
	if _, _, _, err := discoverySources(ServeOptions{Endpoints: "[fe80::1]:8000"}, &c, log); err != nil {
		t.Fatalf("discovery.allow_link_local: %v", err)
	}
}
