package engine_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newEngine(t *testing.T, name string, opts engine.Options, eps ...routing.Endpoint) *engine.Engine {
	t.Helper()
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New(name, policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	e := engine.Must(p, opts, engine.Deps{Rand: rnd})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return e
}

func ep(key string, models ...routing.ModelName) routing.Endpoint {
	return routing.Endpoint{Key: routing.EndpointKey(key), Models: models}
}

func TestRoundRobinAlternatesAndReleases(t *testing.T) {
	e := newEngine(t, "round_robin", engine.Options{}, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"), ep("10.0.0.3:8000"))
	var got []routing.EndpointKey
	var ds []*routing.Decision
	for range 6 {
		d, err := e.Pick(t.Context(), &routing.Request{Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, d.Endpoint)
		ds = append(ds, d)
	}
	want := []routing.EndpointKey{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("pick %d = %s, want %s (all %v)", i, got[i], want[i], got)
		}
	}
	for _, st := range e.Endpoints() {
		if n := st.InFlight.Load(); n != 2 {
			t.Errorf("%s in-flight = %d, want 2", st.Key, n)
		}
	}
	for _, d := range ds {
		if !d.Done(routing.NoUsage(routing.OutcomeSuccess)) {
			t.Fatal("first Done returned false")
		}
		if d.Done(routing.NoUsage(routing.OutcomeSuccess)) {
			t.Fatal("second Done returned true")
		}
	}
	for _, st := range e.Endpoints() {
		if n := st.InFlight.Load(); n != 0 {
			t.Errorf("%s in-flight = %d after Done, want 0", st.Key, n)
		}
	}
}

func TestLeastLoadedPrefersIdleAndBreaksTiesRandomly(t *testing.T) {
	e := newEngine(t, "least_loaded", engine.Options{}, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	first, err := e.Pick(t.Context(), &routing.Request{})
	if err != nil {
		t.Fatal(err)
	}
	second, _ := e.Pick(t.Context(), &routing.Request{})
	if first.Endpoint == second.Endpoint {
		t.Fatalf("least_loaded put two requests on %s while the other was idle", first.Endpoint)
	}
	first.Done(routing.NoUsage(routing.OutcomeSuccess))
	second.Done(routing.NoUsage(routing.OutcomeSuccess))
	// With both idle, the first pick is a random tie-break: over many fresh
	// picks both endpoints must be chosen (list position must not win).
	seen := map[routing.EndpointKey]int{}
	for range 200 {
		d, _ := e.Pick(t.Context(), &routing.Request{})
		seen[d.Endpoint]++
		d.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
	if len(seen) != 2 || seen["10.0.0.1:8000"] < 60 || seen["10.0.0.2:8000"] < 60 {
		t.Fatalf("tie-breaks not random: %v", seen)
	}
}

func TestRandomIsReproducibleWithSeed(t *testing.T) {
	run := func() []routing.EndpointKey {
		e := newEngine(t, "random", engine.Options{}, ep("10.0.0.1:1"), ep("10.0.0.2:1"), ep("10.0.0.3:1"), ep("10.0.0.4:1"))
		var out []routing.EndpointKey
		for range 50 {
			d, _ := e.Pick(t.Context(), &routing.Request{})
			out = append(out, d.Endpoint)
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
		}
		return out
	}
	a, b := run(), run()
	seen := map[routing.EndpointKey]bool{}
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("pick %d differs between runs with the same seed", i)
		}
		seen[a[i]] = true
	}
	if len(seen) != 4 {
		t.Fatalf("random used %d of 4 endpoints in 50 picks", len(seen))
	}
}

func TestCandidatesByModelAndSubset(t *testing.T) {
	e := newEngine(t, "round_robin", engine.Options{},
		ep("10.0.0.1:8000", "llama"), ep("10.0.0.1:8001", "qwen"), ep("[fd00::1]:8000", "qwen"))
	cases := []struct {
		name  string
		req   routing.Request
		want  []routing.EndpointKey
		errIs error
	}{
		{"model filter", routing.Request{Model: "qwen"}, []routing.EndpointKey{"10.0.0.1:8001", "[fd00::1]:8000"}, nil},
		{"unknown model", routing.Request{Model: "gpt"}, nil, routing.ErrModelNotFound},
		{"model-less request", routing.Request{}, []routing.EndpointKey{"10.0.0.1:8000", "10.0.0.1:8001", "[fd00::1]:8000"}, nil},
		{"subset exact ip:port", routing.Request{Model: "qwen", Subset: routing.NewSubset([]string{"10.0.0.1:8001"})}, []routing.EndpointKey{"10.0.0.1:8001"}, nil},
		{"subset ip only matches every port", routing.Request{Subset: routing.NewSubset([]string{" 10.0.0.1 "})}, []routing.EndpointKey{"10.0.0.1:8000", "10.0.0.1:8001"}, nil},
		{"subset ipv6 bracketed", routing.Request{Subset: routing.NewSubset([]string{"[fd00::1]"})}, []routing.EndpointKey{"[fd00::1]:8000"}, nil},
		{"subset ipv6 with port", routing.Request{Subset: routing.NewSubset([]string{"[fd00::1]:8000"})}, []routing.EndpointKey{"[fd00::1]:8000"}, nil},
		{"subset port mismatch", routing.Request{Subset: routing.NewSubset([]string{"10.0.0.1:9999"})}, nil, routing.ErrSubsetEmpty},
		{"subset empty", routing.Request{Subset: routing.NewSubset(nil)}, nil, routing.ErrSubsetEmpty},
		{"subset garbage", routing.Request{Subset: routing.NewSubset([]string{"not-an-ip", "10.0.0.1:0"})}, nil, routing.ErrSubsetEmpty},
		{"subset and model disjoint", routing.Request{Model: "llama", Subset: routing.NewSubset([]string{"10.0.0.1:8001"})}, nil, routing.ErrSubsetEmpty},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got := map[routing.EndpointKey]bool{}
			for range 12 {
				req := c.req
				d, err := e.Score(t.Context(), &req)
				if c.errIs != nil {
					if !errors.Is(err, c.errIs) {
						t.Fatalf("err = %v, want %v", err, c.errIs)
					}
					return
				}
				if err != nil {
					t.Fatal(err)
				}
				d2, err := e.Pick(t.Context(), &req)
				if err != nil {
					t.Fatal(err)
				}
				got[d2.Endpoint] = true
				d2.Done(routing.NoUsage(routing.OutcomeSuccess))
				_ = d
			}
			if len(got) != len(c.want) {
				t.Fatalf("chose %v, want exactly %v", got, c.want)
			}
			for _, w := range c.want {
				if !got[w] {
					t.Fatalf("never chose %s (chose %v)", w, got)
				}
			}
		})
	}
}

func TestPassThroughUnknownModels(t *testing.T) {
	e := newEngine(t, "round_robin", engine.Options{PassThroughUnknownModels: true}, ep("10.0.0.1:8000", "llama"))
	d, err := e.Pick(t.Context(), &routing.Request{Model: "other"})
	if err != nil {
		t.Fatal(err)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
}

func TestNoEndpoints(t *testing.T) {
	p, _ := policy.Builtin().New("round_robin", policy.Deps{})
	e := engine.Must(p, engine.Options{}, engine.Deps{})
	defer e.Close()
	if _, err := e.Pick(t.Context(), &routing.Request{}); !errors.Is(err, routing.ErrNoEndpoints) {
		t.Fatalf("err = %v, want ErrNoEndpoints", err)
	}
	if e.Ready() {
		t.Fatal("engine with no endpoints reports ready")
	}
}

func TestScoreHasNoSideEffects(t *testing.T) {
	e := newEngine(t, "round_robin", engine.Options{Fallbacks: 1}, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	a, _ := e.Score(t.Context(), &routing.Request{})
	b, _ := e.Score(t.Context(), &routing.Request{})
	if a.Endpoint != b.Endpoint {
		t.Fatal("Score advanced the round-robin counter")
	}
	if len(a.Fallbacks) != 1 || a.Fallbacks[0] == a.Endpoint {
		t.Fatalf("fallbacks = %v", a.Fallbacks)
	}
	for _, st := range e.Endpoints() {
		if st.InFlight.Load() != 0 || st.Decisions.Load() != 0 {
			t.Fatal("Score changed counters")
		}
	}
	if a.Done(routing.NoUsage(routing.OutcomeSuccess)) {
		t.Fatal("a scored decision must not be Done-able")
	}
}

func TestUpdateKeepsCountersAndRejectsInvalid(t *testing.T) {
	e := newEngine(t, "round_robin", engine.Options{}, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	d, _ := e.Pick(t.Context(), &routing.Request{})
	bad := []routing.EndpointSet{
		{Endpoints: []routing.Endpoint{ep("10.0.0.1:8000"), ep("10.0.0.1:8000")}},
		{Endpoints: []routing.Endpoint{ep("host.example:80")}},
		{Endpoints: []routing.Endpoint{ep("10.0.0.1:0")}},
		{Endpoints: []routing.Endpoint{ep("[::ffff:10.0.0.1]:80")}},
		{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:80", BlockSize: -1}}},
	}
	for i, s := range bad {
		if err := e.Update(s); !errors.Is(err, routing.ErrInvalidEndpointSet) {
			t.Errorf("bad set %d accepted: %v", i, err)
		}
	}
	if len(e.Endpoints()) != 2 {
		t.Fatal("a rejected set replaced the snapshot")
	}
	// Keep the chosen endpoint, drop the other, then remove it entirely:
	// Done must still release the counter of the removed endpoint.
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{ep(string(d.Endpoint))}}); err != nil {
		t.Fatal(err)
	}
	if n := e.Endpoints()[0].InFlight.Load(); n != 1 {
		t.Fatalf("in-flight after swap = %d, want 1", n)
	}
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{ep("10.0.0.9:8000")}}); err != nil {
		t.Fatal(err)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{ep(string(d.Endpoint))}}); err != nil {
		t.Fatal(err)
	}
	if n := e.Endpoints()[0].InFlight.Load(); n != 0 {
		t.Fatalf("re-added endpoint starts with in-flight %d", n)
	}
}

func TestConcurrentPickUpdateDone(t *testing.T) {
	e := newEngine(t, "least_loaded", engine.Options{}, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		sets := [][]routing.Endpoint{{ep("10.0.0.1:8000"), ep("10.0.0.2:8000")}, {ep("10.0.0.2:8000"), ep("10.0.0.3:8000")}}
		for i := 0; ctx.Err() == nil; i++ {
			_ = e.Update(routing.EndpointSet{Endpoints: sets[i%2]})
		}
	}()
	var pw sync.WaitGroup
	for range 4 {
		pw.Add(1)
		go func() {
			defer pw.Done()
			for range 2000 {
				d, err := e.Pick(ctx, &routing.Request{})
				if err != nil {
					t.Error(err)
					return
				}
				d.Done(routing.NoUsage(routing.OutcomeSuccess))
			}
		}()
	}
	pw.Wait()
	cancel()
	wg.Wait()
	for _, st := range e.Endpoints() {
		if n := st.InFlight.Load(); n != 0 {
			t.Fatalf("%s in-flight %d after all Done", st.Key, n)
		}
	}
}

func TestParseEndpointList(t *testing.T) {
	s, err := routing.ParseEndpointList(" 127.0.0.1:8001 ,[::1]:8002,")
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Endpoints) != 2 || s.Endpoints[1].Key != "[::1]:8002" {
		t.Fatalf("got %+v", s.Endpoints)
	}
	for _, bad := range []string{"", ",", "localhost:80", "127.0.0.1", "127.0.0.1:99999", "127.0.0.1:1,127.0.0.1:1"} {
		if _, err := routing.ParseEndpointList(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestHintsHeadStart(t *testing.T) {
	if got := (routing.Hints{HasPriority: true, Priority: -2}).HeadStart(); got != 0 {
		t.Fatalf("negative priority head start = %v", got)
	}
	if !(routing.Hints{HasPriority: true, Priority: -1}).Sheddable() || (routing.Hints{}).Sheddable() {
		t.Fatal("sheddable")
	}
	if got := (routing.Hints{LatencySensitivity: 1.5}).HeadStart(); got.Seconds() != 1.5 {
		t.Fatalf("latency sensitivity head start = %v", got)
	}
}
