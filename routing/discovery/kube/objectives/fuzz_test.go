package objectives_test

import (
	"encoding/json"
	"testing"

	"github.com/kvbandit/kvbandit/routing/discovery/kube/objectives"
)

// FuzzParse feeds arbitrary JSON objects to Parse: it must never panic, and
// an object it accepts has a bounded name.
func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"metadata":{"name":"gold"},"spec":{"poolRef":{"name":"p"},"priority":10}}`))
	f.Add([]byte(`{"metadata":{"name":"x"},"spec":{"poolRef":{"name":"p","group":"inference.networking.k8s.io","kind":"InferencePool"},"priority":-1e300}}`))
	f.Add([]byte(`{"metadata":{"name":"x"},"spec":{"poolRef":null,"priority":"1"}}`))
	f.Add([]byte(`{"metadata":[],"spec":{"poolRef":{"name":7}}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		var obj map[string]any
		if json.Unmarshal(data, &obj) != nil {
			return
		}
		prio, _, err := objectives.Parse(obj, "p")
		if err != nil {
			return
		}
		name, _ := obj["metadata"].(map[string]any)["name"].(string)
		if name == "" || len(name) > objectives.MaxNameLen || prio > 1<<31-1 || prio < -1<<31 {
			t.Fatalf("accepted name %q priority %d", name, prio)
		}
	})
}
