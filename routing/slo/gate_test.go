package slo_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/slo"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// predictor is a test policy implementing routing.Predictor: predictions
// come from a table by endpoint (or by position when keys are absent),
// Choose takes the first candidate and records what it was offered.
type predictor struct {
	mu      sync.Mutex
	ttft    map[routing.EndpointKey]time.Duration
	byIndex []time.Duration
	offered [][]routing.EndpointKey
}

var (
	_ routing.Policy    = (*predictor)(nil)
	_ routing.Predictor = (*predictor)(nil)
)

func (p *predictor) Name() string { return "test_predictor" }

func (p *predictor) Predict(s *routing.Scoring) []routing.Prediction {
	if p.byIndex != nil { // may be short on purpose
		out := make([]routing.Prediction, len(p.byIndex))
		for i, v := range p.byIndex {
			out[i].TTFT = v
		}
		return out
	}
	out := make([]routing.Prediction, len(s.Candidates))
	for i := range s.Candidates {
		out[i].TTFT = p.ttft[s.Candidates[i].Key()]
	}
	return out
}

func (p *predictor) Choose(s *routing.Scoring, _ bool) (routing.Choice, error) {
	keys := make([]routing.EndpointKey, len(s.Candidates))
	for i := range s.Candidates {
		keys[i] = s.Candidates[i].Key()
	}
	p.mu.Lock()
	p.offered = append(p.offered, keys)
	p.mu.Unlock()
	return routing.Choice{Index: 0}, nil
}

func (p *predictor) Done(*routing.Decision, routing.Outcome) {}

// plain is a policy without predictions.
type plain struct{}

func (plain) Name() string { return "plain" }
func (plain) Choose(*routing.Scoring, bool) (routing.Choice, error) {
	return routing.Choice{Index: 0}, nil
}
func (plain) Done(*routing.Decision, routing.Outcome) {}

func scoring(obj time.Duration, prio *int, overlaps ...int) *routing.Scoring {
	req := &routing.Request{Hints: routing.Hints{TTFTObjective: obj}}
	if prio != nil {
		req.Hints.Priority, req.Hints.HasPriority = *prio, true
	}
	s := &routing.Scoring{Req: req}
	for _, o := range overlaps {
		s.Candidates = append(s.Candidates, routing.Candidate{Overlap: o})
	}
	return s
}

func ms(v ...int) []time.Duration {
	out := make([]time.Duration, len(v))
	for i, x := range v {
		out[i] = time.Duration(x) * time.Millisecond
	}
	return out
}

func TestFilter(t *testing.T) {
	t.Parallel()
	neg, pos := -1, 2
	cases := []struct {
		name    string
		cfg     slo.Config
		s       *routing.Scoring
		pred    []time.Duration
		want    []int
		wantErr bool
	}{
		{name: "no objective", s: scoring(0, nil, 1, 5, 9), pred: ms(10, 10, 10)},
		{name: "most cache among those that meet", cfg: slo.Config{Headroom: 1}, s: scoring(300*time.Millisecond, nil, 2, 5, 9), pred: ms(100, 300, 500), want: []int{1}},
		{name: "headroom excludes a tight prediction", cfg: slo.Config{Headroom: 0.8}, s: scoring(300*time.Millisecond, nil, 2, 5, 9), pred: ms(100, 250, 500), want: []int{0}},
		{name: "near ties kept", cfg: slo.Config{Headroom: 1, NearTie: 0.1}, s: scoring(time.Second, nil, 20, 19, 5, 20), pred: ms(10, 10, 10, 2000), want: []int{0, 1}},
		{name: "exact ties only", cfg: slo.Config{Headroom: 1, NearTie: -1}, s: scoring(time.Second, nil, 20, 19, 5), pred: ms(10, 10, 10), want: []int{0}},
		{name: "all kept means no narrowing", cfg: slo.Config{Headroom: 1}, s: scoring(time.Second, nil, 0, 0), pred: ms(10, 10)},
		{name: "none meet, sheddable", cfg: slo.Config{Headroom: 1}, s: scoring(100*time.Millisecond, &neg, 1, 2), pred: ms(101, 500), wantErr: true},
		{name: "none meet, not sheddable", cfg: slo.Config{Headroom: 1}, s: scoring(100*time.Millisecond, &pos, 1, 2), pred: ms(101, 500)},
		{name: "none meet, no priority", cfg: slo.Config{Headroom: 1}, s: scoring(100*time.Millisecond, nil, 1, 2), pred: ms(101, 500)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			g, err := slo.New(c.cfg)
			if err != nil {
				t.Fatal(err)
			}
			got, err := g.Filter(c.s, &predictor{byIndex: c.pred}, true)
			if c.wantErr {
				if !errors.Is(err, routing.ErrOverloaded) || !errors.Is(err, slo.ErrUnmeetable) {
					t.Fatalf("err = %v, want ErrOverloaded and ErrUnmeetable", err)
				}
				if _, _, shed := g.Counts(); shed != 1 {
					t.Fatalf("shed = %d, want 1", shed)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, c.want) {
				t.Fatalf("keep = %v, want %v", got, c.want)
			}
		})
	}
}

func TestFilterWithoutPredictorOrOnDryRun(t *testing.T) {
	t.Parallel()
	g, err := slo.New(slo.Config{})
	if err != nil {
		t.Fatal(err)
	}
	neg := -1
	s := scoring(time.Millisecond, &neg, 1, 2)
	if keep, err := g.Filter(s, plain{}, true); keep != nil || err != nil {
		t.Fatalf("plain policy: keep %v err %v; want untouched", keep, err)
	}
	if _, err := g.Filter(s, &predictor{byIndex: ms(5, 5)}, false); !errors.Is(err, routing.ErrOverloaded) {
		t.Fatalf("dry run: err %v", err)
	}
	if _, _, shed := g.Counts(); shed != 0 {
		t.Fatalf("a dry run counted %d shed", shed)
	}
	off, err := slo.New(slo.Config{Off: true})
	if err != nil {
		t.Fatal(err)
	}
	if keep, err := off.Filter(s, &predictor{byIndex: ms(5, 5)}, true); keep != nil || err != nil {
		t.Fatalf("rule off: keep %v err %v", keep, err)
	}
	// A predictor returning the wrong number of predictions is ignored.
	if keep, err := g.Filter(s, &predictor{byIndex: ms(5)}, true); keep != nil || err != nil {
		t.Fatalf("short predictions: keep %v err %v", keep, err)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, c := range []slo.Config{{Headroom: -0.1}, {Headroom: 1.5}, {NearTie: 1}} {
		if _, err := slo.New(c); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}

func newEngine(t *testing.T, p routing.Policy, g *slo.Gate, keys ...string) *engine.Engine {
	t.Helper()
	e, err := engine.New(p, engine.Options{SyncIndex: true}, engine.Deps{Rand: routing.NewRand(1), Gate: g, OnDone: g.Observe})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	var eps []routing.Endpoint
	for _, k := range keys {
		eps = append(eps, routing.Endpoint{Key: routing.EndpointKey(k)})
	}
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return e
}

func tokens(n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(i + 7)
	}
	return out
}

// TestEngineRule drives the rule through a real engine: the cache comes
// from the approximate index (a first pick), the predictions from the
// test policy.
func TestEngineRule(t *testing.T) {
	t.Parallel()
	const a, b, c = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
	p := &predictor{ttft: map[routing.EndpointKey]time.Duration{a: 50 * time.Millisecond, b: 200 * time.Millisecond, c: 900 * time.Millisecond}}
	g, err := slo.New(slo.Config{Headroom: 1})
	if err != nil {
		t.Fatal(err)
	}
	e := newEngine(t, p, g, a, b, c)
	ctx := context.Background()
	toks := tokens(64)

	// Warm: with no objective the test policy takes the first candidate
	// (a) and sees all three.
	d, err := e.Pick(ctx, &routing.Request{Tokens: toks, TokenCount: len(toks)})
	if err != nil || d.Endpoint != a {
		t.Fatalf("warm pick: %v %v", d, err)
	}
	d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: time.Millisecond})
	if got := p.offered[0]; len(got) != 3 {
		t.Fatalf("no objective: offered %v, want all three", got)
	}
	if met, missed, shed := g.Counts(); met+missed+shed != 0 {
		t.Fatalf("a request without objective was counted: %d %d %d", met, missed, shed)
	}

	// b and a meet 300 ms; only a caches the prompt: the policy is offered a.
	p.ttft[a], p.ttft[b] = 250*time.Millisecond, 100*time.Millisecond
	req := &routing.Request{Tokens: toks, TokenCount: len(toks), Hints: routing.Hints{TTFTObjective: 300 * time.Millisecond}}
	d, err = e.Pick(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if got := p.offered[len(p.offered)-1]; !slices.Equal(got, []routing.EndpointKey{a}) || d.Endpoint != a || d.Objective != 300*time.Millisecond {
		t.Fatalf("offered %v, chose %s (objective %v); want only %s", got, d.Endpoint, d.Objective, a)
	}
	d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: 280 * time.Millisecond})

	// a no longer meets it: b (no cache, but in time) is the only offer.
	p.ttft[a] = 400 * time.Millisecond
	d, err = e.Pick(ctx, req)
	if err != nil || d.Endpoint != b {
		t.Fatalf("pick: %v %v, want %s", d, err, b)
	}
	d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: 301 * time.Millisecond})

	// Nobody meets it: a sheddable request is rejected, another is routed
	// over every candidate.
	p.ttft[b] = time.Second
	shedReq := *req
	shedReq.Hints.Priority, shedReq.Hints.HasPriority = -1, true
	if _, err := e.Pick(ctx, &shedReq); !errors.Is(err, routing.ErrOverloaded) {
		t.Fatalf("sheddable: err %v, want ErrOverloaded", err)
	}
	if _, err := e.Score(ctx, &shedReq); !errors.Is(err, routing.ErrOverloaded) {
		t.Fatalf("score: err %v, want ErrOverloaded", err)
	}
	n := len(p.offered)
	d, err = e.Pick(ctx, req)
	if err != nil || len(p.offered[n]) != 3 {
		t.Fatalf("non-sheddable: %v, offered %v", err, p.offered[n])
	}
	d.Done(routing.NoUsage(routing.OutcomeCancelled))

	met, missed, shed := g.Counts()
	if met != 1 || missed != 1 || shed != 1 {
		t.Fatalf("met %d missed %d shed %d, want 1 1 1", met, missed, shed)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(g)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "kvbandit_objective_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			got[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
	}
	if got["met"] != 1 || got["missed"] != 1 || got["shed"] != 1 || len(got) != 3 {
		t.Fatalf("kvbandit_objective_total = %v", got)
	}
}

func TestObserve(t *testing.T) {
	t.Parallel()
	g, err := slo.New(slo.Config{})
	if err != nil {
		t.Fatal(err)
	}
	d := routing.NewTestDecision("10.0.0.1:1", nil, time.Time{})
	g.Observe(d, routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: time.Hour}) // no objective
	d.Objective = time.Second
	g.Observe(d, routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: time.Second})
	g.Observe(d, routing.Outcome{Kind: routing.OutcomeUpstreamError, TTFT: 0})
	g.Observe(d, routing.Outcome{Kind: routing.OutcomeUpstreamError, TTFT: time.Millisecond})
	g.Observe(d, routing.NoUsage(routing.OutcomeReset))
	g.Observe(d, routing.NoUsage(routing.OutcomeExpired))
	g.Observe(nil, routing.Outcome{})
	if met, missed, shed := g.Counts(); met != 2 || missed != 2 || shed != 0 {
		t.Fatalf("met %d missed %d shed %d, want 2 2 0", met, missed, shed)
	}
}
