package kube_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"

	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/kube"
)

// TestMain checks for leaked goroutines. klog starts a flush daemon when
// client-go is imported and never stops it; that one is ignored.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"))
}

// recSink records what the source reports.
type recSink struct {
	mu       sync.Mutex
	sets     []pub
	degraded error
	degrades int
	skipped  map[string]int
}

type pub struct {
	at  time.Time
	set routing.EndpointSet
}

var _ discovery.Sink = (*recSink)(nil)

func (s *recSink) Publish(set routing.EndpointSet) error {
	if err := set.Validate(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sets = append(s.sets, pub{time.Now(), set})
	return nil
}

func (s *recSink) SetDegraded(source string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil && s.degraded == nil {
		s.degrades++
	}
	s.degraded = err
}

func (s *recSink) Skipped(source, reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.skipped == nil {
		s.skipped = map[string]int{}
	}
	s.skipped[source+"/"+reason]++
}

func (s *recSink) snapshot() (sets []pub, degraded error, skipped map[string]int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sk := map[string]int{}
	for k, v := range s.skipped {
		sk[k] = v
	}
	return slices.Clone(s.sets), s.degraded, sk
}

func keys(set routing.EndpointSet) []string {
	out := make([]string, 0, len(set.Endpoints))
	for _, ep := range set.Endpoints {
		out = append(out, string(ep.Key))
	}
	return out
}

// waitFor waits until the last published set has exactly want (sorted).
func (s *recSink) waitFor(t *testing.T, want ...string) routing.EndpointSet {
	t.Helper()
	slices.Sort(want)
	if want == nil {
		want = []string{}
	}
	deadline := time.Now().Add(20 * time.Second)
	var got []string
	for time.Now().Before(deadline) {
		sets, _, _ := s.snapshot()
		if len(sets) > 0 {
			last := sets[len(sets)-1].set
			got = keys(last)
			if slices.Equal(got, want) {
				return last
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("endpoint set: got %v, want %v", got, want)
	return routing.EndpointSet{}
}

func (s *recSink) waitDegraded(t *testing.T, want bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		_, d, _ := s.snapshot()
		if (d != nil) == want {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("degraded: want %v", want)
}

// run starts a source and stops it when the test ends; Run must return nil.
func run(t *testing.T, cfg kube.Config, rc *rest.Config) *recSink {
	t.Helper()
	src, err := kube.New(cfg, kube.Deps{Config: rc})
	if err != nil {
		t.Fatal(err)
	}
	if src.Name() != "kube" {
		t.Fatalf("Name() = %q", src.Name())
	}
	sink := &recSink{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, sink) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return sink
}

func pool(ns, name string, sel map[string]string, ports ...int) *unstructured.Unstructured {
	ml := map[string]any{}
	for k, v := range sel {
		ml[k] = v
	}
	tps := []any{}
	for _, p := range ports {
		tps = append(tps, map[string]any{"number": int64(p)})
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1",
		"kind":       "InferencePool",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": ml},
			"targetPorts":       tps,
			"endpointPickerRef": map[string]any{"name": "kvbandit", "port": map[string]any{"number": int64(9002)}},
		},
	}}
}

// env is one namespace of the shared cluster.
type env struct {
	c  *kubeenv.Cluster
	ns string
}

func newEnv(t *testing.T, c *kubeenv.Cluster) env {
	ns := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	c.CreateNamespace(t, ns)
	return env{c, ns}
}

func (e env) createPool(t *testing.T, name string, sel map[string]string, ports ...int) {
	t.Helper()
	_, err := e.c.Dynamic(t).Resource(kube.PoolGVR).Namespace(e.ns).Create(t.Context(), pool(e.ns, name, sel, ports...), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
}

func (e env) updatePool(t *testing.T, name string, sel map[string]string, ports ...int) {
	t.Helper()
	r := e.c.Dynamic(t).Resource(kube.PoolGVR).Namespace(e.ns)
	cur, err := r.Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p := pool(e.ns, name, sel, ports...)
	p.SetResourceVersion(cur.GetResourceVersion())
	if _, err := r.Update(t.Context(), p, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (e env) deletePool(t *testing.T, name string) {
	t.Helper()
	if err := e.c.Dynamic(t).Resource(kube.PoolGVR).Namespace(e.ns).Delete(t.Context(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// pod creates a pod with labels and annotations and, when ip is set, makes
// it ready with that IP.
func (e env) pod(t *testing.T, name, ip string, labels, ann map[string]string) {
	t.Helper()
	e.c.CreatePod(t, e.ns, name, labels, ann)
	if ip != "" {
		e.c.SetPodStatus(t, e.ns, name, ip, true)
	}
}

func (e env) deletePod(t *testing.T, name string) {
	t.Helper()
	zero := int64(0)
	if err := e.c.Client(t).CoreV1().Pods(e.ns).Delete(t.Context(), name, metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
		t.Fatal(err)
	}
}

var sim = map[string]string{"app": "sim"}

// TestKube runs the pool-mode and standalone scenarios on one API server,
// each subtest in its own namespace.
func TestKube(t *testing.T) {
	c := kubeenv.Start(t)
	admin := c.AdminConfig()

	t.Run("FirstSetAfterSync", func(t *testing.T) {
		// Pods and pool exist before the source starts: the first set
		// published is already complete (no empty set while listing).
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000)
		for i := range 5 {
			e.pod(t, fmt.Sprintf("w%d", i), fmt.Sprintf("10.1.0.%d", i+1), sim, nil)
		}
		start := time.Now()
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		s.waitFor(t, "10.1.0.1:8000", "10.1.0.2:8000", "10.1.0.3:8000", "10.1.0.4:8000", "10.1.0.5:8000")
		sets, _, _ := s.snapshot()
		t.Logf("first set %v after Run", sets[0].at.Sub(start).Round(time.Millisecond))
		if n := len(sets[0].set.Endpoints); n != 5 || sets[0].set.Source != "kube" {
			t.Fatalf("first set: %d endpoints from %q, want 5 from kube", n, sets[0].set.Source)
		}
	})

	t.Run("ScaleUpDown", func(t *testing.T) {
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000)
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		s.waitFor(t) // an empty pool is published (the picker answers 503)
		e.pod(t, "a", "10.2.0.1", sim, nil)
		s.waitFor(t, "10.2.0.1:8000")
		e.pod(t, "b", "10.2.0.2", sim, nil)
		e.pod(t, "c", "10.2.0.3", sim, nil)
		e.pod(t, "other", "10.2.0.9", map[string]string{"app": "other"}, nil) // not selected
		s.waitFor(t, "10.2.0.1:8000", "10.2.0.2:8000", "10.2.0.3:8000")
		e.deletePod(t, "b")
		s.waitFor(t, "10.2.0.1:8000", "10.2.0.3:8000")
		e.deletePod(t, "a")
		e.deletePod(t, "c")
		s.waitFor(t)
	})

	t.Run("PodIPChangeAndNotReady", func(t *testing.T) {
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000)
		e.pod(t, "a", "10.3.0.1", sim, nil)
		e.pod(t, "b", "10.3.0.2", sim, nil)
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		s.waitFor(t, "10.3.0.1:8000", "10.3.0.2:8000")
		c.SetPodStatus(t, e.ns, "a", "10.3.0.11", true)
		s.waitFor(t, "10.3.0.11:8000", "10.3.0.2:8000")
		c.SetPodStatus(t, e.ns, "b", "10.3.0.2", false)
		s.waitFor(t, "10.3.0.11:8000")
		c.SetPodStatus(t, e.ns, "b", "10.3.0.2", true)
		s.waitFor(t, "10.3.0.11:8000", "10.3.0.2:8000")
		c.SetPodStatus(t, e.ns, "a", "", true) // lost its IP: left out
		s.waitFor(t, "10.3.0.2:8000")
	})

	t.Run("PodsWithoutIP", func(t *testing.T) {
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000)
		e.pod(t, "pending", "", sim, nil)     // never got a status
		e.pod(t, "ready-no-ip", "", sim, nil) // ready but no IP
		c.SetPodStatus(t, e.ns, "ready-no-ip", "", true)
		e.pod(t, "ok", "10.4.0.1", sim, nil)
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		s.waitFor(t, "10.4.0.1:8000")
		c.SetPodStatus(t, e.ns, "pending", "10.4.0.2", true)
		s.waitFor(t, "10.4.0.1:8000", "10.4.0.2:8000")
		_, _, sk := s.snapshot()
		if len(sk) != 0 {
			t.Fatalf("pods without an IP were counted as skipped: %v", sk)
		}
	})

	t.Run("SelectorAndTargetPortsEdited", func(t *testing.T) {
		e := newEnv(t, c)
		blue, green := map[string]string{"app": "sim", "color": "blue"}, map[string]string{"app": "sim", "color": "green"}
		e.createPool(t, "p", blue, 8000)
		e.pod(t, "b1", "10.5.0.1", blue, nil)
		e.pod(t, "g1", "10.5.0.2", green, nil)
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		s.waitFor(t, "10.5.0.1:8000")
		e.updatePool(t, "p", green, 8000)
		s.waitFor(t, "10.5.0.2:8000")
		e.updatePool(t, "p", green, 8000, 8001)
		set := s.waitFor(t, "10.5.0.2:8000", "10.5.0.2:8001")
		if set.Endpoints[0].Labels[kube.LabelPod] != e.ns+"/g1" || set.Endpoints[0].Labels["color"] != "green" {
			t.Fatalf("labels: %v", set.Endpoints[0].Labels)
		}
		e.updatePool(t, "p", sim, 8001) // both colours
		s.waitFor(t, "10.5.0.1:8001", "10.5.0.2:8001")
	})

	t.Run("PoolDeletedAndRecreated", func(t *testing.T) {
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000)
		e.pod(t, "a", "10.6.0.1", sim, nil)
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		s.waitFor(t, "10.6.0.1:8000")
		e.deletePool(t, "p")
		s.waitFor(t)
		e.createPool(t, "p", sim, 9000)
		s.waitFor(t, "10.6.0.1:9000")
		if _, d, _ := s.snapshot(); d != nil {
			t.Fatalf("degraded: %v", d)
		}
	})

	t.Run("PoolMissingAtStart", func(t *testing.T) {
		e := newEnv(t, c)
		e.pod(t, "a", "10.7.0.1", sim, nil)
		s := run(t, kube.Config{Namespace: e.ns, Pool: "later"}, admin)
		s.waitFor(t) // synced: an empty set
		e.createPool(t, "later", sim, 8000)
		s.waitFor(t, "10.7.0.1:8000")
	})

	t.Run("Metadata", func(t *testing.T) {
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000, 8001)
		e.pod(t, "full", "10.8.0.1", sim, map[string]string{
			kube.AnnotationModels:           "m1, m2",
			kube.AnnotationAdapters:         "lora-a",
			kube.AnnotationEngine:           "vllm",
			kube.AnnotationBlockSize:        "16",
			kube.AnnotationMaxBatchedTokens: "8192",
			kube.AnnotationDataParallelSize: "2",
			kube.AnnotationMetricsPort:      "9100",
			kube.AnnotationKVEventsPort:     "5557",
			kube.AnnotationKVEventsReplay:   "5600",
		})
		e.pod(t, "label", "10.8.0.2", map[string]string{"app": "sim", kube.LabelModel: "m3"}, nil)
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		set := s.waitFor(t, "10.8.0.1:8000", "10.8.0.1:8001", "10.8.0.2:8000", "10.8.0.2:8001")
		r0, r1, lb := set.Endpoints[0], set.Endpoints[1], set.Endpoints[2]
		want := routing.Endpoint{Key: "10.8.0.1:8000", Models: []routing.ModelName{"m1", "m2"}, Adapters: []routing.ModelName{"lora-a"},
			Engine: "vllm", BlockSize: 16, MaxBatchedTokens: 8192, DataParallelSize: 2, Labels: map[string]string{"app": "sim", kube.LabelPod: e.ns + "/full"},
			MetricsURL: "http://10.8.0.1:9100/metrics", KVEvents: "tcp://10.8.0.1:5557", KVEventsReplay: "tcp://10.8.0.1:5600"}
		if !r0.Equal(&want) {
			t.Fatalf("rank 0:\n got %+v\nwant %+v", r0, want)
		}
		if r1.KVEvents != "tcp://10.8.0.1:5558" || r1.KVEventsReplay != "tcp://10.8.0.1:5601" || r1.MetricsURL != want.MetricsURL {
			t.Fatalf("rank 1: %+v", r1)
		}
		if !slices.Equal(lb.Models, []routing.ModelName{"m3"}) || lb.Engine != "" || lb.KVEvents != "" || lb.MetricsURL != "" {
			t.Fatalf("label-only pod: %+v", lb)
		}
	})

	t.Run("Roles", func(t *testing.T) {
		// llm-d's label, kvbandit's annotation (it wins over the label),
		// neither (both), and an unknown value (left out, counted).
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000)
		e.pod(t, "prefill", "10.12.0.1", map[string]string{"app": "sim", kube.LabelRole: "prefill"}, nil)
		e.pod(t, "decode", "10.12.0.2", map[string]string{"app": "sim", kube.LabelRole: "decode"}, nil)
		e.pod(t, "pd", "10.12.0.3", map[string]string{"app": "sim", kube.LabelRole: "prefill-decode"}, nil)
		e.pod(t, "ann-wins", "10.12.0.4", map[string]string{"app": "sim", kube.LabelRole: "decode"}, map[string]string{kube.AnnotationRole: "Prefill"})
		e.pod(t, "plain", "10.12.0.5", sim, nil)
		e.pod(t, "bad-role", "10.12.0.6", map[string]string{"app": "sim", kube.LabelRole: "encode"}, nil)
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		set := s.waitFor(t, "10.12.0.1:8000", "10.12.0.2:8000", "10.12.0.3:8000", "10.12.0.4:8000", "10.12.0.5:8000")
		got := map[routing.EndpointKey]string{}
		for _, ep := range set.Endpoints {
			got[ep.Key] = ep.Role.String()
		}
		want := map[routing.EndpointKey]string{"10.12.0.1:8000": "prefill", "10.12.0.2:8000": "decode", "10.12.0.3:8000": "both", "10.12.0.4:8000": "prefill", "10.12.0.5:8000": "both"}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("roles: got %v, want %v", got, want)
		}
		if _, _, sk := s.snapshot(); fmt.Sprint(sk) != fmt.Sprint(map[string]int{"kube/unknown_role": 1}) {
			t.Fatalf("skipped: %v", sk)
		}
	})

	t.Run("MalformedSkipped", func(t *testing.T) {
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000)
		e.pod(t, "good", "10.9.0.1", sim, map[string]string{kube.AnnotationEngine: "sglang"})
		e.pod(t, "bad-engine", "10.9.0.2", sim, map[string]string{kube.AnnotationEngine: "tgi"})
		e.pod(t, "bad-block", "10.9.0.3", sim, map[string]string{kube.AnnotationBlockSize: "abc"})
		e.pod(t, "bad-port", "10.9.0.4", sim, map[string]string{kube.AnnotationKVEventsPort: "70000"})
		e.pod(t, "dup-ip", "10.9.0.1", sim, nil) // same address as "good"
		s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, admin)
		s.waitFor(t, "10.9.0.1:8000")
		// More changes rebuild the set; each bad pod stays counted once.
		e.pod(t, "good2", "10.9.0.5", sim, nil)
		s.waitFor(t, "10.9.0.1:8000", "10.9.0.5:8000")
		_, _, sk := s.snapshot()
		want := map[string]int{"kube/unknown_engine": 1, "kube/malformed": 1, "kube/invalid": 1, "kube/duplicate": 1}
		if fmt.Sprint(sk) != fmt.Sprint(want) {
			t.Fatalf("skipped: got %v, want %v", sk, want)
		}
		// Fixing a pod brings it in.
		p, err := c.Client(t).CoreV1().Pods(e.ns).Get(t.Context(), "bad-block", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Annotations[kube.AnnotationBlockSize] = "32"
		if _, err := c.Client(t).CoreV1().Pods(e.ns).Update(t.Context(), p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		set := s.waitFor(t, "10.9.0.1:8000", "10.9.0.3:8000", "10.9.0.5:8000")
		if set.Endpoints[1].BlockSize != 32 {
			t.Fatalf("fixed pod: %+v", set.Endpoints[1])
		}
	})

	t.Run("Standalone", func(t *testing.T) {
		e := newEnv(t, c)
		sel := map[string]string{"app": "sa"}
		e.pod(t, "a", "10.10.0.1", sel, nil)
		e.pod(t, "b", "10.10.0.2", sim, nil)
		e.pod(t, "v6", "fd00::1", sel, nil)
		s := run(t, kube.Config{Namespace: e.ns, Selector: sel, TargetPorts: []int{8000, 8001}}, admin)
		s.waitFor(t, "10.10.0.1:8000", "10.10.0.1:8001", "[fd00::1]:8000", "[fd00::1]:8001")
		e.deletePod(t, "v6")
		s.waitFor(t, "10.10.0.1:8000", "10.10.0.1:8001")
	})

	t.Run("RBAC", func(t *testing.T) {
		e := newEnv(t, c)
		e.createPool(t, "p", sim, 8000)
		e.pod(t, "a", "10.11.0.1", sim, nil)

		// nobody: a clear error at start, quickly.
		for _, cfg := range []kube.Config{{Namespace: e.ns, Pool: "p"}, {Namespace: e.ns, Selector: sim, TargetPorts: []int{8000}}} {
			src, err := kube.New(cfg, kube.Deps{Config: c.UserConfig("nobody")})
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			err = src.Run(t.Context(), &recSink{})
			if err == nil || !strings.Contains(err.Error(), "forbidden") || !strings.Contains(err.Error(), "get/list/watch on pods") ||
				!strings.Contains(err.Error(), "namespace "+e.ns) {
				t.Fatalf("Run as nobody: %v", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("Run as nobody took %v", d)
			}
			t.Logf("nobody: %v", err)
		}

		// kvbandit with a namespaced Role: works.
		cs := c.Client(t)
		role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "kvbandit-discovery", Namespace: e.ns}, Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list", "watch"}},
			{APIGroups: []string{"inference.networking.k8s.io"}, Resources: []string{"inferencepools"}, Verbs: []string{"get", "list", "watch"}},
		}}
		if _, err := cs.RbacV1().Roles(e.ns).Create(t.Context(), role, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		rb := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "kvbandit-discovery", Namespace: e.ns},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: role.Name},
			Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: "rbac.authorization.k8s.io", Name: "kvbandit"}}}
		if _, err := cs.RbacV1().RoleBindings(e.ns).Create(t.Context(), rb, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		user := c.UserConfig("kvbandit")
		// The role may take a moment to reach the authorizer's cache.
		deadline := time.Now().Add(10 * time.Second)
		for {
			src, err := kube.New(kube.Config{Namespace: e.ns, Pool: "p"}, kube.Deps{Config: user})
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
			sink := &recSink{}
			err = src.Run(ctx, sink)
			cancel()
			sets, _, _ := sink.snapshot()
			if err == nil && len(sets) > 0 && slices.Equal(keys(sets[len(sets)-1].set), []string{"10.11.0.1:8000"}) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("Run as kvbandit with a Role: err %v, sets %v", err, sets)
			}
			time.Sleep(200 * time.Millisecond)
		}
		// The same user in another namespace has no rights there.
		other := e.ns + "-other"
		c.CreateNamespace(t, other)
		src, err := kube.New(kube.Config{Namespace: other, Pool: "p"}, kube.Deps{Config: user})
		if err != nil {
			t.Fatal(err)
		}
		if err := src.Run(t.Context(), &recSink{}); err == nil || !strings.Contains(err.Error(), "forbidden") {
			t.Fatalf("Run as kvbandit in another namespace: %v", err)
		}
		// A Role without watch is refused at start too (the informers
		// would otherwise retry their watches silently).
		noWatch := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "no-watch", Namespace: e.ns}, Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get", "list"}},
			{APIGroups: []string{"inference.networking.k8s.io"}, Resources: []string{"inferencepools"}, Verbs: []string{"get", "list"}},
		}}
		if _, err := cs.RbacV1().Roles(e.ns).Create(t.Context(), noWatch, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		rb2 := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "no-watch", Namespace: e.ns},
			RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: noWatch.Name},
			Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: "rbac.authorization.k8s.io", Name: "kvbandit-2"}}}
		if _, err := cs.RbacV1().RoleBindings(e.ns).Create(t.Context(), rb2, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		deadline = time.Now().Add(10 * time.Second)
		for {
			src, err := kube.New(kube.Config{Namespace: e.ns, Pool: "p"}, kube.Deps{Config: c.UserConfig("kvbandit-2")})
			if err != nil {
				t.Fatal(err)
			}
			err = src.Run(t.Context(), &recSink{})
			if err != nil && strings.Contains(err.Error(), "forbidden") && strings.Contains(err.Error(), "watch") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("Run with get/list but no watch: %v", err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	})

	t.Run("Churn", func(t *testing.T) { churn(t, c, newEnv(t, c)) })
}

func TestNewErrors(t *testing.T) {
	rc := &rest.Config{Host: "https://127.0.0.1:1"}
	for _, tc := range []struct {
		name string
		cfg  kube.Config
		deps kube.Deps
		want string
	}{
		{"no rest config", kube.Config{Pool: "p"}, kube.Deps{}, "no API server"},
		{"standalone without selector", kube.Config{TargetPorts: []int{8000}}, kube.Deps{Config: rc}, "selector"},
		{"standalone without ports", kube.Config{Selector: sim}, kube.Deps{Config: rc}, "no target ports"},
		{"bad port", kube.Config{Selector: sim, TargetPorts: []int{0}}, kube.Deps{Config: rc}, "out of range"},
		{"dup port", kube.Config{Selector: sim, TargetPorts: []int{1, 1}}, kube.Deps{Config: rc}, "twice"},
		{"bad selector", kube.Config{Selector: map[string]string{"a b": "c"}, TargetPorts: []int{1}}, kube.Deps{Config: rc}, "selector"},
		{"pool and selector", kube.Config{Pool: "p", Selector: sim}, kube.Deps{Config: rc}, "standalone"},
		{"bad pool name", kube.Config{Pool: "P_Q"}, kube.Deps{Config: rc}, "pool name"},
		{"bad namespace", kube.Config{Namespace: "Bad NS", Pool: "p"}, kube.Deps{Config: rc}, "namespace"},
	} {
		if _, err := kube.New(tc.cfg, tc.deps); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
	t.Setenv("POD_NAMESPACE", "from-env")
	if _, err := kube.New(kube.Config{Pool: "p"}, kube.Deps{Config: rc}); err != nil {
		t.Fatal(err)
	}
}

// TestOutage kills the API server: the source turns degraded and keeps its
// last set; after a restart it recovers and follows changes again.
func TestOutage(t *testing.T) {
	c := kubeenv.Start(t)
	e := newEnv(t, c)
	e.createPool(t, "p", sim, 8000)
	e.pod(t, "a", "10.20.0.1", sim, nil)
	e.pod(t, "b", "10.20.0.2", sim, nil)
	s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, c.AdminConfig())
	s.waitFor(t, "10.20.0.1:8000", "10.20.0.2:8000")
	before, _, _ := s.snapshot()

	killed := time.Now()
	c.Kill()
	s.waitDegraded(t, true)
	t.Logf("degraded %v after the kill", time.Since(killed).Round(time.Millisecond))
	time.Sleep(2 * time.Second) // keep the outage going for a while
	after, d, _ := s.snapshot()
	if len(after) != len(before) {
		t.Fatalf("published during the outage: %v", after[len(before):])
	}
	if !strings.Contains(d.Error(), "kube discovery") {
		t.Fatalf("degraded error: %v", d)
	}

	c.Restart()
	restarted := time.Now()
	s.waitDegraded(t, false)
	t.Logf("recovered %v after the restart", time.Since(restarted).Round(time.Millisecond))
	e.pod(t, "c", "10.20.0.3", sim, nil)
	e.deletePod(t, "a")
	s.waitFor(t, "10.20.0.2:8000", "10.20.0.3:8000")
	t.Logf("change after the restart seen %v after the restart", time.Since(restarted).Round(time.Millisecond))
}

// TestUnreachableAtStart: an API server that cannot be reached is not fatal:
// the source is degraded and publishes nothing.
func TestUnreachableAtStart(t *testing.T) {
	src, err := kube.New(kube.Config{Namespace: "x", Pool: "p"}, kube.Deps{Config: &rest.Config{Host: "https://127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	sink := &recSink{}
	ctx, cancel := context.WithTimeout(t.Context(), 1500*time.Millisecond)
	defer cancel()
	if err := src.Run(ctx, sink); err != nil {
		t.Fatalf("Run: %v", err)
	}
	sets, d, _ := sink.snapshot()
	if d == nil || len(sets) != 0 {
		t.Fatalf("degraded %v, sets %v", d, sets)
	}
}

// churn creates 100 pods/s for a few seconds (create, then a status write
// making each ready) and measures, per pod, the time from just before its
// ready status write to the first published set holding it.
func churn(t *testing.T, c *kubeenv.Cluster, e env) {
	const rate, secs = 100, 3
	e.createPool(t, "p", sim, 8000)
	s := run(t, kube.Config{Namespace: e.ns, Pool: "p"}, c.AdminConfig())
	s.waitFor(t)
	cs := c.Client(t)
	var (
		mu      sync.Mutex
		readyAt = map[string]time.Time{}
		wg      sync.WaitGroup
		errs    = make(chan error, rate*secs)
	)
	tick := time.NewTicker(time.Second / rate)
	defer tick.Stop()
	start := time.Now()
	for i := range rate * secs {
		<-tick.C
		wg.Add(1)
		go func() {
			defer wg.Done()
			name, ip := fmt.Sprintf("w%04d", i), fmt.Sprintf("10.30.%d.%d", i/250, i%250+1)
			ctx := context.Background()
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns, Labels: sim},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "kubetest"}}}}
			created, err := cs.CoreV1().Pods(e.ns).Create(ctx, pod, metav1.CreateOptions{})
			if err != nil {
				errs <- err
				return
			}
			now := metav1.Now()
			created.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}, StartTime: &now,
				Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now}}}
			mu.Lock()
			readyAt[ip+":8000"] = time.Now()
			mu.Unlock()
			if _, err := cs.CoreV1().Pods(e.ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	t.Logf("created %d pods in %v", rate*secs, time.Since(start).Round(time.Millisecond))
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	var all []string
	for k := range readyAt {
		all = append(all, k)
	}
	s.waitFor(t, all...)
	sets, _, _ := s.snapshot()
	seen := map[string]time.Time{}
	for _, p := range sets {
		for _, k := range keys(p.set) {
			if _, ok := seen[k]; !ok {
				seen[k] = p.at
			}
		}
	}
	var lat []time.Duration
	for k, r := range readyAt {
		lat = append(lat, seen[k].Sub(r))
	}
	slices.Sort(lat)
	pct := func(q float64) time.Duration { return lat[int(q*float64(len(lat)-1))] }
	t.Logf("churn %d pods at %d/s: ready -> published p50 %v, p99 %v, max %v; %d sets published (goal p99 < 1s)",
		len(lat), rate, pct(0.5).Round(time.Millisecond), pct(0.99).Round(time.Millisecond), lat[len(lat)-1].Round(time.Millisecond), len(sets))
	if pct(0.99) > time.Second {
		t.Logf("WARNING: p99 above the 1 s goal")
	}
}
