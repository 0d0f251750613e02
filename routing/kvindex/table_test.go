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
