package thompson

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/evidence"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

const (
	epA = routing.EndpointKey("10.0.0.1:8000")
	epB = routing.EndpointKey("10.0.0.2:8000")
	epC = routing.EndpointKey("10.0.0.3:8000")
)

func newPolicy(t testing.TB, cfg Config, clk clock.Clock) *Policy {
	t.Helper()
	if clk == nil {
		clk = clock.NewVirtual(t0)
	}
	p, err := New(cfg, Deps{Clock: clk, Rand: routing.NewRand(7)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func cand(key routing.EndpointKey, overlap int, load routing.Load) routing.Candidate {
	return routing.Candidate{
		State:   &routing.EndpointState{Endpoint: routing.Endpoint{Key: key}, Live: &routing.Live{}},
		DPRank:  -1,
		Overlap: overlap,
		Load:    load,
	}
}

// workedExample is research notes §3.9: ISL 2048, osl MEDIUM, iat LOW,
// R = 4, last = A; A has 75 % overlap, gpu 0.5, queue 2; B none, 0.2, 0.
func workedExample(t testing.TB, p *Policy, extra ...routing.Candidate) *routing.Scoring {
	t.Helper()
	k := prefixstate.Key{Tenant: "t", PrefixID: "wf"}
	// Six announced requests, one already routed to A: the next one leaves
	// R = 4. Zero costs keep A's outstanding work at 0, as in the example.
	r, _, _ := p.prefix.Arrive(k, 6, true)
	p.prefix.Pin(k, prefixstate.Pin{Endpoint: epA, DPRank: -1}, r)
	return &routing.Scoring{
		Req: &routing.Request{Tenant: "t", Hints: routing.Hints{
			PrefixID: "wf", TotalRequests: 6, OSL: routing.LevelMedium, IAT: routing.LevelLow,
		}},
		BlockSize: 16,
		ISL:       2048,
		Candidates: append([]routing.Candidate{
			cand(epA, 96, routing.Load{KVUsage: 0.5, Waiting: 2, Known: true}),
			cand(epB, 0, routing.Load{KVUsage: 0.2, Waiting: 0, Known: true}),
		}, extra...),
		Rand: routing.NewRand(42),
		Now:  t0,
	}
}

func near(t *testing.T, name string, got, want, tol float64) {
	t.Helper()
	if math.Abs(got-want) > tol || math.IsNaN(got) {
		t.Errorf("%s = %.6f, want %.6f (±%g)", name, got, want, tol)
	}
}

func TestWorkedExample(t *testing.T) {
	cfg := DefaultConfig()
	cfg.ReferenceCompat = true
	p := newPolicy(t, cfg, nil)
	s := workedExample(t, p)
	terms := make([]candidateTerms, 2)
	rq := p.terms(s, false, terms)

	if rq.reuse != 4 || !rq.hasLast || rq.last.Endpoint != epA {
		t.Fatalf("R = %d, last = %+v (%v); want 4, A", rq.reuse, rq.last, rq.hasLast)
	}
	near(t, "T", rq.temperature, 0.15, 1e-12)
	near(t, "ε", rq.eps, 0.1/7, 1e-12)
	near(t, "ε (rounded)", rq.eps, 0.0143, 1e-4)

	a, b := terms[0], terms[1]
	wantA := vec{1, 0.2222, 0.75, 1, 0, 0.6667, 0.4621, 1.0, 0.7616}
	wantB := vec{1, 0.8333, 0, 0, 0, 0.6667, 0.9640, 1.0, 0.7616}
	for i := range dim {
		near(t, "x_A["+string(rune('0'+i))+"]", a.x[i], wantA[i], 1e-4)
		near(t, "x_B["+string(rune('0'+i))+"]", b.x[i], wantB[i], 1e-4)
	}
	near(t, "prefill_A", a.prefill, 0.5, 1e-12)
	near(t, "prefill_B", b.prefill, 2.0, 1e-12)
	near(t, "job_A", a.jobCost, 2.5, 1e-12)
	near(t, "job_B", b.jobCost, 4.0, 1e-12)
	near(t, "load_mod_A", a.loadMod, 1.0/6, 1e-12)
	near(t, "load_mod_A (rounded)", a.loadMod, 0.1667, 1e-4)
	near(t, "load_mod_B", b.loadMod, 1/1.52, 1e-12)
	near(t, "load_mod_B (rounded)", b.loadMod, 0.6579, 1e-4)
	near(t, "affinity_A", a.affinity, 0.805, 1e-12)
	near(t, "switch_A", a.switching, 0, 0)
	near(t, "affinity_B", b.affinity, 0, 0)
	near(t, "switch_B", b.switching, 0.305, 1e-12)

	// Cold start, θ ≈ 0 and p_beta ≈ 0.5 (§3.9): val_A ≈ 0.135, val_B ≈ −0.196.
	vA := assemble(&a, 0, 0.5, rq.eps, true)
	vB := assemble(&b, 0, 0.5, rq.eps, true)
	near(t, "val_A", vA, 0.135, 5e-4)
	near(t, "val_B", vB, -0.196, 5e-4)
	pA := 1 / (1 + math.Exp(-(vA-vB)/rq.temperature))
	near(t, "P(A)", pA, 0.90, 0.005)
}

// TestSwitchingCostAfterLoadModifier is a hand-computed case for defect (a).
// A is the prefix's last endpoint; B (load_mod 1/1.52) and C (busier) are
// not. With θ = 0 and p_beta = 0.5, ε = 0.1/7:
//
//	reference: val = (ε/2 − 0.305)·load_mod → B −0.19596, C −0.02288: the
//	           busier C scores higher, since its penalty shrinks with load.
//	fixed:     val = (ε/2)·load_mod − 0.305 → B −0.30030, C −0.30445: the
//	           busier C scores lower, and the penalty is the same for both.
func TestSwitchingCostAfterLoadModifier(t *testing.T) {
	// C: gpu 0.2, queue 5, no overlap: P = 0.2 + 7.5 + 0.4·4·0.2 + 0.2·4·5 = 12.02.
	busy := cand(epC, 0, routing.Load{KVUsage: 0.2, Waiting: 5, Known: true})
	for _, tc := range []struct {
		compat bool
		b, c   float64
	}{
		{compat: true, b: (0.05/7 - 0.305) / 1.52, c: (0.05/7 - 0.305) / 13.02},
		{compat: false, b: 0.05/7/1.52 - 0.305, c: 0.05/7/13.02 - 0.305},
	} {
		cfg := DefaultConfig()
		cfg.Compat.ScaledSwitchingCost = tc.compat
		p := newPolicy(t, cfg, nil)
		s := workedExample(t, p, busy)
		terms := make([]candidateTerms, 3)
		rq := p.terms(s, false, terms)
		near(t, "load_mod_C", terms[2].loadMod, 1/13.02, 1e-12)
		vB := assemble(&terms[1], 0, 0.5, rq.eps, tc.compat)
		vC := assemble(&terms[2], 0, 0.5, rq.eps, tc.compat)
		near(t, "val_B", vB, tc.b, 1e-12)
		near(t, "val_C", vC, tc.c, 1e-12)
		if tc.compat && !(vC > vB) {
			t.Errorf("reference ordering: busier C (%v) should score above B (%v)", vC, vB)
		}
		if !tc.compat && !(vC < vB) {
			t.Errorf("fixed ordering: busier C (%v) should score below B (%v)", vC, vB)
		}
	}
}

// TestChoiceProbabilityAtColdStart samples the worked example with θ frozen
// at its prior mean (v = 0, so θ = 0) and checks the softmax draw.
func TestChoiceProbabilityAtColdStart(t *testing.T) {
	for _, tc := range []struct {
		compat bool
		want   float64
	}{
		{true, 0.90},  // logit (0.1354 + 0.1960)/0.15
		{false, 0.95}, // logit (0.1354 + 0.3003)/0.15
	} {
		cfg := DefaultConfig()
		cfg.LinTS.V = 0
		cfg.ReferenceCompat = tc.compat
		p := newPolicy(t, cfg, nil)
		s := workedExample(t, p)
		const n = 20000
		var hitsA int
		for range n {
			ch, err := p.Choose(s, false)
			if err != nil {
				t.Fatal(err)
			}
			if ch.Index == 0 {
				hitsA++
			}
			if ch.Ranked[0] != 0 || ch.Scores[0] <= ch.Scores[1] {
				t.Fatalf("ranked %v scores %v: A should rank first", ch.Ranked, ch.Scores)
			}
		}
		t.Logf("reference_compat=%v: P(A) = %.4f over %d draws (expected ≈ %.2f)", tc.compat, float64(hitsA)/n, n, tc.want)
		near(t, "P(A)", float64(hitsA)/n, tc.want, 0.012)
		if p.prefix.Len() != 1 || p.Stats().Pending != 0 || p.Stats().Decisions != 0 {
			t.Fatalf("Score had side effects: %+v", p.Stats())
		}
	}
}

func TestScoreHasNoSideEffects(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	s := workedExample(t, p)
	before, _, _ := p.prefix.Arrive(prefixstate.Key{Tenant: "t", PrefixID: "wf"}, 6, false)
	for range 10 {
		if _, err := p.Choose(s, false); err != nil {
			t.Fatal(err)
		}
	}
	after, _, _ := p.prefix.Arrive(prefixstate.Key{Tenant: "t", PrefixID: "wf"}, 6, false)
	armsN := len(p.learned.Load().arms)
	if before != after || armsN != 0 || p.Stats().Pending != 0 {
		t.Fatalf("R %d → %d, %d arms, %d pending; want no change", before, after, armsN, p.Stats().Pending)
	}
}

func TestLinTSConvergesToLinearReward(t *testing.T) {
	w := vec{0.1, 0.2, 0.05, 0.1, -0.05, 0.1, 0.05, 0.1, 0.15}
	p := newPolicy(t, DefaultConfig(), nil)
	a := newArm(armKey{epA, -1}, &endpointState{}, p.prior, 1)
	rng := rand.New(rand.NewPCG(1, 2))
	for range 5000 {
		x := vec{1}
		for i := 1; i < dim; i++ {
			x[i] = rng.Float64()
		}
		a.update(&x, dot(&w, &x), 1, 0.995)
	}
	mu := a.post.Load().mu
	for i := range dim {
		near(t, "μ["+string(rune('0'+i))+"]", mu[i], w[i], 0.02)
	}
	// Samples with v = 0.25 scatter around μᵀx.
	x := vec{1, 0.5, 0.5, 1, 0.2, 0.67, 0.4, 1, 0.76}
	var sum float64
	const n = 20000
	for range n {
		sum += a.post.Load().sample(rng, 0.25, &x)
	}
	near(t, "mean θᵀx", sum/n, dot(&mu, &x), 0.005)
}

func TestLinTSPriorNoise(t *testing.T) {
	// At the prior A = λI the noise std of θᵀx is v·‖x‖/√λ (§3.9's cold-start note).
	p := newPolicy(t, DefaultConfig(), nil)
	rng := rand.New(rand.NewPCG(3, 4))
	x := vec{1, 0.2222, 0.75, 1, 0, 0.6667, 0.4621, 1.0, 0.7616}
	var s, s2 float64
	const n = 40000
	for range n {
		v := p.prior.sample(rng, 0.25, &x)
		s += v
		s2 += v * v
	}
	mean := s / n
	std := math.Sqrt(s2/n - mean*mean)
	near(t, "mean", mean, 0, 0.01)
	near(t, "std", std, 0.25*math.Sqrt(dot(&x, &x)), 0.01)
}

func TestBetaSampler(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, ab := range [][2]float64{{1, 1}, {3, 7}, {0.5, 0.5}, {20, 2.5}} {
		a, b := ab[0], ab[1]
		var s, s2 float64
		const n = 100000
		for range n {
			v := sampleBeta(rng, a, b)
			if v < 0 || v > 1 {
				t.Fatalf("Beta(%v,%v) drew %v", a, b, v)
			}
			s += v
			s2 += v * v
		}
		mean := s / n
		variance := s2/n - mean*mean
		wantMean := a / (a + b)
		wantVar := a * b / ((a + b) * (a + b) * (a + b + 1))
		near(t, "mean", mean, wantMean, 0.005)
		near(t, "var", variance, wantVar, 0.1*wantVar)
	}
}

func TestRewardTable(t *testing.T) {
	for _, tc := range []struct{ ratio, want float64 }{
		{0.25, 0.8}, {0.5, 2.0 / 3}, {1, 0.5}, {2, 1.0 / 3}, {4, 0.2},
	} {
		near(t, "reward", rewardFor(tc.ratio*40, 40), tc.want, 1e-12)
	}
	// The baseline is floored at 1e-3, and out-of-range values are clipped.
	near(t, "tiny baseline", rewardFor(1e-3, 0), 0.5, 1e-12)
	near(t, "negative metric", rewardFor(-5, 1), 0, 0)
	near(t, "NaN", rewardFor(math.NaN(), 1), 0, 0)
	near(t, "zero metric", rewardFor(0, 1), 1, 0)
	near(t, "clip01 high", clip01(1.7), 1, 0)
}

func TestBaselineHierarchy(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	a := &endpointState{key: epA}
	b := &endpointState{key: epB}
	// Each step reads the baseline, then (on success) moves the bucket,
	// endpoint and global averages toward the metric with α = 0.2.
	steps := []struct {
		name         string
		ep           *endpointState
		osl, bin     int
		perTok       bool
		metric       float64
		success      bool
		wantBaseline float64
	}{
		{"nothing known: max(1, metric)", a, 1, 0, true, 40, true, 40},
		{"ms mode is separate; max(1, 0.5)", a, 1, 0, false, 0.5, true, 1},
		{"bucket", a, 1, 0, true, 60, true, 40},
		{"bucket EMA 0.2·60 + 0.8·40", a, 1, 0, true, 10, true, 44},
		{"failure reads, does not update", a, 1, 0, true, 1000, false, 37.2},
		{"bucket unchanged by the failure", a, 1, 0, true, 37.2, true, 37.2},
		{"new bucket: endpoint level", a, 2, 2, true, 5, true, 37.2},
		{"new endpoint: global level", b, 0, 1, true, 5, true, 0.2*5 + 0.8*37.2},
		{"global ms mode", b, 0, 1, false, 3000, true, 0.5},
		{"B's bucket", b, 0, 1, true, 1, true, 5},
		{"B's endpoint level", b, 1, 1, true, 1, true, 0.2*1 + 0.8*5},
	}
	for _, st := range steps {
		got := p.baseline(st.ep, st.osl, st.bin, st.perTok, st.metric, st.success, evidence.Local)
		near(t, st.name, got, st.wantBaseline, 1e-9)
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		mut  func(*Config)
		want string
	}{
		{func(c *Config) { c.LinTS.ForgetRate = 0 }, "thompson.lints.forget_rate: must be in (0, 1]"},
		{func(c *Config) { c.LinTS.ForgetRate = 1.5 }, "thompson.lints.forget_rate: must be in (0, 1]"},
		{func(c *Config) { c.Affinity.Base = math.NaN() }, "thompson.affinity.base:"},
		{func(c *Config) { c.LoadBalancing.QueuePenaltyWeight = -1 }, "thompson.load_balancing.queue_penalty_weight:"},
		{func(c *Config) { c.SwitchingCost.IATPenalty = math.Inf(1) }, "thompson.switching_cost.iat_penalty:"},
		{func(c *Config) { c.Exploration.Temperature.Min = 3 }, "thompson.exploration.temperature: min (3) must not exceed max (2)"},
		{func(c *Config) { c.Exploration.Temperature.Base = 0 }, "thompson.exploration.temperature.base:"},
		{func(c *Config) { c.Prefill.TokenScale = 0 }, "thompson.prefill.token_scale:"},
		{func(c *Config) { c.LinTS.Lambda = 0 }, "thompson.lints.lambda:"},
		{func(c *Config) { c.Feedback.TimeoutReward = 2 }, "thompson.feedback.timeout_reward: must be in [0, 1]"},
		{func(c *Config) { c.Feedback.LatencyEMAAlpha = 0 }, "thompson.feedback.latency_ema_alpha:"},
		{func(c *Config) { c.Feedback.TimeoutSeconds = 0 }, "thompson.feedback.timeout_seconds:"},
		{func(c *Config) { c.Affinity.StickyLoadFloor = 1.1 }, "thompson.affinity.sticky_load_floor:"},
		{func(c *Config) { c.IdleEndpointSeconds = 60 }, "thompson.idle_endpoint_seconds:"},
	} {
		c := DefaultConfig()
		tc.mut(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate() = %v, want it to contain %q", err, tc.want)
		}
		if _, err := New(c, Deps{}); err == nil {
			t.Errorf("New accepted an invalid config (%s)", tc.want)
		}
	}
	c := DefaultConfig()
	if err := c.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
}

func TestBadLoadNeverGivesNaNScores(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	nan, inf := math.NaN(), math.Inf(1)
	s := &routing.Scoring{
		Req:       &routing.Request{Hints: routing.Hints{PrefixID: "p", TotalRequests: 1 << 40, OSL: routing.Level(9), IAT: routing.LevelHigh}},
		BlockSize: 16,
		ISL:       100,
		Candidates: []routing.Candidate{
			cand(epA, 1000, routing.Load{KVUsage: nan, Waiting: 3, Known: true}),
			cand(epB, -5, routing.Load{KVUsage: -0.5, Waiting: -3, Known: true}),
			cand(epC, 3, routing.Load{KVUsage: 7, Waiting: inf, Known: true}),
			cand("10.0.0.4:8000", 3, routing.Load{KVUsage: 0.5, Waiting: 1e300, Known: true}),
			cand("10.0.0.5:8000", 3, routing.Load{KVUsage: 0.5, Waiting: 1, Known: true, Stale: true}),
		},
		Rand: routing.NewRand(1),
	}
	s.Candidates[2].State.InFlight.Store(40)
	terms := make([]candidateTerms, len(s.Candidates))
	p.terms(s, false, terms)
	if terms[0].overlap != 1 || terms[1].overlap != 0 {
		t.Errorf("overlap clamp: %v %v", terms[0].overlap, terms[1].overlap)
	}
	if terms[0].gpu != 0 || terms[0].queue != 0 {
		t.Errorf("NaN scrape should fall back to pending (0): gpu %v queue %v", terms[0].gpu, terms[0].queue)
	}
	if terms[1].gpu != 0 || terms[1].queue != 0 {
		t.Errorf("negative scrape should count as 0: gpu %v queue %v", terms[1].gpu, terms[1].queue)
	}
	if terms[2].gpu != 1 || terms[2].queue != 40 {
		t.Errorf("Inf scrape should fall back to pending 40: gpu %v queue %v", terms[2].gpu, terms[2].queue)
	}
	for range 100 {
		for _, commit := range []bool{false, true} {
			ch, err := p.Choose(s, commit)
			if err != nil {
				t.Fatal(err)
			}
			for i, v := range ch.Scores {
				if math.IsNaN(v) || math.IsInf(v, 0) {
					t.Fatalf("score %d = %v", i, v)
				}
			}
		}
	}
	// ISL 0: no overlap term, no prefill.
	s.ISL = 0
	p.terms(s, false, terms)
	for i := range terms {
		if terms[i].overlap != 0 || terms[i].prefill != 0 {
			t.Fatalf("ISL 0: candidate %d overlap %v prefill %v", i, terms[i].overlap, terms[i].prefill)
		}
	}
}

func TestLateJoiners(t *testing.T) {
	for _, blind := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Compat.LateJoinersBlind = blind
		p := newPolicy(t, cfg, nil)
		s := workedExample(t, p)
		if _, err := p.Choose(s, true); err != nil { // the startup fleet: A, B
			t.Fatal(err)
		}
		s.Candidates = append(s.Candidates, cand(epC, 128, routing.Load{KVUsage: 0.1, Waiting: 1, Known: true}))
		s.Candidates[2].State.InFlight.Store(4)
		terms := make([]candidateTerms, 3)
		p.terms(s, false, terms)
		c := terms[2]
		if blind {
			if c.overlap != 0 || c.gpu != 0.2 || c.queue != 4 {
				t.Errorf("compat: late joiner overlap %v gpu %v queue %v; want 0, 0.2, 4", c.overlap, c.gpu, c.queue)
			}
		} else if c.overlap != 1 || c.gpu != 0.1 || c.queue != 4 {
			t.Errorf("fixed: late joiner overlap %v gpu %v queue %v; want 1, 0.1, max(1, 4)", c.overlap, c.gpu, c.queue)
		}
		if _, err := p.Choose(s, true); err != nil {
			t.Fatal(err)
		}
		if _, ok := p.learned.Load().arms[armKey{epC, -1}]; !ok {
			t.Error("late joiner has no LinTS state")
		}
	}
}

func TestRebuiltFeatures(t *testing.T) {
	for _, rebuilt := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Compat.RebuiltFeatures = rebuilt
		cfg.LinTS.V = 0
		p := newPolicy(t, cfg, nil)
		s := workedExample(t, p)
		ch, err := p.Choose(s, true)
		if err != nil {
			t.Fatal(err)
		}
		rec := ch.State.(*decision)
		want := 0.0 // scored with no outstanding work
		if rebuilt {
			// Re-pinned with R = 4, decode 2, the chosen prefill, iat 1.5.
			prefill := []float64{0.5, 2}[ch.Index]
			want = math.Tanh(0.1 * 4 * (2 + prefill) * 1.5)
		}
		near(t, "stored x[4]", rec.x[4], want, 1e-9)
	}
}

func TestIdleEndpointsAreDropped(t *testing.T) {
	clk := clock.NewVirtual(t0)
	cfg := DefaultConfig()
	cfg.IdleEndpointSeconds = 600
	p := newPolicy(t, cfg, clk)
	s := &routing.Scoring{Candidates: []routing.Candidate{cand(epA, 0, routing.Load{}), cand(epB, 0, routing.Load{})}, Rand: routing.NewRand(1)}
	pick := func(now time.Time, cands ...routing.Candidate) {
		s.Candidates, s.Now = cands, now
		if _, err := p.Choose(s, true); err != nil {
			t.Fatal(err)
		}
	}
	a, b := cand(epA, 0, routing.Load{}), cand(epB, 0, routing.Load{})
	pick(t0, a, b)
	for m := 1; m <= 20; m++ {
		pick(t0.Add(time.Duration(m)*time.Minute), a) // B left the fleet
	}
	_ = p.Close() // the pending decisions' timers
	if _, ok := p.learned.Load().endpoints[epB]; ok {
		t.Error("B's state survived 20 idle minutes")
	}
	if _, ok := p.learned.Load().arms[armKey{epB, -1}]; ok {
		t.Error("B's sampler survived 20 idle minutes")
	}
	if _, ok := p.learned.Load().endpoints[epA]; !ok {
		t.Error("A's state was dropped")
	}
	if st := p.Stats(); st.DroppedEndpoints != 1 {
		t.Errorf("dropped = %d, want 1", st.DroppedEndpoints)
	}
}

func TestAffinityFollowsTheChoice(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	s := &routing.Scoring{
		Req:        &routing.Request{Hints: routing.Hints{PrefixID: "wf", TotalRequests: 3}},
		Candidates: []routing.Candidate{cand(epA, 0, routing.Load{}), cand(epB, 0, routing.Load{})},
		Rand:       routing.NewRand(3),
		ISL:        512,
	}
	first, err := p.Choose(s, true)
	if err != nil {
		t.Fatal(err)
	}
	k := prefixstate.Key{PrefixID: "wf"}
	r, last, ok := p.prefix.Arrive(k, 3, false)
	if r != 1 || !ok || last.Endpoint != s.Candidates[first.Index].Key() {
		t.Fatalf("after the first pick: R %d last %+v %v; want 1, the chosen endpoint", r, last, ok)
	}
	terms := make([]candidateTerms, 2)
	p.terms(s, false, terms)
	if !terms[first.Index].isLast || terms[first.Index].affinity == 0 || terms[1-first.Index].switching == 0 {
		t.Fatalf("affinity not applied: %+v", terms)
	}
	p.Choose(s, true) // R = 1 → pinned again
	p.Choose(s, true) // R = 0 → entry removed
	if p.prefix.Len() != 0 {
		t.Fatalf("prefix entries = %d after the last request, want 0", p.prefix.Len())
	}
	if p.prefix.OutstandingWork(epA) != 0 || p.prefix.OutstandingWork(epB) != 0 {
		t.Fatal("outstanding work left after the last request")
	}
}

func TestEmptyCandidates(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	if _, err := p.Choose(&routing.Scoring{}, true); err == nil {
		t.Fatal("no error for no candidates")
	}
}

func TestDrawDegenerate(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	rng := rand.New(rand.NewPCG(9, 9))
	counts := make([]int, 3)
	for range 3000 {
		counts[p.draw(rng, []float64{badScore, badScore, badScore}, 1, make([]float64, 3))]++
	}
	for i, c := range counts {
		if c < 800 {
			t.Errorf("equal scores: index %d drawn %d/3000 times", i, c)
		}
	}
	if got := p.draw(rng, []float64{0, 1e6, -1e6}, 0.15, make([]float64, 3)); got != 1 {
		t.Errorf("dominant score not chosen: %d", got)
	}
}

func TestStickyLoadFloor(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	s := workedExample(t, p)
	s.Candidates[0].Load.Waiting = 100 // A, the last endpoint, is swamped
	s.Candidates[1].Load.Waiting = 100
	terms := make([]candidateTerms, 2)
	p.terms(s, false, terms)
	near(t, "load_mod_A (floored)", terms[0].loadMod, 0.01, 0)
	if terms[1].loadMod >= 0.01 {
		t.Errorf("load_mod_B = %v: the floor applies to the last endpoint only", terms[1].loadMod)
	}
	// R = 0: no affinity, no switching cost, no floor.
	s.Req.Hints.PrefixID = ""
	p.terms(s, false, terms)
	if terms[0].loadMod >= 0.01 || terms[0].affinity != 0 || terms[1].switching != 0 {
		t.Errorf("R = 0: %+v", terms)
	}
}

// A prefix id without a total is a session assumed to continue: its second
// request has a reuse budget and knows where the first went. With
// compat.session_needs_total (the reference) it is a group of one.
func TestSessionIDAloneIsASession(t *testing.T) {
	for _, needsTotal := range []bool{false, true} {
		cfg := DefaultConfig()
		cfg.Compat.SessionNeedsTotal = needsTotal
		p := newPolicy(t, cfg, nil)
		s := &routing.Scoring{
			Req:       &routing.Request{Tenant: "t", Hints: routing.Hints{PrefixID: "s1", OSL: routing.LevelMedium, IAT: routing.LevelLow}},
			BlockSize: 16, ISL: 256,
			Candidates: []routing.Candidate{cand(epA, 0, routing.Load{Known: true}), cand(epB, 0, routing.Load{Known: true})},
			Rand:       routing.NewRand(1), Now: t0,
		}
		if _, err := p.Choose(s, true); err != nil {
			t.Fatal(err)
		}
		terms := make([]candidateTerms, len(s.Candidates))
		rq := p.terms(s, false, terms)
		if needsTotal && (rq.reuse != 0 || rq.hasLast) {
			t.Fatalf("session_needs_total: reuse %d, hasLast %v; want a group of one", rq.reuse, rq.hasLast)
		}
		if !needsTotal && (rq.reuse != 2 || !rq.hasLast) {
			t.Fatalf("reuse %d, hasLast %v; want 2 (two seen), pinned", rq.reuse, rq.hasLast)
		}
	}
}
