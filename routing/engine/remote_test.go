package engine_test

import (
	"errors"
	"fmt"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/policy/kvbandit"
	"github.com/kvbandit/kvbandit/routing/policy/thompson"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// replica is one kvbandit replica of a test: an engine with its own policy
// and prefix store, on a clock shared by the replicas of the test.
type replica struct {
	e     *engine.Engine
	store *prefixstate.Store
}

func newReplica(t testing.TB, name string, seed int64, clk clock.Clock, opts engine.Options, eps ...routing.Endpoint) replica {
	t.Helper()
	if _, bench := t.(*testing.B); !bench {
		opts.SyncIndex = true
	}
	store, err := prefixstate.New(prefixstate.Config{}, clk)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	rnd := routing.NewRand(seed)
	// Peers' outcomes teach kvbandit's speed factors only when asked
	// (speed.remote_weight, 0 by default); these tests check that path.
	cfg := policy.DefaultConfig()
	cfg.KVBandit.Speed.RemoteWeight = 1
	p, err := policy.Builtin().New(name, policy.Deps{Rand: rnd, Clock: clk, Prefixes: store, Logger: quiet(), Config: &cfg})
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := p.(interface{ Close() error }); ok {
		t.Cleanup(func() { c.Close() })
	}
	e, err := engine.New(p, opts, engine.Deps{Rand: rnd, Clock: clk, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return replica{e: e, store: store}
}

func fleet(n int) []routing.Endpoint {
	eps := make([]routing.Endpoint, n)
	for i := range eps {
		eps[i] = ep(fmt.Sprintf("10.0.0.%d:8000", i+1))
	}
	return eps
}

func virtualClock() *clock.Virtual { return clock.NewVirtual(time.Unix(1_700_000_000, 0)) }

// load is an engine's view of one endpoint's in-flight load.
type load struct {
	local, remote, prefill int64
	blocks                 []int64
}

func loads(e *engine.Engine) map[routing.EndpointKey]load {
	out := map[routing.EndpointKey]load{}
	for _, st := range e.Endpoints() {
		out[st.Key] = load{st.InFlight.Load(), st.RemoteInFlight.Load(), st.InFlightPrefill(), st.ActiveBlocks()}
	}
	return out
}

// fleetLoad is loads with local and remote in-flight counts summed: what a
// replica believes the fleet's load is.
func fleetLoad(e *engine.Engine) map[routing.EndpointKey]load {
	out := loads(e)
	for k, l := range out {
		out[k] = load{local: l.local + l.remote, prefill: l.prefill, blocks: l.blocks}
	}
	return out
}

func sameLoad(a, b map[routing.EndpointKey]load) bool {
	if len(a) != len(b) {
		return false
	}
	for k, la := range a {
		lb, ok := b[k]
		if !ok || la.local != lb.local || la.remote != lb.remote || la.prefill != lb.prefill || !slices.Equal(la.blocks, lb.blocks) {
			return false
		}
	}
	return true
}

func mustStart(t testing.TB, e *engine.Engine, s routing.RemoteStart) *engine.RemoteDecision {
	t.Helper()
	rd, err := e.StartRemote(s)
	if err != nil {
		t.Fatal(err)
	}
	return rd
}

// TestRemoteStartLoadsLikeLocal: decisions made on A and applied on B with
// StartRemote give B the load A has (slots, prefill, index): B scores the
// next request exactly as A does, and first tokens and ends release the
// same load on both.
func TestRemoteStartLoadsLikeLocal(t *testing.T) {
	clk := virtualClock()
	eps := fleet(4)
	a := newReplica(t, "kv", 1, clk, engine.Options{}, eps...)
	b := newReplica(t, "kv", 2, clk, engine.Options{}, eps...)
	var local []*routing.Decision
	var remote []*engine.RemoteDecision
	for i := range 10 {
		// Two prompt families, so that requests share prefixes.
		d, err := a.e.Pick(t.Context(), req(tokens(128+32*i, uint32(1+i%2*100_000))))
		if err != nil {
			t.Fatal(err)
		}
		local = append(local, d)
		remote = append(remote, mustStart(t, b.e, d.Share()))
	}
	check := func(when string) {
		t.Helper()
		if got, want := fleetLoad(b.e), fleetLoad(a.e); !sameLoad(got, want) {
			t.Fatalf("%s: B's load %+v, A's %+v", when, got, want)
		}
		for _, r := range []*routing.Request{req(tokens(512, 1)), req(tokens(300, 100_000)), req(tokens(64, 7_000_000))} {
			sa, err := a.e.Score(t.Context(), r)
			if err != nil {
				t.Fatal(err)
			}
			sb, err := b.e.Score(t.Context(), r)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(sa.Scores, sb.Scores) {
				t.Fatalf("%s: B scores %v, A scores %v", when, sb.Scores, sa.Scores)
			}
		}
	}
	check("started")
	for _, st := range b.e.Endpoints() {
		if st.InFlight.Load() != 0 {
			t.Fatalf("B counts peers' decisions as its own: %s in-flight %d", st.Key, st.InFlight.Load())
		}
	}
	for i := range 5 {
		local[i].Prefilled()
		remote[i].Prefilled()
	}
	check("half prefilled")
	for i := range 10 {
		local[i].Done(routing.NoUsage(routing.OutcomeSuccess))
		if !remote[i].End() {
			t.Fatal("first End returned false")
		}
		if remote[i].End() {
			t.Fatal("second End returned true")
		}
		remote[i].Prefilled() // after End: nothing
	}
	check("ended")
	for k, l := range loads(b.e) {
		if l.remote != 0 || l.prefill != 0 || slices.ContainsFunc(l.blocks, func(n int64) bool { return n != 0 }) {
			t.Fatalf("%s still loaded after End: %+v", k, l)
		}
	}
}

// TestRemoteBurstSpreadsLikeOneEngine: a burst of requests sharing a
// prompt, entering alternately through A and B, spreads over the fleet as
// it does through one engine: while an endpoint is idle, no endpoint gets a
// second request of the burst (the kv cost ties, and the tie goes to the
// endpoint that holds less). Without sharing, B would not see A's picks
// and would land on one of them by chance.
func TestRemoteBurstSpreadsLikeOneEngine(t *testing.T) {
	clk := virtualClock()
	eps := fleet(4)
	one := newReplica(t, "kv", 1, clk, engine.Options{}, eps...)
	a := newReplica(t, "kv", 2, clk, engine.Options{}, eps...)
	b := newReplica(t, "kv", 3, clk, engine.Options{}, eps...)
	for round := range 16 {
		prompt := tokens(256, uint32(1+round*1_000_000))
		viaOne, viaTwo := map[routing.EndpointKey]int{}, map[routing.EndpointKey]int{}
		var ends []func()
		for i := range len(eps) {
			d, err := one.e.Pick(t.Context(), req(prompt))
			if err != nil {
				t.Fatal(err)
			}
			viaOne[d.Endpoint]++
			ends = append(ends, func() { d.Done(routing.NoUsage(routing.OutcomeSuccess)) })
			from, to := a, b
			if i%2 == 1 {
				from, to = b, a
			}
			d2, err := from.e.Pick(t.Context(), req(prompt))
			if err != nil {
				t.Fatal(err)
			}
			rd := mustStart(t, to.e, d2.Share())
			viaTwo[d2.Endpoint]++
			ends = append(ends, func() { d2.Done(routing.NoUsage(routing.OutcomeSuccess)); rd.End() })
		}
		if len(viaOne) != len(eps) || len(viaTwo) != len(eps) {
			t.Fatalf("round %d: a burst of %d over %d endpoints: through one engine %v, through two %v", round, len(eps), len(eps), viaOne, viaTwo)
		}
		for _, end := range ends {
			end()
		}
	}
}

// TestRemoteStartRejectsUnknown: an endpoint or rank outside the set, or
// out-of-bounds values, give an error and leave no state.
func TestRemoteStartRejectsUnknown(t *testing.T) {
	clk := virtualClock()
	dp := ep("10.0.0.9:8000")
	dp.DataParallelSize = 2
	r := newReplica(t, "kvbandit", 1, clk, engine.Options{}, ep("10.0.0.1:8000"), dp)
	blocks := []uint64{1, 2, 3, 4}
	good := routing.RemoteStart{Endpoint: "10.0.0.1:8000", DPRank: -1, BlockSize: 16, Blocks: blocks, ISL: 64, PrefixID: "p", TotalRequests: 4}
	cases := []struct {
		name string
		mut  func(*routing.RemoteStart)
		want error
	}{
		{"unknown endpoint", func(s *routing.RemoteStart) { s.Endpoint = "10.0.0.2:8000" }, routing.ErrUnknownEndpoint},
		{"rank of a single-rank endpoint", func(s *routing.RemoteStart) { s.DPRank = 0 }, routing.ErrUnknownEndpoint},
		{"no rank of a dp endpoint", func(s *routing.RemoteStart) { s.Endpoint = dp.Key }, routing.ErrUnknownEndpoint},
		{"rank beyond a dp endpoint", func(s *routing.RemoteStart) { s.Endpoint, s.DPRank = dp.Key, 2 }, routing.ErrUnknownEndpoint},
		{"too many blocks", func(s *routing.RemoteStart) { s.Blocks = make([]uint64, routing.MaxRemoteBlocks+1) }, routing.ErrInvalidRemote},
		{"block size 0", func(s *routing.RemoteStart) { s.BlockSize = 0 }, routing.ErrInvalidRemote},
		{"negative prompt", func(s *routing.RemoteStart) { s.ISL = -1 }, routing.ErrInvalidRemote},
		{"huge prompt", func(s *routing.RemoteStart) { s.ISL = routing.MaxRemoteTokens + 1 }, routing.ErrInvalidRemote},
		{"overlap beyond blocks", func(s *routing.RemoteStart) { s.Overlap = 5 }, routing.ErrInvalidRemote},
		{"long prefix id", func(s *routing.RemoteStart) { s.PrefixID = string(make([]byte, routing.MaxRemoteString+1)) }, routing.ErrInvalidRemote},
		{"bad level", func(s *routing.RemoteStart) { s.OSL = routing.LevelHigh + 1 }, routing.ErrInvalidRemote},
		{"negative total", func(s *routing.RemoteStart) { s.TotalRequests = -1 }, routing.ErrInvalidRemote},
	}
	for _, c := range cases {
		s := good
		c.mut(&s)
		rd, err := r.e.StartRemote(s)
		if !errors.Is(err, c.want) || rd != nil {
			t.Errorf("%s: got %v, %v; want %v", c.name, rd, err, c.want)
		}
	}
	for k, l := range loads(r.e) {
		if l.remote != 0 || l.prefill != 0 || slices.ContainsFunc(l.blocks, func(n int64) bool { return n != 0 }) {
			t.Errorf("%s loaded by a rejected start: %+v", k, l)
		}
	}
	if st := r.e.Index().Stats(); st.Entries != 0 {
		t.Errorf("rejected starts indexed %d entries", st.Entries)
	}
	if n := r.store.Len(); n != 0 {
		t.Errorf("rejected starts made %d prefix entries", n)
	}
	// The good one, and a rank of the dp endpoint, are accepted.
	mustStart(t, r.e, good).End()
	s := good
	s.Endpoint, s.DPRank = dp.Key, 1
	rd := mustStart(t, r.e, s)
	if got := r.e.Endpoints()[1].ActiveBlocks(); !slices.Equal(got, []int64{0, 4}) {
		t.Errorf("dp rank 1 start: active blocks %v, want [0 4]", got)
	}
	rd.End()

	// Outcomes about unknown endpoints teach nothing.
	o := routing.RemoteOutcome{Endpoint: "10.0.0.1:8000", DPRank: -1, Outcome: routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: time.Second, PromptTokens: 64, CompletionTokens: 10, CachedTokens: 0}, BlockSize: 16, ISL: 64}
	bad := []struct {
		name string
		mut  func(*routing.RemoteOutcome)
		want error
	}{
		{"unknown endpoint", func(o *routing.RemoteOutcome) { o.Endpoint = "10.0.0.2:8000" }, routing.ErrUnknownEndpoint},
		{"unknown served", func(o *routing.RemoteOutcome) { o.Served = "10.0.0.2:8000" }, routing.ErrUnknownEndpoint},
		{"bad rank", func(o *routing.RemoteOutcome) { o.DPRank = 3 }, routing.ErrUnknownEndpoint},
		{"bad kind", func(o *routing.RemoteOutcome) { o.Kind = routing.LastOutcomeKind + 1 }, routing.ErrInvalidRemote},
		{"negative ttft", func(o *routing.RemoteOutcome) { o.TTFT = -1 }, routing.ErrInvalidRemote},
		{"bad tokens", func(o *routing.RemoteOutcome) { o.CachedTokens = -2 }, routing.ErrInvalidRemote},
		{"block size 0", func(o *routing.RemoteOutcome) { o.BlockSize = 0 }, routing.ErrInvalidRemote},
	}
	for _, c := range bad {
		oo := o
		c.mut(&oo)
		if err := r.e.LearnRemote(oo); !errors.Is(err, c.want) {
			t.Errorf("outcome %s: got %v, want %v", c.name, err, c.want)
		}
	}
	if post := r.e.Policy().(*kvbandit.Policy).Posteriors(); len(post) != 0 {
		t.Errorf("rejected outcomes taught %+v", post)
	}
	if err := r.e.LearnRemote(o); err != nil {
		t.Fatal(err)
	}
	if post := r.e.Policy().(*kvbandit.Policy).Posteriors(); len(post) != 1 || post[0].Endpoint != "10.0.0.1:8000" {
		t.Errorf("a good outcome taught %+v", post)
	}
}

// TestRemoteLimits: the engine holds at most MaxRemoteDecisions peers'
// decisions and RemoteBlockBudget block keys for them; ending decisions
// makes room again.
func TestRemoteLimits(t *testing.T) {
	r := newReplica(t, "kv", 1, virtualClock(), engine.Options{MaxRemoteDecisions: 3, RemoteBlockBudget: 10}, ep("10.0.0.1:8000"))
	s := routing.RemoteStart{Endpoint: "10.0.0.1:8000", DPRank: -1, BlockSize: 16, Blocks: []uint64{1, 2, 3, 4}, ISL: 64}
	first, second := mustStart(t, r.e, s), mustStart(t, r.e, s)
	if _, err := r.e.StartRemote(s); !errors.Is(err, routing.ErrRemoteLimit) {
		t.Fatalf("12 block keys of a budget of 10: %v", err)
	}
	small := s
	small.Blocks = small.Blocks[:2]
	third := mustStart(t, r.e, small)
	if _, err := r.e.StartRemote(routing.RemoteStart{Endpoint: "10.0.0.1:8000", DPRank: -1, BlockSize: 16}); !errors.Is(err, routing.ErrRemoteLimit) {
		t.Fatalf("a 4th decision of at most 3: %v", err)
	}
	if l := loads(r.e)["10.0.0.1:8000"]; l.remote != 3 || l.prefill != 3*64 {
		t.Fatalf("refused starts recorded load: %+v", l)
	}
	first.End()
	first.End() // idempotent: releases once
	mustStart(t, r.e, s).End()
	second.End()
	third.End()
	for range 3 {
		defer mustStart(t, r.e, small).End()
	}
}

// TestRemoteMemoryBudget: a peer that starts decisions with the largest
// block lists and never ends them cannot make the engine hold more than
// its block budget. Unbounded, the 2000 starts below would hold 256 MiB of
// block keys; the budget is 8 MiB.
func TestRemoteMemoryBudget(t *testing.T) {
	const budget = 1 << 20 // block keys: 8 MiB
	r := newReplica(t, "kv", 1, virtualClock(), engine.Options{RemoteBlockBudget: budget, Index: kvindex.Options{MaxEntries: 1 << 14}}, fleet(4)...)
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	var open []*engine.RemoteDecision
	refused := 0
	for i := range 2000 {
		blocks := make([]uint64, routing.MaxRemoteBlocks)
		blocks[0] = uint64(i) + 1 // a chain of its own: later keys never match
		rd, err := r.e.StartRemote(routing.RemoteStart{Endpoint: routing.EndpointKey(fmt.Sprintf("10.0.0.%d:8000", i%4+1)), DPRank: -1, BlockSize: 16, Blocks: blocks, ISL: len(blocks) * 16})
		switch {
		case errors.Is(err, routing.ErrRemoteLimit):
			refused++
		case err != nil:
			t.Fatal(err)
		default:
			open = append(open, rd)
		}
	}
	grown := int64(heap()) - int64(before)
	t.Logf("%d starts held, %d refused, heap grew %d MiB", len(open), refused, grown>>20)
	if len(open) != budget/routing.MaxRemoteBlocks || grown > 40<<20 {
		t.Fatalf("%d starts held (want %d), heap grew %d MiB (bound 40 MiB)", len(open), budget/routing.MaxRemoteBlocks, grown>>20)
	}
	for _, rd := range open {
		rd.End()
	}
}

// TestRemoteDecisionSurvivesUpdate: a peer's decision keeps its load across
// endpoint-set updates that keep its endpoint, and End stays safe and
// exact when the endpoint left the set or changed its ranks.
func TestRemoteDecisionSurvivesUpdate(t *testing.T) {
	clk := virtualClock()
	x, y := ep("10.0.0.1:8000"), ep("10.0.0.2:8000")
	r := newReplica(t, "kv", 1, clk, engine.Options{}, x)
	s := routing.RemoteStart{Endpoint: x.Key, DPRank: -1, BlockSize: 16, Blocks: []uint64{1, 2, 3}, ISL: 48}
	rd := mustStart(t, r.e, s)
	before := loads(r.e)[x.Key]
	if before.remote != 1 || before.prefill != 48 || !slices.Equal(before.blocks, []int64{3}) {
		t.Fatalf("started: %+v", before)
	}
	if err := r.e.Update(routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{x, y}}); err != nil {
		t.Fatal(err)
	}
	if got := loads(r.e)[x.Key]; !sameLoad(map[routing.EndpointKey]load{x.Key: got}, map[routing.EndpointKey]load{x.Key: before}) {
		t.Fatalf("after an update keeping it: %+v, want %+v", got, before)
	}
	rd.End()
	if got := loads(r.e)[x.Key]; got.remote != 0 || got.prefill != 0 || got.blocks[0] != 0 {
		t.Fatalf("ended: %+v", got)
	}

	// The endpoint leaves with a peer's decision open, then comes back.
	rd = mustStart(t, r.e, s)
	if err := r.e.Update(routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{y}}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.e.StartRemote(s); !errors.Is(err, routing.ErrUnknownEndpoint) {
		t.Fatalf("start on a removed endpoint: %v", err)
	}
	if !rd.End() {
		t.Fatal("End after the endpoint left returned false")
	}
	if err := r.e.Update(routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{x, y}}); err != nil {
		t.Fatal(err)
	}
	if got := loads(r.e)[x.Key]; got.remote != 0 || got.prefill != 0 {
		t.Fatalf("re-added endpoint carries load: %+v", got)
	}

	// Its ranks change with a peer's decision open: the decision keeps its
	// own slot, the new ranks start empty.
	rd = mustStart(t, r.e, s)
	x2 := x
	x2.DataParallelSize = 2
	if err := r.e.Update(routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{x2, y}}); err != nil {
		t.Fatal(err)
	}
	if got := loads(r.e)[x.Key]; got.remote != 0 || !slices.Equal(got.blocks, []int64{0, 0}) {
		t.Fatalf("new ranks carry load: %+v", got)
	}
	rd.End()
	if got := loads(r.e)[x.Key]; got.remote != 0 || got.prefill != 0 {
		t.Fatalf("End on the old ranks touched the new ones: %+v", got)
	}
}

// TestRemoteDecisionExpires: a peer's decision whose End never comes is
// released after StaleAfter, like a local one.
func TestRemoteDecisionExpires(t *testing.T) {
	clk := virtualClock()
	r := newReplica(t, "kv", 1, clk, engine.Options{StaleAfter: time.Minute}, ep("10.0.0.1:8000"))
	rd := mustStart(t, r.e, routing.RemoteStart{Endpoint: "10.0.0.1:8000", DPRank: -1, BlockSize: 16, Blocks: []uint64{1}, ISL: 16})
	clk.Step(59 * time.Second)
	if rd.Ended() || r.e.RemoteExpired() != 0 {
		t.Fatal("expired early")
	}
	clk.Step(time.Second)
	if !rd.Ended() || r.e.RemoteExpired() != 1 {
		t.Fatalf("not expired after StaleAfter: ended %v, expired %d", rd.Ended(), r.e.RemoteExpired())
	}
	if l := loads(r.e)["10.0.0.1:8000"]; l.remote != 0 || l.prefill != 0 || l.blocks[0] != 0 {
		t.Fatalf("expired decision still loads: %+v", l)
	}
	if rd.End() {
		t.Fatal("End after expiry returned true")
	}
}

// TestRemoteLoadCountsForInFlightPolicies: the policies that read in-flight
// counts as load (least_loaded; weighted without scraped queues) see
// peers' decisions. (thompson's pending load: its own test.)
func TestRemoteLoadCountsForInFlightPolicies(t *testing.T) {
	clk := virtualClock()
	for _, name := range []string{"least_loaded", "weighted"} {
		t.Run(name, func(t *testing.T) {
			r := newReplica(t, name, 1, clk, engine.Options{}, fleet(2)...)
			busy := make([]*engine.RemoteDecision, 0, 40)
			for range 40 {
				busy = append(busy, mustStart(t, r.e, routing.RemoteStart{Endpoint: "10.0.0.1:8000", DPRank: -1, BlockSize: 16}))
			}
			if n := r.e.Endpoints()[0].FleetInFlight(); n != 40 {
				t.Fatalf("fleet in-flight %d, want 40", n)
			}
			picks := 0
			for range 20 {
				d, err := r.e.Pick(t.Context(), &routing.Request{Model: "m"})
				if err != nil {
					t.Fatal(err)
				}
				if d.Endpoint == "10.0.0.2:8000" {
					picks++
				}
				d.Done(routing.NoUsage(routing.OutcomeCancelled))
			}
			if picks != 20 {
				t.Fatalf("%d of 20 picks avoided the endpoint with 40 peers' requests", picks)
			}
			for _, rd := range busy {
				rd.End()
			}
		})
	}
}

// outcomeFor is a success whose TTFT grows with the prefill work behind it.
func outcomeFor(i int, d *routing.Decision) routing.Outcome {
	o := routing.Outcome{Kind: routing.OutcomeSuccess, Status: 200, PromptTokens: 256, CompletionTokens: 20 + i, CachedTokens: d.Overlap * 16}
	o.TTFT = time.Duration(20+7*i%13) * time.Millisecond
	o.Latency = o.TTFT + time.Duration(100+i)*time.Millisecond
	switch i % 7 {
	case 3:
		o.Kind, o.Status = routing.OutcomeUpstreamError, 500
	case 5:
		o = routing.NoUsage(routing.OutcomeExpired)
	case 6:
		o = routing.NoUsage(routing.OutcomeCancelled)
	}
	return o
}

// TestRemoteOutcomesTeachLikeLocal: a peer's outcomes move B's learned
// state exactly as the same outcomes move A's, whose decisions they were:
// kvbandit's speed posteriors, thompson's Beta bandits (LinTS learns
// locally only, see thompson.Policy.LearnRemote).
func TestRemoteOutcomesTeachLikeLocal(t *testing.T) {
	for _, name := range []string{"kvbandit", "thompson"} {
		t.Run(name, func(t *testing.T) {
			clk := virtualClock()
			eps := fleet(3)
			a := newReplica(t, name, 1, clk, engine.Options{}, eps...)
			b := newReplica(t, name, 2, clk, engine.Options{}, eps...)
			var open []*routing.Decision
			for i := range 60 {
				d, err := a.e.Pick(t.Context(), req(tokens(128+64*(i%5), uint32(1+i%3*10_000))))
				if err != nil {
					t.Fatal(err)
				}
				// Keep some decisions in flight, so that queued prefill
				// counts in the work outcomes are measured against.
				open = append(open, d)
				if len(open) < 4 {
					continue
				}
				d, open = open[0], open[1:]
				o := outcomeFor(i, d)
				d.Done(o)
				ro, ok := d.ShareOutcome(o)
				if !ok {
					t.Fatal("a known endpoint's outcome not shared")
				}
				if err := b.e.LearnRemote(ro); err != nil {
					t.Fatal(err)
				}
				clk.Step(10 * time.Millisecond)
			}
			for _, d := range open {
				d.Done(routing.NoUsage(routing.OutcomeCancelled))
			}
			switch p := a.e.Policy().(type) {
			case *kvbandit.Policy:
				// The same outcomes reach the same speed posteriors (count
				// and spread); the means are relative to each replica's own
				// pooled latency fit, which peers' outcomes do not move (the
				// running sequences at their decisions are not shared).
				pa, pb := p.Posteriors(), b.e.Policy().(*kvbandit.Policy).Posteriors()
				if len(pa) == 0 || len(pa) != len(pb) {
					t.Fatalf("posteriors differ:\nA %+v\nB %+v", pa, pb)
				}
				for i := range pa {
					if pa[i].Endpoint != pb[i].Endpoint || pa[i].Observations != pb[i].Observations || pa[i].Sigma != pb[i].Sigma || !(pb[i].Factor > 0) {
						t.Fatalf("posteriors differ:\nA %+v\nB %+v", pa, pb)
					}
				}
			case *thompson.Policy:
				sa, sb := p.Stats(), b.e.Policy().(*thompson.Policy).Stats()
				if len(sa.Endpoints) != len(eps) || len(sb.Endpoints) != len(eps) {
					t.Fatalf("endpoints learnt: A %d, B %d", len(sa.Endpoints), len(sb.Endpoints))
				}
				for i := range sa.Endpoints {
					ea, eb := sa.Endpoints[i], sb.Endpoints[i]
					if ea.Endpoint != eb.Endpoint || ea.Alpha != eb.Alpha || ea.Beta != eb.Beta || ea.Rewards != eb.Rewards || ea.Rewards == 0 {
						t.Fatalf("Beta bandits differ:\nA %+v\nB %+v", ea, eb)
					}
				}
				if sb.Remote != sa.Feedback+sa.Timeouts || sb.Feedback != 0 {
					t.Fatalf("B learnt %d remote outcomes (%d local), A %d feedback + %d timeouts", sb.Remote, sb.Feedback, sa.Feedback, sa.Timeouts)
				}
			}
		})
	}
}

// TestRemoteSessionAffinity: a session's first turn decided on A and
// applied on B sends its second turn, entering through B, to the same
// worker as often as when both turns enter through one engine: through the
// approximate index for kv, through the prefix state's pin for kvbandit and
// thompson (turns without token ids, so that only the session can keep
// them together). B's prefix state must equal A's after each first turn.
func TestRemoteSessionAffinity(t *testing.T) {
	for _, name := range []string{"kv", "kvbandit", "thompson"} {
		t.Run(name, func(t *testing.T) {
			clk := virtualClock()
			eps := fleet(4)
			a := newReplica(t, name, 1, clk, engine.Options{}, eps...)
			b := newReplica(t, name, 2, clk, engine.Options{}, eps...)
			one := newReplica(t, name, 3, clk, engine.Options{}, eps...)
			sessions := 40
			if name == "thompson" {
				sessions = 200
			}
			turn := func(s, n int) *routing.Request {
				r := &routing.Request{Model: "m", TokenCount: 512 + 64*n}
				if name == "kv" {
					r = req(tokens(256+64*n, uint32(1+s*100_000)))
				}
				r.Tenant = "t"
				r.Hints = routing.Hints{PrefixID: fmt.Sprintf("session-%d", s), TotalRequests: 5, OSL: routing.LevelMedium, IAT: routing.LevelLow}
				return r
			}
			o := routing.Outcome{Kind: routing.OutcomeSuccess, Status: 200, TTFT: 30 * time.Millisecond, Latency: 200 * time.Millisecond, PromptTokens: 512, CompletionTokens: 40}
			pick := func(r replica, rq *routing.Request) *routing.Decision {
				t.Helper()
				d, err := r.e.Pick(t.Context(), rq)
				if err != nil {
					t.Fatal(err)
				}
				return d
			}
			viaOne, viaTwo := 0, 0
			for s := range sessions {
				// Through one engine.
				d1 := pick(one, turn(s, 0))
				d1.Done(o)
				clk.Step(100 * time.Millisecond)
				d2 := pick(one, turn(s, 1))
				d2.Done(o)
				if d2.Endpoint == d1.Endpoint {
					viaOne++
				}
				// Turn 1 through A, turn 2 through B.
				d1 = pick(a, turn(s, 0))
				rd := mustStart(t, b.e, d1.Share())
				d1.Done(o)
				rd.End()
				if ro, ok := d1.ShareOutcome(o); ok {
					if err := b.e.LearnRemote(ro); err != nil {
						t.Fatal(err)
					}
				}
				if name != "kv" {
					key := prefixstate.NewKey("t", fmt.Sprintf("session-%d", s))
					ra, pa, oka := a.store.Arrive(key, 5, false)
					rb, pb, okb := b.store.Arrive(key, 5, false)
					if !oka || !okb || ra != rb || pa.Endpoint != pb.Endpoint || pa.DPRank != pb.DPRank || pb.Endpoint != d1.Endpoint {
						t.Fatalf("session %d: prefix state on A (%v %d %+v), on B (%v %d %+v)", s, oka, ra, pa, okb, rb, pb)
					}
				}
				clk.Step(100 * time.Millisecond)
				d2 = pick(b, turn(s, 1))
				d2.Done(o)
				if d2.Endpoint == d1.Endpoint {
					viaTwo++
				}
				clk.Step(time.Second)
			}
			t.Logf("second turns on the first turn's worker: %d of %d through one engine, %d through two", viaOne, sessions, viaTwo)
			// kv and kvbandit keep every session. Thompson samples from a
			// softmax and strays as often through one engine as through
			// two; without the shared pin a quarter of the second turns
			// would stay by chance.
			if name == "thompson" {
				if viaTwo < viaOne-sessions/10 || viaTwo < sessions*2/5 {
					t.Fatalf("%d of %d second turns stayed through two engines, %d through one", viaTwo, sessions, viaOne)
				}
			} else if viaOne != sessions || viaTwo != sessions {
				t.Fatalf("second turns that stayed: %d through one engine, %d through two, of %d", viaOne, viaTwo, sessions)
			}
		})
	}
}

// TestDecisionShare: Share carries what the peer needs and leaves out
// over-long strings; ShareOutcome withholds outcomes served outside the set.
func TestDecisionShare(t *testing.T) {
	clk := virtualClock()
	r := newReplica(t, "kv", 1, clk, engine.Options{}, fleet(2)...)
	rq := req(tokens(100, 1))
	rq.Tenant, rq.MaxTokens = "tenant", 70
	rq.Hints = routing.Hints{PrefixID: "p", TotalRequests: 3, OSL: routing.LevelHigh, OSLTokens: 2000, IAT: routing.LevelLow}
	d, err := r.e.Pick(t.Context(), rq)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Done(routing.NoUsage(routing.OutcomeSuccess))
	s := d.Share()
	want := routing.RemoteStart{
		Endpoint: d.Endpoint, DPRank: -1, BlockSize: 16, Blocks: s.Blocks, ISL: 100, Overlap: 0, ExpectedDecodeBlocks: 125, Model: "m",
		PrefixID: "p", Tenant: "tenant", TotalRequests: 3, OSL: routing.LevelHigh, OSLTokens: 2000, IAT: routing.LevelLow, MaxTokens: 70,
	}
	if len(s.Blocks) != 6 || fmt.Sprint(s) != fmt.Sprint(want) {
		t.Fatalf("Share = %+v\nwant    %+v", s, want)
	}
	if d.Number() == 0 {
		t.Fatal("committed decision has no number")
	}
	rq.Tenant = string(make([]byte, routing.MaxRemoteString+1))
	d2, _ := r.e.Pick(t.Context(), rq)
	defer d2.Done(routing.NoUsage(routing.OutcomeSuccess))
	if s := d2.Share(); s.PrefixID != "" || s.Tenant != "" || s.TotalRequests != 0 || len(s.Blocks) != 6 {
		t.Fatalf("long tenant shared: %+v", s)
	}
	if _, ok := d.ShareOutcome(routing.Outcome{Kind: routing.OutcomeSuccess, ServedUnknown: true}); ok {
		t.Fatal("outcome served outside the set shared")
	}
	if allocs := testing.AllocsPerRun(100, func() { _ = d.Share() }); allocs != 0 {
		t.Fatalf("Share allocates %v times", allocs)
	}
}

// BenchmarkStartRemote measures applying a peer's decision and ending it:
// slot accounting, the approximate insert (queued to the index goroutine,
// as when serving) and the stale timer.
//
//	go test -run '^$' -bench StartRemote -benchmem ./routing/
func BenchmarkStartRemote(b *testing.B) {
	for _, pol := range []string{"kv", "kvbandit"} {
		for _, ntok := range []int{1024, 8192} {
			b.Run(fmt.Sprintf("policy=%s/tokens=%d", pol, ntok), func(b *testing.B) {
				r := newReplica(b, pol, 1, nil, engine.Options{}, fleet(8)...)
				var shares []routing.RemoteStart
				for i := range 64 {
					rq := req(tokens(ntok, uint32(1+i*1_000_000)))
					rq.Hints.PrefixID, rq.Hints.TotalRequests = fmt.Sprint("s", i), 4
					d, err := r.e.Pick(b.Context(), rq)
					if err != nil {
						b.Fatal(err)
					}
					shares = append(shares, d.Share())
					d.Done(routing.NoUsage(routing.OutcomeCancelled))
				}
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					rd, err := r.e.StartRemote(shares[i%len(shares)])
					if err != nil {
						b.Fatal(err)
					}
					rd.End()
					i++
				}
			})
		}
	}
}
