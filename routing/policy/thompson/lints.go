package thompson

import (
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"

	"github.com/kvbandit/kvbandit/routing"
)

// Cholesky jitter schedule and eigenvalue floor of the reference.
const (
	jitterBase   = 1e-9
	jitterSteps  = 7 // 1e-9, 1e-8, …, 1e-3
	eigenFloor   = 1e-10
	minForget    = 1e-6
	maxForget    = 0.999999
	maxFeatureAb = 1e6 // features beyond this are treated as corrupt
)

type armKey struct {
	endpoint routing.EndpointKey
	rank     int
}

// arm is the LinTS ridge regression of one (endpoint, rank). Sampling reads
// the published posterior without locking; mu serialises updates, which
// rebuild the posterior and swap it in.
type arm struct {
	key  armKey
	ep   *endpointState
	post atomic.Pointer[posterior]

	mu      sync.Mutex
	a       mat
	b       vec
	updates uint64
}

// posterior is an immutable view of N(μ, A⁻¹) ready for sampling: the
// noise term of θᵀx is zᵀ(M·x) with z ~ N(0, I) and M = L⁻¹ (Cholesky,
// since (L⁻ᵀz)ᵀx = zᵀL⁻¹x) or M = diag(1/√λ)·Vᵀ (eigen fallback, since
// (V(z/√λ))ᵀx = zᵀ diag(1/√λ) Vᵀx). Precomputing M when the posterior is
// rebuilt leaves sampling one matrix-vector product with no divisions.
type posterior struct {
	mu   vec
	m    mat
	chol bool
}

func newArm(k armKey, ep *endpointState, prior *posterior, lambda float64) *arm {
	a := &arm{key: k, ep: ep, a: identity(lambda)}
	a.post.Store(prior)
	return a
}

// computePosterior factors a symmetrised A as the reference does: Cholesky
// of A + jitter·I with jitter 1e-9 ×10 up to 1e-3, then the eigen fallback
// with eigenvalues floored at 1e-10. fellBack reports the fallback.
func computePosterior(a *mat, b *vec) (p *posterior, fellBack bool) {
	s := *a
	s.symmetrize()
	var l mat
	jitter := jitterBase
	for range jitterSteps {
		if cholesky(&s, jitter, &l) {
			p = &posterior{chol: true}
			y := solveLower(&l, b)
			p.mu = solveUpperT(&l, &y)
			// M = L⁻¹, column by column.
			for j := range dim {
				var e vec
				e[j] = 1
				col := solveLower(&l, &e)
				for i := range dim {
					p.m[i][j] = col[i]
				}
			}
			return p, false
		}
		jitter *= 10
	}
	return eigenPosterior(&s, b), true
}

// eigenPosterior is the fallback for a symmetric s: s = V diag(λ) Vᵀ with λ
// floored at 1e-10, μ = V diag(1/λ) Vᵀ b, M = diag(1/√λ) Vᵀ.
func eigenPosterior(s *mat, b *vec) *posterior {
	w, v := symEigen(*s)
	p := &posterior{}
	var vtb vec
	for j := range dim {
		w[j] = max(w[j], eigenFloor)
		for i := range dim {
			vtb[j] += v[i][j] * b[i]
		}
		vtb[j] /= w[j]
		isq := 1 / math.Sqrt(w[j])
		for i := range dim {
			p.m[j][i] = isq * v[i][j]
		}
	}
	for i := range dim {
		for j := range dim {
			p.mu[i] += v[i][j] * vtb[j]
		}
	}
	return p
}

// sample returns θᵀx for θ = μ + scale·noise, noise ~ N(0, A⁻¹), drawing
// z ~ N(0, I₉). scale 0 draws nothing.
func (p *posterior) sample(r *rand.Rand, scale float64, x *vec) float64 {
	mean := dot(&p.mu, x)
	if scale == 0 {
		return mean
	}
	var noise float64
	for j := range dim {
		row := &p.m[j]
		var w float64
		for i := range dim {
			w += row[i] * x[i]
		}
		noise += r.NormFloat64() * w
	}
	return mean + scale*noise
}

// update applies A ← γA + xxᵀ + (1−γ)λI, b ← γb + r·x and publishes the new
// posterior. It reports whether the eigen fallback was needed.
func (a *arm) update(x *vec, reward, lambda, forget float64) bool {
	g := min(max(forget, minForget), maxForget)
	reward = clip01(reward)
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := range dim {
		for j := range dim {
			a.a[i][j] = g*a.a[i][j] + x[i]*x[j]
		}
		a.a[i][i] += (1 - g) * lambda
		a.b[i] = g*a.b[i] + reward*x[i]
	}
	a.a.symmetrize()
	a.updates++
	p, fellBack := computePosterior(&a.a, &a.b)
	a.post.Store(p)
	return fellBack
}

// validFeatures reports whether x can be learned from.
func validFeatures(x *vec) bool {
	for _, v := range x {
		if !(math.Abs(v) <= maxFeatureAb) {
			return false
		}
	}
	return true
}

func clip01(v float64) float64 {
	if !(v > 0) { // also NaN
		return 0
	}
	return min(v, 1)
}
