package kvindex

import (
	"fmt"

	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file holds the warm start's side of the index (issue 22): a
// worker's event-fed entries exported for a peer replica that starts, and
// imported from one.

// ExportWorker returns w's event-fed entries, one run per medium and block
// size: each engine hash with its key, the maps later events name parents
// and removals by. Approximate entries are not exported. It takes w's
// event lock, so it sees the worker between two events; the caller
// exports between the same two messages the stream's sequence number (see
// kvevents.Sub.Export). At most maxBlocks blocks are exported (0: no
// bound); complete is false when some were left out. Endpoint and Rank of
// the runs are left for the caller to fill in. An unknown or removed
// worker has none.
func (ix *Index) ExportWorker(w WorkerID, maxBlocks int) (runs []warmstate.Blocks, complete bool) {
	wk := ix.worker(w)
	if wk == nil {
		return nil, true
	}
	wk.mu.Lock()
	defer wk.mu.Unlock()
	if wk.removed.Load() {
		return nil, true
	}
	left := maxBlocks
	if left <= 0 {
		left = int(^uint(0) >> 1)
	}
	complete = true
	take := func(medium uint8, bs, factor int, m map[uint64]uint64) {
		if len(m) == 0 {
			return
		}
		n := min(len(m), left)
		if n < len(m) {
			complete = false
		}
		if n == 0 {
			return
		}
		run := warmstate.Blocks{Medium: medium, BlockSize: uint32(bs), Factor: uint32(factor), Blocks: make([]warmstate.Block, 0, n)}
		for h, k := range m {
			if len(run.Blocks) == n {
				break
			}
			run.Blocks = append(run.Blocks, warmstate.Block{Hash: h, Key: k})
		}
		left -= n
		runs = append(runs, run)
	}
	for bs, m := range wk.engine {
		take(warmstate.MediumGPU, bs, 1, m)
	}
	wk.tmu.RLock()
	defer wk.tmu.RUnlock()
	for med := MediumCPU; med < numMedia; med++ {
		for bs, sp := range wk.tiers.spaces[med] {
			take(uint8(med), bs, sp.factor, sp.engine)
		}
	}
	return runs, complete
}

// ImportWorker replaces w's entries (event-fed, approximate and lower
// tiers alike, as a Cleared event does) with runs, a peer's export of the
// same worker. The runs come from the network and are checked as events
// are: a block size out of (0, warmstate.MaxBlockSize], a medium or
// factor out of range rejects the whole import with ErrInvalidEvent (and
// w is left cleared); more block sizes than WorkerBlockSizes (per medium)
// or MaxBlockSizes in the index give ErrTooManyBlockSizes, and more than
// MaxEventEntries blocks ErrWorkerFull, after the blocks before the first
// that did not fit were imported: the caller must then not trust the
// view. On a lower tier both are ErrTierFull, as for events: the GPU view
// stays whole. An engine hash that repeats keeps its last key.
// Like Apply, it must not run concurrently with Apply for w (the caller
// holds w's event stream, kvevents.Sub.Resume).
func (ix *Index) ImportWorker(w WorkerID, runs []warmstate.Blocks) error {
	wk := ix.worker(w)
	if wk == nil {
		return fmt.Errorf("%w: %d", ErrUnknownWorker, w)
	}
	wk.mu.Lock()
	defer wk.mu.Unlock()
	if wk.removed.Load() {
		return fmt.Errorf("%w: %d (endpoint %s removed)", ErrUnknownWorker, w, wk.endpoint)
	}
	ix.clear(wk)
	for i := range runs {
		if err := checkRun(&runs[i]); err != nil {
			ix.rejected.Add(1)
			ix.clear(wk)
			return fmt.Errorf("%w: worker %s rank %d, run %d: %w", ErrInvalidEvent, wk.endpoint, wk.rank, i, err)
		}
	}
	// Every run is imported as far as it fits; the GPU's first error wins
	// over a lower tier's, which leaves the GPU view whole.
	var gpuErr, tierErr error
	for i := range runs {
		r := &runs[i]
		if r.Medium == warmstate.MediumGPU {
			if err := ix.importGPU(wk, r); err != nil && gpuErr == nil {
				gpuErr = err
			}
		} else if err := ix.importLower(wk, r); err != nil && tierErr == nil {
			tierErr = err
		}
	}
	if gpuErr != nil {
		return gpuErr
	}
	return tierErr
}

func checkRun(r *warmstate.Blocks) error {
	switch {
	case r.BlockSize == 0 || r.BlockSize > warmstate.MaxBlockSize:
		return fmt.Errorf("block size %d", r.BlockSize)
	case Medium(r.Medium) >= numMedia:
		return fmt.Errorf("medium %d", r.Medium)
	case r.Factor == 0 || r.Factor > maxTierFactor || (r.Medium == warmstate.MediumGPU && r.Factor != 1):
		return fmt.Errorf("factor %d on medium %d", r.Factor, r.Medium)
	}
	return nil
}

// importGPU adds a GPU run to wk (wk.mu held).
func (ix *Index) importGPU(wk *worker, r *warmstate.Blocks) error {
	bs := int(r.BlockSize)
	m := wk.engine[bs]
	if m == nil {
		if len(r.Blocks) == 0 {
			return nil
		}
		if err := ix.newEngineMap(wk, bs); err != nil {
			return err
		}
		m = make(map[uint64]uint64, min(len(r.Blocks), ix.maxEventEntries-wk.hashes))
		if wk.engine == nil {
			wk.engine = make(map[int]map[uint64]uint64)
		}
		wk.engine[bs] = m
	}
	sp := ix.space(bs) // alive: m holds a reference
	keys := make([]uint64, 0, len(r.Blocks))
	var err error
	for i, b := range r.Blocks {
		old, held := m[b.Hash]
		if !held && wk.hashes >= ix.maxEventEntries {
			ix.overCapacity.Add(1)
			err = fmt.Errorf("%w: worker %s rank %d holds %d blocks; %d of a run's %d imported",
				ErrWorkerFull, wk.endpoint, wk.rank, wk.hashes, i, len(r.Blocks))
			break
		}
		switch {
		case !held:
			wk.hashes++
		case old == b.Key:
			continue
		default:
			// The hash moves to other content: its old key may still
			// wait in keys; store what waits before dropping it.
			ix.storeBatch(sp, wk, keys)
			keys = keys[:0]
			ix.unhold(sp, wk, old, keepNone)
		}
		m[b.Hash] = b.Key
		keys = append(keys, b.Key)
	}
	ix.storeBatch(sp, wk, keys)
	return err
}

// storeBatch makes wk hold every key of keys as an event-fed entry, as
// store does key by key, taking each shard's lock once.
func (ix *Index) storeBatch(sp *space, wk *worker, keys []uint64) {
	if len(keys) == 0 {
		return
	}
	type located struct {
		k, h  uint64
		shard int
	}
	loc := make([]located, len(keys))
	var count [numShards]int
	for i, k := range keys {
		h := mix(k ^ sp.seed)
		s := int(h >> (64 - shardBits))
		loc[i] = located{k, h, s}
		count[s]++
	}
	// Counting sort by shard.
	var start [numShards + 1]int
	for s := range numShards {
		start[s+1] = start[s] + count[s]
	}
	sorted := make([]located, len(loc))
	next := start
	for _, l := range loc {
		sorted[next[l.shard]] = l
		next[l.shard]++
	}
	var added, fed int64
	for s := range numShards {
		if start[s] == start[s+1] {
			continue
		}
		sh := &sp.shards[s]
		sh.lock()
		for _, l := range sorted[start[s]:start[s+1]] {
			a, old := sh.put(l.k, l.h, wk.id, eventStamp)
			switch {
			case a:
				added++
			case old != 0: // an approximate entry becomes event-fed
				fed++
			}
		}
		// The counters move under the lock, as store's do, so that they
		// never go negative.
		ix.entries.Add(added)
		wk.size.Add(added)
		ix.approxEntries.Add(-fed)
		wk.approx.Add(-fed)
		added, fed = 0, 0
		sh.unlock()
	}
}

// importLower adds a lower-tier run to wk (wk.mu held).
func (ix *Index) importLower(wk *worker, r *warmstate.Blocks) error {
	med, bs := Medium(r.Medium), int(r.BlockSize)
	ts := &wk.tiers
	wk.tmu.Lock()
	defer wk.tmu.Unlock()
	sp := ts.spaces[med][bs]
	if sp == nil {
		if len(r.Blocks) == 0 {
			return nil
		}
		if len(ts.spaces[med]) >= WorkerBlockSizes {
			ix.blockSizes.Add(1)
			return fmt.Errorf("%w: worker %s rank %d already uses %d block sizes on %v, %d would be one more",
				ErrTierFull, wk.endpoint, wk.rank, len(ts.spaces[med]), med, bs)
		}
		sp = &tierSpace{engine: make(map[uint64]uint64), held: make(map[uint64]int32)}
		if ts.spaces[med] == nil {
			ts.spaces[med] = make(map[int]*tierSpace, 1)
		}
		ts.spaces[med][bs] = sp
	}
	sp.factor = int(r.Factor)
	for i, b := range r.Blocks {
		old, had := sp.engine[b.Hash]
		if !had && ts.hashes[med] >= ix.maxEventEntries {
			ix.overCapacity.Add(1)
			return fmt.Errorf("%w: worker %s rank %d holds %d %v blocks; %d of a run's %d imported",
				ErrTierFull, wk.endpoint, wk.rank, ts.hashes[med], med, i, len(r.Blocks))
		}
		ix.storeTier(wk, sp, med, b.Hash, b.Key, old, had)
	}
	return nil
}
