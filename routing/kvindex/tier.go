package kvindex

import (
	"fmt"
)

// Medium is the storage tier a KV event speaks of. The zero value is the
// GPU (device) cache, the one [Index.Overlaps] scores; the lower tiers are
// kept apart, per worker, and scored by [Index.TierOverlap].
type Medium uint8

// Media, best first.
const (
	MediumGPU Medium = iota
	// MediumCPU is host memory: vLLM's OffloadingConnector ("CPU"), SGLang
	// HiCache and Dynamo KVBM's G2 ("CPU_TIER1").
	MediumCPU
	// MediumDisk is local or remote storage: Dynamo KVBM's G3 and SGLang
	// HiCache's L3 ("CPU_TIER2"), "DISK".
	MediumDisk
	numMedia
)

func (m Medium) String() string {
	switch m {
	case MediumGPU:
		return "gpu"
	case MediumCPU:
		return "cpu"
	case MediumDisk:
		return "disk"
	}
	return fmt.Sprintf("Medium(%d)", uint8(m))
}

// maxTierFactor bounds the GPU blocks one lower-tier block may cover: vLLM's
// offloaded block size is a small multiple of the GPU block size.
const maxTierFactor = 1 << 10

// tierSpace is one worker's blocks of one lower medium and one block size.
// Keys are GPU-block keys of that block size: a lower-tier block covering
// factor GPU blocks is recorded under the key of its last GPU block (vLLM
// names an offloaded block by the hash of its last GPU block).
type tierSpace struct {
	engine map[uint64]uint64 // engine hash → key
	held   map[uint64]int32  // key → engine hashes naming it
	factor int               // GPU blocks per lower-tier block, >= 1
}

// tierState is a worker's lower-tier view. Writers hold worker.mu and
// tmu; readers (TierOverlap, TierSizes) hold tmu's read lock.
type tierState struct {
	spaces [numMedia]map[int]*tierSpace // index 0 (GPU) unused
	hashes [numMedia]int                // engine hashes per medium, <= maxEventEntries
}

// applyLower applies a Stored or Removed event of a lower medium. The
// caller holds wk.mu.
func (ix *Index) applyLower(wk *worker, ev *Event) error {
	switch ev.Kind {
	case Stored:
		return ix.applyLowerStored(wk, ev)
	case Removed:
		return ix.applyLowerRemoved(wk, ev)
	}
	ix.rejected.Add(1)
	return fmt.Errorf("%w: kind %v on medium %v", ErrInvalidEvent, ev.Kind, ev.Medium)
}

// resolved is one lower-tier block ready to record.
type resolved struct {
	engine, key uint64
	bs, factor  int
}

func (ix *Index) applyLowerStored(wk *worker, ev *Event) error {
	if err := checkDistinct(ev); err != nil {
		ix.rejected.Add(1)
		return err
	}
	var blocks []resolved
	unknown := 0
	if len(ev.Blocks) > 0 && len(ev.Blocks[0].Tokens) > 0 {
		// A publisher that sends the tokens (SGLang HiCache, Dynamo
		// KVBM): keys are computed as for the GPU.
		if err := ix.checkBlockSizes(ev); err != nil {
			return err
		}
		var key uint64
		if ev.HasParent {
			var ok bool
			if key, ok = ix.lowerParent(wk, ev); !ok {
				ix.unknownParent.Add(1)
				return fmt.Errorf("%w: worker %s rank %d, %v parent %d, block size %d",
					ErrUnknownParent, wk.endpoint, wk.rank, ev.Medium, ev.Parent, ev.BlockSize)
			}
		}
		seed := Seed(ev.LoRA, ev.Namespace)
		chained := ev.HasParent
		blocks = make([]resolved, len(ev.Blocks))
		for i, b := range ev.Blocks {
			local := hashTokens(b.Tokens, seed)
			if chained {
				key = ChainHash(key, local)
			} else {
				key, chained = local, true
			}
			blocks[i] = resolved{engine: b.EngineHash, key: key, bs: ev.BlockSize, factor: 1}
		}
	} else {
		// Location only (vLLM's OffloadingConnector sends no tokens and no
		// parent): the engine hash names a block the GPU held, so its key
		// is found in the worker's GPU engine maps. The event's block size
		// (0 in newer vLLM) may be a multiple of the GPU's.
		blocks = make([]resolved, 0, len(ev.Blocks))
		for _, b := range ev.Blocks {
			r, ok := resolveLower(wk, b.EngineHash, ev.BlockSize)
			if !ok {
				unknown++
				continue
			}
			blocks = append(blocks, r)
		}
	}
	ts := &wk.tiers
	m := ev.Medium
	wk.tmu.Lock()
	defer wk.tmu.Unlock()
	for i, r := range blocks {
		sp := ts.spaces[m][r.bs]
		if sp == nil {
			if len(ts.spaces[m]) >= WorkerBlockSizes {
				ix.blockSizes.Add(1)
				return fmt.Errorf("%w: worker %s rank %d already uses %d block sizes on %v, %d would be one more",
					ErrTierFull, wk.endpoint, wk.rank, len(ts.spaces[m]), m, r.bs)
			}
			sp = &tierSpace{engine: make(map[uint64]uint64), held: make(map[uint64]int32), factor: r.factor}
			if ts.spaces[m] == nil {
				ts.spaces[m] = make(map[int]*tierSpace, 1)
			}
			ts.spaces[m][r.bs] = sp
		}
		old, had := sp.engine[r.engine]
		if !had && ts.hashes[m] >= ix.maxEventEntries {
			ix.overCapacity.Add(1)
			return fmt.Errorf("%w: worker %s rank %d holds %d %v blocks; %d of the event's %d blocks applied",
				ErrTierFull, wk.endpoint, wk.rank, ts.hashes[m], m, i, len(blocks))
		}
		sp.factor = r.factor
		ix.storeTier(wk, sp, m, r.engine, r.key, old, had)
	}
	if unknown > 0 {
		ix.unknownRemoved.Add(uint64(unknown))
		return fmt.Errorf("%w: %d of %d %v blocks of worker %s rank %d name no block the GPU held",
			ErrUnknownBlock, unknown, len(ev.Blocks), m, wk.endpoint, wk.rank)
	}
	return nil
}

// lowerParent finds the key of a lower-tier event's parent: a block of the
// same medium, else one the GPU holds. The caller holds wk.mu.
func (ix *Index) lowerParent(wk *worker, ev *Event) (uint64, bool) {
	if sp := wk.tiers.spaces[ev.Medium][ev.BlockSize]; sp != nil {
		if k, ok := sp.engine[ev.Parent]; ok {
			return k, true
		}
	}
	k, ok := wk.engine[ev.BlockSize][ev.Parent]
	return k, ok
}

// resolveLower finds the GPU key of engine hash h for a location-only
// event whose block size is eventBS. The caller holds wk.mu.
func resolveLower(wk *worker, h uint64, eventBS int) (resolved, bool) {
	for bs, m := range wk.engine {
		k, ok := m[h]
		if !ok {
			continue
		}
		f := 1
		if eventBS > bs && eventBS%bs == 0 && eventBS/bs <= maxTierFactor {
			f = eventBS / bs
		}
		return resolved{engine: h, key: k, bs: bs, factor: f}, true
	}
	return resolved{}, false
}

func (sp *tierSpace) unhold(k uint64) {
	if n := sp.held[k]; n > 1 {
		sp.held[k] = n - 1
	} else {
		delete(sp.held, k)
	}
}

func (ix *Index) applyLowerRemoved(wk *worker, ev *Event) error {
	m := ev.Medium
	ts := &wk.tiers
	unknown := 0
	wk.tmu.Lock()
	for _, h := range ev.RemovedHashes {
		found := false
		for bs, sp := range ts.spaces[m] {
			k, ok := sp.engine[h]
			if !ok {
				continue
			}
			found = true
			delete(sp.engine, h)
			sp.unhold(k)
			ts.hashes[m]--
			ix.tierEntries[m].Add(-1)
			wk.tierSize[m].Add(-1)
			if len(sp.engine) == 0 {
				delete(ts.spaces[m], bs) // Go maps never shrink
			}
			break
		}
		if !found {
			unknown++
		}
	}
	wk.tmu.Unlock()
	if unknown > 0 {
		ix.unknownRemoved.Add(uint64(unknown))
		return fmt.Errorf("%w: %d of %d removed %v hashes of worker %s rank %d",
			ErrUnknownBlock, unknown, len(ev.RemovedHashes), m, wk.endpoint, wk.rank)
	}
	return nil
}

// clearTiers drops wk's lower-tier blocks. The caller holds wk.mu.
func (ix *Index) clearTiers(wk *worker) {
	wk.tmu.Lock()
	for m := MediumCPU; m < numMedia; m++ {
		ix.tierEntries[m].Add(-int64(wk.tiers.hashes[m]))
		wk.tierSize[m].Store(0)
		wk.tiers.spaces[m] = nil
		wk.tiers.hashes[m] = 0
	}
	wk.tmu.Unlock()
}

// TierOverlap returns how many of the request's blocks after its first gpu
// (the worker's GPU overlap from [Index.Overlaps]) worker w holds in host
// memory (cpu) and on disk (disk): the run of keys[gpu:] each held in some
// lower tier, each counted at its best one (CPU before disk), stopping at
// the first block held in neither. A lower-tier block covering several GPU
// blocks counts only when the request has all of them. Blocks the GPU holds
// past its first gap are not looked for: a publisher that offloads keeps a
// copy of what it evicts, so they are in a lower tier too.
//
// It returns 0, 0 without locking when w holds no lower-tier block; else it
// takes w's tier read lock, which Apply holds only while it updates the
// lower tiers' maps.
func (ix *Index) TierOverlap(w WorkerID, blockSize int, keys []uint64, gpu int) (cpu, disk int) {
	wk := ix.worker(w)
	if wk == nil || gpu >= len(keys) || gpu < 0 {
		return 0, 0
	}
	if wk.tierSize[MediumCPU].Load() == 0 && wk.tierSize[MediumDisk].Load() == 0 {
		return 0, 0
	}
	wk.tmu.RLock()
	defer wk.tmu.RUnlock()
	c, d := wk.tiers.spaces[MediumCPU][blockSize], wk.tiers.spaces[MediumDisk][blockSize]
	if c == nil && d == nil {
		return 0, 0
	}
	for j := gpu; j < len(keys); j++ {
		switch {
		case c.holds(keys, j):
			cpu++
		case d.holds(keys, j):
			disk++
		default:
			return cpu, disk
		}
	}
	return cpu, disk
}

// holds reports whether sp holds the request's block j: the lower-tier block
// covering it (the one ending at the next multiple of factor) is held.
func (sp *tierSpace) holds(keys []uint64, j int) bool {
	if sp == nil {
		return false
	}
	end := j
	if f := sp.factor; f > 1 {
		end = (j/f+1)*f - 1
		if end >= len(keys) {
			return false
		}
	}
	_, ok := sp.held[keys[end]]
	return ok
}

// TierSizes returns the engine blocks w holds in host memory and on disk;
// 0, 0 for an unknown or removed worker. It does not lock.
func (ix *Index) TierSizes(w WorkerID) (cpu, disk int) {
	if wk := ix.worker(w); wk != nil {
		return int(wk.tierSize[MediumCPU].Load()), int(wk.tierSize[MediumDisk].Load())
	}
	return 0, 0
}

// storeTier maps the engine hash to key in sp, worker wk's space on medium
// m, where it was mapped to old (had) or not: a new entry counts in the
// worker's and the index's tier sizes, a replaced key is released. Stored
// events and the warm start's import (export.go) both store this way;
// wk.tmu is held.
func (ix *Index) storeTier(wk *worker, sp *tierSpace, m Medium, hash, key, old uint64, had bool) {
	if had {
		if old == key {
			return
		}
		sp.unhold(old)
	} else {
		wk.tiers.hashes[m]++
		ix.tierEntries[m].Add(1)
		wk.tierSize[m].Add(1)
	}
	sp.engine[hash] = key
	sp.held[key]++
}
