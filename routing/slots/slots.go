// Package slots tracks the load that in-flight requests put on each worker
// (Dynamo's slot tracker): prompt tokens still to be prefilled, and KV
// blocks held, with a block shared by several in-flight requests of one
// prefix counted once.
//
// Block identities are the router's chained block keys (routing/kvindex):
// key i encodes the whole prefix up to block i, so two requests that share
// key i share keys 0..i. The blocks that in-flight requests hold on a slot
// therefore form a tree (a trie of chains), and everything the tracker
// needs follows from longest common prefixes, found by binary search:
//
//   - a request's blocks already held on a slot: the longest common prefix
//     with any in-flight request there;
//   - distinct blocks added by a request: its length minus that prefix;
//   - distinct blocks freed when it ends: its length minus the longest common
//     prefix with the requests that remain.
//
// No per-block table is kept, so adding and freeing a request costs a few
// binary searches per in-flight request on the slot, not a map operation
// per block. Each slot has its own lock; nothing is global.
package slots

import (
	"sync"
	"sync/atomic"
)

// Slot is one (endpoint, data-parallel rank)'s in-flight load. The zero
// value is ready to use.
type Slot struct {
	prefill  atomic.Int64
	blocks   atomic.Int64
	requests atomic.Int64

	mu      sync.RWMutex
	entries []*Entry
}

// PrefillTokens is the prompt tokens of in-flight requests that have not
// produced a first token yet.
func (s *Slot) PrefillTokens() int64 { return s.prefill.Load() }

// Blocks is the number of distinct blocks held by in-flight requests.
func (s *Slot) Blocks() int64 { return s.blocks.Load() }

// Requests is the number of in-flight requests.
func (s *Slot) Requests() int64 { return s.requests.Load() }

// CommonPrefix is the length of the longest common prefix of two chains of
// block keys (see lcp).
func CommonPrefix(a, b []uint64) int { return lcp(a, b) }

// lcp is the length of the longest common prefix of two chains of keys.
// Chained keys make the "equal at i" predicate monotone (true up to the
// split, false after), so a binary search finds it.
func lcp(a, b []uint64) int {
	lo, hi := 0, min(len(a), len(b)) // a[:lo] == b[:lo]; answer <= hi
	for lo < hi {
		mid := int(uint(lo+hi+1) >> 1)
		if a[mid-1] == b[mid-1] {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return lo
}

// maxLCP returns the longest common prefix of keys with any entry except
// skip. s.mu is held.
func (s *Slot) maxLCP(keys []uint64, skip *Entry) int {
	best := 0
	if len(keys) == 0 {
		return 0
	}
	for _, e := range s.entries {
		if e == skip || len(e.keys) <= best || e.keys[0] != keys[0] {
			continue // cannot beat best, or shares no block at all
		}
		if n := lcp(keys, e.keys); n > best {
			best = n
			if best == len(keys) {
				break
			}
		}
	}
	return best
}

// ActivePrefix returns how many leading keys of the request are already
// held by in-flight requests on the slot.
func (s *Slot) ActivePrefix(keys []uint64) int {
	if len(keys) == 0 || s.requests.Load() == 0 {
		return 0
	}
	s.mu.RLock()
	n := s.maxLCP(keys, nil)
	s.mu.RUnlock()
	return n
}

// Entry is one request's hold on a slot, released by [Slot.Free].
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
func (s *Slot) Add(keys []uint64, isl, overlap, blockSize int) *Entry {
	e := &Entry{slot: s, keys: keys, prefill: int64(max(isl-overlap*blockSize, 0))}
	s.prefill.Add(e.prefill)
	s.mu.Lock()
	added := len(keys) - s.maxLCP(keys, nil)
	s.entries = append(s.entries, e)
	s.requests.Add(1)
	s.blocks.Add(int64(added))
	s.mu.Unlock()
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
func (e *Entry) Free() {
	if e == nil || !e.freed.CompareAndSwap(false, true) {
		return
	}
	e.Prefilled()
	s := e.slot
	s.mu.Lock()
	removed := len(e.keys) - s.maxLCP(e.keys, e)
	for i, x := range s.entries {
		if x == e {
			last := len(s.entries) - 1
			s.entries[i] = s.entries[last]
			s.entries[last] = nil
			s.entries = s.entries[:last]
			break
		}
	}
	s.requests.Add(-1)
	s.blocks.Add(-int64(removed))
	s.mu.Unlock()
}
