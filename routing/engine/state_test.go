package engine_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// stateEngine is an engine with the named policy over a prefix store, on
// two endpoints, e1 with two data-parallel ranks.
func stateEngine(t *testing.T, name string) *engine.Engine {
	t.Helper()
	store, err := prefixstate.New(prefixstate.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	rnd := routing.NewRand(7)
	p, err := policy.Builtin().New(name, policy.Deps{Rand: rnd, Prefixes: store})
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := p.(interface{ Close() error }); ok {
		t.Cleanup(func() { _ = c.Close() })
	}
	e := engine.Must(p, engine.Options{SyncIndex: true}, engine.Deps{Rand: rnd})
	t.Cleanup(e.Close)
	set := routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{
		{Key: "10.0.0.1:8000", BlockSize: 4, DataParallelSize: 2}, {Key: "10.0.0.2:8000", BlockSize: 4},
	}}
	if err := e.Update(set); err != nil {
		t.Fatal(err)
	}
	return e
}

func seqTokens(seed, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(seed*10000 + i + 1)
	}
	return out
}

// stored is a Stored event of the blocks of toks (block size 4), engine
// hashes from salt.
func stored(toks []uint32, salt uint64) kvindex.Event {
	ev := kvindex.Event{Kind: kvindex.Stored, BlockSize: 4}
	for b := 0; b+4 <= len(toks); b += 4 {
		ev.Blocks = append(ev.Blocks, kvindex.StoredBlock{EngineHash: salt + uint64(b/4), Tokens: toks[b : b+4]})
	}
	return ev
}

// TestStateHandover: an engine's KV index (per rank) and its policy's
// learning and sessions, exported and imported into a fresh engine, make
// the fresh one score cache overlap and session affinity as the first
// does, for both learning policies.
func TestStateHandover(t *testing.T) {
	for _, name := range []string{"kvbandit", "thompson"} {
		t.Run(name, func(t *testing.T) {
			src, dst := stateEngine(t, name), stateEngine(t, name)
			cached := seqTokens(1, 64)
			if err := src.ApplyKVEvent("10.0.0.1:8000", 1, stored(cached, 100)); err != nil {
				t.Fatal(err)
			}
			src.TrustKVEvents("10.0.0.1:8000", true)
			src.TrustKVEvents("10.0.0.2:8000", true)
			// Sessions and outcomes on the source.
			for i := range 6 {
				d, err := src.Pick(t.Context(), &routing.Request{Model: "m", Tokens: seqTokens(2, 40), TokenCount: 40,
					Hints: routing.Hints{PrefixID: "s1", TotalRequests: 20}})
				if err != nil {
					t.Fatal(err)
				}
				d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: time.Duration(20+i) * time.Millisecond,
					Latency: 200 * time.Millisecond, PromptTokens: 40, CompletionTokens: 10, CachedTokens: -1})
			}
			var snap warmstate.Snapshot
			src.ExportState(&snap)
			for _, ep := range []routing.EndpointKey{"10.0.0.1:8000", "10.0.0.2:8000"} {
				runs, complete := src.ExportKV(ep, 0)
				if !complete {
					t.Fatalf("%s: export incomplete", ep)
				}
				snap.Blocks = append(snap.Blocks, runs...)
				if err := dst.ImportKV(ep, snap.RunsOf(string(ep))); err != nil {
					t.Fatal(err)
				}
				dst.TrustKVEvents(ep, true)
			}
			got := dst.ImportState(&snap)
			if got.Sessions != 1 || got.Malformed != 0 || (name == "kvbandit" && (!got.Latency || got.Speeds == 0)) || (name == "thompson" && got.Arms == 0) {
				t.Fatalf("import %+v", got)
			}
			probe := func(e *engine.Engine, req *routing.Request) (routing.EndpointKey, int, int) {
				d, err := e.Score(t.Context(), req)
				if err != nil {
					t.Fatal(err)
				}
				return d.Endpoint, d.DPRank, d.Overlap
			}
			// Cache overlap: only e1 rank 1 holds the prompt, in both
			// indexes; kvbandit's choice follows it (thompson samples).
			keys := kvindex.AppendBlockKeys(nil, cached, 4, kvindex.BaseSeed)
			if a, b := holders(src, keys), holders(dst, keys); a != "10.0.0.1:8000/1:16" || b != a {
				t.Errorf("index: source %q, imported %q", a, b)
			}
			if name == "kvbandit" {
				req := &routing.Request{Model: "m", Tokens: cached, TokenCount: len(cached)}
				se, sr, so := probe(src, req)
				de, dr, do := probe(dst, req)
				if se != "10.0.0.1:8000" || sr != 1 || so != 16 || de != se || dr != sr || do != so {
					t.Errorf("overlap probe: source %s/%d (%d blocks), imported %s/%d (%d blocks)", se, sr, so, de, dr, do)
				}
			}
			// Session affinity: s1's next request sticks where it was pinned.
			sreq := &routing.Request{Model: "m", Tokens: seqTokens(2, 40), TokenCount: 40, Hints: routing.Hints{PrefixID: "s1", TotalRequests: 20}}
			d1, err := src.Score(t.Context(), sreq)
			if err != nil {
				t.Fatal(err)
			}
			d2, err := dst.Score(t.Context(), sreq)
			if err != nil {
				t.Fatal(err)
			}
			if !d1.Sticky || !d2.Sticky || d1.Endpoint != d2.Endpoint {
				t.Errorf("session probe: source %s (sticky %v), imported %s (sticky %v)", d1.Endpoint, d1.Sticky, d2.Endpoint, d2.Sticky)
			}
		})
	}
}

// holders lists who holds keys in e's index, as "endpoint/rank:blocks".
func holders(e *engine.Engine, keys []uint64) string {
	out := ""
	for _, m := range e.Index().Overlaps(4, keys, nil) {
		ep, rank, _ := e.Index().Lookup(m.Worker)
		out += fmt.Sprintf("%s/%d:%d", ep, rank, m.Blocks)
	}
	return out
}

// TestImportKVChecked: runs for another endpoint or a rank the endpoint
// lacks are refused (the others imported), an unknown endpoint is an
// error, and a policy without state imports nothing.
func TestImportKVChecked(t *testing.T) {
	e := stateEngine(t, "kvbandit")
	run := func(ep string, rank int32) warmstate.Blocks {
		return warmstate.Blocks{Endpoint: ep, Rank: rank, BlockSize: 4, Factor: 1, Blocks: []warmstate.Block{{Hash: 1, Key: 2}}}
	}
	if err := e.ImportKV("10.0.0.1:8000", []warmstate.Blocks{run("10.0.0.1:8000", 0), run("10.0.0.1:8000", 2), run("10.0.0.2:8000", 0)}); !errors.Is(err, kvindex.ErrUnknownWorker) {
		t.Fatalf("bad ranks: %v", err)
	}
	if runs, _ := e.ExportKV("10.0.0.1:8000", 0); len(runs) != 1 || runs[0].Rank != 0 {
		t.Errorf("after a partly refused import: %+v", runs)
	}
	if err := e.ImportKV("10.0.0.9:8000", nil); !errors.Is(err, kvindex.ErrUnknownWorker) {
		t.Errorf("unknown endpoint: %v", err)
	}
	rr := newEngine(t, "round_robin", engine.Options{}, ep("10.0.0.1:8000"))
	var snap warmstate.Snapshot
	rr.ExportState(&snap)
	if !snap.Empty() || rr.ImportState(&warmstate.Snapshot{Speeds: []warmstate.Speed{{Endpoint: "10.0.0.1:8000"}}}) != (warmstate.Imported{}) {
		t.Error("a policy without state exported or imported some")
	}
}
