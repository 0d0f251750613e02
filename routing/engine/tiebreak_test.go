package engine_test

import (
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/policy"
)

// kvEngine is a kv-policy engine over eps seeded with seed, the index
// applied in-line.
func kvEngine(t *testing.T, seed int64, eps ...routing.Endpoint) *engine.Engine {
	t.Helper()
	return kvEngineDeps(t, seed, engine.Deps{}, eps...)
}

// kvEngineDeps is kvEngine with deps (their Rand and Logger are set).
func kvEngineDeps(t *testing.T, seed int64, deps engine.Deps, eps ...routing.Endpoint) *engine.Engine {
	t.Helper()
	rnd := routing.NewRand(seed)
	p, err := policy.Builtin().New("kv", policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	deps.Rand, deps.Logger = rnd, quiet()
	e, err := engine.New(p, engine.Options{SyncIndex: true}, deps)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestKVTiesGoToTheLessCachedEndpoint: on an idle fleet, prompts that no
// endpoint caches cost the same everywhere, and the tie goes to the
// endpoint with the smaller indexed tree before any coin is tossed (the kv
// policy's documented tie-break). Two idle workers therefore take turns
// instead of one of them getting every request as often as a seed says so.
// Before, the engine filled in tree sizes only when some endpoint cached a
// block of the prompt, so these ties were coin flips.
func TestKVTiesGoToTheLessCachedEndpoint(t *testing.T) {
	const x, y = "10.0.0.1:8000", "10.0.0.2:8000"
	for seed := int64(1); seed <= 32; seed++ {
		e := kvEngine(t, seed, ep(x), ep(y))
		var got []routing.EndpointKey
		for i := range 6 {
			d, err := e.Pick(t.Context(), req(tokens(64, uint32(1_000_000*(i+1)))))
			if err != nil {
				t.Fatal(err)
			}
			if d.Overlap != 0 {
				t.Fatalf("seed %d: distinct prompt %d overlaps %d blocks", seed, i, d.Overlap)
			}
			got = append(got, d.Endpoint)
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
		}
		// Every second request finds the trees unequal (4 blocks against 0,
		// 8 against 4, ...): it goes to the other endpoint.
		for i := 1; i < len(got); i += 2 {
			if got[i] == got[i-1] {
				t.Fatalf("seed %d: requests %d and %d both went to %s (all: %v)", seed, i-1, i, got[i], got)
			}
		}
	}
}

// TestKVTieGoesToTheEmptyEventFedEndpoint: the same with an event-fed
// index: the endpoint whose KV events say it caches something loses an
// exact tie to the one that caches nothing.
func TestKVTieGoesToTheEmptyEventFedEndpoint(t *testing.T) {
	const x, y = "10.0.0.1:8000", "10.0.0.2:8000"
	for seed := int64(1); seed <= 32; seed++ {
		e := kvEngine(t, seed, ep(x), ep(y))
		cached := tokens(32, 7)
		for _, k := range []routing.EndpointKey{x, y} {
			e.TrustKVEvents(k, true)
		}
		ev := kvindex.Event{Kind: kvindex.Stored, BlockSize: 16, Blocks: []kvindex.StoredBlock{
			{EngineHash: 1, Tokens: cached[:16]}, {EngineHash: 2, Tokens: cached[16:]}}}
		if err := e.ApplyKVEvent(x, -1, ev); err != nil {
			t.Fatal(err)
		}
		d, err := e.Pick(t.Context(), req(tokens(64, 500_000)))
		if err != nil {
			t.Fatal(err)
		}
		if d.Endpoint != y {
			t.Fatalf("seed %d: a prompt cached nowhere went to %s, which caches 2 blocks, not to the empty %s", seed, d.Endpoint, y)
		}
		d.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
}
