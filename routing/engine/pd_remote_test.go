package engine_test

import (
	"errors"
	"slices"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
)

// pdFleet is two decode and two prefill endpoints.
func pdFleet() []routing.Endpoint {
	eps := fleet(4)
	for i := range eps {
		eps[i].Role = routing.RoleDecode
		if i >= 2 {
			eps[i].Role = routing.RolePrefill
		}
	}
	return eps
}

// newPDEngine is an engine over eps that always disaggregates (threshold
// 0) with policy name.
func newPDEngine(t testing.TB, name string, seed int64, eps ...routing.Endpoint) *engine.Engine {
	t.Helper()
	rnd := routing.NewRand(seed)
	p, err := policy.Builtin().New(name, policy.Deps{Rand: rnd, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	d, err := pd.New(pd.Config{ThresholdTokens: 0})
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(p, engine.Options{SyncIndex: true}, engine.Deps{Rand: rnd, Logger: quiet(), PD: d})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestRemotePDStartLoadsLikeLocal: disaggregated decisions made on A and
// applied on B carry both endpoints: B's prefill endpoints hold the
// prompts' prefill tokens and blocks (and count the decisions in flight)
// until the first token, its decode endpoints the decisions and their
// blocks without prefill tokens, exactly as A holds them; first tokens
// and ends release the same load on both.
func TestRemotePDStartLoadsLikeLocal(t *testing.T) {
	eps := pdFleet()
	a, b := newPDEngine(t, "kv", 1, eps...), newPDEngine(t, "kv", 2, eps...)
	var local []*routing.Decision
	var remote []*engine.RemoteDecision
	for i := range 8 {
		d, err := a.Pick(t.Context(), req(tokens(256+64*i, uint32(1+i%2*100_000))))
		if err != nil {
			t.Fatal(err)
		}
		if d.PD != routing.PDDisaggregated || d.Prefill == "" {
			t.Fatalf("decision %d not disaggregated: %v", i, d.PD)
		}
		s := d.Share()
		if s.PrefillEndpoint != d.Prefill || s.PrefillDPRank != d.PrefillRank {
			t.Fatalf("Share: prefill %q rank %d, decision's %q %d", s.PrefillEndpoint, s.PrefillDPRank, d.Prefill, d.PrefillRank)
		}
		local = append(local, d)
		rd := mustStart(t, b, s)
		if rd.PrefillEndpoint != d.Prefill {
			t.Fatalf("remote decision's prefill endpoint %q, want %q", rd.PrefillEndpoint, d.Prefill)
		}
		remote = append(remote, rd)
	}
	check := func(when string) {
		t.Helper()
		got, want := fleetLoad(b), fleetLoad(a)
		if !sameLoad(got, want) {
			t.Fatalf("%s: B's load %+v, A's %+v", when, got, want)
		}
	}
	check("started")
	prefill := int64(0)
	for _, st := range b.Endpoints() {
		if st.Role == routing.RolePrefill {
			prefill += st.InFlightPrefill()
		} else if st.InFlightPrefill() != 0 {
			t.Fatalf("decode endpoint %s holds %d prefill tokens of peers' disaggregated decisions", st.Key, st.InFlightPrefill())
		}
	}
	if prefill == 0 {
		t.Fatal("B's prefill endpoints hold none of the peers' prefill tokens")
	}
	for i := range 4 {
		local[i].Prefilled()
		remote[i].Prefilled()
	}
	check("half prefilled")
	for i := range local {
		local[i].Done(routing.NoUsage(routing.OutcomeSuccess))
		remote[i].End()
	}
	check("ended")
	for k, l := range loads(b) {
		if l.remote != 0 || l.prefill != 0 || slices.ContainsFunc(l.blocks, func(n int64) bool { return n != 0 }) {
			t.Fatalf("%s still loaded after End: %+v", k, l)
		}
	}
}

// TestRemotePDPrefillLoadSteersPrefill: B sees A's disaggregated
// decisions' prefill load, so its own next decision prefills on the other
// prefill endpoint, as A's would; without the prefill endpoint in the
// shared start (as before), B would pick the loaded one half the time.
func TestRemotePDPrefillLoadSteersPrefill(t *testing.T) {
	eps := pdFleet()
	a, b := newPDEngine(t, "kv", 1, eps...), newPDEngine(t, "kv", 2, eps...)
	d, err := a.Pick(t.Context(), req(tokens(4096, 1)))
	if err != nil {
		t.Fatal(err)
	}
	mustStart(t, b, d.Share())
	for i := range 6 {
		// Unrelated prompts: no cache anywhere, only the load differs.
		db, err := b.Score(t.Context(), req(tokens(2048, uint32(1_000_000*(i+2)))))
		if err != nil {
			t.Fatal(err)
		}
		if db.Prefill == "" || db.Prefill == d.Prefill {
			t.Fatalf("B prefills on %q while A's 4096-token prefill is on %q", db.Prefill, d.Prefill)
		}
	}
}

// TestRemotePDUnknownPrefill: a start whose prefill endpoint or rank is
// not in the set records nothing.
func TestRemotePDUnknownPrefill(t *testing.T) {
	eps := pdFleet()
	a, b := newPDEngine(t, "kv", 1, eps...), newPDEngine(t, "kv", 2, eps...)
	d, err := a.Pick(t.Context(), req(tokens(512, 1)))
	if err != nil {
		t.Fatal(err)
	}
	before := loads(b)
	for _, bad := range []func(*routing.RemoteStart){
		func(s *routing.RemoteStart) { s.PrefillEndpoint = "10.9.9.9:8000" },
		func(s *routing.RemoteStart) { s.PrefillDPRank = 3 },
	} {
		s := d.Share()
		bad(&s)
		if _, err := b.StartRemote(s); !errors.Is(err, routing.ErrUnknownEndpoint) {
			t.Fatalf("start with prefill %q rank %d: %v, want ErrUnknownEndpoint", s.PrefillEndpoint, s.PrefillDPRank, err)
		}
	}
	for _, bad := range []func(*routing.RemoteStart){
		func(s *routing.RemoteStart) { s.PrefillCached = -1 },
		func(s *routing.RemoteStart) { s.PrefillCached = routing.MaxRemoteTokens + 1 },
		func(s *routing.RemoteStart) { s.PrefillEndpoint, s.PrefillCached = "", 64 },
	} {
		s := d.Share()
		bad(&s)
		if _, err := b.StartRemote(s); !errors.Is(err, routing.ErrInvalidRemote) {
			t.Fatalf("start with prefill %q cached %d: %v, want ErrInvalidRemote", s.PrefillEndpoint, s.PrefillCached, err)
		}
	}
	if !sameLoad(loads(b), before) {
		t.Fatalf("refused starts left load: %+v", loads(b))
	}
}

// TestRemotePDOutcomeLeavesTTFTOut: a disaggregated decision's shared
// outcome carries no time to first token (the prefill endpoint's, which
// the outcome cannot name), its latency still.
func TestRemotePDOutcomeLeavesTTFTOut(t *testing.T) {
	a := newPDEngine(t, "kv", 1, pdFleet()...)
	d, err := a.Pick(t.Context(), req(tokens(512, 1)))
	if err != nil {
		t.Fatal(err)
	}
	o := routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: 30e6, Latency: 900e6, CompletionTokens: 10}
	ro, ok := d.ShareOutcome(o)
	if !ok || ro.TTFT != 0 || ro.Latency != o.Latency || ro.Endpoint != d.Endpoint {
		t.Fatalf("shared outcome %+v (ok %v): want no TTFT, the latency, the decode endpoint", ro, ok)
	}
}
