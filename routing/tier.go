package routing

import (
	"fmt"
	"math"
)

// TierWeights price a cached block by the tier it sits in, for
// [Candidate.EffectiveOverlap]: a GPU hit costs nothing, a block in host
// memory (CPU) or on disk must be loaded back before prefill, which is
// cheaper than recomputing it but not free. The zero value means
// [DefaultTierWeights]. Config: router.tier_weights {gpu, cpu, disk}.
type TierWeights struct {
	GPU  float64 `json:"gpu"`
	CPU  float64 `json:"cpu"`
	Disk float64 `json:"disk"`
}

// DefaultTierWeights are llm-d's and the anchors: GPU 1.0, CPU 0.8,
// disk 0.25.
func DefaultTierWeights() TierWeights { return TierWeights{GPU: 1, CPU: 0.8, Disk: 0.25} }

// OrDefault returns w, or DefaultTierWeights for the zero value.
func (w TierWeights) OrDefault() TierWeights {
	if w == (TierWeights{}) {
		return DefaultTierWeights()
	}
	return w
}

// Validate checks that every weight is finite and in [0, 1], GPU above 0,
// and that a lower tier never weighs more than a higher one
// (1 >= gpu >= cpu >= disk >= 0).
func (w TierWeights) Validate() error {
	for _, f := range []struct {
		name string
		v    float64
	}{{"gpu", w.GPU}, {"cpu", w.CPU}, {"disk", w.Disk}} {
		if !(f.v >= 0 && f.v <= 1) || math.IsInf(f.v, 0) {
			return fmt.Errorf("tier_weights.%s: must be in [0, 1], got %v", f.name, f.v)
		}
	}
	switch {
	case w.GPU == 0:
		return fmt.Errorf("tier_weights.gpu: must be > 0")
	case w.CPU > w.GPU || w.Disk > w.CPU:
		return fmt.Errorf("tier_weights: want gpu >= cpu >= disk, got %v >= %v >= %v", w.GPU, w.CPU, w.Disk)
	}
	return nil
}

// EffectiveOverlap is the candidate's cached prefix in GPU-block
// equivalents: Overlap·w.GPU + OverlapCPU·w.CPU + OverlapDisk·w.Disk (w's
// zero value means DefaultTierWeights). Without lower-tier KV events it is
// Overlap·w.GPU, i.e. Overlap at the default weights.
func (c *Candidate) EffectiveOverlap(w TierWeights) float64 {
	w = w.OrDefault()
	return float64(c.Overlap)*w.GPU + float64(c.OverlapCPU)*w.CPU + float64(c.OverlapDisk)*w.Disk
}
