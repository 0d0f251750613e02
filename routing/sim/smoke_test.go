package sim

import (
	"testing"
)

func TestSmoke(t *testing.T) {
	reqs := synthetic(500, 10, 4096, 256, 20, 1)
	for _, p := range []string{"round_robin", "kv", "kvbandit"} {
		res, err := Run(t.Context(), Config{Workers: make([]WorkerConfig, 4), Policy: p, KVEvents: true}, reqs)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: hit %.3f span %v wall %v decisions %d kvErr %d", p, res.HitRate(), res.Span, res.Wall, res.Decisions, res.KVEventErrors)
	}
}
