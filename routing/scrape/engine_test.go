package scrape_test

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/scrape"
)

func TestEngineAdapters(t *testing.T) {
	t.Parallel()
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New("least_loaded", policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	e := routing.MustEngine(p, routing.Options{}, routing.Deps{Rand: rnd, Clock: clock.NewVirtual(time.Unix(0, 0))})
	t.Cleanup(e.Close)
	w := newWorker(t, serve(sglangMetrics))
	key := w.target().Key
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{{Key: routing.EndpointKey(key)}}}); err != nil {
		t.Fatal(err)
	}
	if got := scrape.EngineTargets(e)(); !cmp.Equal(got, []scrape.Target{{Key: key}}) {
		t.Fatalf("EngineTargets = %v", got)
	}
	publish := scrape.EnginePublish(e)
	s := scrape.New(scrape.Config{}, scrape.Deps{
		Client:  newClient(t),
		Clock:   clock.NewVirtual(time.Unix(0, 0)),
		Targets: scrape.EngineTargets(e),
		Publish: publish,
	})
	s.ScrapeOnce(t.Context())
	publish(scrape.Target{Key: "10.9.9.9:1"}, scrape.Sample{Known: true}) // departed: dropped
	if st := s.Stats(); st.OK != 1 {
		t.Errorf("Stats() = %+v", st)
	}
}
