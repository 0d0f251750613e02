package sim

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/policy"
)

func run(t *testing.T, cfg Config, reqs []Request) *Result {
	t.Helper()
	res, err := Run(t.Context(), cfg, reqs)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func TestRunReportsEveryRequest(t *testing.T) {
	reqs := synthetic(200, 4, 1024, 128, 20, 1)
	res := run(t, Config{Workers: make([]WorkerConfig, 3), Policy: "round_robin", KVEvents: true}, reqs)
	if res.Decisions != len(reqs) || len(res.Requests) != len(reqs) || res.KVEventErrors != 0 {
		t.Fatalf("decisions %d, results %d, kv event errors %d", res.Decisions, len(res.Requests), res.KVEventErrors)
	}
	routed := 0
	for i, r := range res.Requests {
		if r.Err != "" || r.Worker < 0 || r.TTFT <= 0 || r.E2E < r.TTFT || r.OutputTokens != reqs[i].OutputLen || r.PromptTokens != len(reqs[i].Tokens) {
			t.Fatalf("request %d: %+v", i, r)
		}
		if r.Arrival != reqs[i].Arrival {
			t.Fatalf("request %d arrival %v", i, r.Arrival)
		}
	}
	for i, w := range res.Workers {
		routed += w.Requests
		// round_robin spreads evenly.
		if w.Requests < 66 || w.Requests > 67 || w.Busy <= 0 {
			t.Fatalf("worker %d: %+v", i, w)
		}
	}
	if routed != len(reqs) {
		t.Fatalf("routed %d", routed)
	}
	if last := res.Requests[len(reqs)-1]; res.Span < last.Arrival+last.E2E-reqs[0].Arrival {
		t.Fatalf("span %v", res.Span)
	}
	if n := len(res.Queue); n < int(res.Span/time.Second) || res.Queue[1].At-res.Queue[0].At != time.Second || len(res.Queue[0].Waiting) != 3 {
		t.Fatalf("%d queue samples over %v", n, res.Span)
	}
	if res.Wall <= 0 || res.DecisionTime <= 0 || res.Policy != "round_robin" {
		t.Fatalf("result %+v", res.Policy)
	}
}

func TestDeterministic(t *testing.T) {
	reqs := synthetic(400, 6, 2048, 256, 40, 7)
	for _, p := range policy.Builtin().Names() {
		for _, events := range []bool{false, true} {
			cfg := Config{Workers: make([]WorkerConfig, 4), Policy: p, KVEvents: events, Seed: 42,
				Schedule: []Change{{Worker: 1, At: 2 * time.Second, Speed: 0.5}}}
			a, b := run(t, cfg, reqs), run(t, cfg, reqs)
			for _, r := range []*Result{a, b} {
				r.Wall, r.DecisionTime = 0, 0
			}
			if !reflect.DeepEqual(a, b) {
				t.Fatalf("%s (events %v): two runs differ", p, events)
			}
		}
	}
}

func TestStoppedWorkerHoldsRequests(t *testing.T) {
	reqs := []Request{
		{Arrival: time.Second, Tokens: seq(500, 1), OutputLen: 200},
		{Arrival: 2 * time.Second, Tokens: seq(500, 10_000), OutputLen: 10},
	}
	cfg := Config{Workers: make([]WorkerConfig, 1), Policy: "round_robin",
		Schedule: []Change{{Worker: 0, At: 0, Speed: 0}, {Worker: 0, At: 10 * time.Second, Speed: 1}}}
	res := run(t, cfg, reqs)
	for i, r := range res.Requests {
		if r.Err != "" || r.Arrival+r.TTFT <= 10*time.Second {
			t.Fatalf("request %d served before the restart: %+v", i, r)
		}
	}
	if q := res.Queue[5]; q.Waiting[0] != 2 || q.Running[0] != 0 {
		t.Fatalf("while stopped: %+v", q)
	}
	// Stopped mid-run and never restarted: the step in progress ends, the
	// requests stay and are reported unfinished.
	cfg.Schedule = []Change{{Worker: 0, At: 1500 * time.Millisecond, Speed: 0}}
	res = run(t, cfg, reqs)
	for i, r := range res.Requests {
		if !strings.Contains(r.Err, "not finished") {
			t.Fatalf("request %d: %+v", i, r)
		}
	}
	if r := res.Requests[0]; r.OutputTokens == 0 || r.OutputTokens >= 200 {
		t.Fatalf("first request generated %d tokens before the stop", r.OutputTokens)
	}
}

func TestSlowWorkerSchedule(t *testing.T) {
	// A worker slowed to a quarter after the prefill: the rest of the
	// decode (about 0.77 s at full speed) takes four times as long.
	reqs := []Request{{Arrival: 0, Tokens: seq(4000, 1), OutputLen: 200}}
	base := run(t, Config{Workers: make([]WorkerConfig, 1), Policy: "random"}, reqs)
	slow := run(t, Config{Workers: make([]WorkerConfig, 1), Policy: "random", Schedule: []Change{{At: 500 * time.Millisecond, Speed: 0.25}}}, reqs)
	if slow.Requests[0].TTFT != base.Requests[0].TTFT || slow.Requests[0].E2E < 5*base.Requests[0].E2E/2 {
		t.Fatalf("base %+v, slowed after prefill %+v", base.Requests[0], slow.Requests[0])
	}
	// Heterogeneous fleet: a twice-as-fast worker.
	fast := run(t, Config{Workers: []WorkerConfig{{Speed: 2}}, Policy: "random"}, reqs)
	if d := base.Requests[0].E2E - 2*fast.Requests[0].E2E; d < -time.Microsecond || d > time.Microsecond {
		t.Fatalf("speed 2: %v vs %v", fast.Requests[0].E2E, base.Requests[0].E2E)
	}
}

func TestKVPolicyBeatsRoundRobinOnSharedPrefixes(t *testing.T) {
	// 16 system prompts of 4k tokens on 8 workers whose caches hold a
	// few of them each: affinity pays.
	reqs := synthetic(600, 16, 4096, 128, 15, 11)
	workers := make([]WorkerConfig, 8)
	for i := range workers {
		workers[i].KVBlocks = 300
	}
	hit := map[string]float64{}
	for _, p := range []string{"round_robin", "kv"} {
		for _, events := range []bool{false, true} {
			res := run(t, Config{Workers: workers, Policy: p, KVEvents: events, Seed: 1}, reqs)
			t.Logf("%s events=%v: hit rate %.3f", p, events, res.HitRate())
			hit[p] = res.HitRate()
			if events && res.KVEventErrors != 0 {
				t.Fatalf("%d KV events refused", res.KVEventErrors)
			}
		}
	}
	if hit["kv"] <= hit["round_robin"]+0.1 {
		t.Fatalf("kv hit rate %.3f, round_robin %.3f", hit["kv"], hit["round_robin"])
	}
}

func TestConfigErrors(t *testing.T) {
	ok := []Request{{Tokens: seq(10, 1), OutputLen: 1}}
	for _, c := range []struct {
		name string
		cfg  Config
		reqs []Request
		want error
	}{
		{"no workers", Config{Policy: "kv"}, ok, ErrNoWorkers},
		{"negative speed", Config{Workers: []WorkerConfig{{Speed: -1}}, Policy: "kv"}, ok, ErrWorkerConfig},
		{"negative blocks", Config{Workers: []WorkerConfig{{KVBlocks: -1}}, Policy: "kv"}, ok, ErrWorkerConfig},
		{"schedule worker", Config{Workers: make([]WorkerConfig, 1), Policy: "kv", Schedule: []Change{{Worker: 1, Speed: 1}}}, ok, ErrSchedule},
		{"schedule speed", Config{Workers: make([]WorkerConfig, 1), Policy: "kv", Schedule: []Change{{Speed: -2}}}, ok, ErrSchedule},
		{"schedule order", Config{Workers: make([]WorkerConfig, 1), Policy: "kv", Schedule: []Change{{At: 2}, {At: 1}}}, ok, ErrSchedule},
		{"unsorted", Config{Workers: make([]WorkerConfig, 1), Policy: "kv"}, []Request{{Arrival: 2, Tokens: seq(1, 1), OutputLen: 1}, {Arrival: 1, Tokens: seq(1, 1), OutputLen: 1}}, ErrInvalidRequest},
		{"empty prompt", Config{Workers: make([]WorkerConfig, 1), Policy: "kv"}, []Request{{OutputLen: 1}}, ErrInvalidRequest},
		{"no output", Config{Workers: make([]WorkerConfig, 1), Policy: "kv"}, []Request{{Tokens: seq(1, 1)}}, ErrInvalidRequest},
		{"unknown policy", Config{Workers: make([]WorkerConfig, 1), Policy: "nope"}, ok, policy.ErrUnknownPolicy},
	} {
		if _, err := Run(t.Context(), c.cfg, c.reqs); !errors.Is(err, c.want) {
			t.Errorf("%s: err %v, want %v", c.name, err, c.want)
		}
	}
	// A request larger than a worker's cache fails alone.
	res := run(t, Config{Workers: []WorkerConfig{{KVBlocks: 4, BlockSize: 4}}, Policy: "kv"},
		[]Request{{Tokens: seq(100, 1), OutputLen: 1}, {Arrival: 1, Tokens: seq(8, 1), OutputLen: 1}})
	if !strings.Contains(res.Requests[0].Err, "KV blocks") || res.Requests[1].Err != "" {
		t.Fatalf("results %+v", res.Requests)
	}
	// An empty trace is fine.
	if res := run(t, Config{Workers: make([]WorkerConfig, 2), Policy: "kv"}, nil); len(res.Requests) != 0 || res.Span != 0 {
		t.Fatalf("empty trace: %+v", res)
	}
}

func TestContextCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := Run(ctx, Config{Workers: make([]WorkerConfig, 1), Policy: "kv"}, synthetic(10, 1, 10, 10, 1, 1)); !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v", err)
	}
}

func BenchmarkRun(b *testing.B) {
	reqs := synthetic(2000, 32, 4096, 512, 30, 5)
	cfg := Config{Workers: make([]WorkerConfig, 8), Policy: "kvbandit", KVEvents: true}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Run(b.Context(), cfg, reqs); err != nil {
			b.Fatal(err)
		}
	}
}

// TestProgress: Config.Progress sees the arrivals grow every ProgressEvery
// requests and ends at the last one.
func TestProgress(t *testing.T) {
	reqs := synthetic(2*ProgressEvery+10, 4, 256, 32, 50, 1)
	var got []int
	run(t, Config{Workers: make([]WorkerConfig, 2), Policy: "round_robin", Progress: func(n int) { got = append(got, n) }}, reqs)
	if want := []int{ProgressEvery, 2 * ProgressEvery, len(reqs)}; !reflect.DeepEqual(got, want) {
		t.Fatalf("progress %v, want %v", got, want)
	}
}
