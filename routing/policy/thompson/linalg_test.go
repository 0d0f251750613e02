package thompson

import (
	"math"
	"math/rand/v2"
	"testing"
)

func randomSPD(rng *rand.Rand) mat {
	var g, a mat
	for i := range dim {
		for j := range dim {
			g[i][j] = rng.NormFloat64()
		}
	}
	for i := range dim {
		for j := range dim {
			for k := range dim {
				a[i][j] += g[i][k] * g[j][k]
			}
		}
		a[i][i] += 0.1
	}
	return a
}

func matVec(a *mat, x *vec) vec {
	var y vec
	for i := range dim {
		for j := range dim {
			y[i] += a[i][j] * x[j]
		}
	}
	return y
}

func TestCholeskyAndSolves(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	for range 50 {
		a := randomSPD(rng)
		var l mat
		if !cholesky(&a, 0, &l) {
			t.Fatal("SPD matrix refused")
		}
		for i := range dim {
			for j := range dim {
				var s float64
				for k := range dim {
					s += l[i][k] * l[j][k]
				}
				if math.Abs(s-a[i][j]) > 1e-9*(1+math.Abs(a[i][j])) {
					t.Fatalf("LLᵀ[%d][%d] = %v, want %v", i, j, s, a[i][j])
				}
				if j > i && l[i][j] != 0 {
					t.Fatal("L not lower triangular")
				}
			}
		}
		var b vec
		for i := range b {
			b[i] = rng.NormFloat64()
		}
		y := solveLower(&l, &b)
		x := solveUpperT(&l, &y)
		ax := matVec(&a, &x)
		for i := range dim {
			if math.Abs(ax[i]-b[i]) > 1e-8 {
				t.Fatalf("A·A⁻¹b = %v, want %v", ax, b)
			}
		}
	}
	neg := identity(1)
	neg[4][4] = -1
	var l mat
	if cholesky(&neg, 1e-3, &l) {
		t.Fatal("indefinite matrix accepted")
	}
	nan := identity(1)
	nan[2][2] = math.NaN()
	if cholesky(&nan, 0, &l) {
		t.Fatal("NaN matrix accepted")
	}
}

func TestSymEigen(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 2))
	for range 50 {
		a := randomSPD(rng)
		// Make it indefinite half the time.
		if rng.IntN(2) == 0 {
			for i := range dim {
				a[i][i] -= 5
			}
		}
		w, v := symEigen(a)
		for i := range dim {
			for j := range dim {
				var s, o float64
				for k := range dim {
					s += v[i][k] * w[k] * v[j][k]
					o += v[k][i] * v[k][j]
				}
				if math.Abs(s-a[i][j]) > 1e-9*(1+math.Abs(a[i][j])) {
					t.Fatalf("VΛVᵀ[%d][%d] = %v, want %v", i, j, s, a[i][j])
				}
				want := 0.0
				if i == j {
					want = 1
				}
				if math.Abs(o-want) > 1e-10 {
					t.Fatalf("VᵀV[%d][%d] = %v", i, j, o)
				}
			}
		}
	}
}

func TestPosteriorFallsBackToEigen(t *testing.T) {
	// Indefinite A: Cholesky fails at every jitter up to 1e-3, so the
	// eigen path floors the negative eigenvalue at 1e-10.
	a := identity(2)
	a[3][3] = -1
	b := vec{2, 4, 0, 1e-10, 0, 0, 0, 0, 8}
	p, fellBack := computePosterior(&a, &b)
	if !fellBack || p.chol {
		t.Fatal("no eigen fallback for an indefinite matrix")
	}
	want := vec{1, 2, 0, 1, 0, 0, 0, 0, 4} // b/2, and 1e-10/1e-10 for the floored one
	for i := range dim {
		if math.Abs(p.mu[i]-want[i]) > 1e-9 {
			t.Fatalf("μ = %v, want %v", p.mu, want)
		}
	}
	// Samples stay finite.
	rng := rand.New(rand.NewPCG(3, 3))
	x := vec{1, 1, 1, 0, 1, 1, 1, 1, 1}
	for range 100 {
		if v := p.sample(rng, 0.25, &x); math.IsNaN(v) || math.IsInf(v, 0) {
			t.Fatal(v)
		}
	}
	// A nearly singular but PSD matrix needs jitter, not the fallback.
	var s mat
	x1 := vec{1, 1, 1, 1, 1, 1, 1, 1, 1}
	for i := range dim {
		for j := range dim {
			s[i][j] = x1[i] * x1[j]
		}
	}
	if _, fellBack := computePosterior(&s, &vec{}); fellBack {
		t.Fatal("rank-one PSD matrix fell back; jitter should rescue it")
	}
}

func TestForgetRateOneIsClamped(t *testing.T) {
	a := newArm(armKey{}, &endpointState{}, nil, 1)
	x := vec{1, 0.5}
	for range 10 {
		a.update(&x, 1, 1, 1)
	}
	// γ = 0.999999: A ≈ I + 10·xxᵀ, finite and positive definite.
	if a.a[0][0] < 10.9 || a.a[0][0] > 11 || a.a[2][2] < 0.99 {
		t.Fatalf("A = %v", a.a)
	}
}

// TestPosteriorCovariance checks both noise paths against v²·xᵀA⁻¹x.
func TestPosteriorCovariance(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	a := randomSPD(rng)
	x := vec{1, 0.3, 0.7, 1, 0.1, 0.67, 0.5, 1, 0.76}
	var l mat
	if !cholesky(&a, 0, &l) {
		t.Fatal("not SPD")
	}
	y := solveLower(&l, &x)
	want := 0.25 * 0.25 * dot(&y, &y) // xᵀA⁻¹x = ‖L⁻¹x‖²
	chol, fellBack := computePosterior(&a, &vec{})
	if fellBack {
		t.Fatal("SPD matrix fell back")
	}
	for name, p := range map[string]*posterior{"cholesky": chol, "eigen": eigenPosterior(&a, &vec{})} {
		var s, s2 float64
		const n = 200000
		for range n {
			v := p.sample(rng, 0.25, &x)
			s += v
			s2 += v * v
		}
		mean, variance := s/n, s2/n-(s/n)*(s/n)
		if math.Abs(mean) > 4*math.Sqrt(want/n) || math.Abs(variance-want) > 0.02*want {
			t.Errorf("%s: mean %v variance %v, want 0 and %v", name, mean, variance, want)
		}
	}
}
