package engine_test

import (
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
)

// TestScrapedLoad: ScrapedLoadOf and ScrapedLoads give the last reported
// load with the engine-clock time it was reported, this engine's own
// in-flight decisions and the KV capacity in tokens (num_gpu_blocks x
// the block size the worker reports, else the endpoint's).
func TestScrapedLoad(t *testing.T) {
	clk := clock.NewVirtual(time.Unix(1000, 0))
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New("least_loaded", policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	e := engine.Must(p, engine.Options{}, engine.Deps{Rand: rnd, Clock: clk})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{
		{Key: "10.0.0.1:8000", BlockSize: 32}, {Key: "10.0.0.2:8000", Role: routing.RoleDecode},
	}}); err != nil {
		t.Fatal(err)
	}
	sl, ok := e.ScrapedLoadOf("10.0.0.1:8000")
	if !ok || !sl.At.IsZero() || sl.Load.Known || sl.KVCapacityTokens != 0 {
		t.Fatalf("before a scrape: %+v %v", sl, ok)
	}
	if _, ok := e.ScrapedLoadOf("10.9.9.9:1"); ok {
		t.Error("an unknown endpoint has a load")
	}
	d, err := e.Pick(t.Context(), &routing.Request{Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Done(routing.NoUsage(routing.OutcomeCancelled))
	clk.Step(time.Second)
	e.ReportLoad("10.0.0.1:8000", routing.Load{Running: 3, Waiting: 2, Known: true, KVBlocks: 1000}, 0)
	e.ReportLoad("10.0.0.2:8000", routing.Load{Running: 1, Known: true, KVBlocks: 500}, 16)
	got := map[routing.EndpointKey]engine.ScrapedLoad{}
	for _, sl := range e.ScrapedLoads(nil) {
		got[sl.Endpoint] = sl
	}
	a, b := got["10.0.0.1:8000"], got["10.0.0.2:8000"]
	if !a.At.Equal(time.Unix(1001, 0)) || a.Load.Running != 3 || a.Load.Waiting != 2 || a.KVCapacityTokens != 32000 {
		t.Errorf("10.0.0.1: %+v, want reported at 1001 s, 3 running, 2 waiting, 1000 blocks x 32 tokens", a)
	}
	if b.KVCapacityTokens != 8000 || b.Role != routing.RoleDecode {
		t.Errorf("10.0.0.2: %+v, want 500 blocks x 16 tokens (the worker's block size), decode role", b)
	}
	if a.LocalInFlight+b.LocalInFlight != 1 || got[d.Endpoint].LocalInFlight != 1 {
		t.Errorf("local in-flight %d and %d, want the one decision on %s", a.LocalInFlight, b.LocalInFlight, d.Endpoint)
	}
}
