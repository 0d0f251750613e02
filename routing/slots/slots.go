// Package slots tracks the load that in-flight requests put on each worker
// (Dynamo's slot tracker): prompt tokens still to be prefilled, and KV
// blocks held, with a block shared by several in-flight requests of one
// prefix counted once.
//
// Block identities are the router's chained block keys (routing/kvindex):
// a key encodes its whole prefix, so an in-flight request holding key i
// also holds keys 0..i-1, and the request blocks already active on a slot
// always form a prefix of the request's keys. [Tracker.ActivePrefix] walks
// them once for every slot at the same time.
//
// Reads and writes are safe for concurrent use. The block table is split
// into shards with their own locks; counters are atomics.
package slots

import (
	"sync"
	"sync/atomic"
)

const nShards = 64

// Slot is one (endpoint, data-parallel rank)'s live load.
type Slot struct {
	prefill  atomic.Int64
	blocks   atomic.Int64
	requests atomic.Int64
}

// PrefillTokens is the prompt tokens of in-flight requests that have not
// produced a first token yet.
func (s *Slot) PrefillTokens() int64 { return s.prefill.Load() }

// Blocks is the number of distinct blocks held by in-flight requests.
func (s *Slot) Blocks() int64 { return s.blocks.Load() }

// Requests is the number of in-flight requests.
func (s *Slot) Requests() int64 { return s.requests.Load() }

type holder struct {
	slot *Slot
	n    int32
}

type shard struct {
	mu sync.RWMutex
	m  map[uint64][]holder
}

// Tracker holds the block table shared by all slots.
type Tracker struct {
	shards [nShards]shard
}

// New returns an empty tracker.
func New() *Tracker {
	t := &Tracker{}
	for i := range t.shards {
		t.shards[i].m = map[uint64][]holder{}
	}
	return t
}

func (t *Tracker) shard(key uint64) *shard { return &t.shards[(key^key>>32)%nShards] }

// Match is one slot's active prefix length for a request.
type Match struct {
	Slot *Slot
	N    int
}

// holdersLen returns how many slots hold key.
func (t *Tracker) holdersLen(key uint64) int {
	sh := t.shard(key)
	sh.mu.RLock()
	n := len(sh.m[key])
	sh.mu.RUnlock()
	return n
}

// holders appends the slots holding key, sorted by address, to dst.
func (t *Tracker) holders(key uint64, dst []*Slot) []*Slot {
	sh := t.shard(key)
	sh.mu.RLock()
	for _, h := range sh.m[key] {
		dst = append(dst, h.slot)
	}
	sh.mu.RUnlock()
	return dst
}

// ActivePrefix appends to dst, for every slot on which an in-flight request
// holds keys[0], the number of leading keys held on that slot. Slots not
// listed hold none.
//
// Because the slots holding key i are a subset of those holding key i-1,
// the holder count never grows along keys; the walk gallops to the points
// where it shrinks, so its cost grows with the number of distinct prefix
// lengths, not with the number of keys.
func (t *Tracker) ActivePrefix(keys []uint64, dst []Match) []Match {
	dst = dst[:0]
	n := len(keys)
	if n == 0 {
		return dst
	}
	var scratch [64]*Slot
	hs := t.holders(keys[0], scratch[:0])
	for _, s := range hs {
		dst = append(dst, Match{Slot: s, N: -1})
	}
	alive := len(dst)
	lo := 0 // the alive set is the holder set of keys[lo]
	for alive > 0 {
		// First index j in (lo, n] with fewer holders than alive (n: none).
		step, hi := 1, lo+1
		for hi < n && t.holdersLen(keys[hi]) >= alive {
			lo, step = hi, step*2
			hi = lo + step
		}
		if hi > n {
			hi = n
		}
		for lo+1 < hi { // invariant: len(lo) >= alive, len(hi) < alive or hi == n
			mid := (lo + hi) / 2
			if t.holdersLen(keys[mid]) >= alive {
				lo = mid
			} else {
				hi = mid
			}
		}
		if hi == n {
			break
		}
		// Drop the alive slots that do not hold keys[hi].
		hs = t.holders(keys[hi], scratch[:0])
		alive = 0
		for k := range dst {
			if dst[k].N >= 0 {
				continue
			}
			held := false
			for _, s := range hs {
				if s == dst[k].Slot {
					held = true
					break
				}
			}
			if held {
				alive++
			} else {
				dst[k].N = hi
			}
		}
		lo = hi
	}
	for k := range dst {
		if dst[k].N < 0 {
			dst[k].N = n
		}
	}
	return dst
}

// Entry is one request's hold on a slot. It is released by [Tracker.Free].
type Entry struct {
	slot      *Slot
	keys      []uint64
	prefill   int64
	prefilled atomic.Bool
	freed     atomic.Bool
}

// Add records an in-flight request on s: its uncached prompt tokens
// (max(isl − overlap·blockSize, 0)) count as prefill load until
// [Entry.Prefilled], and its block keys are held until Free. keys is
// retained; the caller must not modify it afterwards.
func (t *Tracker) Add(s *Slot, keys []uint64, isl, overlap, blockSize int) *Entry {
	e := &Entry{slot: s, keys: keys, prefill: int64(max(isl-overlap*blockSize, 0))}
	s.requests.Add(1)
	s.prefill.Add(e.prefill)
	added := 0
	for _, k := range keys {
		sh := t.shard(k)
		sh.mu.Lock()
		hs := sh.m[k]
		found := false
		for i := range hs {
			if hs[i].slot == s {
				hs[i].n++
				found = true
				break
			}
		}
		if !found {
			sh.m[k] = append(hs, holder{slot: s, n: 1})
			added++
		}
		sh.mu.Unlock()
	}
	s.blocks.Add(int64(added))
	return e
}

// Prefilled marks the request's prefill as done (first token seen). It is
// idempotent.
func (e *Entry) Prefilled() {
	if e != nil && e.prefilled.CompareAndSwap(false, true) {
		e.slot.prefill.Add(-e.prefill)
	}
}

// Free releases the request's hold. It is idempotent and implies Prefilled.
func (t *Tracker) Free(e *Entry) {
	if e == nil || !e.freed.CompareAndSwap(false, true) {
		return
	}
	e.Prefilled()
	s := e.slot
	s.requests.Add(-1)
	removed := 0
	for _, k := range e.keys {
		sh := t.shard(k)
		sh.mu.Lock()
		hs := sh.m[k]
		for i := range hs {
			if hs[i].slot != s {
				continue
			}
			hs[i].n--
			if hs[i].n == 0 {
				removed++
				hs[i] = hs[len(hs)-1]
				hs = hs[:len(hs)-1]
				if len(hs) == 0 {
					delete(sh.m, k)
				} else {
					sh.m[k] = hs
				}
			}
			break
		}
		sh.mu.Unlock()
	}
	s.blocks.Add(-int64(removed))
}

// Len returns the number of distinct keys held by any slot.
func (t *Tracker) Len() int {
	n := 0
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.RLock()
		n += len(sh.m)
		sh.mu.RUnlock()
	}
	return n
}
