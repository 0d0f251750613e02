package weighted_test

import (
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/policy/weighted"
)

const (
	epA = routing.EndpointKey("10.0.0.1:8000")
	epB = routing.EndpointKey("10.0.0.2:8000")
	epC = routing.EndpointKey("10.0.0.3:8000")
)

// newEngine builds the weighted policy the way `kvbandit serve --policy
// weighted` does, through the registry, over three endpoints.
func newEngine(t *testing.T, opts engine.Options) *engine.Engine {
	t.Helper()
	clk := clock.NewVirtual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	rnd := routing.NewRand(5)
	p, err := policy.Builtin().New(weighted.Name, policy.Deps{Rand: rnd, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	opts.SyncIndex = true
	e := engine.Must(p, opts, engine.Deps{Rand: rnd, Clock: clk, Logger: slog.New(slog.DiscardHandler)})
	t.Cleanup(e.Close)
	set := routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: epA}, {Key: epB}, {Key: epC}}}
	if err := e.Update(set); err != nil {
		t.Fatal(err)
	}
	return e
}

func prompt(n int, base uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

func request(toks []uint32) *routing.Request {
	return &routing.Request{Tokens: toks, TokenCount: len(toks)}
}

func report(t *testing.T, e *engine.Engine, ep routing.EndpointKey, waiting, kv float64) {
	t.Helper()
	if !e.ReportLoad(ep, routing.Load{Waiting: waiting, KVUsage: kv, Known: true}, 0) {
		t.Fatalf("ReportLoad(%s) refused", ep)
	}
}

// TestEngineCacheThenLoad: with equal scraped loads the endpoint holding
// the prompt's blocks (per its KV events) wins; once it reports a long
// queue and a nearly full cache, an idle endpoint wins (3.2 vs 3.8), and
// the fallbacks follow the descending scores.
func TestEngineCacheThenLoad(t *testing.T) {
	e := newEngine(t, engine.Options{Fallbacks: 2})
	toks := prompt(64, 100) // 4 blocks of 16
	var blocks []kvindex.StoredBlock
	for i := range 4 {
		blocks = append(blocks, kvindex.StoredBlock{EngineHash: uint64(7000 + i), Tokens: toks[16*i : 16*i+16]})
	}
	e.TrustKVEvents(epB, true)
	if err := e.ApplyKVEvent(epB, -1, kvindex.Event{Kind: kvindex.Stored, BlockSize: 16, Blocks: blocks}); err != nil {
		t.Fatal(err)
	}
	for _, ep := range []routing.EndpointKey{epA, epB, epC} {
		report(t, e, ep, 2, 0.3)
	}
	d, err := e.Pick(t.Context(), request(toks))
	if err != nil {
		t.Fatal(err)
	}
	if d.Endpoint != epB || d.Overlap != 4 || d.Policy != weighted.Name {
		t.Fatalf("picked %s (overlap %d, policy %s), want %s with 4", d.Endpoint, d.Overlap, d.Policy, epB)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))

	report(t, e, epA, 0, 0.1)
	report(t, e, epB, 20, 0.9)
	report(t, e, epC, 10, 0.1)
	// Score is side-effect free and sees the same numbers as Pick.
	sd, err := e.Score(t.Context(), request(toks))
	if err != nil {
		t.Fatal(err)
	}
	want := map[routing.EndpointKey]float64{epA: 3.8, epB: 3.2, epC: 2.8}
	for _, s := range sd.Scores {
		if w := want[s.Endpoint]; s.Score < w-1e-9 || s.Score > w+1e-9 {
			t.Fatalf("score %s = %v, want %v", s.Endpoint, s.Score, w)
		}
	}
	d, err = e.Pick(t.Context(), request(toks))
	if err != nil {
		t.Fatal(err)
	}
	if d.Endpoint != epA || !slices.Equal(d.Fallbacks, []routing.EndpointKey{epB, epC}) {
		t.Fatalf("picked %s fallbacks %v, want %s then [%s %s]", d.Endpoint, d.Fallbacks, epA, epB, epC)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
}

// TestEngineWithoutScrapesSpreadsByInFlight: with no load scraped the queue
// score uses the engine's in-flight counts, so concurrent cold requests
// spread over the endpoints instead of herding.
func TestEngineWithoutScrapesSpreadsByInFlight(t *testing.T) {
	e := newEngine(t, engine.Options{})
	var open []*routing.Decision
	seen := map[routing.EndpointKey]int{}
	for i := range 6 {
		d, err := e.Pick(t.Context(), request(prompt(64, uint32(10000*(i+1)))))
		if err != nil {
			t.Fatal(err)
		}
		seen[d.Endpoint]++
		open = append(open, d)
	}
	for _, d := range open {
		d.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
	if seen[epA] != 2 || seen[epB] != 2 || seen[epC] != 2 {
		t.Fatalf("in-flight spread %v, want 2 each", seen)
	}
}
