package thompson_test

import (
	"fmt"
	"log/slog"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy/thompson"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

var (
	start = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	quiet = slog.New(slog.DiscardHandler)
)

type fixture struct {
	clk *clock.Virtual
	p   *thompson.Policy
	e   *engine.Engine

	mu      sync.Mutex
	rewards []thompson.Reward
}

func newFixture(t testing.TB, cfg thompson.Config, endpoints ...string) *fixture {
	t.Helper()
	f := &fixture{clk: clock.NewVirtual(start)}
	rnd := routing.NewRand(11)
	store, err := prefixstate.New(prefixstate.Config{}, f.clk)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	f.p, err = thompson.New(cfg, thompson.Deps{Clock: f.clk, Rand: rnd, Prefix: store, OnReward: func(r thompson.Reward) {
		f.mu.Lock()
		f.rewards = append(f.rewards, r)
		f.mu.Unlock()
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.p.Close() })
	f.e = engine.Must(f.p, engine.Options{}, engine.Deps{Clock: f.clk, Rand: rnd, Logger: quiet})
	t.Cleanup(f.e.Close)
	var set routing.EndpointSet
	for _, k := range endpoints {
		set.Endpoints = append(set.Endpoints, routing.Endpoint{Key: routing.EndpointKey(k)})
	}
	if err := f.e.Update(set); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *fixture) pick(t testing.TB, h routing.Hints) *routing.Decision {
	t.Helper()
	d, err := f.e.Pick(t.Context(), &routing.Request{TokenCount: 1000, Hints: h})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func (f *fixture) endpoint(t testing.TB, k routing.EndpointKey) thompson.EndpointStats {
	t.Helper()
	for _, es := range f.p.Stats().Endpoints {
		if es.Endpoint == k {
			return es
		}
	}
	t.Fatalf("no state for %s", k)
	return thompson.EndpointStats{}
}

func success(latency time.Duration, tokens int) routing.Outcome {
	return routing.Outcome{Kind: routing.OutcomeSuccess, Latency: latency, PromptTokens: -1, CompletionTokens: tokens, CachedTokens: -1}
}

func TestTimeoutAppliesOnceAndIgnoresLateDone(t *testing.T) {
	f := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000")
	d := f.pick(t, routing.Hints{})
	if st := f.p.Stats(); st.Pending != 1 {
		t.Fatalf("pending = %d, want 1", st.Pending)
	}
	f.clk.Step(119 * time.Second)
	if st := f.p.Stats(); st.Timeouts != 0 || st.Pending != 1 {
		t.Fatalf("before 120 s: %+v", st)
	}
	f.clk.Step(2 * time.Second)
	st := f.p.Stats()
	if st.Timeouts != 1 || st.Pending != 0 {
		t.Fatalf("after 120 s: timeouts %d pending %d, want 1, 0", st.Timeouts, st.Pending)
	}
	es := f.endpoint(t, d.Endpoint)
	if es.Alpha != 1 || es.Beta != 2 || es.Ranks[0].Updates != 1 {
		t.Fatalf("timeout reward 0: Beta(%v, %v), LinTS updates %d; want Beta(1, 2), 1", es.Alpha, es.Beta, es.Ranks[0].Updates)
	}
	d.Done(success(time.Second, 10))
	f.clk.Step(time.Hour)
	st = f.p.Stats()
	es = f.endpoint(t, d.Endpoint)
	if st.Timeouts != 1 || st.Late != 1 || st.Feedback != 0 || es.Alpha != 1 || es.Beta != 2 || es.Ranks[0].Updates != 1 {
		t.Fatalf("late Done changed state: %+v %+v", st, es)
	}
	if len(f.rewards) != 1 || !f.rewards[0].Timeout || f.rewards[0].Value != 0 {
		t.Fatalf("rewards observed: %+v", f.rewards)
	}
}

func TestDoneStopsTheTimer(t *testing.T) {
	f := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000")
	d := f.pick(t, routing.Hints{})
	d.Done(success(400*time.Millisecond, 20))
	f.clk.Step(time.Hour)
	st := f.p.Stats()
	if st.Timeouts != 0 || st.Feedback != 1 || st.Pending != 0 {
		t.Fatalf("%+v", st)
	}
	// First observation: metric = baseline → reward 0.5.
	es := f.endpoint(t, d.Endpoint)
	if es.Alpha != 1.5 || es.Beta != 1.5 || es.LastReward != 0.5 {
		t.Fatalf("Beta(%v, %v) last %v; want Beta(1.5, 1.5), 0.5", es.Alpha, es.Beta, es.LastReward)
	}
	if r := f.rewards[0]; !r.PerToken || r.Metric != 20 || r.Baseline != 20 {
		t.Fatalf("reward %+v: want 400 ms / 20 tokens = 20 ms/token against itself", r)
	}
}

func TestOutcomeKinds(t *testing.T) {
	for _, tc := range []struct {
		kind                    routing.OutcomeKind
		feedback, timeout, none uint64
		alpha, beta             float64
	}{
		{routing.OutcomeSuccess, 1, 0, 0, 1.5, 1.5},
		{routing.OutcomeUpstreamError, 1, 0, 0, 1, 2},
		{routing.OutcomeExpired, 0, 1, 0, 1, 2},
		{routing.OutcomeCancelled, 0, 0, 1, 1, 1},
		{routing.OutcomeReset, 0, 0, 1, 1, 1},
		{routing.OutcomeAbandoned, 0, 0, 1, 1, 1},
		{routing.OutcomeRejected, 0, 0, 1, 1, 1},
	} {
		t.Run(tc.kind.String(), func(t *testing.T) {
			f := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000")
			d := f.pick(t, routing.Hints{})
			o := success(time.Second, 10)
			o.Kind = tc.kind
			d.Done(o)
			f.clk.Step(time.Hour) // no timeout may follow
			st := f.p.Stats()
			es := f.endpoint(t, d.Endpoint)
			if st.Feedback != tc.feedback || st.Timeouts != tc.timeout || st.NoLearning != tc.none || st.Pending != 0 {
				t.Fatalf("stats %+v", st)
			}
			if es.Alpha != tc.alpha || es.Beta != tc.beta {
				t.Fatalf("Beta(%v, %v), want Beta(%v, %v)", es.Alpha, es.Beta, tc.alpha, tc.beta)
			}
		})
	}
}

func TestBetaMeanAfterRewards(t *testing.T) {
	f := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000")
	// Latencies per token: the first sets the baseline (0.5); each later one
	// is compared with the EMA before it.
	lat := []time.Duration{100, 25, 400, 100, 100}
	var wantA, wantB float64 = 1, 1
	ema := 0.0
	for i, l := range lat {
		d := f.pick(t, routing.Hints{})
		m := float64(l) // ms per token: latency l ms over 1 token
		base := math.Max(1, m)
		if i > 0 {
			base = ema
		}
		r := 1 / (1 + m/base)
		wantA, wantB = wantA+r, wantB+1-r
		if i == 0 {
			ema = m
		} else {
			ema = 0.2*m + 0.8*ema
		}
		d.Done(success(l*time.Millisecond, 1))
	}
	for range 3 { // three failures
		f.pick(t, routing.Hints{}).Done(routing.NoUsage(routing.OutcomeUpstreamError))
	}
	wantB += 3
	es := f.endpoint(t, "10.0.0.1:8000")
	if math.Abs(es.Alpha-wantA) > 1e-12 || math.Abs(es.Beta-wantB) > 1e-12 || math.Abs(es.Mean-wantA/(wantA+wantB)) > 1e-12 {
		t.Fatalf("Beta(%v, %v) mean %v; want Beta(%v, %v) mean %v", es.Alpha, es.Beta, es.Mean, wantA, wantB, wantA/(wantA+wantB))
	}
	if es.Rewards != 8 {
		t.Fatalf("rewards = %d, want 8", es.Rewards)
	}
}

func TestUnknownTokenCountUsesLatency(t *testing.T) {
	f := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000")
	f.pick(t, routing.Hints{}).Done(success(300*time.Millisecond, -1))
	f.pick(t, routing.Hints{}).Done(success(150*time.Millisecond, 0))
	r := f.rewards
	if len(r) != 2 || r[0].PerToken || r[0].Metric != 300 || r[1].Baseline != 300 || math.Abs(r[1].Value-2.0/3) > 1e-12 {
		t.Fatalf("rewards %+v", r)
	}
}

func TestServedElsewhere(t *testing.T) {
	f := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000", "10.0.0.2:8000")
	d := f.pick(t, routing.Hints{})
	other := routing.EndpointKey("10.0.0.1:8000")
	if d.Endpoint == other {
		other = "10.0.0.2:8000"
	}
	o := success(time.Second, 10)
	o.Served = other
	d.Done(o)
	st := f.p.Stats()
	chosen, served := f.endpoint(t, d.Endpoint), f.endpoint(t, other)
	if st.ServedMismatch != 1 || served.Rewards != 1 || chosen.Rewards != 0 {
		t.Fatalf("stats %+v chosen %+v served %+v", st, chosen, served)
	}
	for _, r := range append(chosen.Ranks, served.Ranks...) {
		if r.Updates != 0 {
			t.Fatalf("LinTS learned from a request it did not score: %+v", r)
		}
	}
}

func TestCloseStopsTimers(t *testing.T) {
	f := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000")
	for range 5 {
		f.pick(t, routing.Hints{})
	}
	_ = f.p.Close()
	// Past the policy's 120 s, before the engine's own stale-decision
	// sweep (engine.DefaultStaleAfter), whose OutcomeExpired would teach
	// the timeout reward through Done.
	f.clk.Step(engine.DefaultStaleAfter - time.Second)
	if st := f.p.Stats(); st.Timeouts != 0 || st.Pending != 0 {
		t.Fatalf("%+v", st)
	}
}

// TestRealClockTimeout runs one timeout on the wall clock.
func TestRealClockTimeout(t *testing.T) {
	cfg := thompson.DefaultConfig()
	cfg.Feedback.TimeoutSeconds = 0.02
	cfg.IdleEndpointSeconds = 0
	p, err := thompson.New(cfg, thompson.Deps{Rand: routing.NewRand(1)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	e := engine.Must(p, engine.Options{}, engine.Deps{Rand: routing.NewRand(1), Logger: quiet})
	defer e.Close()
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Pick(t.Context(), &routing.Request{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for p.Stats().Timeouts != 1 {
		if time.Now().After(deadline) {
			t.Fatal("no timeout on the real clock")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestConcurrentChooseAndDone(t *testing.T) {
	var eps []string
	for i := range 8 {
		eps = append(eps, fmt.Sprintf("10.0.0.%d:8000", i+1))
	}
	f := newFixture(t, thompson.DefaultConfig(), eps...)
	kinds := []routing.OutcomeKind{routing.OutcomeSuccess, routing.OutcomeSuccess, routing.OutcomeUpstreamError, routing.OutcomeCancelled, routing.OutcomeExpired}
	var wg sync.WaitGroup
	const workers, per = 16, 300
	var mu sync.Mutex
	var leftover []*routing.Decision
	for g := range workers {
		wg.Go(func() {
			for i := range per {
				h := routing.Hints{PrefixID: fmt.Sprintf("wf-%d", (g*per+i)%40), TotalRequests: 8, OSL: routing.Level(i % 4), IAT: routing.Level(i % 3)}
				req := &routing.Request{Tenant: "t", TokenCount: 100 + i, Hints: h}
				if i%7 == 0 {
					if _, err := f.e.Score(t.Context(), req); err != nil {
						t.Error(err)
					}
					continue
				}
				d, err := f.e.Pick(t.Context(), req)
				if err != nil {
					t.Error(err)
					return
				}
				if i%11 == 0 { // left for the timeout
					mu.Lock()
					leftover = append(leftover, d)
					mu.Unlock()
					continue
				}
				o := success(time.Duration(50+i)*time.Millisecond, i%5)
				o.Kind = kinds[i%len(kinds)]
				d.Done(o)
				_ = f.p.Stats()
			}
		})
	}
	wg.Go(func() {
		for range 100 {
			f.clk.Step(2 * time.Second)
		}
	})
	wg.Wait()
	f.clk.Step(time.Hour)
	for _, d := range leftover {
		d.Done(success(time.Second, 1)) // all late
	}
	st := f.p.Stats()
	if st.Pending != 0 {
		t.Fatalf("pending = %d after the timeout", st.Pending)
	}
	total := st.Feedback + st.Timeouts + st.NoLearning
	if total != st.Decisions || st.Late < uint64(len(leftover)) {
		t.Fatalf("feedback %d + timeouts %d + no-learning %d != decisions %d (late %d, leftover %d)",
			st.Feedback, st.Timeouts, st.NoLearning, st.Decisions, st.Late, len(leftover))
	}
	for _, es := range st.Endpoints {
		if math.IsNaN(es.Mean) || es.Alpha < 1 || es.Beta < 1 {
			t.Fatalf("endpoint %+v", es)
		}
		for _, r := range es.Ranks {
			for _, th := range r.Theta {
				if math.IsNaN(th) || math.IsInf(th, 0) {
					t.Fatalf("theta %+v", r)
				}
			}
		}
	}
}

func benchScoring(n int) *routing.Scoring {
	s := &routing.Scoring{
		Req:       &routing.Request{Tenant: "t", Hints: routing.Hints{PrefixID: "wf", TotalRequests: 1 << 20, OSL: routing.LevelMedium, IAT: routing.LevelLow}},
		BlockSize: 16,
		ISL:       4096,
		Rand:      routing.NewRand(1),
		Now:       start,
	}
	for i := range n {
		s.Candidates = append(s.Candidates, routing.Candidate{
			State:   &routing.EndpointState{Endpoint: routing.Endpoint{Key: routing.EndpointKey(fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250+1))}, Live: &routing.Live{}},
			DPRank:  -1,
			Overlap: (i * 37) % 256,
			Load:    routing.Load{KVUsage: float64(i%10) / 10, Waiting: float64(i % 4), Known: true},
		})
	}
	return s
}

// BenchmarkChoose measures one scoring pass (commit=false: the full
// sampling maths without the pending timer) and one committed decision
// through the engine including Done.
//
//	go test -run '^$' -bench Choose -benchmem ./routing/policy/thompson/
func BenchmarkChoose(b *testing.B) {
	for _, n := range []int{8, 64} {
		b.Run(fmt.Sprintf("candidates=%d/score", n), func(b *testing.B) {
			p, err := thompson.New(thompson.DefaultConfig(), thompson.Deps{Clock: clock.NewVirtual(start)})
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			s := benchScoring(n)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := p.Choose(s, false); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("candidates=%d/pick+done", n), func(b *testing.B) {
			f := newFixture(b, thompson.DefaultConfig())
			var set routing.EndpointSet
			for _, c := range benchScoring(n).Candidates {
				set.Endpoints = append(set.Endpoints, c.State.Endpoint)
			}
			if err := f.e.Update(set); err != nil {
				b.Fatal(err)
			}
			req := &routing.Request{Tenant: "t", TokenCount: 4096, Hints: routing.Hints{PrefixID: "wf", TotalRequests: 1 << 20}}
			o := success(800*time.Millisecond, 100)
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					d, err := f.e.Pick(b.Context(), req)
					if err != nil {
						b.Error(err)
						return
					}
					d.Done(o)
				}
			})
		})
	}
}
