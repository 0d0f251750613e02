package engine_test

import (
	"testing"

	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// TestLowerTierOverlapReachesPolicies: a worker whose prompt blocks sit in
// host memory (vLLM offloading: a location-only CPU event naming the
// blocks' GPU hashes, then the GPU evicting them) wins over one that holds
// nothing, and the decision reports the CPU blocks beside the GPU overlap.
func TestLowerTierOverlapReachesPolicies(t *testing.T) {
	for _, name := range []string{"kv", "weighted"} {
		t.Run(name, func(t *testing.T) {
			e := engineWith(t, name, engine.Options{}, nil, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
			prompt := tokens(128, 70)
			var blocks []kvindex.StoredBlock
			var hashes []uint64
			for i := range 8 {
				blocks = append(blocks, kvindex.StoredBlock{EngineHash: uint64(500 + i), Tokens: prompt[16*i : 16*i+16]})
				hashes = append(hashes, uint64(500+i))
			}
			const holder = "10.0.0.2:8000"
			e.TrustKVEvents(holder, true)
			e.TrustKVEvents("10.0.0.1:8000", true)
			loc := kvindex.Event{Kind: kvindex.Stored, Medium: kvindex.MediumCPU}
			for _, h := range hashes {
				loc.Blocks = append(loc.Blocks, kvindex.StoredBlock{EngineHash: h})
			}
			for _, ev := range []kvindex.Event{
				{Kind: kvindex.Stored, BlockSize: 16, Blocks: blocks},
				loc,
				{Kind: kvindex.Removed, RemovedHashes: hashes[2:]},
			} {
				if err := e.ApplyKVEvent(holder, -1, ev); err != nil {
					t.Fatal(err)
				}
			}
			d, err := e.Score(t.Context(), req(prompt))
			if err != nil {
				t.Fatal(err)
			}
			if d.Endpoint != holder || d.Overlap != 2 || d.OverlapCPU != 6 || d.OverlapDisk != 0 {
				t.Fatalf("went to %s with overlap %d+%d cpu+%d disk, want %s with 2+6+0", d.Endpoint, d.Overlap, d.OverlapCPU, d.OverlapDisk, holder)
			}
		})
	}
}
