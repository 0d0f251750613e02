package engine_test

import (
	"errors"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/policy/kvbandit"
	"github.com/kvbandit/kvbandit/routing/policy/thompson"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// These tests send hostile client-supplied values through the engine with
// the hint-aware policies and check that the state kept beyond each
// request stays bounded (docs/security.md lists every such value).

var boundsStart = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// stateFixture is an engine with a hint-aware policy on a shared prefix
// store, on a virtual clock.
type stateFixture struct {
	clk    *clock.Virtual
	store  *prefixstate.Store
	policy routing.Policy
	e      *engine.Engine
}

func newStateFixture(t *testing.T, name string, eps ...string) *stateFixture {
	t.Helper()
	f := &stateFixture{clk: clock.NewVirtual(boundsStart)}
	var err error
	f.store, err = prefixstate.New(prefixstate.Config{}, f.clk)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.store.Close)
	rnd := routing.NewRand(7)
	f.policy, err = policy.Builtin().New(name, policy.Deps{Rand: rnd, Clock: f.clk, Prefixes: f.store, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := f.policy.(interface{ Close() error }); ok {
		t.Cleanup(func() { _ = c.Close() })
	}
	f.e = engine.Must(f.policy, engine.Options{}, engine.Deps{Clock: f.clk, Rand: rnd, Logger: quiet()})
	t.Cleanup(f.e.Close)
	var set routing.EndpointSet
	for _, k := range eps {
		set.Endpoints = append(set.Endpoints, routing.Endpoint{Key: routing.EndpointKey(k)})
	}
	if err := f.e.Update(set); err != nil {
		t.Fatal(err)
	}
	return f
}

func (f *stateFixture) pick(t *testing.T, r *routing.Request) *routing.Decision {
	t.Helper()
	d, err := f.e.Pick(t.Context(), r)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// liveHeap returns the bytes of live heap objects after a full collection.
func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// longTenant is a fresh tenant of size bytes that differs from every other
// i only in its last bytes, far past prefixstate's hashing threshold.
func longTenant(size, i int) string {
	suffix := strconv.Itoa(i)
	return strings.Repeat("t", size-len(suffix)) + suffix
}

// Issue 11, defect 3: tenants (from --tenant-header) were stored whole in
// the prefix state for its TTL, so 1,500 requests with 700 KB tenants held
// about 1 GB. The run below, scaled down to keep -race runs short (1,500 ×
// 64 KB: 96 MB held unfixed, 0.5 MB fixed), must stay under 8 MB while
// every tenant keeps its own state.
func TestMemoryBudgetLongTenants(t *testing.T) {
	const (
		n      = 1500
		size   = 64 << 10
		budget = 8 << 20
	)
	for _, name := range []string{kvbandit.Name, thompson.Name} {
		t.Run(name, func(t *testing.T) {
			f := newStateFixture(t, name, "10.0.0.1:8000", "10.0.0.2:8000")
			before := liveHeap()
			for i := range n {
				d := f.pick(t, &routing.Request{
					Tenant: longTenant(size, i), TokenCount: 100,
					Hints: routing.Hints{PrefixID: "session", TotalRequests: 8, OSL: routing.LevelMedium, IAT: routing.LevelMedium},
				})
				o := routing.NoUsage(routing.OutcomeSuccess)
				o.Latency, o.TTFT = 100*time.Millisecond, 20*time.Millisecond
				d.Done(o)
			}
			after := liveHeap()
			if got := f.store.Len(); got != n {
				t.Fatalf("prefix store holds %d entries, want %d (one per tenant)", got, n)
			}
			growth := int64(after) - int64(before)
			t.Logf("%s: heap growth %.1f MB for %d entries with %d-byte tenants", name, float64(growth)/(1<<20), n, size)
			if growth > budget {
				t.Fatalf("heap grew by %.1f MB holding %d long tenants, budget %d MB", float64(growth)/(1<<20), n, budget>>20)
			}
			// Tenants that differ only past the threshold keep separate
			// sessions: each spent 1 of its 8 requests, so a peek at the
			// next request of each finds 6 left after it.
			for _, i := range []int{0, 1, n - 1} {
				if reuse, _, _ := f.store.Arrive(prefixstate.Key{Tenant: longTenant(size, i), PrefixID: "session"}, 8, false); reuse != 6 {
					t.Fatalf("tenant %d: reuse after next = %d, want 6 (sessions of distinct tenants merged?)", i, reuse)
				}
			}
			runtime.KeepAlive(f)
		})
	}
}

// servedUnknown returns kvbandit_served_unknown_total from the engine's
// collector (-1 when it is not exported) and the number of series the
// collector exports.
func servedUnknown(t *testing.T, e *engine.Engine) (float64, int) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(engine.NewCollector(e))
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v, series := -1.0, 0
	for _, mf := range mfs {
		series += len(mf.GetMetric())
		if mf.GetName() == "kvbandit_served_unknown_total" {
			v = mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	return v, series
}

// Issue 11, defect 4: under thompson, 20,000 outcomes with distinct forged
// served endpoints (response metadata the data plane forwards) created
// 20,002 endpoint states and as many metric series. A served endpoint
// outside the set must now update nothing but a counter, while a real one
// (in the set, not the chosen one) is still charged the outcome.
func TestForgedServedEndpointsCreateNoState(t *testing.T) {
	const n = 20_000
	a, b := routing.EndpointKey("10.0.0.1:8000"), routing.EndpointKey("10.0.0.2:8000")
	other := func(k routing.EndpointKey) routing.EndpointKey {
		if k == a {
			return b
		}
		return a
	}
	success := func(served routing.EndpointKey) routing.Outcome {
		o := routing.NoUsage(routing.OutcomeSuccess)
		o.Served, o.Latency, o.TTFT, o.CompletionTokens = served, 200*time.Millisecond, 50*time.Millisecond, 10
		return o
	}

	t.Run(thompson.Name, func(t *testing.T) {
		f := newStateFixture(t, thompson.Name, string(a), string(b))
		p := f.policy.(*thompson.Policy)
		f.pick(t, &routing.Request{TokenCount: 100}).Done(success(""))
		_, seriesBefore := servedUnknown(t, f.e)
		rewards := func() map[routing.EndpointKey]uint64 {
			m := map[routing.EndpointKey]uint64{}
			for _, es := range p.Stats().Endpoints {
				m[es.Endpoint] = es.Rewards
			}
			return m
		}
		learnedBefore := rewards()
		for i := range n {
			d := f.pick(t, &routing.Request{TokenCount: 100})
			d.Done(success(routing.EndpointKey("10.9." + strconv.Itoa(i/250) + "." + strconv.Itoa(i%250) + ":8000")))
		}
		st := p.Stats()
		if len(st.Endpoints) != 2 {
			t.Fatalf("thompson holds state for %d endpoints after %d forged served endpoints, want 2", len(st.Endpoints), n)
		}
		if got := rewards(); got[a] != learnedBefore[a] || got[b] != learnedBefore[b] {
			t.Fatalf("forged outcomes taught the fleet: rewards %v, before %v", got, learnedBefore)
		}
		if st.Pending != 0 {
			t.Fatalf("%d decisions still pending after Done", st.Pending)
		}
		count, series := servedUnknown(t, f.e)
		if count != n {
			t.Fatalf("kvbandit_served_unknown_total = %v, want %d", count, n)
		}
		if series != seriesBefore {
			t.Fatalf("engine metric series: %d, before the forged outcomes %d", series, seriesBefore)
		}

		// A real served endpoint other than the chosen one is still charged.
		d := f.pick(t, &routing.Request{TokenCount: 100})
		served := other(d.Endpoint)
		before := rewards()
		d.Done(success(served))
		got := rewards()
		if got[served] != before[served]+1 || got[d.Endpoint] != before[d.Endpoint] {
			t.Fatalf("legitimate served endpoint: rewards %v, before %v (chosen %s, served %s)", got, before, d.Endpoint, served)
		}
		if p.Stats().ServedMismatch != 1 {
			t.Fatalf("ServedMismatch = %d, want 1", p.Stats().ServedMismatch)
		}
	})

	t.Run(kvbandit.Name, func(t *testing.T) {
		f := newStateFixture(t, kvbandit.Name, string(a), string(b))
		p := f.policy.(*kvbandit.Policy)
		observations := func() map[routing.EndpointKey]int {
			m := map[routing.EndpointKey]int{}
			for _, post := range p.Posteriors() {
				m[post.Endpoint] += post.Observations
			}
			return m
		}
		for range 4 {
			f.pick(t, &routing.Request{TokenCount: 100}).Done(success(""))
		}
		before := observations()
		for i := range n {
			d := f.pick(t, &routing.Request{TokenCount: 100})
			d.Done(success(routing.EndpointKey("forged-" + strconv.Itoa(i))))
		}
		if got := observations(); len(p.Posteriors()) > 2 || got[a] != before[a] || got[b] != before[b] {
			t.Fatalf("forged outcomes changed the posteriors: observations %v, before %v", got, before)
		}
		if count, _ := servedUnknown(t, f.e); count != n {
			t.Fatalf("kvbandit_served_unknown_total = %v, want %d", count, n)
		}
		// A real served endpoint is charged as before: kvbandit's speed
		// observation belongs to the decision (its work was the chosen
		// endpoint's), so the chosen endpoint's posterior learns.
		d := f.pick(t, &routing.Request{TokenCount: 100})
		before = observations()
		d.Done(success(other(d.Endpoint)))
		if got := observations(); got[d.Endpoint] != before[d.Endpoint]+1 {
			t.Fatalf("legitimate served endpoint: observations %v, before %v (chosen %s)", got, before, d.Endpoint)
		}
	})
}

// Audit (issue 11): a model no endpoint serves creates no state, and the
// 404 error that goes back to the client quotes at most a bounded part of
// its name (a 16 MiB body could otherwise come back several times over).
func TestUnknownModelCreatesNothing(t *testing.T) {
	f := newStateFixture(t, thompson.Name)
	if err := f.e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{
		{Key: "10.0.0.1:8000", Models: []routing.ModelName{"m"}},
	}}); err != nil {
		t.Fatal(err)
	}
	p := f.policy.(*thompson.Policy)
	_, seriesBefore := servedUnknown(t, f.e)
	for i := range 1000 {
		_, err := f.e.Pick(t.Context(), &routing.Request{Model: routing.ModelName("unknown-" + strconv.Itoa(i)), Tenant: "t",
			Hints: routing.Hints{PrefixID: "s" + strconv.Itoa(i), TotalRequests: 5}})
		if !errors.Is(err, routing.ErrModelNotFound) {
			t.Fatalf("err = %v, want ErrModelNotFound", err)
		}
	}
	if n := len(p.Stats().Endpoints); n != 0 || f.store.Len() != 0 {
		t.Fatalf("unknown models created state: %d endpoint states, %d prefix entries", n, f.store.Len())
	}
	if _, series := servedUnknown(t, f.e); series != seriesBefore {
		t.Fatalf("metric series: %d, before %d", series, seriesBefore)
	}
	huge := routing.ModelName(strings.Repeat("\xff", 1<<20))
	_, err := f.e.Pick(t.Context(), &routing.Request{Model: huge})
	if !errors.Is(err, routing.ErrModelNotFound) || len(err.Error()) > 2048 {
		t.Fatalf("err for a 1 MiB model name: %d bytes, ErrModelNotFound %v", len(err.Error()), errors.Is(err, routing.ErrModelNotFound))
	}
}
