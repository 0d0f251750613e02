package kvindex

import (
	"math/rand/v2"
	"testing"
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
