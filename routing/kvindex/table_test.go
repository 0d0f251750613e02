package kvindex

import (
	"math/rand/v2"
	"testing"
	"unsafe"
)

func TestFingerprintInverts(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	for range 10000 {
		x := rng.Uint64()
		if unmix(mix(x)) != x {
			t.Fatalf("unmix(mix(%d)) != x", x)
		}
	}
	for _, w := range []WorkerID{1, 2, 3, 1000, spillTag - 1} {
		if got, ok := fingerprintOwner(fingerprint(w)); !ok || got != w {
			t.Errorf("fingerprintOwner(fingerprint(%d)) = %d, %v", w, got, ok)
		}
	}
	if _, ok := fingerprintOwner(fingerprint(spillTag)); ok {
		t.Error("spillTag owns a fingerprint")
	}
	if _, ok := fingerprintOwner(fingerprint(2) + fingerprint(3)); ok {
		t.Error("a sum of two fingerprints named a worker") // 2^-32 chance of a false failure
	}
}

// The memory figures in the package documentation depend on these sizes.
func TestLayout(t *testing.T) {
	if got := unsafe.Sizeof(slot{}); got != 24 {
		t.Errorf("slot is %d bytes, want 24", got)
	}
	if got := unsafe.Sizeof(qitem{}); got != 16 {
		t.Errorf("qitem is %d bytes, want 16", got)
	}
	if got := unsafe.Sizeof(shard{}); got%64 != 0 {
		t.Errorf("shard is %d bytes, not whole cache lines", got)
	}
}

// TestPeekDefersToWriters pins the optimistic-read protocol: a peek that
// overlaps a write section reports !ok, so Overlaps takes the read lock.
func TestPeekDefersToWriters(t *testing.T) {
	ix, v := newTestIndex(t, Options{})
	w := ix.Worker("a", 0)
	keys := AppendBlockKeys(nil, prompt(90, 8), 4, BaseSeed)
	mustInsert(t, ix, w, 4, keys, v.Now())
	h, sh := ix.space(4).locate(keys[1])
	ids, _, found, ok := sh.peek(keys[1], h)
	if !ok || !found || WorkerID(ids) != w {
		t.Fatalf("peek = %x, %v, %v", ids, found, ok)
	}
	if _, _, found, ok := sh.peek(keys[1]+1, h); !ok || found {
		t.Fatalf("peek of an absent key = %v, %v", found, ok)
	}
	sh.lock()
	if _, _, _, ok := sh.peek(keys[1], h); ok {
		t.Error("peek during a write section reported a consistent reading")
	}
	sh.unlock()
	if _, _, _, ok := sh.peek(0, 0); ok {
		t.Error("the zero key must be read under the lock")
	}
}
