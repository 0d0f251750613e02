package kvindex

import "fmt"

// EventKind says what a KV cache [Event] reports.
type EventKind uint8

// Event kinds, mirroring vLLM/SGLang's BlockStored, BlockRemoved and
// AllBlocksCleared.
const (
	Stored EventKind = iota + 1
	Removed
	Cleared
)

func (k EventKind) String() string {
	switch k {
	case Stored:
		return "stored"
	case Removed:
		return "removed"
	case Cleared:
		return "cleared"
	}
	return fmt.Sprintf("EventKind(%d)", uint8(k))
}

// StoredBlock is one block of a Stored event.
type StoredBlock struct {
	// EngineHash is the engine's id for the block. It is opaque: the index
	// only uses it to find parents and removals.
	EngineHash uint64
	// Tokens are the block's token ids; there must be exactly BlockSize.
	Tokens []uint32
}

// Event is a KV cache event of one worker, already decoded from the wire.
// The index keeps no reference to its slices.
type Event struct {
	Kind EventKind
	// BlockSize is the engine's tokens per block. Stored needs it; for
	// Removed, 0 looks the hashes up under every block size.
	BlockSize int
	// HasParent says the first block of a Stored event continues the
	// indexed block whose engine hash is Parent; otherwise it starts a
	// sequence.
	HasParent bool
	Parent    uint64
	// Blocks are the stored blocks, each the child of the one before.
	Blocks []StoredBlock
	// RemovedHashes are the engine hashes of a Removed event.
	RemovedHashes []uint64
	// LoRA and Namespace salt the block keys (see [Seed]).
	LoRA, Namespace string
	// Medium is the tier a Stored or Removed event speaks of; the zero
	// value is the GPU. Lower-tier events feed [Index.TierOverlap] and
	// may carry no tokens (see Apply).
	Medium Medium
}

// Apply applies one KV event of worker w:
//
//   - Stored hashes each block's tokens (salted by LoRA and Namespace) and
//     chains it from the parent's key, or from the root without a parent,
//     exactly as [AppendBlockKeys] does for a request, then records the
//     engine hash → key mapping (an engine hash seen before with other
//     content moves to the new block). An unknown parent rejects the whole
//     event with ErrUnknownParent, a block with a token count other than
//     BlockSize with ErrBlockSize, and an engine hash named twice with
//     ErrInvalidEvent. A block size new to w that would go over
//     WorkerBlockSizes or MaxBlockSizes rejects the event with
//     ErrTooManyBlockSizes. The blocks are applied in order up to the
//     first new engine hash that would take w over MaxEventEntries; that
//     one and the rest are not, and Apply returns ErrWorkerFull.
//   - Removed drops w from the blocks of those engine hashes; hashes not
//     indexed for w are counted and reported with ErrUnknownBlock after the
//     others are applied (common right after the router subscribes, so
//     callers usually count rather than log it).
//   - Cleared drops every entry of w, approximate ones and lower tiers
//     included; w stays registered.
//   - Stored and Removed with a lower Medium (CPU, disk) update w's blocks
//     of that medium, kept apart from the GPU's and capped separately at
//     MaxEventEntries per medium (ErrTierFull past it) and WorkerBlockSizes.
//     A Stored event with tokens is keyed like a GPU one (its parent found
//     in that medium or the GPU); one without tokens, as vLLM's
//     OffloadingConnector sends, names blocks by the engine hashes the GPU
//     reported for them: their keys come from w's GPU engine maps (hashes
//     not there are reported with ErrUnknownBlock), and an event block
//     size that is a multiple k of the GPU's means each block covers k GPU
//     blocks and is named by the last.
//
// Events of one worker must be applied in the order the engine emitted
// them, so feed each worker from one goroutine; events of different
// workers may be applied concurrently. A Stored block that w already holds
// as an approximate entry becomes event-fed and stops expiring.
func (ix *Index) Apply(w WorkerID, ev Event) error {
	wk := ix.worker(w)
	if wk == nil {
		return fmt.Errorf("%w: %d", ErrUnknownWorker, w)
	}
	wk.mu.Lock()
	defer wk.mu.Unlock()
	if wk.removed.Load() {
		return fmt.Errorf("%w: %d (endpoint %s removed)", ErrUnknownWorker, w, wk.endpoint)
	}
	if ev.Medium >= numMedia {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: medium %v", ErrInvalidEvent, ev.Medium)
	}
	if ev.Medium != MediumGPU && ev.Kind != Cleared {
		return ix.applyLower(wk, &ev)
	}
	switch ev.Kind {
	case Stored:
		return ix.applyStored(wk, &ev)
	case Removed:
		return ix.applyRemoved(wk, &ev)
	case Cleared:
		ix.clear(wk)
		return nil
	}
	ix.rejected.Add(1)
	return fmt.Errorf("%w: kind %v", ErrInvalidEvent, ev.Kind)
}

// checkBlockSizes rejects (and counts) a stored event whose block size is
// not positive or one of whose blocks does not hold exactly that many tokens.
func (ix *Index) checkBlockSizes(ev *Event) error {
	if ev.BlockSize <= 0 {
		ix.rejected.Add(1)
		return fmt.Errorf("%w: stored event with block size %d", ErrBlockSize, ev.BlockSize)
	}
	for i, b := range ev.Blocks {
		if len(b.Tokens) != ev.BlockSize {
			ix.rejected.Add(1)
			return fmt.Errorf("%w: block %d of %d has %d tokens, block size is %d",
				ErrBlockSize, i, len(ev.Blocks), len(b.Tokens), ev.BlockSize)
		}
	}
	return nil
}

func (ix *Index) applyStored(wk *worker, ev *Event) error {
	if err := ix.checkBlockSizes(ev); err != nil {
		return err
	}
	if err := checkDistinct(ev); err != nil {
		ix.rejected.Add(1)
		return err
	}
	m := wk.engine[ev.BlockSize]
	var key uint64
	if ev.HasParent {
		var ok bool
		if key, ok = m[ev.Parent]; !ok {
			ix.unknownParent.Add(1)
			return fmt.Errorf("%w: worker %s rank %d, parent %d, block size %d",
				ErrUnknownParent, wk.endpoint, wk.rank, ev.Parent, ev.BlockSize)
		}
	}
	if len(ev.Blocks) == 0 {
		return nil
	}
	var sp *space
	if m == nil {
		if err := ix.newEngineMap(wk, ev.BlockSize); err != nil {
			return err
		}
		sp = ix.space(ev.BlockSize) // alive: the new map holds a reference
		m = make(map[uint64]uint64, min(len(ev.Blocks), ix.maxEventEntries-wk.hashes))
		if wk.engine == nil {
			wk.engine = make(map[int]map[uint64]uint64)
		}
		wk.engine[ev.BlockSize] = m
	} else {
		sp = ix.space(ev.BlockSize)
	}
	seed := Seed(ev.LoRA, ev.Namespace)
	chained := ev.HasParent
	for i, b := range ev.Blocks {
		old, held := m[b.EngineHash]
		if !held && wk.hashes >= ix.maxEventEntries {
			ix.overCapacity.Add(1)
			return fmt.Errorf("%w: worker %s rank %d holds %d blocks; %d of the event's %d blocks applied",
				ErrWorkerFull, wk.endpoint, wk.rank, wk.hashes, i, len(ev.Blocks))
		}
		local := hashTokens(b.Tokens, seed)
		if chained {
			key = ChainHash(key, local)
		} else {
			key, chained = local, true
		}
		switch {
		case !held:
			wk.hashes++
		case old != key:
			// The engine reused a hash for other content: the old block
			// is gone from this worker.
			ix.unhold(sp, wk, old, keepNone)
		}
		m[b.EngineHash] = key
		ix.store(sp, wk, key)
	}
	return nil
}

// newEngineMap checks that wk may start indexing blocks of blockSize and
// takes a reference to its space; the caller then makes the engine map.
// The caller holds wk.mu.
func (ix *Index) newEngineMap(wk *worker, blockSize int) error {
	if wk.hashes >= ix.maxEventEntries {
		ix.overCapacity.Add(1)
		return fmt.Errorf("%w: worker %s rank %d holds %d blocks; none of the event's applied",
			ErrWorkerFull, wk.endpoint, wk.rank, wk.hashes)
	}
	if len(wk.engine) >= WorkerBlockSizes {
		ix.blockSizes.Add(1)
		return fmt.Errorf("%w: worker %s rank %d already uses %d block sizes, %d would be one more",
			ErrTooManyBlockSizes, wk.endpoint, wk.rank, len(wk.engine), blockSize)
	}
	ix.approx.mu.Lock()
	_, err := ix.spaceLocked(blockSize, true)
	ix.approx.mu.Unlock()
	if err != nil {
		ix.blockSizes.Add(1)
		return fmt.Errorf("%w (worker %s rank %d)", err, wk.endpoint, wk.rank)
	}
	return nil
}

// checkDistinct rejects a Stored event that names one engine hash twice
// (or as its own parent): it cannot be a chain.
func checkDistinct(ev *Event) error {
	n := len(ev.Blocks)
	dup := func(i int) error {
		return fmt.Errorf("%w: engine hash %d repeats in a stored event", ErrInvalidEvent, ev.Blocks[i].EngineHash)
	}
	if n <= 64 {
		for i := range n {
			h := ev.Blocks[i].EngineHash
			if ev.HasParent && h == ev.Parent {
				return dup(i)
			}
			for j := range i {
				if ev.Blocks[j].EngineHash == h {
					return dup(i)
				}
			}
		}
		return nil
	}
	seen := make(map[uint64]struct{}, n+1)
	if ev.HasParent {
		seen[ev.Parent] = struct{}{}
	}
	for i, b := range ev.Blocks {
		if _, ok := seen[b.EngineHash]; ok {
			return dup(i)
		}
		seen[b.EngineHash] = struct{}{}
	}
	return nil
}

func (ix *Index) applyRemoved(wk *worker, ev *Event) error {
	unknown := 0
	for _, h := range ev.RemovedHashes {
		found := false
		for bs, m := range wk.engine {
			if ev.BlockSize > 0 && bs != ev.BlockSize {
				continue
			}
			if k, ok := m[h]; ok {
				sp := ix.space(bs) // alive: m holds a reference
				delete(m, h)
				wk.hashes--
				ix.unhold(sp, wk, k, keepNone)
				found = true
				if len(m) == 0 {
					// Drop the map (Go maps never shrink) and its
					// reference, so the space can be reclaimed.
					delete(wk.engine, bs)
					ix.releaseSpace(sp)
				}
			}
		}
		if !found {
			unknown++
		}
	}
	if unknown > 0 {
		ix.unknownRemoved.Add(uint64(unknown))
		return fmt.Errorf("%w: %d of %d removed hashes of worker %s rank %d",
			ErrUnknownBlock, unknown, len(ev.RemovedHashes), wk.endpoint, wk.rank)
	}
	return nil
}
