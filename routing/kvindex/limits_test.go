package kvindex

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"
)

// flood applies total distinct Stored blocks of block size 1 for w, in
// events of chain blocks that each start a sequence (so none is refused
// for an unknown parent), and returns the first error other than
// ErrWorkerFull.
func flood(ix *Index, w WorkerID, total, chain int) error {
	toks := make([]uint32, chain)
	ev := Event{Kind: Stored, BlockSize: 1, Blocks: make([]StoredBlock, chain)}
	for c := 0; c*chain < total; c++ {
		for j := range ev.Blocks {
			n := c*chain + j
			toks[j] = uint32(n)
			ev.Blocks[j] = StoredBlock{EngineHash: uint64(n) + 1, Tokens: toks[j : j+1]}
		}
		if err := ix.Apply(w, ev); err != nil && !errors.Is(err, ErrWorkerFull) {
			return err
		}
	}
	return nil
}

// TestMemoryBudgetEventFlood: a peer publishing 5M distinct BlockStored
// blocks for one worker (anyone who can reach a bound SUB socket can)
// leaves at most the worker's cap of entries, and the heap within what
// that cap costs. Before the cap, every block stayed: 5M entries, 336 MiB
// with the default options.
func TestMemoryBudgetEventFlood(t *testing.T) {
	const (
		total = 5_000_000
		limit = 1 << 16  // ~100 B per entry: ~6 MiB at the cap
		bound = 32 << 20 // unbounded, 5M entries take ~350 MiB
	)
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc

	ix, _ := newTestIndex(t, Options{MaxEventEntries: limit})
	w := ix.Worker("flooded", 0)
	if err := flood(ix, w, total, 4096); err != nil {
		t.Fatal(err)
	}
	st := ix.Stats()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	grew := int64(ms.HeapAlloc) - int64(base)
	t.Logf("after %d stored blocks: heap %+d KiB, stats %+v", total, grew>>10, st)
	if st.Entries > limit || ix.Size(w) > limit {
		t.Errorf("%d entries (worker %d) after %d distinct stored blocks, cap %d", st.Entries, ix.Size(w), total, limit)
	}
	if st.Entries != limit || st.OverCapacity != uint64((total+4095)/4096-limit/4096) {
		t.Errorf("stats %+v: want the worker filled to its cap and the rest counted", st)
	}
	if grew > bound {
		t.Errorf("heap grew by %d MiB, bound %d MiB", grew>>20, bound>>20)
	}
	runtime.KeepAlive(ix)
}

// TestWorkerCap: at the cap a Stored event is applied up to its first new
// block, the rest rejected with ErrWorkerFull; blocks already held still
// refresh; removals make room again; other workers are not affected.
func TestWorkerCap(t *testing.T) {
	const bs = 4
	tokens := prompt(11, 12*bs)
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	ix, _ := newTestIndex(t, Options{MaxEventEntries: 6})
	a, b := ix.Worker("a", 0), ix.Worker("b", 0)
	mustApply(t, ix, a, storedChain(tokens, bs, 0, 4, 0))
	err := ix.Apply(a, storedChain(tokens, bs, 4, 10, 0))
	if !errors.Is(err, ErrWorkerFull) {
		t.Fatalf("over the cap: %v", err)
	}
	if got := overlaps(ix, bs, keys)[a]; got != 6 || ix.Size(a) != 6 {
		t.Errorf("overlap %d, Size %d: want the first 6 blocks applied", got, ix.Size(a))
	}
	// Storing held blocks again adds nothing and is fine at the cap.
	mustApply(t, ix, a, storedChain(tokens, bs, 0, 6, 0))
	// A new block size is a new engine map: refused at the cap too.
	if err := ix.Apply(a, storedChain(prompt(12, 8), 8, 0, 1, 50)); !errors.Is(err, ErrWorkerFull) {
		t.Errorf("new block size at the cap: %v", err)
	}
	mustApply(t, ix, b, storedChain(tokens, bs, 0, 6, 100))
	mustApply(t, ix, a, removeBlocks(0, 4, 5))
	mustApply(t, ix, a, storedChain(tokens, bs, 4, 6, 0))
	if got := overlaps(ix, bs, keys); got[a] != 6 || got[b] != 6 {
		t.Errorf("after making room: %v", got)
	}
	if err := ix.Apply(a, storedChain(tokens, bs, 6, 7, 0)); !errors.Is(err, ErrWorkerFull) {
		t.Errorf("full again: %v", err)
	}
	if st := ix.Stats(); st.OverCapacity != 3 || st.Entries != 12 {
		t.Errorf("stats %+v", st)
	}
	// Cleared empties the worker, and its cap with it.
	mustApply(t, ix, a, Event{Kind: Cleared})
	mustApply(t, ix, a, storedChain(tokens, bs, 0, 6, 300))
}

// TestManyBlockSizesAreBounded: events of 1000 distinct block sizes (from
// 1000 workers, so that the per-worker limit cannot hide the global one)
// make at most MaxBlockSizes key spaces; the rest are rejected and
// counted. Before the bound, 1000 spaces (each 12 KiB, never freed, and
// searched in turn by every lookup).
func TestManyBlockSizesAreBounded(t *testing.T) {
	ix, _ := newTestIndex(t, Options{})
	rejected := 0
	for bs := 1; bs <= 1000; bs++ {
		w := ix.Worker(fmt.Sprintf("pod-%d", bs), 0)
		err := ix.Apply(w, Event{Kind: Stored, BlockSize: bs, Blocks: []StoredBlock{{EngineHash: 1, Tokens: prompt(bs, bs)}}})
		switch {
		case errors.Is(err, ErrTooManyBlockSizes):
			rejected++
		case err != nil:
			t.Fatalf("block size %d: %v", bs, err)
		}
	}
	if n := len(*ix.spaces.Load()); n > DefaultMaxBlockSizes {
		t.Errorf("%d key spaces after events of 1000 block sizes, want at most %d", n, DefaultMaxBlockSizes)
	}
	if st := ix.Stats(); rejected != 1000-DefaultMaxBlockSizes || st.TooManyBlockSizes != uint64(rejected) || st.Spaces != DefaultMaxBlockSizes {
		t.Errorf("%d rejected, stats %+v", rejected, st)
	}
}

// TestBlockSizesPerWorker: one worker's events may use WorkerBlockSizes
// block sizes at once, so a peer that reaches one worker's socket cannot
// take every key space; a block size the worker stops using frees its
// place.
func TestBlockSizesPerWorker(t *testing.T) {
	ix, _ := newTestIndex(t, Options{})
	w := ix.Worker("a", 0)
	store := func(bs int, h uint64) error {
		return ix.Apply(w, Event{Kind: Stored, BlockSize: bs, Blocks: []StoredBlock{{EngineHash: h, Tokens: prompt(bs, bs)}}})
	}
	for bs := 1; bs <= WorkerBlockSizes; bs++ {
		if err := store(bs, uint64(bs)); err != nil {
			t.Fatal(err)
		}
	}
	if err := store(99, 99); !errors.Is(err, ErrTooManyBlockSizes) {
		t.Fatalf("block size %d of one worker: %v", WorkerBlockSizes+1, err)
	}
	// Removing the worker's last block of size 1 frees its place.
	mustApply(t, ix, w, Event{Kind: Removed, BlockSize: 1, RemovedHashes: []uint64{1}})
	if err := store(99, 99); err != nil {
		t.Fatalf("after removing block size 1: %v", err)
	}
	other := ix.Worker("b", 0)
	if err := ix.Apply(other, Event{Kind: Stored, BlockSize: 7, Blocks: []StoredBlock{{EngineHash: 1, Tokens: prompt(7, 7)}}}); err != nil {
		t.Errorf("another worker: %v", err)
	}
}

// TestBlockSizesReclaimed: a peer that fills every key space with junk
// block sizes cannot keep the real one out for longer than it keeps blocks
// in them: once a worker's junk is removed (or cleared, or its endpoint
// removed) and approximate entries have expired, the spaces are reused.
// Spaces in use are never reclaimed.
func TestBlockSizesReclaimed(t *testing.T) {
	const real = 16
	ix, v := newTestIndex(t, Options{MaxBlockSizes: 4, TTL: time.Second})
	store := func(w WorkerID, bs int) error {
		return ix.Apply(w, Event{Kind: Stored, BlockSize: bs, Blocks: []StoredBlock{{EngineHash: 1, Tokens: prompt(bs, bs)}}})
	}
	j1, j2 := ix.Worker("junk-1", 0), ix.Worker("junk-2", 0)
	for i, w := range []WorkerID{j1, j1, j2} {
		if err := store(w, 100+i); err != nil {
			t.Fatal(err)
		}
	}
	approx := ix.Worker("approx", 0)
	mustInsert(t, ix, approx, 200, []uint64{1, 2}, v.Now())
	worker := ix.Worker("real", 0)
	if err := store(worker, real); !errors.Is(err, ErrTooManyBlockSizes) {
		t.Fatalf("fifth block size: %v", err)
	}
	if err := ix.InsertApprox(worker, real, []uint64{1}, v.Now()); !errors.Is(err, ErrTooManyBlockSizes) {
		t.Fatalf("fifth block size, approximate: %v", err)
	}
	mustApply(t, ix, j1, Event{Kind: Cleared})
	if err := store(worker, real); err != nil {
		t.Fatalf("after junk-1 was cleared: %v", err)
	}
	if err := store(ix.Worker("real-2", 0), 32); err != nil {
		t.Fatalf("second space freed by junk-1: %v", err)
	}
	if err := store(ix.Worker("real-3", 0), 64); !errors.Is(err, ErrTooManyBlockSizes) {
		t.Fatalf("spaces in use were reclaimed: %v", err)
	}
	v.Step(3 * time.Second) // the approximate entries expire
	ix.RemoveEndpoint("junk-2")
	for _, bs := range []int{64, 128} {
		if err := store(ix.Worker(fmt.Sprintf("real-%d", bs), 0), bs); err != nil {
			t.Fatalf("block size %d after the approximate entries expired and junk-2 left: %v", bs, err)
		}
	}
	keys := AppendBlockKeys(nil, prompt(real, real), real, BaseSeed)
	if got := overlaps(ix, real, keys); got[worker] != 1 {
		t.Errorf("the real worker's block: %v", got)
	}
	if st := ix.Stats(); st.Spaces != 4 || st.TooManyBlockSizes != 3 {
		t.Errorf("stats %+v", st)
	}
}

// TestBlockSizeChurnConcurrent: workers storing, removing and clearing
// blocks of more block sizes than there are key spaces, approximate
// inserts and readers, all at once, so spaces are reclaimed and remade
// under load. Under -race: no race, no entry written to a reclaimed space
// (its blocks would be lost, and the counters would disagree), nothing
// left once every worker is cleared and the approximate entries expire.
func TestBlockSizeChurnConcurrent(t *testing.T) {
	ix, v := newTestIndex(t, Options{MaxBlockSizes: 3, TTL: time.Second})
	const writers, rounds = 4, 400
	var wg, readers sync.WaitGroup
	ids := make([]WorkerID, writers)
	for i := range ids {
		ids[i] = ix.Worker(fmt.Sprintf("pod-%d", i), 0)
	}
	for i, w := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 3))
			for r := range rounds {
				bs := 1 + rng.IntN(6)
				h := uint64(r)
				err := ix.Apply(w, Event{Kind: Stored, BlockSize: bs, Blocks: []StoredBlock{{EngineHash: h, Tokens: prompt(bs, bs)}}})
				if err != nil && !errors.Is(err, ErrTooManyBlockSizes) {
					t.Error(err)
					return
				}
				switch rng.IntN(3) {
				case 0:
					_ = ix.Apply(w, Event{Kind: Removed, RemovedHashes: []uint64{h}})
				case 1:
					_ = ix.Apply(w, Event{Kind: Cleared})
				}
			}
			_ = ix.Apply(w, Event{Kind: Cleared})
		}()
	}
	approx := ix.Worker("approx", 0)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for r := range rounds {
			bs := 1 + r%6
			_ = ix.InsertApprox(approx, bs, AppendBlockKeys(nil, prompt(bs, bs), bs, BaseSeed), v.Now())
			if r%50 == 0 {
				v.Step(2 * time.Second)
			}
		}
	}()
	stop := make(chan struct{})
	readers.Add(1)
	go func() {
		defer readers.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			for bs := 1; bs <= 6; bs++ {
				ix.Overlaps(bs, AppendBlockKeys(nil, prompt(bs, bs), bs, BaseSeed), nil)
			}
		}
	}()
	wg.Wait()
	close(stop)
	readers.Wait()
	v.Step(time.Hour)
	st := ix.Stats()
	if st.Entries != 0 || st.ApproxEntries != 0 || st.Blocks != 0 || st.Spaces > 3 || st.TooManyBlockSizes == 0 {
		t.Errorf("after clearing every worker and expiry: %+v", st)
	}
	for _, w := range append(ids, approx) {
		if ix.Size(w) != 0 {
			t.Errorf("worker %d: Size %d", w, ix.Size(w))
		}
	}
}
