package latency

import (
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
)

// engine is a synthetic chunked-prefill engine with constants unlike the
// model's prior (and unlike Dynamo's mocker): ttft is what a request with
// features f waits on it at speed 1.
type engine struct {
	perToken, perStep, decodeBase, decodePerRun float64 // ms
	budget                                      int
}

func (e engine) decode(running float64) float64 { return e.decodeBase + e.decodePerRun*running }

func (e engine) ttft(f Features) float64 {
	w := float64(f.Queued) + float64(f.Uncached)
	steps := math.Ceil(w / float64(e.budget))
	t := e.perToken*w + e.perStep*steps
	if f.Running > 0 {
		t += e.decode(f.Running) / 2 // on average half a decode step in progress
	}
	return t
}

var fleet = engine{perToken: 0.04, perStep: 30, decodeBase: 12, decodePerRun: 0.3, budget: 8192}

func randFeatures(r *rand.Rand) Features {
	return Features{Queued: int64(r.IntN(20000)), Uncached: r.IntN(16000), Running: float64(r.IntN(64))}
}

func obs(ep string, f Features, ttftMs, stepMs float64, out int) Observation {
	ttft := time.Duration(ttftMs * float64(time.Millisecond))
	return Observation{Endpoint: routing.EndpointKey(ep), DPRank: -1, Features: f, TTFT: ttft,
		Latency: ttft + time.Duration(float64(out-1)*stepMs*float64(time.Millisecond)), Output: out}
}

func cand(ep string) *routing.Candidate {
	return &routing.Candidate{State: &routing.EndpointState{Endpoint: routing.Endpoint{Key: routing.EndpointKey(ep)}}, DPRank: -1}
}

func newModel(t testing.TB, cfg Config) *Model {
	t.Helper()
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestLearnsTheEngineFromOutcomes(t *testing.T) {
	m := newModel(t, DefaultConfig())
	r := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		f := randFeatures(r)
		noise := math.Exp(0.1 * r.NormFloat64())
		m.Observe(obs("a:1", f, fleet.ttft(f)*noise, fleet.decode(f.Running)*noise, 100))
	}
	c := cand("a:1")
	var worst float64
	for range 200 {
		f := randFeatures(r)
		got := m.Predict(c, f).TTFT.Seconds() * 1000
		worst = max(worst, math.Abs(got-fleet.ttft(f))/fleet.ttft(f))
	}
	if worst > 0.2 {
		t.Fatalf("worst relative error %.2f after 2000 outcomes (coefficients %+v)", worst, m.Coefficients())
	}
	k := m.Coefficients()
	if d := k.DecodeBase + 32*k.DecodePerRunning; math.Abs(d-fleet.decode(32))/fleet.decode(32) > 0.1 {
		t.Fatalf("decode step at 32 running: %.1f ms, want %.1f (%+v)", d, fleet.decode(32), k)
	}
}

func TestPredictionParts(t *testing.T) {
	m := newModel(t, DefaultConfig())
	c := cand("a:1")
	f := Features{Queued: 10000, Uncached: 3000, Running: 5}
	p := m.Predict(c, f)
	if p.TTFT <= 0 || p.Prefill <= 0 || p.Wait <= 0 {
		t.Fatalf("%+v", p)
	}
	if d := p.TTFT - p.Wait - p.Prefill; d.Abs() > time.Microsecond {
		t.Fatalf("TTFT %v != wait %v + prefill %v", p.TTFT, p.Wait, p.Prefill)
	}
	if want := 5 * p.Prefill; (p.Impact - want).Abs() > time.Microsecond {
		t.Fatalf("impact %v, want running × prefill = %v", p.Impact, want)
	}
	more := m.Predict(c, Features{Queued: 20000, Uncached: 3000, Running: 5})
	if more.Wait <= p.Wait || more.TTFT <= p.TTFT {
		t.Fatalf("more work ahead predicted no longer wait: %+v vs %+v", more, p)
	}
	cached := m.Predict(c, Features{Queued: 10000, Uncached: 500, Running: 5})
	if cached.Prefill >= p.Prefill {
		t.Fatalf("fewer uncached tokens predicted no shorter prefill: %+v vs %+v", cached, p)
	}
}

// TestDetectsASpeedChangeWithinTheBound checks the documented forgetting
// bound: after DetectWithin(0.9) of its outcomes, an endpoint that halved
// its speed (and then one that recovered) is predicted within 10% (in log
// space) of the change, while its peers keep their own speed.
func TestDetectsASpeedChangeWithinTheBound(t *testing.T) {
	cfg := DefaultConfig()
	m := newModel(t, cfg)
	r := rand.New(rand.NewPCG(3, 4))
	eps := []string{"a:1", "b:1", "c:1", "d:1"}
	speed := map[string]float64{"a:1": 1, "b:1": 1, "c:1": 1, "d:1": 1}
	feed := func(ep string) {
		f := randFeatures(r)
		m.Observe(obs(ep, f, fleet.ttft(f)/speed[ep], fleet.decode(f.Running)/speed[ep], 50))
	}
	for range 500 {
		for _, ep := range eps {
			feed(ep)
		}
	}
	n := cfg.DetectWithin(0.9)
	if n <= 0 || n > 30 {
		t.Fatalf("bound %d outcomes", n)
	}
	check := func(phase string) {
		t.Helper()
		for _, ep := range eps {
			f := Features{Queued: 8000, Uncached: 4000, Running: 16}
			got := m.Predict(cand(ep), f).TTFT.Seconds() * 1000
			want := fleet.ttft(f) / speed[ep]
			// 10% of the log change (ln 2) plus the pooled fit's error.
			if e := math.Abs(math.Log(got / want)); e > 0.1*math.Ln2+0.05 {
				t.Errorf("%s: %s predicted %.0f ms, true %.0f ms (log error %.3f)", phase, ep, got, want, e)
			}
		}
	}
	check("before")
	speed["a:1"] = 0.5
	for range n {
		feed("a:1")
		// The others keep getting traffic (three times as much).
		for _, ep := range eps[1:] {
			feed(ep)
			feed(ep)
			feed(ep)
		}
	}
	check("slowed")
	speed["a:1"] = 1
	for range n {
		feed("a:1")
	}
	check("recovered")
}

func TestUnseenRegressorKeepsItsPrior(t *testing.T) {
	m := newModel(t, DefaultConfig())
	r := rand.New(rand.NewPCG(5, 6))
	for range 5000 {
		f := randFeatures(r) // KVUsage 0: the memory regressor stays 0
		m.Observe(obs("a:1", f, fleet.ttft(f), fleet.decode(f.Running), 10))
	}
	if k := m.Coefficients(); k.PerWaiting != prior.PerWaiting || math.IsNaN(k.PerBatch) {
		t.Fatalf("memory coefficient moved without data: %+v", k)
	}
}

func TestLearnsMemoryQueueing(t *testing.T) {
	m := newModel(t, DefaultConfig())
	r := rand.New(rand.NewPCG(7, 8))
	for range 3000 {
		f := randFeatures(r)
		y := fleet.ttft(f)
		if r.IntN(2) == 0 {
			f.KVUsage, f.Waiting = 0.95, float64(r.IntN(10))
			y += 200 * f.Waiting // each request blocked on memory costs 200 ms
		}
		m.Observe(obs("a:1", f, y, fleet.decode(f.Running), 10))
	}
	if k := m.Coefficients(); math.Abs(k.PerWaiting-200) > 20 {
		t.Fatalf("per waiting request %.1f ms, want 200 (%+v)", k.PerWaiting, k)
	}
}

func TestHostileObservations(t *testing.T) {
	m := newModel(t, DefaultConfig())
	bad := []Observation{
		{Endpoint: "a:1", TTFT: 0},
		{Endpoint: "a:1", TTFT: -time.Second},
		{Endpoint: "a:1", TTFT: time.Millisecond, Features: Features{Queued: -5, Uncached: -7, Running: -3, Waiting: math.Inf(1), KVUsage: math.NaN()}},
		{Endpoint: "a:1", TTFT: time.Duration(math.MaxInt64), Latency: 1, Output: math.MaxInt},
		{Endpoint: "a:1", TTFT: time.Nanosecond, Features: Features{Queued: math.MaxInt64, Uncached: math.MaxInt}},
	}
	for _, o := range bad {
		m.Observe(o)
	}
	k := m.Coefficients()
	for _, v := range []float64{k.PerBatch, k.PerStep, k.Base, k.DecodeShare, k.PerWaiting, k.DecodeBase, k.DecodePerRunning} {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			t.Fatalf("coefficients %+v", k)
		}
	}
	p := m.Predict(cand("a:1"), Features{Queued: 100, Uncached: 100})
	if p.TTFT < 0 || p.Wait < 0 || p.Prefill < 0 {
		t.Fatalf("prediction %+v", p)
	}
	for _, s := range m.Speeds() {
		if math.IsNaN(s.Factor) || s.Factor > m.cfg.MaxFactor*1.0001 || s.Factor < 1/m.cfg.MaxFactor/1.0001 {
			t.Fatalf("speed %+v", s)
		}
	}
}

func TestConcurrentObserveAndPredict(t *testing.T) {
	m := newModel(t, DefaultConfig())
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 9))
			c := cand("a:1")
			for range 500 {
				f := randFeatures(r)
				m.Observe(obs("a:1", f, fleet.ttft(f), fleet.decode(f.Running), 20))
				if p := m.Predict(c, f); p.TTFT <= 0 {
					t.Errorf("prediction %+v", p)
					return
				}
			}
		}()
	}
	wg.Wait()
	if s := m.Speeds(); len(s) != 1 || s[0].Observations != 2000 {
		t.Fatalf("%+v", s)
	}
}

func TestValidate(t *testing.T) {
	bad := []func(*Config){
		func(c *Config) { c.BatchTokens = 0 },
		func(c *Config) { c.Forget = 0 },
		func(c *Config) { c.Forget = 1.5 },
		func(c *Config) { c.Ridge = 0 },
		func(c *Config) { c.MemoryFull = math.NaN() },
		func(c *Config) { c.ObsSigma = 0 },
		func(c *Config) { c.SpeedForget = 1.01 },
		func(c *Config) { c.MaxFactor = 0.5 },
	}
	for i, f := range bad {
		c := DefaultConfig()
		f(&c)
		if _, err := New(c); err == nil {
			t.Errorf("case %d accepted", i)
		}
	}
	if got := DefaultConfig().DetectWithin(0.9); got != 22 {
		t.Fatalf("DetectWithin(0.9) = %d, want 22 for forget 0.9", got)
	}
}

func BenchmarkEstimate(b *testing.B) {
	m := newModel(b, DefaultConfig())
	c := cand("a:1")
	f := Features{Queued: 9000, Uncached: 2000, Running: 12}
	b.ReportAllocs()
	for b.Loop() {
		_ = m.Predict(c, f)
	}
}

// TestRemoteOutcomesUseTheRecentRunning: a peer's outcome carries no
// running count; the endpoint's recent one from local outcomes stands in,
// so that a peer's outcome on a busy endpoint is not read as slowness.
func TestRemoteOutcomesUseTheRecentRunning(t *testing.T) {
	cfg := DefaultConfig()
	cfg.RemoteWeight = 1
	m := newModel(t, cfg)
	r := rand.New(rand.NewPCG(11, 12))
	for range 3000 {
		f := randFeatures(r)
		f.Running = 200 // a busy endpoint: long decode steps
		m.Observe(obs("a:1", f, fleet.ttft(f), fleet.decode(f.Running), 50))
	}
	before, _ := m.Factor(cand("a:1"))
	for range 50 {
		// Short prompts, nothing queued: the decode step in progress is
		// most of the wait.
		f := Features{Uncached: 100 + r.IntN(400), Running: 200}
		o := obs("a:1", f, fleet.ttft(f), 0, 0)
		o.Remote, o.Features.Running = true, 0
		m.Observe(o)
	}
	after, _ := m.Factor(cand("a:1"))
	if math.Abs(after-before) > 0.1 {
		t.Fatalf("peers' outcomes moved the log factor from %.3f to %.3f", before, after)
	}
}

// A peer's outcome counts RemoteWeight local ones: nothing at the default
// 0, less at 0.25 than at 1.
func TestRemoteWeight(t *testing.T) {
	moved := func(w float64, remote bool) float64 {
		cfg := DefaultConfig()
		cfg.RemoteWeight = w
		m := newModel(t, cfg)
		f := Features{Uncached: 2000}
		for range 5 {
			o := obs("a:1", f, 3*fleet.ttft(f), 0, 0) // three times slower than the fit's prior
			o.Remote = remote
			m.Observe(o)
		}
		mu, _ := m.Factor(cand("a:1"))
		return mu
	}
	if d := moved(0, true); d != 0 {
		t.Errorf("remote weight 0: the factor moved to %v", d)
	}
	quarter, full := moved(0.25, true), moved(1, true)
	if !(0 < quarter && quarter < full) {
		t.Errorf("remote weight 0.25 moved the factor %v, 1 moved it %v: want 0 < quarter < full", quarter, full)
	}
}
