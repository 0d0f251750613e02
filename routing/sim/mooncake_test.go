package sim

import (
	"os"
	"testing"
	"time"
)

// TestMooncakeReplay replays the first 2000 requests of the Mooncake
// conversation trace on 8 workers and logs hit rate and runtime. With
// SIM_MOONCAKE_FULL=1 it replays the whole trace under every policy (the
// 60 s goal is for all of them together, without -race).
func TestMooncakeReplay(t *testing.T) {
	limit := 2000
	policies := []string{"kvbandit"}
	if os.Getenv("SIM_MOONCAKE_FULL") != "" {
		limit = 0
		policies = []string{"random", "round_robin", "least_loaded", "kv", "thompson", "kvbandit"}
	} else if testing.Short() {
		t.Skip("short")
	}
	t0 := time.Now()
	reqs := loadMooncake(t, mooncakeConversation, limit)
	t.Logf("loaded %d requests in %v", len(reqs), time.Since(t0))
	var total time.Duration
	for _, p := range policies {
		res, err := Run(t.Context(), Config{Workers: make([]WorkerConfig, 8), Policy: p, KVEvents: true, Seed: 1}, reqs)
		if err != nil {
			t.Fatal(err)
		}
		total += res.Wall
		ttft := make([]time.Duration, 0, len(res.Requests))
		failed := 0
		for _, r := range res.Requests {
			if r.Err != "" {
				failed++
				continue
			}
			ttft = append(ttft, r.TTFT)
		}
		t.Logf("%-12s hit %.3f  TTFT p50 %v p90 %v  span %v  wall %v  decisions %d (%v in Pick)  failed %d  kv event errors %d",
			p, res.HitRate(), pct(ttft, 0.5), pct(ttft, 0.9), res.Span.Round(time.Second), res.Wall.Round(time.Millisecond),
			res.Decisions, res.DecisionTime.Round(time.Millisecond), failed, res.KVEventErrors)
		if res.KVEventErrors != 0 {
			t.Errorf("%s: %d KV events refused", p, res.KVEventErrors)
		}
	}
	t.Logf("total wall %v", total.Round(time.Millisecond))
}
