package routing

import (
	"math"
	"testing"
)

func TestTierWeights(t *testing.T) {
	if err := DefaultTierWeights().Validate(); err != nil {
		t.Fatal(err)
	}
	if (TierWeights{}).OrDefault() != DefaultTierWeights() {
		t.Fatal("zero weights are not the defaults")
	}
	for _, w := range []TierWeights{
		{GPU: 0, CPU: 0, Disk: 0},
		{GPU: 1, CPU: 1.1, Disk: 0},
		{GPU: 1, CPU: 0.5, Disk: 0.6},
		{GPU: 1.5, CPU: 0.5, Disk: 0},
		{GPU: 1, CPU: -0.1, Disk: 0},
		{GPU: math.NaN(), CPU: 0.5, Disk: 0},
		{GPU: 1, CPU: math.Inf(1), Disk: 0},
	} {
		if err := w.Validate(); err == nil {
			t.Errorf("%+v validated", w)
		}
	}
	c := Candidate{Overlap: 3, OverlapCPU: 5, OverlapDisk: 4}
	if got := c.EffectiveOverlap(TierWeights{}); math.Abs(got-(3+4+1)) > 1e-12 {
		t.Errorf("effective overlap %v, want 8 at the defaults", got)
	}
	if got := c.EffectiveOverlap(TierWeights{GPU: 1, CPU: 0.5}); got != 5.5 {
		t.Errorf("effective overlap %v, want 5.5", got)
	}
}
