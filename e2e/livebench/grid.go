package livebench

import (
	"math/rand/v2"
	"slices"
	"time"
)

// MinGrid is the smallest grid DetectGrid reports: a finer one is taken
// for real arrival times, which are not spread.
const MinGrid = 10 * time.Millisecond

// DetectGrid finds the grid arrivals were stamped on (Mooncake's
// conversation trace: 3 s, stamped 0, 3000, 5999, 9000, ... ms). It is
// the greatest common divisor of the distinct arrivals when that is at
// least MinGrid; otherwise the smallest positive gap g between distinct
// arrivals, refined to the mean of the gaps within 1% of g, provided it
// is at least MinGrid and at least 95% of the arrivals lie within 2% of
// the grid of a multiple of it (counted from the first). Otherwise, or
// with fewer than three distinct arrivals, it returns 0: no grid.
func DetectGrid(arrivals []time.Duration) time.Duration {
	d := slices.Clone(arrivals)
	slices.Sort(d)
	d = slices.Compact(d)
	if len(d) < 3 {
		return 0
	}
	var g time.Duration
	for _, a := range d[1:] {
		g = gcd(g, a-d[0])
	}
	if g >= MinGrid {
		return g
	}
	minGap := d[1] - d[0]
	for i := 2; i < len(d); i++ {
		minGap = min(minGap, d[i]-d[i-1])
	}
	var sum, n time.Duration
	for i := 1; i < len(d); i++ {
		if gap := d[i] - d[i-1]; gap-minGap <= minGap/100 {
			sum += gap
			n++
		}
	}
	grid := sum / n
	if grid < MinGrid {
		return 0
	}
	// Fit the grid to the whole span, so that a mean a little off does
	// not drift out of tolerance over thousands of cells.
	span := d[len(d)-1] - d[0]
	grid = span / ((span + grid/2) / grid)
	tol := grid / 50
	on := 0
	for _, a := range d {
		off := (a - d[0]) % grid
		if off <= tol || grid-off <= tol {
			on++
		}
	}
	if on*100 < len(d)*95 {
		return 0
	}
	return grid
}

func gcd(a, b time.Duration) time.Duration {
	for b != 0 {
		a, b = b, a%b
	}
	return max(a, -a)
}

// Spread moves every arrival to a uniformly random point of its grid
// cell, [a, a+grid), drawing from rng in slice order. Arrivals at the
// same grid time thus get independent offsets; the caller re-sorts.
func Spread(arrivals []time.Duration, grid time.Duration, rng *rand.Rand) {
	if grid <= 0 {
		return
	}
	for i := range arrivals {
		arrivals[i] += time.Duration(rng.Int64N(int64(grid)))
	}
}
