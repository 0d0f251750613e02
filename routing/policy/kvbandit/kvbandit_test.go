package kvbandit

import (
	"math"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

func cands(keys ...string) []routing.Candidate {
	out := make([]routing.Candidate, len(keys))
	for i, k := range keys {
		out[i] = routing.Candidate{State: &routing.EndpointState{Endpoint: routing.Endpoint{Key: routing.EndpointKey(k)}}, DPRank: -1, NewBlocks: 4}
	}
	return out
}

func scoring(cs []routing.Candidate, rnd *routing.Rand) *routing.Scoring {
	return &routing.Scoring{Req: &routing.Request{}, BlockSize: 16, ISL: 64, Candidates: cs, Rand: rnd, Now: time.Unix(100, 0)}
}

// decide runs Choose and returns a Decision carrying the policy state, as
// the engine would.
func decide(t *testing.T, p *Policy, s *routing.Scoring) (int, *routing.Decision) {
	t.Helper()
	ch, err := p.Choose(s, true)
	if err != nil {
		t.Fatal(err)
	}
	return ch.Index, routing.NewTestDecision(s.Candidates[ch.Index].Key(), ch.State, s.Now)
}

// costs runs f for both costs.
func costs(t *testing.T, f func(t *testing.T, cfg Config)) {
	for _, cost := range []string{CostTTFT, CostBlocks} {
		t.Run(cost, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Cost = cost
			f(t, cfg)
		})
	}
}

func TestWithoutUncertaintyTheCheapestPrefillWins(t *testing.T) {
	costs(t, func(t *testing.T, cfg Config) {
		cfg.Speed.PriorSigma = 0
		p, err := New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		cs := cands("a:1", "b:1", "c:1")
		cs[1].Overlap = 3 // cheapest prefill
		rnd := routing.NewRand(1)
		for range 50 {
			if i, _ := decide(t, p, scoring(cs, rnd)); i != 1 {
				t.Fatalf("chose %d, want the most-cached candidate", i)
			}
		}
	})
}

func TestTTFTCostWeighsTheWaitAgainstTheCache(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Speed.PriorSigma = 0
	cfg.RecomputeWeight = 0
	p, _ := New(cfg, nil)
	cs := cands("a:1", "b:1")
	s := scoring(cs, routing.NewRand(1))
	s.ISL = 4096
	cs[0].Overlap = 200                   // a caches 3200 of the 4096 tokens...
	cs[0].ActivePrefillTokens = 64 * 1024 // ...behind 8 full batches of work
	if i, _ := decide(t, p, s); i != 1 {
		t.Fatal("the cached but swamped endpoint won on predicted TTFT")
	}
	cs[0].ActivePrefillTokens = 1024 // a short queue: the cache wins
	if i, _ := decide(t, p, s); i != 0 {
		t.Fatal("the cached endpoint with a short queue lost")
	}
	// The fleet's recompute cost keeps a conversation with its cache when
	// the wait there is only somewhat longer.
	cs[0].ActivePrefillTokens = 3 * 8192
	if i, _ := decide(t, p, s); i != 1 {
		t.Fatal("setup: without the recompute term the idle endpoint should win")
	}
	cfg.RecomputeWeight = 8
	p, _ = New(cfg, nil)
	// It weighs by the share of busy candidates: with b idle it is halved
	// and the idle endpoint still wins; with b busy too (decodes held, no
	// prefill queued) the cache wins.
	if i, _ := decide(t, p, s); i != 1 {
		t.Fatal("the recompute term counted in full with half the fleet idle")
	}
	cs[1].ActiveBlocks = 16
	if i, _ := decide(t, p, s); i != 0 {
		t.Fatal("recompute_weight 8 did not keep the request with its cache on a busy fleet")
	}
}

func TestPredictIsTheMeanWithoutSideEffects(t *testing.T) {
	p, _ := New(DefaultConfig(), nil)
	cs := cands("a:1", "b:1", "c:1")
	cs[0].ActivePrefillTokens = 20000
	cs[1].Overlap = 2
	cs[1].Load = routing.Load{Known: true, Running: 4}
	s := scoring(cs, routing.NewRand(1))
	s.ISL = 1000
	pr := p.Predict(s)
	if len(pr) != 3 {
		t.Fatalf("%d predictions", len(pr))
	}
	if pr[0].Wait <= pr[2].Wait || pr[1].Prefill >= pr[2].Prefill {
		t.Fatalf("queued work or cache not reflected: %+v", pr)
	}
	if pr[0].Impact != 0 || (pr[1].Impact-4*pr[1].Prefill).Abs() > time.Microsecond {
		t.Fatalf("impact: %+v", pr)
	}
	again := p.Predict(s)
	if again[0] != pr[0] || again[1] != pr[1] || again[2] != pr[2] || len(p.Posteriors()) != 0 {
		t.Fatal("Predict is not a pure function of the model")
	}
	s.WantPredicted = true
	ch, _ := p.Choose(s, false)
	if len(ch.Predicted) != 3 || ch.Predicted[0] != pr[0] {
		t.Fatalf("Choice.Predicted %+v", ch.Predicted)
	}
	s.WantPredicted = false
	ch, _ = p.Choose(s, true)
	if ch.Predicted != nil || ch.Prediction != pr[ch.Index] {
		t.Fatalf("Choice.Prediction %+v, want %+v", ch.Prediction, pr[ch.Index])
	}
}

func TestName(t *testing.T) {
	cfg := DefaultConfig()
	if p, _ := New(cfg, nil); p.Name() != Name {
		t.Fatal(p.Name())
	}
	cfg.Cost = CostBlocks
	if p, _ := New(cfg, nil); p.Name() != BlocksName {
		t.Fatal(p.Name())
	}
}

func TestLearnsASlowEndpoint(t *testing.T) {
	p, _ := New(DefaultConfig(), nil)
	rnd := routing.NewRand(2)
	cs := cands("10.0.0.1:1", "10.0.0.2:1")
	msPerToken := map[routing.EndpointKey]float64{"10.0.0.1:1": 10, "10.0.0.2:1": 25}
	picks := map[routing.EndpointKey]int{}
	for i := range 400 {
		idx, d := decide(t, p, scoring(cs, rnd))
		ep := cs[idx].Key()
		if i >= 200 {
			picks[ep]++
		}
		tokens := 100
		// TTFT ∝ the endpoint's slowness × prefill work (1 + 4 blocks here).
		p.Done(d, routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: time.Duration(msPerToken[ep]*5) * time.Millisecond, Latency: time.Second, CompletionTokens: tokens})
	}
	post := p.Posteriors()
	if len(post) != 2 {
		t.Fatalf("posteriors %+v", post)
	}
	// Thompson sampling stops trying the slow arm once it is confidently
	// worse, so its estimate stays rough; it must point the right way.
	if ratio := post[1].Factor / post[0].Factor; ratio < 1.1 {
		t.Fatalf("learned speed ratio %.2f, want well above 1 (true 2.5) (%+v)", ratio, post)
	}
	if picks["10.0.0.1:1"] < 150 {
		t.Fatalf("after learning, the fast endpoint got %d of 200 equal-cost picks", picks["10.0.0.1:1"])
	}
}

func TestForgetsWhenAnEndpointRecovers(t *testing.T) {
	p, _ := New(DefaultConfig(), nil)
	cs := cands("a:1", "b:1")
	s := scoring(cs, routing.NewRand(1))
	done := func(ep int, ms float64) {
		st := &decision{ep: cs[ep].Key(), rank: -1}
		p.Done(routing.NewTestDecision(cs[ep].Key(), st, s.Now), routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: time.Duration(ms * float64(time.Millisecond))})
	}
	for range 100 {
		done(0, 40)
		done(1, 10)
	}
	slow := p.Posteriors()[0].Factor / p.Posteriors()[1].Factor
	for range p.Model().Config().DetectWithin(0.9) {
		done(0, 10)
		done(1, 10)
	}
	now := p.Posteriors()[0].Factor / p.Posteriors()[1].Factor
	if !(slow > 3 && now < 1.3) {
		t.Fatalf("factor ratio while slow %.2f, after recovery %.2f", slow, now)
	}
}

func TestNonSuccessTeachesNothing(t *testing.T) {
	p, _ := New(DefaultConfig(), nil)
	cs := cands("a:1")
	for _, k := range []routing.OutcomeKind{routing.OutcomeUpstreamError, routing.OutcomeCancelled, routing.OutcomeAbandoned, routing.OutcomeExpired} {
		_, d := decide(t, p, scoring(cs, routing.NewRand(1)))
		p.Done(d, routing.Outcome{Kind: k, TTFT: time.Second, Latency: time.Second, CompletionTokens: 10})
	}
	_, d := decide(t, p, scoring(cs, routing.NewRand(1)))
	p.Done(d, routing.Outcome{Kind: routing.OutcomeSuccess, Latency: time.Second, CompletionTokens: -1}) // no TTFT
	if got := p.Posteriors(); len(got) != 0 {
		t.Fatalf("learned from %+v", got)
	}
}

// fakePrefixes is a hand-written Prefixes.
type fakePrefixes struct {
	mu          sync.Mutex
	sess        Session
	ok          bool
	outstanding map[routing.EndpointKey]float64
	pinned      routing.EndpointKey
	work        float64
}

func (f *fakePrefixes) Arrive(*routing.Request, bool) (Session, bool) { return f.sess, f.ok }
func (f *fakePrefixes) Pin(_ *routing.Request, ep routing.EndpointKey, _, _ int, work float64) {
	f.mu.Lock()
	f.pinned, f.work = ep, work
	f.mu.Unlock()
}
func (f *fakePrefixes) Outstanding(ep routing.EndpointKey) float64 { return f.outstanding[ep] }

func TestAffinityHoldsASessionAndDecays(t *testing.T) {
	costs(t, testAffinity)
}

func testAffinity(t *testing.T, cfg Config) {
	cfg.Speed.PriorSigma = 0
	cfg.Affinity.Weight = 1
	fp := &fakePrefixes{ok: true, sess: Session{Reuse: 4, Last: "a:1", Since: 0}}
	p, _ := New(cfg, fp)
	cs := cands("a:1", "b:1")
	cs[0].ActivePrefillTokens = 32 // a costs 2 blocks more; credit 1·4/5·4 = 3.2 blocks
	s := scoring(cs, routing.NewRand(1))
	s.Req.Hints.IAT = routing.LevelLow
	if i, _ := decide(t, p, s); i != 0 {
		t.Fatal("affinity did not keep the session on its endpoint")
	}
	if fp.pinned != "a:1" || fp.work <= 0 {
		t.Fatalf("pinned %q work %v", fp.pinned, fp.work)
	}
	fp.sess.Since = 10 * time.Second // 5 decay times at LOW (2 s): credit ≈ 0.02
	if i, _ := decide(t, p, s); i != 1 {
		t.Fatal("a stale affinity still outweighs the cost")
	}
	fp.sess = Session{Reuse: 0, Last: "a:1"}
	if i, _ := decide(t, p, s); i != 1 {
		t.Fatal("no reuse budget left, yet affinity applied")
	}
}

func TestOutstandingWorkSpreadsSessions(t *testing.T) {
	costs(t, testOutstanding)
}

func testOutstanding(t *testing.T, cfg Config) {
	cfg.Speed.PriorSigma = 0
	fp := &fakePrefixes{ok: true, outstanding: map[routing.EndpointKey]float64{"a:1": 100}}
	p, _ := New(cfg, fp)
	if i, _ := decide(t, p, scoring(cands("a:1", "b:1"), routing.NewRand(1))); i != 1 {
		t.Fatal("new session placed on the endpoint with more announced work")
	}
}

func TestScoreHasNoSideEffects(t *testing.T) {
	fp := &fakePrefixes{ok: true, sess: Session{Reuse: 3}}
	p, _ := New(DefaultConfig(), fp)
	if _, err := p.Choose(scoring(cands("a:1"), routing.NewRand(1)), false); err != nil {
		t.Fatal(err)
	}
	if fp.pinned != "" {
		t.Fatal("Score pinned a session")
	}
}

func TestValidate(t *testing.T) {
	bad := []func(*Config){
		func(c *Config) { c.OverlapScoreWeight = -1 },
		func(c *Config) { c.Speed.ObsSigma = 0 },
		func(c *Config) { c.Speed.Forget = 1.5 },
		func(c *Config) { c.Speed.PriorSigma = math.NaN() },
		func(c *Config) { c.Speed.MaxFactor = 0.5 },
		func(c *Config) { c.Affinity.DecayLowSeconds = 0 },
		func(c *Config) { c.Cost = "latency" },
		func(c *Config) { c.ImpactWeight = -1 },
		func(c *Config) { c.RecomputeWeight = math.Inf(1) },
		func(c *Config) { c.Latency.BatchTokens = 0 },
		func(c *Config) { c.Latency.Ridge = 0 },
	}
	for i, f := range bad {
		c := DefaultConfig()
		f(&c)
		if _, err := New(c, nil); err == nil {
			t.Errorf("case %d accepted", i)
		}
	}
}

func TestConcurrentChooseAndDone(t *testing.T) {
	p, _ := New(DefaultConfig(), nil)
	rnd := routing.NewRand(5)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cs := cands("a:1", "b:1", "c:1")
			for i := range 500 {
				ch, _ := p.Choose(scoring(cs, rnd), true)
				d := routing.NewTestDecision(cs[ch.Index].Key(), ch.State, time.Unix(int64(i), 0))
				p.Done(d, routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: time.Duration(10+g) * time.Millisecond, Latency: time.Second, CompletionTokens: 5})
			}
		}()
	}
	wg.Wait()
	for _, post := range p.Posteriors() {
		if math.IsNaN(post.Factor) || post.Observations == 0 {
			t.Fatalf("%+v", post)
		}
	}
}

func TestAnnouncedWorkDoesNotMoveAPinnedSession(t *testing.T) {
	costs(t, testPinned)
}

func testPinned(t *testing.T, cfg Config) {
	cfg.Speed.PriorSigma = 0
	cfg.Affinity.Weight = 0
	// a:1 carries 1000 blocks of announced work (other sessions'); the
	// session pinned there stays, its own prefix being cached there.
	fp := &fakePrefixes{ok: true, sess: Session{Reuse: 3, Last: "a:1"}, outstanding: map[routing.EndpointKey]float64{"a:1": 1000}}
	p, _ := New(cfg, fp)
	cs := cands("a:1", "b:1")
	cs[0].Overlap = 2 // the session's prefix is cached on a
	if i, _ := decide(t, p, scoring(cs, routing.NewRand(1))); i != 0 {
		t.Fatal("announced work pushed a pinned session off its worker")
	}
}

// A prefix held in host memory is worth less than one in GPU memory and
// more than none, under both costs; with tier weights of 0 it is ignored.
func TestLowerTierOverlapCountsBetweenAHitAndAMiss(t *testing.T) {
	costs(t, func(t *testing.T, cfg Config) {
		cfg.Speed.PriorSigma = 0
		p, err := New(cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		rnd := routing.NewRand(1)
		cs := cands("none:1", "cpu:1")
		cs[1].OverlapCPU = 3
		if i, _ := decide(t, p, scoring(cs, rnd)); i != 1 {
			t.Fatalf("chose %d, want the candidate holding the prefix in host memory", i)
		}
		cs = cands("gpu:1", "cpu:1")
		cs[0].Overlap = 3
		cs[1].OverlapCPU = 3
		if i, _ := decide(t, p, scoring(cs, rnd)); i != 0 {
			t.Fatalf("chose %d, want the candidate holding the prefix in GPU memory", i)
		}
		cs = cands("none:1", "cpu:1")
		cs[1].OverlapCPU = 3
		cs[1].ActivePrefillTokens = 1 // otherwise a tie
		s := scoring(cs, rnd)
		s.TierWeights = routing.TierWeights{GPU: 1, CPU: 0, Disk: 0}
		for range 20 {
			if i, _ := decide(t, p, s); i != 0 {
				t.Fatalf("chose %d with a CPU weight of 0, want the idle candidate", i)
			}
		}
	})
}

// A session id alone (x-prefix-id without x-prefix-total-requests) keeps a
// session on one worker: nine requests of one session, on four equal
// workers, all go where the first went; with an announced total the
// affinity ends at the last announced request.
func TestSessionIDAloneGivesAffinity(t *testing.T) {
	costs(t, func(t *testing.T, cfg Config) {
		clk := clock.NewVirtual(time.Unix(100, 0))
		st, err := prefixstate.New(prefixstate.Config{}, clk)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(st.Close)
		p, err := New(cfg, FromStore(st, clk))
		if err != nil {
			t.Fatal(err)
		}
		rnd := routing.NewRand(7)
		cs := cands("a:1", "b:1", "c:1", "d:1")
		seen := map[routing.EndpointKey]int{}
		for range 9 {
			s := scoring(cs, rnd)
			s.Req.Hints.PrefixID = "s1"
			i, _ := decide(t, p, s)
			seen[cs[i].Key()]++
			clk.Step(time.Second)
		}
		if len(seen) != 1 {
			t.Fatalf("nine requests of one session went to %d workers: %v", len(seen), seen)
		}
		if w := st.OutstandingWork(cs[0].Key()) + st.OutstandingWork("b:1") + st.OutstandingWork("c:1") + st.OutstandingWork("d:1"); w != 0 {
			t.Fatalf("a session without a total announced work %v", w)
		}
	})
}
