package engine_test

import (
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
)

const (
	epA = routing.EndpointKey("10.0.0.1:8000")
	epB = routing.EndpointKey("10.0.0.2:8000")
)

// healthEngine is a round-robin engine on a virtual clock over a and b.
func healthEngine(t *testing.T, opts engine.Options, eps ...routing.Endpoint) (*engine.Engine, *clock.Virtual) {
	t.Helper()
	clk := clock.NewVirtual(time.Unix(1_700_000_000, 0))
	if len(eps) == 0 {
		eps = []routing.Endpoint{ep(string(epA)), ep(string(epB))}
	}
	return engineWith(t, "round_robin", opts, clk, eps...), clk
}

// outcome ends one decision with an upstream answer served by key.
func outcome(t *testing.T, e *engine.Engine, key routing.EndpointKey, kind routing.OutcomeKind, status int) {
	t.Helper()
	d, err := e.Pick(t.Context(), &routing.Request{})
	if err != nil {
		t.Fatal(err)
	}
	o := routing.NoUsage(kind)
	o.Served, o.Status = key, status
	d.Done(o)
}

func fail(t *testing.T, e *engine.Engine, key routing.EndpointKey, n, status int) {
	t.Helper()
	for range n {
		outcome(t, e, key, routing.OutcomeUpstreamError, status)
	}
}

// picks returns how often each endpoint is chosen in n picks.
func picks(t *testing.T, e *engine.Engine, r *routing.Request, n int) map[routing.EndpointKey]int {
	t.Helper()
	got := map[routing.EndpointKey]int{}
	for range n {
		d, err := e.Pick(t.Context(), r)
		if err != nil {
			t.Fatal(err)
		}
		got[d.Endpoint]++
		d.Done(routing.NoUsage(routing.OutcomeCancelled))
	}
	return got
}

func ejected(e *engine.Engine, key routing.EndpointKey) bool {
	return e.Ejected(key, e.Clock().Now())
}

func TestUpstreamErrorsEject(t *testing.T) {
	for _, status := range []int{503, 500, 504, 408, 0} {
		t.Run(fmt.Sprintf("status=%d", status), func(t *testing.T) {
			e, clk := healthEngine(t, engine.Options{})
			fail(t, e, epA, 4, status)
			if ejected(e, epA) {
				t.Fatal("ejected after 4 failures")
			}
			fail(t, e, epA, 1, status)
			if !ejected(e, epA) || ejected(e, epB) {
				t.Fatalf("after 5 failures: a ejected %v, b ejected %v", ejected(e, epA), ejected(e, epB))
			}
			if got := picks(t, e, req(tokens(16, 1)), 10); got[epA] != 0 {
				t.Fatalf("ejected endpoint chosen: %v", got)
			}
			if byErrors, byScrape := e.Ejections(); byErrors != 1 || byScrape != 0 {
				t.Fatalf("Ejections() = %d, %d", byErrors, byScrape)
			}
			clk.Step(engine.DefaultBaseEjection - time.Millisecond)
			if !ejected(e, epA) {
				t.Fatal("ejection ended early")
			}
			clk.Step(time.Millisecond)
			if ejected(e, epA) {
				t.Fatal("still ejected after the base ejection")
			}
			if got := picks(t, e, req(tokens(16, 1)), 10); got[epA] != 5 {
				t.Fatalf("after the ejection: %v", got)
			}
		})
	}
}

// TestChosenEndpointWithoutServed: with no Served header the decision's own
// endpoint takes the blame.
func TestChosenEndpointWithoutServed(t *testing.T) {
	e, _ := healthEngine(t, engine.Options{})
	for range 10 { // round robin: five on each
		d, err := e.Pick(t.Context(), req(tokens(16, 1)))
		if err != nil {
			t.Fatal(err)
		}
		o := routing.NoUsage(routing.OutcomeUpstreamError)
		o.Status = 503
		d.Done(o)
	}
	if !ejected(e, epA) || !ejected(e, epB) {
		t.Fatalf("a %v, b %v: want both ejected", ejected(e, epA), ejected(e, epB))
	}
}

func TestClientErrorsNeverEject(t *testing.T) {
	e, _ := healthEngine(t, engine.Options{})
	for _, status := range []int{400, 401, 404, 413, 422, 429} {
		fail(t, e, epA, 10, status)
	}
	for _, k := range []routing.OutcomeKind{routing.OutcomeCancelled, routing.OutcomeReset, routing.OutcomeAbandoned, routing.OutcomeRejected, routing.OutcomeExpired} {
		for range 10 {
			outcome(t, e, epA, k, 0)
		}
	}
	if ejected(e, epA) {
		t.Fatal("ejected by client errors or neutral outcomes")
	}
	// 4xx does not reset the run either: 4 failures, 4xx, 1 failure ejects.
	fail(t, e, epA, 4, 503)
	fail(t, e, epA, 3, 404)
	outcome(t, e, epA, routing.OutcomeReset, 0)
	fail(t, e, epA, 1, 503)
	if !ejected(e, epA) {
		t.Fatal("4xx between failures reset the count")
	}
}

func TestSuccessResetsErrors(t *testing.T) {
	e, _ := healthEngine(t, engine.Options{})
	for range 3 {
		fail(t, e, epA, 4, 502)
		outcome(t, e, epA, routing.OutcomeSuccess, 200)
	}
	if ejected(e, epA) {
		t.Fatal("ejected though no 5 failures were consecutive")
	}
	if h := e.Health(e.Endpoints()[0].Key, e.Clock().Now()); h.ConsecutiveErrors != 0 {
		t.Fatalf("Health = %+v", h)
	}
}

func TestEjectionBackOffDoublesAndCaps(t *testing.T) {
	opts := engine.Options{Ejection: engine.EjectionOptions{ConsecutiveErrors: 2, BaseEjection: 10 * time.Second, MaxEjection: 35 * time.Second}}
	e, clk := healthEngine(t, opts)
	lengths := func(n int) []time.Duration {
		var out []time.Duration
		for range n {
			fail(t, e, epA, 2, 503)
			start := clk.Now()
			if !ejected(e, epA) {
				t.Fatal("not ejected")
			}
			for ejected(e, epA) {
				// Failures during an ejection are not counted.
				fail(t, e, epA, 1, 503)
				clk.Step(time.Second)
			}
			out = append(out, clk.Now().Sub(start))
		}
		return out
	}
	want := []time.Duration{10 * time.Second, 20 * time.Second, 35 * time.Second, 35 * time.Second}
	if got := lengths(4); !equalDurations(got, want) {
		t.Fatalf("ejection lengths %v, want %v", got, want)
	}
	// A success resets the back-off.
	outcome(t, e, epA, routing.OutcomeSuccess, 200)
	if got := lengths(2); !equalDurations(got, want[:2]) {
		t.Fatalf("after a success: %v, want %v", got, want[:2])
	}
	if byErrors, _ := e.Ejections(); byErrors != 6 {
		t.Fatalf("ejections = %d, want 6", byErrors)
	}
}

func equalDurations(a, b []time.Duration) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestEjectedStillChosenWhenAlone: ejection never fails a request; an
// ejected endpoint is chosen when no healthy eligible endpoint exists,
// with or without the model and subset filters.
func TestEjectedStillChosenWhenAlone(t *testing.T) {
	e, _ := healthEngine(t, engine.Options{}, ep(string(epA), "llama"), ep(string(epB), "qwen"))
	fail(t, e, epA, 5, 503)
	if !ejected(e, epA) {
		t.Fatal("not ejected")
	}
	llama := &routing.Request{Model: "llama"}
	if got := picks(t, e, llama, 4); got[epA] != 4 {
		t.Fatalf("llama (only on the ejected endpoint) went to %v", got)
	}
	subset := &routing.Request{Subset: routing.NewSubset([]string{string(epA)})}
	if got := picks(t, e, subset, 4); got[epA] != 4 {
		t.Fatalf("subset of the ejected endpoint went to %v", got)
	}
	if got := picks(t, e, &routing.Request{}, 4); got[epB] != 4 {
		t.Fatalf("model-less requests went to %v", got)
	}
	fail(t, e, epB, 5, 503)
	if got := picks(t, e, &routing.Request{}, 4); got[epA] != 2 || got[epB] != 2 {
		t.Fatalf("with every endpoint ejected: %v", got)
	}
	if _, err := e.Score(t.Context(), &routing.Request{Model: "qwen"}); err != nil {
		t.Fatal(err)
	}
}

func TestEjectionDisabled(t *testing.T) {
	e, _ := healthEngine(t, engine.Options{Ejection: engine.EjectionOptions{Disabled: true}})
	fail(t, e, epA, 20, 503)
	for range 5 {
		e.ReportScrapeFailure(epB)
	}
	if ejected(e, epA) || ejected(e, epB) {
		t.Fatal("ejected with ejection disabled")
	}
}

// TestEjectionSurvivesUpdate: health lives with the endpoint's counters.
func TestEjectionSurvivesUpdate(t *testing.T) {
	e, _ := healthEngine(t, engine.Options{})
	fail(t, e, epA, 5, 503)
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{ep(string(epB)), ep(string(epA))}}); err != nil {
		t.Fatal(err)
	}
	if !ejected(e, epA) {
		t.Fatal("ejection lost in a snapshot swap")
	}
}

func TestScrapeFailuresEject(t *testing.T) {
	e, clk := healthEngine(t, engine.Options{})
	if e.ReportScrapeFailure("10.9.9.9:1") {
		t.Fatal("unknown endpoint accepted")
	}
	for range 2 {
		e.ReportScrapeFailure(epA)
	}
	if ejected(e, epA) {
		t.Fatal("ejected after 2 scrape failures")
	}
	e.ReportScrapeFailure(epA)
	if !ejected(e, epA) {
		t.Fatal("not ejected after 3 scrape failures")
	}
	clk.Step(time.Hour) // no timeout: only a good scrape restores it
	e.ReportScrapeFailure(epA)
	if !ejected(e, epA) {
		t.Fatal("scrape ejection expired by time")
	}
	if got := picks(t, e, req(tokens(16, 1)), 6); got[epA] != 0 {
		t.Fatalf("scrape-ejected endpoint chosen: %v", got)
	}
	// A stale mark is not a good scrape.
	e.ReportLoad(epA, routing.Load{Known: true, Stale: true}, 0)
	if !ejected(e, epA) {
		t.Fatal("a stale mark restored the endpoint")
	}
	e.ReportLoad(epA, routing.Load{Known: true, Waiting: 1}, 0)
	if ejected(e, epA) {
		t.Fatal("a good scrape did not restore the endpoint")
	}
	if _, byScrape := e.Ejections(); byScrape != 1 {
		t.Fatalf("scrape ejections = %d, want 1", byScrape)
	}
	// The count starts over after a good scrape.
	e.ReportScrapeFailure(epA)
	e.ReportScrapeFailure(epA)
	if ejected(e, epA) {
		t.Fatal("failure count not reset by the good scrape")
	}
}

func TestScrapedAdaptersRouteModels(t *testing.T) {
	e, clk := healthEngine(t, engine.Options{AdapterRetention: time.Minute},
		ep(string(epA), "llama"), ep(string(epB), "llama"))
	sql := &routing.Request{Model: "sql-lora"}
	if _, err := e.Pick(t.Context(), sql); !errors.Is(err, routing.ErrModelNotFound) {
		t.Fatalf("before the scrape: err = %v, want ErrModelNotFound", err)
	}
	if e.ReportAdapters("10.9.9.9:1", []routing.ModelName{"x"}) {
		t.Fatal("unknown endpoint accepted")
	}
	e.ReportAdapters(epB, []routing.ModelName{"sql-lora", "chat-lora"})
	if got := picks(t, e, sql, 6); got[epB] != 6 {
		t.Fatalf("sql-lora went to %v, want only %s", got, epB)
	}
	if got := picks(t, e, &routing.Request{Model: "llama"}, 6); got[epA] != 3 || got[epB] != 3 {
		t.Fatalf("base model went to %v", got)
	}
	if _, err := e.Pick(t.Context(), &routing.Request{Model: "gpt"}); !errors.Is(err, routing.ErrModelNotFound) {
		t.Fatalf("unknown model: err = %v, want ErrModelNotFound", err)
	}
	if got := e.ScrapedAdapters(e.Endpoints()[1].Key); len(got) != 2 || got[0] != "chat-lora" || got[1] != "sql-lora" {
		t.Fatalf("ScrapedAdapters() = %v", got)
	}
	// An adapter the worker stops reporting is kept for the retention.
	clk.Step(30 * time.Second)
	e.ReportAdapters(epB, []routing.ModelName{"chat-lora"})
	if got := picks(t, e, sql, 2); got[epB] != 2 {
		t.Fatalf("within retention: %v", got)
	}
	clk.Step(31 * time.Second)
	e.ReportAdapters(epB, []routing.ModelName{"chat-lora"})
	if _, err := e.Pick(t.Context(), sql); !errors.Is(err, routing.ErrModelNotFound) {
		t.Fatalf("after retention: err = %v, want ErrModelNotFound", err)
	}
	if got := picks(t, e, &routing.Request{Model: "chat-lora"}, 2); got[epB] != 2 {
		t.Fatalf("chat-lora went to %v", got)
	}
}

// TestScrapedAdapterWithModellessEndpoint: an endpoint declaring no models
// serves everything, so an adapter scraped elsewhere adds a candidate.
func TestScrapedAdapterWithModellessEndpoint(t *testing.T) {
	e, _ := healthEngine(t, engine.Options{}, ep(string(epA)), ep(string(epB), "llama"))
	e.ReportAdapters(epB, []routing.ModelName{"sql-lora"})
	if got := picks(t, e, &routing.Request{Model: "sql-lora"}, 4); got[epA] != 2 || got[epB] != 2 {
		t.Fatalf("sql-lora went to %v", got)
	}
	if got := picks(t, e, &routing.Request{Model: "other"}, 4); got[epA] != 4 {
		t.Fatalf("other went to %v", got)
	}
}

// loadsPolicy records the candidates' loads and picks the first.
type loadsPolicy struct{ loads []routing.Load }

func (*loadsPolicy) Name() string { return "loads" }
func (p *loadsPolicy) Choose(s *routing.Scoring, _ bool) (routing.Choice, error) {
	p.loads = p.loads[:0]
	for _, c := range s.Candidates {
		p.loads = append(p.loads, c.Load)
	}
	return routing.Choice{}, nil
}
func (*loadsPolicy) Done(*routing.Decision, routing.Outcome) {}

func TestRankLoads(t *testing.T) {
	p := &loadsPolicy{}
	e := engine.Must(p, engine.Options{SyncIndex: true}, engine.Deps{Logger: quiet()})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: epA, DataParallelSize: 2}}}); err != nil {
		t.Fatal(err)
	}
	loads := func() []routing.Load {
		t.Helper()
		if _, err := e.Score(t.Context(), &routing.Request{}); err != nil {
			t.Fatal(err)
		}
		return p.loads
	}
	e.ReportLoad(epA, routing.Load{Known: true, Waiting: 10, KVUsage: 0.9}, 0)
	if e.ReportRankLoads("10.9.9.9:1", nil) {
		t.Fatal("unknown endpoint accepted")
	}
	e.ReportRankLoads(epA, []routing.Load{{Waiting: 9, KVUsage: 0.9}, {Waiting: 1, KVUsage: 0.1}})
	if got := loads(); len(got) != 2 || got[0].Waiting != 9 || got[1].Waiting != 1 || got[1].KVUsage != 0.1 || !got[1].Known {
		t.Fatalf("rank loads %+v", got)
	}
	e.ReportRankLoads(epA, []routing.Load{{Waiting: 1}}) // wrong length: cleared
	if got := loads(); got[0].Waiting != 10 || got[1].Waiting != 10 {
		t.Fatalf("after clearing: %+v", got)
	}
}

func TestEjectionMetrics(t *testing.T) {
	e, _ := healthEngine(t, engine.Options{})
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(engine.NewCollector(e))
	fail(t, e, epA, 5, 503)
	for range 3 {
		e.ReportScrapeFailure(epB)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			name := f.GetName()
			for _, l := range m.GetLabel() {
				name += "/" + l.GetValue()
			}
			got[name] = m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	want := map[string]float64{
		"kvbandit_endpoint_ejections_total/errors": 1,
		"kvbandit_endpoint_ejections_total/scrape": 1,
		"kvbandit_endpoints_ejected":               2,
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
}

// TestRetainedAdaptersBounded: a worker that reports new adapter names on
// every scrape (each report within the scraper's bound) is remembered for
// at most MaxRetainedAdapters names, the most recent ones: 30 reports of
// 4,096 fresh names within the retention kept all 122,880 before.
func TestRetainedAdaptersBounded(t *testing.T) {
	e, clk := healthEngine(t, engine.Options{AdapterRetention: 10 * time.Minute}, ep(string(epA), "llama"), ep(string(epB), "llama"))
	var last []routing.ModelName
	for r := range 30 {
		last = last[:0]
		for i := range 4096 {
			last = append(last, routing.ModelName(fmt.Sprintf("lora-%02d-%04d", r, i)))
		}
		e.ReportAdapters(epB, last)
		clk.Step(time.Second)
	}
	got := e.ScrapedAdapters(e.Endpoints()[1].Key)
	if len(got) != engine.MaxRetainedAdapters {
		t.Fatalf("%d adapters retained, want %d", len(got), engine.MaxRetainedAdapters)
	}
	if !slices.Equal(got, last) {
		t.Errorf("retained adapters are not the latest report's (first %q)", got[0])
	}
	if got := picks(t, e, &routing.Request{Model: last[0]}, 2); got[epB] != 2 {
		t.Errorf("the latest report's adapter went to %v", got)
	}
}
