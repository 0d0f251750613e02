package engine_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// keyedEngine is a kv-policy engine over eps whose Timings are recorded.
func keyedEngine(t *testing.T, tm *[]engine.Timings, eps ...routing.Endpoint) *engine.Engine {
	t.Helper()
	return kvEngineDeps(t, 1, engine.Deps{OnTimings: func(x engine.Timings) { *tm = append(*tm, x) }}, eps...)
}

// TestPickUsesRequestKeys: a request's Keys replace hashing when they are
// for the endpoint's block size, the request's seed and every complete block
// of its tokens (Timings.HashedBlocks is 0, and deliberately wrong keys of
// that shape change the overlap found, so they were what the index was
// asked); any mismatch is ignored and the tokens are hashed.
func TestPickUsesRequestKeys(t *testing.T) {
	toks := tokens(1000, 7) // 62 blocks and a partial one
	seed := kvindex.Seed("", "salt")
	keys := kvindex.AppendBlockKeys(nil, toks, 16, seed)
	wrong := kvindex.AppendBlockKeys(nil, tokens(1000, 8), 16, seed)
	cases := []struct {
		name        string
		keys        routing.BlockKeys
		hashed, ovl int
	}{
		{"none", routing.BlockKeys{}, 62, 40},
		{"given", routing.BlockKeys{BlockSize: 16, Seed: seed, Keys: keys}, 0, 40},
		{"given wrong", routing.BlockKeys{BlockSize: 16, Seed: seed, Keys: wrong}, 0, 0},
		{"other block size", routing.BlockKeys{BlockSize: 64, Seed: seed, Keys: wrong[:15]}, 62, 40},
		{"other seed", routing.BlockKeys{BlockSize: 16, Seed: kvindex.BaseSeed, Keys: wrong}, 62, 40},
		{"too few", routing.BlockKeys{BlockSize: 16, Seed: seed, Keys: wrong[:61]}, 62, 40},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// A fresh engine whose endpoint caches the first 40 blocks
			// (each decision inserts its keys).
			var tm []engine.Timings
			e := keyedEngine(t, &tm, ep("10.0.0.1:8000"))
			if got := e.KeyBlockSize(); got != routing.DefaultBlockSize {
				t.Fatalf("KeyBlockSize before any decision = %d, want %d", got, routing.DefaultBlockSize)
			}
			w := e.Index().Worker("10.0.0.1:8000", -1)
			if err := e.Index().InsertApprox(w, 16, keys[:40], time.Now()); err != nil {
				t.Fatal(err)
			}
			r := req(toks)
			r.CacheSalt, r.Keys = "salt", c.keys
			kept := slices.Clone(c.keys.Keys)
			d, err := e.Pick(t.Context(), r)
			if err != nil {
				t.Fatal(err)
			}
			d.Done(routing.NoUsage(routing.OutcomeCancelled))
			if len(tm) != 1 || tm[0].HashedBlocks != c.hashed || d.Overlap != c.ovl {
				t.Fatalf("timings %+v, overlap %d: want %d blocks hashed and an overlap of %d", tm, d.Overlap, c.hashed, c.ovl)
			}
			if !slices.Equal(kept, c.keys.Keys) {
				t.Fatal("the engine modified the request's keys")
			}
		})
	}
}

// TestKeyBlockSize: the engine names the block size of the endpoints it
// last hashed for, so that callers precompute keys the engine will use.
func TestKeyBlockSize(t *testing.T) {
	var tm []engine.Timings
	big := ep("10.0.0.1:8000")
	big.BlockSize = 64
	e := keyedEngine(t, &tm, big)
	d, err := e.Pick(t.Context(), req(tokens(300, 1)))
	if err != nil {
		t.Fatal(err)
	}
	d.Done(routing.NoUsage(routing.OutcomeCancelled))
	if got := e.KeyBlockSize(); got != 64 {
		t.Fatalf("KeyBlockSize = %d after a decision at 64", got)
	}
}

// BenchmarkPickKeys is BenchmarkPick's kvbandit case at 64 endpoints for
// turn N+1 of a long conversation, the prompt's keys hashed by Pick
// ("hashed") or given with the request ("given"), as the tokenizer's prefix
// cache gives them.
//
//	go test -run '^$' -bench 'PickKeys' -benchmem ./routing/
func BenchmarkPickKeys(b *testing.B) {
	for _, ntok := range []int{8192, 131072} {
		for _, given := range []bool{false, true} {
			name := map[bool]string{false: "hashed", true: "given"}[given]
			b.Run(fmt.Sprintf("tokens=%d/keys=%s", ntok, name), func(b *testing.B) {
				benchPickWith(b, "kvbandit", 64, ntok, func(r *routing.Request) {
					if given {
						r.Keys = routing.BlockKeys{BlockSize: 16, Seed: kvindex.BaseSeed, Keys: kvindex.AppendBlockKeys(nil, r.Tokens, 16, kvindex.BaseSeed)}
					}
				})
			})
		}
	}
}
