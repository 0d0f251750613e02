package objectives

import (
	"fmt"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
)

func obj(name, uid, rv string, spec map[string]any) *unstructured.Unstructured {
	u := &unstructured.Unstructured{Object: map[string]any{
		"metadata": map[string]any{"name": name, "namespace": "ns"}, "spec": spec,
	}}
	u.SetUID(types.UID(uid))
	u.SetResourceVersion(rv)
	return u
}

func newTestWatcher(t testing.TB, max int) *Watcher {
	w, err := New(Config{Namespace: "ns", Pool: "p", MaxObjectives: max}, Deps{Config: &rest.Config{Host: "https://127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestRebuildSkipsMalformed: objects the CRD schema would refuse (the API
// server's validation is not trusted) are skipped and counted once per
// version; the others keep working.
func TestRebuildSkipsMalformed(t *testing.T) {
	w := newTestWatcher(t, 0)
	good := obj("gold", "u1", "1", map[string]any{"poolRef": map[string]any{"name": "p"}, "priority": int64(4)})
	bad := obj("bad", "u2", "1", map[string]any{"poolRef": map[string]any{"name": "p"}, "priority": "high"})
	w.rebuild([]any{good, bad, "not an object"})
	w.rebuild([]any{good, bad}) // same version: not counted again
	if p, ok := w.Priority("gold"); !ok || p != 4 {
		t.Fatalf("gold = %d, %v", p, ok)
	}
	if _, ok := w.Priority("bad"); ok {
		t.Fatal("a malformed objective was kept")
	}
	if st := w.Stats(); st.Known != 1 || st.Skipped[ReasonMalformed] != 1 {
		t.Fatalf("stats %+v", st)
	}
	bad2 := obj("bad", "u2", "2", map[string]any{"poolRef": "p"}) // a new version, still bad
	w.rebuild([]any{good, bad2})
	if st := w.Stats(); st.Skipped[ReasonMalformed] != 2 {
		t.Fatalf("stats %+v", st)
	}
	fixed := obj("bad", "u2", "3", map[string]any{"poolRef": map[string]any{"name": "p"}, "priority": int64(-2)})
	w.rebuild([]any{good, fixed})
	if p, ok := w.Priority("bad"); !ok || p != -2 {
		t.Fatalf("fixed objective = %d, %v", p, ok)
	}
	if st := w.Stats(); st.Known != 2 || st.Skipped[ReasonMalformed] != 2 || len(w.counted) != 0 {
		t.Fatalf("stats %+v, counted %v", st, w.counted)
	}
}

// BenchmarkPriority: the request-path lookup with MaxObjectives known.
func BenchmarkPriority(b *testing.B) {
	w := newTestWatcher(b, 0)
	objs := make([]any, MaxObjectives)
	for i := range objs {
		objs[i] = obj(fmt.Sprintf("objective-%d", i), fmt.Sprint(i), "1", map[string]any{"poolRef": map[string]any{"name": "p"}, "priority": int64(i%20 - 10)})
	}
	w.rebuild(objs)
	if w.Stats().Known != MaxObjectives {
		b.Fatal("not all known")
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, ok := w.Priority("objective-1234"); !ok {
			b.Fatal("not found")
		}
	}
}

// BenchmarkRebuild: one snapshot rebuild with MaxObjectives objects (done
// off the request path, after each change).
func BenchmarkRebuild(b *testing.B) {
	w := newTestWatcher(b, 0)
	objs := make([]any, MaxObjectives)
	for i := range objs {
		objs[i] = obj(fmt.Sprintf("objective-%d", i), fmt.Sprint(i), "1", map[string]any{"poolRef": map[string]any{"name": "p"}, "priority": int64(i%20 - 10)})
	}
	b.ReportAllocs()
	for b.Loop() {
		w.rebuild(objs)
	}
}
