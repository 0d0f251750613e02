package kvindex

import (
	"errors"
	"testing"
)

// onMedium returns ev for medium m.
func onMedium(ev Event, m Medium) Event { ev.Medium = m; return ev }

// locationOnly is a Stored event of medium m naming engine hashes
// salt+block for blocks, without tokens or parent, as vLLM's
// OffloadingConnector sends it.
func locationOnly(m Medium, bs int, salt uint64, blocks ...int) Event {
	ev := Event{Kind: Stored, BlockSize: bs, Medium: m}
	for _, b := range blocks {
		ev.Blocks = append(ev.Blocks, StoredBlock{EngineHash: salt + uint64(b)})
	}
	return ev
}

func TestTierOverlap(t *testing.T) {
	const bs = 4
	tokens := prompt(7, 10*bs)
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	type want struct{ gpu, cpu, disk int }
	tests := []struct {
		name   string
		events []Event
		want   want
	}{
		{"gpu only", []Event{storedChain(tokens, bs, 0, 3, 0)}, want{3, 0, 0}},
		{"cpu with tokens after gpu", []Event{
			storedChain(tokens, bs, 0, 3, 0),
			onMedium(storedChain(tokens, bs, 0, 8, 100), MediumCPU),
		}, want{3, 5, 0}},
		{"cpu chained to a gpu parent", []Event{
			storedChain(tokens, bs, 0, 3, 0),
			onMedium(storedChain(tokens, bs, 3, 6, 0), MediumCPU),
		}, want{3, 3, 0}},
		{"best tier first, stop at a block in no tier", []Event{
			storedChain(tokens, bs, 0, 2, 0),
			onMedium(storedChain(tokens, bs, 0, 4, 100), MediumCPU),
			onMedium(storedChain(tokens, bs, 0, 6, 200), MediumDisk),
			onMedium(storedChain(tokens, bs, 7, 9, 200), MediumDisk), // unknown parent: rejected
		}, want{2, 2, 2}},
		{"location only, vLLM offloading", []Event{
			storedChain(tokens, bs, 0, 10, 0),
			locationOnly(MediumCPU, bs, 0, 0, 1, 2, 3, 4, 5),
			removeBlocks(0, 4, 5, 6, 7, 8, 9), // GPU evicts the tail
		}, want{4, 2, 0}},
		{"location only, offloaded blocks of 3 GPU blocks", []Event{
			storedChain(tokens, bs, 0, 10, 0),
			locationOnly(MediumCPU, 3*bs, 0, 2, 5, 8), // named by their last GPU block
			removeBlocks(0, 1, 2, 3, 4, 5, 6, 7, 8, 9),
		}, want{1, 8, 0}},
		{"cpu removed", []Event{
			storedChain(tokens, bs, 0, 2, 0),
			onMedium(storedChain(tokens, bs, 0, 6, 100), MediumCPU),
			onMedium(removeBlocks(100, 3), MediumCPU),
		}, want{2, 1, 0}},
		{"cleared drops every tier", []Event{
			onMedium(storedChain(tokens, bs, 0, 6, 100), MediumCPU),
			{Kind: Cleared},
			storedChain(tokens, bs, 0, 2, 0),
		}, want{2, 0, 0}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix, _ := newTestIndex(t, Options{})
			w := ix.Worker("a", 0)
			for _, ev := range tt.events {
				_ = ix.Apply(w, ev)
			}
			gpu := overlaps(ix, bs, keys)[w]
			cpu, disk := ix.TierOverlap(w, bs, keys, gpu)
			if got := (want{gpu, cpu, disk}); got != tt.want {
				t.Errorf("gpu, cpu, disk = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestTierEventsLeaveGPUUnchanged(t *testing.T) {
	const bs = 4
	tokens := prompt(8, 6*bs)
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	ix, _ := newTestIndex(t, Options{})
	w := ix.Worker("a", 0)
	mustApply(t, ix, w, storedChain(tokens, bs, 0, 2, 0))
	mustApply(t, ix, w, onMedium(storedChain(tokens, bs, 0, 6, 100), MediumCPU))
	mustApply(t, ix, w, onMedium(storedChain(tokens, bs, 0, 6, 200), MediumDisk))
	if got := overlaps(ix, bs, keys)[w]; got != 2 {
		t.Errorf("GPU overlap %d, want 2", got)
	}
	if got := ix.Size(w); got != 2 {
		t.Errorf("Size %d, want 2 (GPU blocks only)", got)
	}
	if c, d := ix.TierSizes(w); c != 6 || d != 6 {
		t.Errorf("TierSizes %d, %d, want 6, 6", c, d)
	}
	st := ix.Stats()
	if st.CPUBlocks != 6 || st.DiskBlocks != 6 || st.Entries != 2 {
		t.Errorf("Stats cpu %d disk %d entries %d, want 6 6 2", st.CPUBlocks, st.DiskBlocks, st.Entries)
	}
	// A GPU Removed of a CPU-only hash is unknown to the GPU view.
	if err := ix.Apply(w, removeBlocks(100, 0)); !errors.Is(err, ErrUnknownBlock) {
		t.Errorf("GPU removal of a CPU hash: %v, want ErrUnknownBlock", err)
	}
	if n := ix.RemoveEndpoint("a"); n != 1 {
		t.Fatalf("RemoveEndpoint = %d", n)
	}
	if st := ix.Stats(); st.CPUBlocks != 0 || st.DiskBlocks != 0 {
		t.Errorf("after removal: cpu %d disk %d, want 0 0", st.CPUBlocks, st.DiskBlocks)
	}
}

func TestTierBounds(t *testing.T) {
	const bs = 4
	tokens := prompt(9, 8*bs)
	ix, _ := newTestIndex(t, Options{MaxEventEntries: 3})
	w := ix.Worker("a", 0)
	// The cap is per medium: the GPU's 3 leave the CPU's 3 free.
	mustApply(t, ix, w, storedChain(tokens, bs, 0, 3, 0))
	err := ix.Apply(w, onMedium(storedChain(tokens, bs, 0, 5, 100), MediumCPU))
	if !errors.Is(err, ErrTierFull) || errors.Is(err, ErrWorkerFull) {
		t.Fatalf("over the cap: %v, want ErrTierFull only", err)
	}
	if c, _ := ix.TierSizes(w); c != 3 {
		t.Errorf("cpu blocks %d, want 3 (applied up to the cap)", c)
	}
	// Block sizes per medium are bounded too.
	mustApply(t, ix, w, onMedium(storedChain(prompt(1, 8), 8, 0, 0, 0), MediumDisk)) // empty: no space made
	for i, b := range []int{2, 8, 16} {
		err := ix.Apply(w, onMedium(storedChain(prompt(2, 2*b), b, 0, 1, 500+uint64(i)), MediumDisk))
		if i < WorkerBlockSizes && err != nil {
			t.Fatalf("block size %d: %v", b, err)
		}
		if i >= WorkerBlockSizes && (!errors.Is(err, ErrTierFull) || errors.Is(err, ErrTooManyBlockSizes)) {
			t.Fatalf("block size %d: %v, want ErrTierFull only (the GPU view stays exact)", b, err)
		}
	}
	// Unknown media, malformed lower-tier events and unresolvable hashes.
	if err := ix.Apply(w, Event{Kind: Stored, BlockSize: bs, Medium: numMedia}); !errors.Is(err, ErrInvalidEvent) {
		t.Errorf("unknown medium: %v", err)
	}
	bad := onMedium(storedChain(tokens, bs, 0, 2, 700), MediumCPU)
	bad.BlockSize = 3
	if err := ix.Apply(w, bad); !errors.Is(err, ErrBlockSize) {
		t.Errorf("token count: %v, want ErrBlockSize", err)
	}
	if err := ix.Apply(w, locationOnly(MediumCPU, 0, 9000, 1, 2)); !errors.Is(err, ErrUnknownBlock) {
		t.Errorf("unresolvable location-only: %v, want ErrUnknownBlock", err)
	}
	if err := ix.Apply(w, onMedium(removeBlocks(9000, 1), MediumDisk)); !errors.Is(err, ErrUnknownBlock) {
		t.Errorf("unknown disk removal: %v, want ErrUnknownBlock", err)
	}
}
