package sim

import (
	"os"
	"strconv"
	"testing"
	"time"
)

// TestMooncakeReplay replays the first 2000 requests of the Mooncake
// conversation trace on 8 workers and logs hit rate and runtime. With
// SIM_MOONCAKE_FULL=1 it replays the whole trace under every policy (the
// 60 s goal is for all of them together, without -race); SIM_RATE_SCALE
// compresses the arrivals.
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
	if v := os.Getenv("SIM_RATE_SCALE"); v != "" {
		// Compress arrivals to load the fleet (2 = twice the rate).
		scale, err := strconv.ParseFloat(v, 64)
		if err != nil || scale <= 0 {
			t.Fatalf("SIM_RATE_SCALE %q", v)
		}
		for i := range reqs {
			reqs[i].Arrival = time.Duration(float64(reqs[i].Arrival) / scale)
		}
	}
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

// TestInfiniteCacheReachesBound: one worker with room for everything hits
// exactly what the trace allows — every 512-token block seen before, up to
// the first unseen one (the infinite-cache bound).
func TestInfiniteCacheReachesBound(t *testing.T) {
	reqs := loadMooncake(t, mooncakeConversation, 500)
	seen := map[uint32]bool{}
	var prompt, cached int
	for _, r := range reqs {
		prompt += len(r.Tokens)
		hit := true
		for j := 0; j*512 < len(r.Tokens); j++ {
			id := (r.Tokens[j*512] - 1) / 512
			if hit = hit && seen[id]; hit {
				cached += min(512, len(r.Tokens)-j*512)
			}
			seen[id] = true
		}
	}
	bound := float64(cached) / float64(prompt)
	res := run(t, Config{Workers: []WorkerConfig{{KVBlocks: 1 << 22, Speed: 50, MaxNumSeqs: 1024}}, Policy: "kv", KVEvents: true}, reqs)
	t.Logf("infinite-cache bound %.4f, simulated %.4f", bound, res.HitRate())
	if d := bound - res.HitRate(); d < 0 || d > 0.01 {
		t.Fatalf("hit rate %.4f, bound %.4f", res.HitRate(), bound)
	}
}
