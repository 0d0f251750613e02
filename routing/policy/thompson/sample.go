package thompson

import (
	"math"
	"math/rand/v2"
)

// sampleGamma draws from Gamma(shape a, scale 1) by Marsaglia and Tsang's
// method ("A simple method for generating gamma variables", 2000); a < 1
// uses the boost Gamma(a) = Gamma(a+1)·U^(1/a).
func sampleGamma(r *rand.Rand, a float64) float64 {
	if !(a > 0) {
		return 0
	}
	if a < 1 {
		return sampleGamma(r, a+1) * math.Pow(r.Float64(), 1/a)
	}
	d := a - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		var x, v float64
		for {
			x = r.NormFloat64()
			v = 1 + c*x
			if v > 0 {
				break
			}
		}
		v = v * v * v
		u := r.Float64()
		x2 := x * x
		if u < 1-0.0331*x2*x2 {
			return d * v
		}
		if math.Log(u) < 0.5*x2+d*(1-v+math.Log(v)) {
			return d * v
		}
	}
}

// sampleBeta draws from Beta(a, b) as X/(X+Y) with X ~ Gamma(a) and
// Y ~ Gamma(b).
func sampleBeta(r *rand.Rand, a, b float64) float64 {
	x := sampleGamma(r, a)
	y := sampleGamma(r, b)
	if !(x+y > 0) {
		return 0.5
	}
	return x / (x + y)
}
