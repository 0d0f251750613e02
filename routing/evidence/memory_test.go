package evidence

import (
	"fmt"
	"runtime"
	"testing"
	"unsafe"
)

// heapPerSet is the heap one Set with peers peers' parts costs, measured
// over 2,000 of them.
func heapPerSet(peers int) float64 {
	const n = 2000
	sets := make([]*Set, n)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range sets {
		s := new(Set)
		s.Add(Local, 1, 1, 1)
		for p := range peers {
			s.Add(Source(1+p), 1, 1, 1)
		}
		sets[i] = s
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(sets)
	return float64(after.HeapAlloc-before.HeapAlloc) / n
}

// TestSetMemory: what keeping sources apart costs per learned quantity:
// the Set itself (56 bytes, in its owner) and 32 to about 50 bytes per
// peer's part (the slice's spare capacity). The figures are in the
// package's users' docs (routing/latency, kvbandit's and thompson's
// READMEs).
func TestSetMemory(t *testing.T) {
	if sz := unsafe.Sizeof(Set{}); sz != 56 {
		t.Errorf("a Set is %d bytes, the docs say 56", sz)
	}
	base := heapPerSet(0)
	for _, peers := range []int{1, 3, 8, 64, 256} {
		per := (heapPerSet(peers) - base) / float64(peers)
		t.Logf("%d peers: %.0f bytes per peer's part", peers, per)
		if per > 80 {
			t.Errorf("%d peers: %.0f bytes per part", peers, per)
		}
	}
	t.Log(fmt.Sprintf("a Set with no peer: %.0f bytes of heap (the Set itself when allocated alone)", base))
}
