package trace

import (
	"container/list"

	"github.com/kvbandit/kvbandit/routing/sim"
)

// Bounds are upper bounds on the KV hit rate any router can reach on a
// trace, in prompt tokens served from cache / prompt tokens.
type Bounds struct {
	// Infinite: one cache that never evicts sees every request.
	Infinite float64
	// Finite: one LRU cache of CapacityBlocks blocks sees every request
	// (the whole fleet's capacity as if it were one worker).
	Finite float64
	// CapacityBlocks is the finite cache's size in blocks of BlockSize
	// tokens.
	CapacityBlocks, BlockSize int
	// PromptTokens is the trace's total prompt length.
	PromptTokens int64
}

// ComputeBounds replays reqs in arrival order against an infinite cache
// and an LRU cache of capacityBlocks blocks of blockSize tokens. Hits count
// as the simulator counts them: whole leading blocks, at most
// (prompt-1)/blockSize of them (the last prompt token is always
// computed). Blocks of a request are touched tail first, so that an
// eviction takes the end of a chain before its start, as vLLM does.
func ComputeBounds(reqs []sim.Request, blockSize, capacityBlocks int) Bounds {
	b := Bounds{CapacityBlocks: capacityBlocks, BlockSize: blockSize}
	if blockSize <= 0 {
		return b
	}
	seen := map[uint64]struct{}{}
	lru := list.New() // front: most recent
	where := map[uint64]*list.Element{}
	var infHits, finHits int64
	var keys []uint64
	for _, r := range reqs {
		n := len(r.Tokens)
		b.PromptTokens += int64(n)
		keys = blockKeys(keys[:0], r.Tokens, blockSize)
		limit := 0
		if n > 0 {
			limit = min(len(keys), (n-1)/blockSize)
		}
		inf := 0
		for inf < limit {
			if _, ok := seen[keys[inf]]; !ok {
				break
			}
			inf++
		}
		fin := 0
		for fin < limit {
			if _, ok := where[keys[fin]]; !ok {
				break
			}
			fin++
		}
		infHits += int64(inf * blockSize)
		finHits += int64(fin * blockSize)
		for _, k := range keys {
			seen[k] = struct{}{}
		}
		if capacityBlocks <= 0 {
			continue
		}
		// A request larger than the cache keeps only its leading blocks.
		for i := min(len(keys), capacityBlocks) - 1; i >= 0; i-- {
			k := keys[i]
			if e, ok := where[k]; ok {
				lru.MoveToFront(e)
				continue
			}
			if lru.Len() >= capacityBlocks {
				old := lru.Back()
				delete(where, old.Value.(uint64))
				lru.Remove(old)
			}
			where[k] = lru.PushFront(k)
		}
	}
	if b.PromptTokens > 0 {
		b.Infinite = float64(infHits) / float64(b.PromptTokens)
		b.Finite = float64(finHits) / float64(b.PromptTokens)
	}
	return b
}

// blockKeys appends the chained hashes of the full blocks of toks.
func blockKeys(dst []uint64, toks []uint32, bs int) []uint64 {
	var h uint64 = 0xcbf29ce484222325
	for i := 0; i+bs <= len(toks); i += bs {
		for _, t := range toks[i : i+bs] {
			h = (h ^ uint64(t)) * 0x100000001b3
		}
		h = splitmix64(h)
		dst = append(dst, h)
	}
	return dst
}
