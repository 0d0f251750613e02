package objectives_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/rest"

	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/discovery/kube/objectives"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"))
}

// objective builds an InferenceObjective; prio nil leaves spec.priority
// unset, group "" leaves poolRef.group to the CRD default.
func objective(ns, name, pool, group string, prio *int64) *unstructured.Unstructured {
	ref := map[string]any{"name": pool}
	if group != "" {
		ref["group"] = group
	}
	spec := map[string]any{"poolRef": ref}
	if prio != nil {
		spec["priority"] = *prio
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.x-k8s.io/v1alpha2",
		"kind":       "InferenceObjective",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec":       spec,
	}}
}

func p(v int64) *int64 { return &v }

type env struct {
	c  *kubeenv.Cluster
	ns string
}

func newEnv(t *testing.T, c *kubeenv.Cluster) env {
	ns := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	c.CreateNamespace(t, ns)
	return env{c, ns}
}

func (e env) create(t *testing.T, u *unstructured.Unstructured) {
	t.Helper()
	if _, err := e.c.Dynamic(t).Resource(objectives.GVR).Namespace(e.ns).Create(t.Context(), u, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (e env) setPriority(t *testing.T, name string, prio int64) {
	t.Helper()
	r := e.c.Dynamic(t).Resource(objectives.GVR).Namespace(e.ns)
	cur, err := r.Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := unstructured.SetNestedField(cur.Object, prio, "spec", "priority"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Update(t.Context(), cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}

func (e env) delete(t *testing.T, name string) {
	t.Helper()
	if err := e.c.Dynamic(t).Resource(objectives.GVR).Namespace(e.ns).Delete(t.Context(), name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}

// start runs a watcher until the test ends; Run must return nil.
func start(t *testing.T, cfg objectives.Config, deps objectives.Deps) *objectives.Watcher {
	t.Helper()
	w, err := objectives.New(cfg, deps)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return w
}

// want is a name's expected lookup: ok false means unknown.
type want struct {
	prio int
	ok   bool
}

func waitFor(t *testing.T, w *objectives.Watcher, exp map[string]want) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		bad := ""
		for name, e := range exp {
			if got, ok := w.Priority(name); ok != e.ok || got != e.prio {
				bad = name
				break
			}
		}
		if bad == "" {
			return
		}
		if time.Now().After(deadline) {
			got, ok := w.Priority(bad)
			t.Fatalf("Priority(%q) = %d, %v; want %+v (stats %+v)", bad, got, ok, exp[bad], w.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestWatcher(t *testing.T) {
	c := kubeenv.Start(t)
	admin := c.AdminConfig()

	t.Run("CreateUpdateDelete", func(t *testing.T) {
		e := newEnv(t, c)
		e.create(t, objective(e.ns, "gold", "p", "", p(10)))
		e.create(t, objective(e.ns, "batch", "p", "inference.networking.k8s.io", p(-5)))
		e.create(t, objective(e.ns, "plain", "p", "", nil))              // unset: 0, as GIE
		e.create(t, objective(e.ns, "theirs", "q", "", p(99)))           // another pool
		e.create(t, objective(e.ns, "alien", "p", "example.com", p(77))) // another group
		w := start(t, objectives.Config{Namespace: e.ns, Pool: "p"}, objectives.Deps{Config: admin})
		waitFor(t, w, map[string]want{"gold": {10, true}, "batch": {-5, true}, "plain": {0, true},
			"theirs": {0, false}, "alien": {0, false}, "nope": {0, false}})
		if st := w.Stats(); st.Known != 3 || !st.Available || len(st.Skipped) != 0 {
			t.Fatalf("stats %+v", st)
		}

		e.setPriority(t, "gold", 20)
		waitFor(t, w, map[string]want{"gold": {20, true}})
		e.create(t, objective(e.ns, "late", "p", "", p(3)))
		waitFor(t, w, map[string]want{"late": {3, true}})
		e.delete(t, "batch")
		waitFor(t, w, map[string]want{"batch": {0, false}, "gold": {20, true}, "late": {3, true}})
		if st := w.Stats(); st.Known != 3 {
			t.Fatalf("stats %+v", st)
		}
		if _, ok := w.Priority(strings.Repeat("g", objectives.MaxNameLen+1)); ok {
			t.Fatal("an over-long name was found")
		}
	})

	t.Run("OverLimit", func(t *testing.T) {
		e := newEnv(t, c)
		for _, n := range []string{"c", "a", "b"} {
			e.create(t, objective(e.ns, n, "p", "", p(1)))
		}
		w := start(t, objectives.Config{Namespace: e.ns, Pool: "p", MaxObjectives: 2}, objectives.Deps{Config: admin})
		waitFor(t, w, map[string]want{"a": {1, true}, "b": {1, true}, "c": {0, false}})
		e.setPriority(t, "a", 2) // another version of a kept one: c still counted once
		waitFor(t, w, map[string]want{"a": {2, true}})
		if st := w.Stats(); st.Known != 2 || st.Skipped[objectives.ReasonOverLimit] != 1 {
			t.Fatalf("stats %+v", st)
		}
		e.delete(t, "a")
		waitFor(t, w, map[string]want{"b": {1, true}, "c": {1, true}})
	})

	t.Run("ForbiddenThenGranted", func(t *testing.T) {
		// No RBAC: the watcher stays empty and retries; granting the role
		// is picked up at the next retry (virtual clock).
		e := newEnv(t, c)
		e.create(t, objective(e.ns, "gold", "p", "", p(10)))
		clk := clock.NewVirtual(time.Unix(0, 0))
		w := start(t, objectives.Config{Namespace: e.ns, Pool: "p"}, objectives.Deps{Config: c.UserConfig("kvbandit-2"), Clock: clk})
		waitRetry(t, clk)
		if st := w.Stats(); st.Available || st.Known != 0 {
			t.Fatalf("stats %+v", st)
		}
		if _, ok := w.Priority("gold"); ok {
			t.Fatal("found without permission")
		}
		grant(t, c, e.ns, "kvbandit-2")
		clk.Step(objectives.RetryInterval)
		waitFor(t, w, map[string]want{"gold": {10, true}})
		if !w.Stats().Available {
			t.Fatal("not available")
		}
	})
}

// waitRetry waits until the watcher has scheduled its retry.
func waitRetry(t *testing.T, clk *clock.Virtual) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, ok := clk.NextAt(); ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("no retry scheduled")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// grant gives user the RBAC the manifests give kvbandit for objectives.
func grant(t *testing.T, c *kubeenv.Cluster, ns, user string) {
	t.Helper()
	rb := c.Client(t).RbacV1()
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "objectives", Namespace: ns},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{objectives.GVR.Group}, Resources: []string{"inferenceobjectives"}, Verbs: []string{"get", "list", "watch"}}}}
	if _, err := rb.Roles(ns).Create(t.Context(), role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	bind := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "objectives", Namespace: ns},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "objectives"},
		Subjects: []rbacv1.Subject{{Kind: "User", APIGroup: "rbac.authorization.k8s.io", Name: user}}}
	if _, err := rb.RoleBindings(ns).Create(t.Context(), bind, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// TestUnreachable: an API server that cannot be reached is retried, not
// fatal; Run returns nil when stopped.
func TestUnreachable(t *testing.T) {
	clk := clock.NewVirtual(time.Unix(0, 0))
	w, err := objectives.New(objectives.Config{Namespace: "x", Pool: "p"}, objectives.Deps{Config: &rest.Config{Host: "https://127.0.0.1:1"}, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	waitRetry(t, clk)
	clk.Step(objectives.RetryInterval)
	waitRetry(t, clk)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if st := w.Stats(); st.Available || st.Known != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestNewRejects(t *testing.T) {
	rc := &rest.Config{Host: "https://127.0.0.1:1"}
	for _, cfg := range []objectives.Config{
		{Namespace: "", Pool: "p"},
		{Namespace: "Bad_NS", Pool: "p"},
		{Namespace: "ns", Pool: ""},
		{Namespace: "ns", Pool: "p", MaxObjectives: -1},
	} {
		if _, err := objectives.New(cfg, objectives.Deps{Config: rc}); err == nil {
			t.Errorf("New(%+v) accepted", cfg)
		}
	}
	if _, err := objectives.New(objectives.Config{Namespace: "ns", Pool: "p"}, objectives.Deps{}); err == nil {
		t.Error("New without an API configuration accepted")
	}
}

func TestParse(t *testing.T) {
	obj := func(name string, spec any) map[string]any {
		return map[string]any{"metadata": map[string]any{"name": name}, "spec": spec}
	}
	ref := func(kv ...any) map[string]any {
		m := map[string]any{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i].(string)] = kv[i+1]
		}
		return m
	}
	for _, tc := range []struct {
		name    string
		obj     map[string]any
		prio    int
		ours    bool
		wantErr bool
	}{
		{"defaults", obj("a", map[string]any{"poolRef": ref("name", "p")}), 0, true, false},
		{"priority", obj("a", map[string]any{"poolRef": ref("name", "p"), "priority": int64(-7)}), -7, true, false},
		{"float integer", obj("a", map[string]any{"poolRef": ref("name", "p"), "priority": 4.0}), 4, true, false},
		{"clamped", obj("a", map[string]any{"poolRef": ref("name", "p"), "priority": int64(1) << 40}), 1<<31 - 1, true, false},
		{"explicit group kind", obj("a", map[string]any{"poolRef": ref("name", "p", "group", "inference.networking.k8s.io", "kind", "InferencePool")}), 0, true, false},
		{"other pool", obj("a", map[string]any{"poolRef": ref("name", "q"), "priority": int64(3)}), 3, false, false},
		{"other kind", obj("a", map[string]any{"poolRef": ref("name", "p", "kind", "Service")}), 0, false, false},
		{"fraction", obj("a", map[string]any{"poolRef": ref("name", "p"), "priority": 1.5}), 0, false, true},
		{"string priority", obj("a", map[string]any{"poolRef": ref("name", "p"), "priority": "9"}), 0, false, true},
		{"no spec", map[string]any{"metadata": map[string]any{"name": "a"}}, 0, false, true},
		{"ref not object", obj("a", map[string]any{"poolRef": "p"}), 0, false, true},
		{"ref name not string", obj("a", map[string]any{"poolRef": ref("name", int64(1))}), 0, false, true},
		{"no name", obj("", map[string]any{"poolRef": ref("name", "p")}), 0, false, true},
		{"long name", obj(strings.Repeat("a", 254), map[string]any{"poolRef": ref("name", "p")}), 0, false, true},
	} {
		prio, ours, err := objectives.Parse(tc.obj, "p")
		if (err != nil) != tc.wantErr || (err == nil && (prio != tc.prio || ours != tc.ours)) {
			t.Errorf("%s: Parse = %d, %v, %v; want %d, %v, err %v", tc.name, prio, ours, err, tc.prio, tc.ours, tc.wantErr)
		}
	}
}
