package kvindex

import (
	"errors"
	"testing"

	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// TestExportImportWorker: a worker's event-fed view exported by one index
// and imported into another scores the same overlaps, and later events
// whose parents were stored before the import apply (they were refused
// with ErrUnknownParent before the warm start existed), as do removals.
func TestExportImportWorker(t *testing.T) {
	const bs = 4
	src, _ := newTestIndex(t, Options{})
	dst, _ := newTestIndex(t, Options{})
	a, b := prompt(1, 8*bs), prompt(2, 6*bs)
	ws := src.Worker("w", 0)
	mustApply(t, src, ws, storedChain(a, bs, 0, 8, 100))
	mustApply(t, src, ws, storedChain(b, bs, 0, 6, 200))
	mustApply(t, src, ws, onMedium(locationOnly(MediumCPU, bs, 200, 0, 1, 2), MediumCPU))
	// An approximate entry is not exported.
	if err := src.InsertApprox(src.Worker("w", 0), bs, AppendBlockKeys(nil, prompt(3, 2*bs), bs, BaseSeed), testStart); err != nil {
		t.Fatal(err)
	}
	runs, complete := src.ExportWorker(ws, 0)
	if !complete || len(runs) != 2 {
		t.Fatalf("export: %d runs, complete %v", len(runs), complete)
	}
	wd := dst.Worker("w", 0)
	if err := dst.ImportWorker(wd, runs); err != nil {
		t.Fatal(err)
	}
	for _, p := range [][]uint32{a, b, prompt(3, 2*bs)} {
		keys := AppendBlockKeys(nil, p, bs, BaseSeed)
		if got, want := overlaps(dst, bs, keys)[wd], overlaps(src, bs, keys)[ws]; got != want && !(want == 2 && got == 0) {
			t.Errorf("overlap %d after import, %d on the exporter", got, want)
		}
	}
	if got := overlaps(dst, bs, AppendBlockKeys(nil, prompt(3, 2*bs), bs, BaseSeed))[wd]; got != 0 {
		t.Errorf("approximate entry imported: overlap %d", got)
	}
	if cpu, _ := dst.TierSizes(wd); cpu != 3 {
		t.Errorf("cpu blocks after import %d, want 3", cpu)
	}
	if dst.Size(wd) != 14 {
		t.Errorf("size after import %d, want 14", dst.Size(wd))
	}
	// The next events continue the chains (parents known) and remove.
	a2 := prompt(1, 10*bs)
	mustApply(t, dst, wd, storedChain(a2, bs, 8, 10, 100))
	mustApply(t, dst, wd, removeBlocks(200, 5))
	if got := overlaps(dst, bs, AppendBlockKeys(nil, a2, bs, BaseSeed))[wd]; got != 10 {
		t.Errorf("continued chain overlap %d, want 10", got)
	}
	if got := overlaps(dst, bs, AppendBlockKeys(nil, b, bs, BaseSeed))[wd]; got != 5 {
		t.Errorf("after removal overlap %d, want 5", got)
	}
}

// TestImportWorkerBounds: an import is held to the index's bounds like
// events are, and a malformed run clears the worker.
func TestImportWorkerBounds(t *testing.T) {
	const bs = 4
	ix, _ := newTestIndex(t, Options{MaxEventEntries: 5})
	w := ix.Worker("w", 0)
	run := func(medium uint8, size, factor uint32, n int) warmstate.Blocks {
		r := warmstate.Blocks{Medium: medium, BlockSize: size, Factor: factor}
		for i := range n {
			r.Blocks = append(r.Blocks, warmstate.Block{Hash: uint64(i + 1), Key: uint64(1000 + i)})
		}
		return r
	}
	if err := ix.ImportWorker(w, []warmstate.Blocks{run(0, bs, 1, 8)}); !errors.Is(err, ErrWorkerFull) {
		t.Fatalf("8 blocks over a cap of 5: %v", err)
	}
	if ix.Size(w) != 5 {
		t.Fatalf("size %d after a capped import, want 5", ix.Size(w))
	}
	if err := ix.ImportWorker(w, []warmstate.Blocks{run(0, bs, 1, 2), run(0, 8, 1, 1), run(0, 16, 1, 1)}); !errors.Is(err, ErrTooManyBlockSizes) {
		t.Fatalf("three block sizes: %v", err)
	}
	if ix.Size(w) != 3 {
		t.Fatalf("size %d, want the first two block sizes' 3", ix.Size(w))
	}
	if err := ix.ImportWorker(w, []warmstate.Blocks{run(1, bs, 1, 9), run(0, bs, 1, 2)}); !errors.Is(err, ErrTierFull) {
		t.Fatalf("9 cpu blocks over a cap of 5: %v", err)
	}
	if cpu, _ := ix.TierSizes(w); cpu != 5 || ix.Size(w) != 2 {
		t.Fatalf("cpu %d gpu %d after a capped tier, want 5 and 2 (the GPU run still imported)", cpu, ix.Size(w))
	}
	for _, bad := range []warmstate.Blocks{run(0, 0, 1, 1), run(0, warmstate.MaxBlockSize+1, 1, 1), run(3, bs, 1, 1), run(0, bs, 2, 1), run(1, bs, 0, 1), run(1, bs, maxTierFactor+1, 1)} {
		if err := ix.ImportWorker(w, []warmstate.Blocks{run(0, bs, 1, 2), bad}); !errors.Is(err, ErrInvalidEvent) {
			t.Errorf("run %+v: %v, want ErrInvalidEvent", bad, err)
		}
		if cpu, _ := ix.TierSizes(w); ix.Size(w) != 0 || cpu != 0 {
			t.Errorf("run %+v: worker not cleared (%d blocks)", bad, ix.Size(w))
		}
	}
	// A repeated hash keeps its last key; the counts stay exact.
	rep := warmstate.Blocks{Medium: 0, BlockSize: bs, Factor: 1, Blocks: []warmstate.Block{{Hash: 1, Key: 10}, {Hash: 1, Key: 11}, {Hash: 2, Key: 12}}}
	if err := ix.ImportWorker(w, []warmstate.Blocks{rep}); err != nil {
		t.Fatal(err)
	}
	if ix.Size(w) != 2 || ix.Stats().Entries != 2 {
		t.Fatalf("size %d entries %d after a repeated hash, want 2", ix.Size(w), ix.Stats().Entries)
	}
	if err := ix.ImportWorker(ix.Worker("gone", 0), nil); err != nil {
		t.Fatal(err)
	}
	ix.RemoveEndpoint("gone")
	if err := ix.ImportWorker(ix.Worker("gone", 0), nil); err != nil {
		t.Fatal(err) // a new id for the endpoint
	}
	if err := ix.ImportWorker(9999, nil); !errors.Is(err, ErrUnknownWorker) {
		t.Fatalf("unknown worker: %v", err)
	}
}

// TestExportWorkerBounded: maxBlocks bounds an export, which then says it
// is incomplete.
func TestExportWorkerBounded(t *testing.T) {
	const bs = 4
	ix, _ := newTestIndex(t, Options{})
	w := ix.Worker("w", 0)
	mustApply(t, ix, w, storedChain(prompt(1, 8*bs), bs, 0, 8, 100))
	runs, complete := ix.ExportWorker(w, 3)
	if complete || len(runs) != 1 || len(runs[0].Blocks) != 3 {
		t.Fatalf("bounded export: complete %v, %d runs", complete, len(runs))
	}
	if runs, complete := ix.ExportWorker(w, 8); !complete || len(runs[0].Blocks) != 8 {
		t.Fatalf("export at the bound: complete %v", complete)
	}
}

// BenchmarkImportWorker imports one worker's 8,192 GPU blocks (the e2e
// warm start's size per worker): per block one engine-map insert and
// one shard store.
func BenchmarkImportWorker(b *testing.B) {
	ix, _ := newTestIndex(b, Options{})
	w := ix.Worker("w", 0)
	run := warmstate.Blocks{BlockSize: 16, Factor: 1}
	for i := range 8192 {
		run.Blocks = append(run.Blocks, warmstate.Block{Hash: uint64(i) + 1, Key: uint64(i)*0x9e3779b97f4a7c15 + 7})
	}
	runs := []warmstate.Blocks{run}
	b.ReportAllocs()
	for b.Loop() {
		if err := ix.ImportWorker(w, runs); err != nil {
			b.Fatal(err)
		}
	}
}
