package routing

import (
	"math/rand/v2"
	"sync/atomic"
	"time"
)

// Rand is a lock-free, seedable source of random numbers for the request
// path. Each call draws the next value of a SplitMix64 sequence from an
// atomic counter, so concurrent callers never contend on a lock and a given
// seed yields the same sequence of draws.
type Rand struct {
	seed uint64
	n    atomic.Uint64
}

// NewRand returns a source seeded with seed; 0 picks a seed from the time.
func NewRand(seed int64) *Rand {
	s := uint64(seed)
	if seed == 0 {
		s = uint64(time.Now().UnixNano())
	}
	return &Rand{seed: s}
}

// Uint64 implements [rand.Source].
func (r *Rand) Uint64() uint64 {
	z := r.seed + r.n.Add(1)*0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

var _ rand.Source = (*Rand)(nil)

// Float64 returns a uniform value in [0, 1).
func (r *Rand) Float64() float64 { return float64(r.Uint64()>>11) / (1 << 53) }

// IntN returns a uniform value in [0, n); n must be > 0.
func (r *Rand) IntN(n int) int {
	// Lemire's multiply-shift; the bias is below 2^-64 * n, negligible here.
	hi, _ := mulHi(r.Uint64(), uint64(n))
	return int(hi)
}

func mulHi(a, b uint64) (uint64, uint64) {
	const mask32 = 1<<32 - 1
	a0, a1 := a&mask32, a>>32
	b0, b1 := b&mask32, b>>32
	w0 := a0 * b0
	t := a1*b0 + w0>>32
	w1 := t&mask32 + a0*b1
	return a1*b1 + t>>32 + w1>>32, a * b
}

// Local returns a *rand.Rand for one caller (not shared between
// goroutines), seeded from r, for samplers that need many draws.
func (r *Rand) Local() *rand.Rand { return rand.New(rand.NewPCG(r.Uint64(), r.Uint64())) }
