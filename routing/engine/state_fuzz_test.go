package engine_test

import (
	"fmt"
	"log/slog"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// FuzzImportState: whatever bytes a peer sends as a state chunk, decoding
// and importing them into an engine (its index for every endpoint, the
// kvbandit and thompson policies' learning and the sessions) never
// panics, keeps each worker within the index's cap, refuses out-of-range
// values without applying them, and leaves an engine that still routes.
// Seeds: valid chunks here, hostile ones in testdata/fuzz/FuzzImportState.
func FuzzImportState(f *testing.F) {
	var s warmstate.Snapshot
	for e, ep := range []string{"10.0.0.1:8000", "10.0.0.2:8000"} {
		s.Streams = append(s.Streams, warmstate.Stream{Endpoint: ep, Started: true, Trusted: true, Seq: 7})
		run := warmstate.Blocks{Endpoint: ep, BlockSize: 16, Factor: 1}
		for i := range 20 {
			run.Blocks = append(run.Blocks, warmstate.Block{Hash: uint64(e<<32 | i), Key: uint64(i) * 0x9e3779b97f4a7c15})
		}
		s.Blocks = append(s.Blocks, run)
		s.Sessions = append(s.Sessions, warmstate.Session{PrefixID: fmt.Sprintf("s-%d", e), Total: 4, Pinned: true, Endpoint: ep, Rank: -1, IATFactor: 1})
	}
	s.Latency = &warmstate.Latency{Observations: 9, TTFT: warmstate.Fit{S: make([]float64, 25), XY: make([]float64, 5)},
		Decode: warmstate.Fit{S: make([]float64, 4), XY: make([]float64, 2)}}
	s.Speeds = []warmstate.Speed{{Endpoint: "10.0.0.1:8000", Rank: -1, Mean: 0.2, Precision: 40, Observations: 9}, {Endpoint: "10.0.0.1:8000", Rank: -1, Mean: 99, Precision: -1}}
	arm := warmstate.Arm{Endpoint: "10.0.0.2:8000", Rank: -1, Updates: 3}
	for i := range warmstate.ArmDim {
		arm.A[i*warmstate.ArmDim+i] = 1
	}
	s.Arms = []warmstate.Arm{arm}
	s.Betas = []warmstate.Beta{{Endpoint: "10.0.0.2:8000", Alpha: 2, Beta: 1, Rewards: 1, LastReward: 1}}
	s.Blocks = append(s.Blocks, warmstate.Blocks{Endpoint: "10.0.0.1:8000", Medium: warmstate.MediumCPU, BlockSize: 32, Factor: 2, Blocks: []warmstate.Block{{Hash: 1, Key: 2}}},
		warmstate.Blocks{Endpoint: "10.0.0.9:8000", BlockSize: 16, Factor: 1, Blocks: []warmstate.Block{{Hash: 1, Key: 2}}})
	for _, snap := range []warmstate.Snapshot{s, {}} {
		b, err := wire.Append(nil, &wire.Message{Kind: wire.KindStateChunk, Pool: "p", Replica: "r", StateChunk: wire.StateChunk{Total: 1, State: snap}})
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	const maxBlocks = 64
	// One engine per policy for the whole run: imports pile up on it as
	// they would on a long-lived replica asked again and again.
	engines := map[string]*engine.Engine{}
	for _, name := range []string{"kvbandit", "thompson"} {
		store, err := prefixstate.New(prefixstate.Config{MaxEntries: 16}, nil)
		if err != nil {
			f.Fatal(err)
		}
		p, err := policy.Builtin().New(name, policy.Deps{Rand: routing.NewRand(1), Prefixes: store, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			f.Fatal(err)
		}
		e := engine.Must(p, engine.Options{SyncIndex: true, Index: kvindex.Options{MaxEventEntries: maxBlocks}}, engine.Deps{Rand: routing.NewRand(1), Logger: slog.New(slog.DiscardHandler)})
		if err := e.Update(routing.EndpointSet{Source: "fuzz", Endpoints: fuzzFleet}); err != nil {
			f.Fatal(err)
		}
		f.Cleanup(func() {
			e.Close()
			if c, ok := p.(interface{ Close() error }); ok {
				_ = c.Close()
			}
			store.Close()
		})
		engines[name] = e
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := wire.Decode(b)
		if err != nil || m.Kind != wire.KindStateChunk {
			return
		}
		snap := &m.StateChunk.State
		for name, e := range engines {
			for _, ep := range fuzzFleet {
				_ = e.ImportKV(ep.Key, snap.RunsOf(string(ep.Key)))
			}
			e.ImportState(snap)
			for _, st := range e.Endpoints() {
				if n := e.TierBlocks(st); n.GPU > maxBlocks || n.CPU > maxBlocks || n.Disk > maxBlocks {
					t.Fatalf("%s: %s holds %+v blocks, cap %d", name, st.Key, n, maxBlocks)
				}
			}
			if _, err := e.Score(t.Context(), &routing.Request{Model: "m", Tokens: make([]uint32, 64), TokenCount: 64, Hints: routing.Hints{PrefixID: "s-1"}}); err != nil {
				t.Fatalf("%s: the engine no longer routes: %v", name, err)
			}
		}
	})
}

var fuzzFleet = []routing.Endpoint{{Key: "10.0.0.1:8000"}, {Key: "10.0.0.2:8000", DataParallelSize: 2}, {Key: "10.0.0.3:8000"}}
