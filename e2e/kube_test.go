package e2e

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/internal/simworker"
	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
	"github.com/kvbandit/kvbandit/routing/discovery/kube"
	simmodel "github.com/kvbandit/kvbandit/routing/sim"
)

// TestKubeInferencePoolEndToEnd: the binary discovers an InferencePool on
// a real API server; requests through the Envoy-faithful client reach the
// simulated workers at the Pods' IPs (127.0.0.2–4, one port, as pods);
// their KV events are subscribed from the Pods' annotations; a Pod deleted
// or made not-ready leaves the endpoint set and gets no more requests.
func TestKubeInferencePoolEndToEnd(t *testing.T) {
	c := kubeenv.Start(t)
	const ns, pool, port = "default", "sim-pool", 18000
	var hosts []string
	for i := range 3 {
		ip := fmt.Sprintf("127.0.0.%d", i+2)
		sw, err := simworker.New(simworker.Config{Addr: fmt.Sprintf("%s:%d", ip, port), KVEventsAddr: "tcp://" + ip + ":15557",
			SpeedUp: 50, Worker: simmodel.WorkerConfig{BlockSize: 16, KVBlocks: 4096}})
		if err != nil {
			t.Fatal(err)
		}
		if err := sw.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sw.Close() })
		name := fmt.Sprintf("sim-%d", i)
		c.CreatePod(t, ns, name, map[string]string{"app": "sim"}, map[string]string{
			kube.AnnotationEngine: "vllm", kube.AnnotationBlockSize: "16", kube.AnnotationModels: simworker.DefaultModel,
			kube.AnnotationKVEventsPort: "15557",
		})
		c.SetPodStatus(t, ns, name, ip, true)
		hosts = append(hosts, fmt.Sprintf("%s:%d", ip, port))
	}
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": pool, "namespace": ns},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": map[string]any{"app": "sim"}},
			"targetPorts":       []any{map[string]any{"number": int64(port)}},
			"endpointPickerRef": map[string]any{"name": "kvbandit", "port": map[string]any{"number": int64(9002)}},
		},
	}}
	if _, err := c.Dynamic(t).Resource(kube.PoolGVR).Namespace(ns).Create(t.Context(), u, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	k := startKvbandit(t, nil, "--pool-name", pool, "--pool-namespace", ns, "--kubeconfig", c.Kubeconfig(t, "admin"),
		"--policy", "kvbandit", "--scrape-interval", "250ms")
	k.endpoints = hosts
	k.waitEndpoints(t, hosts, 20*time.Second)
	px := startProxy(t, k, envoysim.Config{})
	cl := httpClient(t)
	sendN := func(n int, tag string) map[string]int {
		t.Helper()
		got := map[string]int{}
		before := len(px.Exchanges())
		for i := range n {
			body, _ := json.Marshal(map[string]any{"model": simworker.DefaultModel, "max_tokens": 4,
				"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("%s request %d: plan a trip. %s", tag, i, strings.Repeat("Lisbon, Porto and the Douro valley by train. ", 8))}}})
			r := send(t, cl, "POST", px.URL()+"/v1/chat/completions", body, map[string]string{"x-prefix-id": fmt.Sprintf("%s-%d", tag, i)})
			if r.status != 200 {
				t.Fatalf("%s request %d: %d %s", tag, i, r.status, r.body)
			}
		}
		xs, err := px.WaitExchanges(t.Context(), before+n)
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range xs[before:] {
			if x.Fallback || x.Upstream != x.Destination {
				t.Fatalf("exchange %d: destination %q upstream %q fallback %v", x.ID, x.Destination, x.Upstream, x.Fallback)
			}
			got[x.Upstream]++
		}
		return got
	}
	if got := sendN(12, "a"); len(got) != 3 {
		t.Fatalf("12 sessions over 3 pods went to %v", got)
	}
	// The KV events of each Pod (port from its annotation) arrive from its
	// first stored blocks on, seen from sequence 0: trusted.
	for _, h := range hosts {
		k.waitMetric(t, "kvbandit_kv_events_trusted", map[string]string{"endpoint": h}, 1)
	}
	// Scale down: the deleted Pod's endpoint leaves and gets nothing more.
	if err := c.Client(t).CoreV1().Pods(ns).Delete(t.Context(), "sim-2", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
		t.Fatal(err)
	}
	k.waitEndpoints(t, hosts[:2], 10*time.Second)
	if got := sendN(8, "b"); got[hosts[2]] != 0 {
		t.Fatalf("after scale-down: %v", got)
	}
	// A Pod that is no longer Ready leaves too.
	c.SetPodStatus(t, ns, "sim-1", "127.0.0.3", false)
	k.waitEndpoints(t, hosts[:1], 10*time.Second)
	if got := sendN(4, "c"); got[hosts[0]] != 4 {
		t.Fatalf("after not-ready: %v", got)
	}
	// No ready Pod at all: the picker answers 503 and stays ready (an
	// empty pool must not eject the picker from the gateway).
	c.SetPodStatus(t, ns, "sim-0", "127.0.0.2", false)
	k.waitEndpoints(t, nil, 10*time.Second)
	body, _ := json.Marshal(map[string]any{"model": simworker.DefaultModel, "messages": []map[string]string{{"role": "user", "content": "hello"}}})
	if r := send(t, cl, "POST", px.URL()+"/v1/chat/completions", body, nil); r.status != 503 {
		t.Fatalf("empty pool: %d %s", r.status, r.body)
	}
	if st := k.readiness(t); st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("readiness with an empty pool: %v", st)
	}
}
