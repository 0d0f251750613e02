package thompson

import "math"

// dim is the number of LinTS features.
const dim = 9

type (
	vec [dim]float64
	mat [dim][dim]float64
)

func identity(scale float64) mat {
	var m mat
	for i := range dim {
		m[i][i] = scale
	}
	return m
}

func (m *mat) symmetrize() {
	for i := range dim {
		for j := i + 1; j < dim; j++ {
			s := 0.5 * (m[i][j] + m[j][i])
			m[i][j], m[j][i] = s, s
		}
	}
}

func dot(a, b *vec) float64 {
	var s float64
	for i := range dim {
		s += a[i] * b[i]
	}
	return s
}

// cholesky writes the lower factor L of a + jitter·I (a symmetric) into l
// and reports whether a + jitter·I is positive definite.
func cholesky(a *mat, jitter float64, l *mat) bool {
	*l = mat{}
	for j := range dim {
		s := a[j][j] + jitter
		for k := range j {
			s -= l[j][k] * l[j][k]
		}
		if !(s > 0) || math.IsInf(s, 1) { // also refuses NaN
			return false
		}
		d := math.Sqrt(s)
		l[j][j] = d
		for i := j + 1; i < dim; i++ {
			s := a[i][j]
			for k := range j {
				s -= l[i][k] * l[j][k]
			}
			l[i][j] = s / d
		}
	}
	return true
}

// solveLower solves L y = b for lower-triangular L.
func solveLower(l *mat, b *vec) vec {
	var y vec
	for i := range dim {
		s := b[i]
		for k := range i {
			s -= l[i][k] * y[k]
		}
		y[i] = s / l[i][i]
	}
	return y
}

// solveUpperT solves Lᵀ x = y for lower-triangular L.
func solveUpperT(l *mat, y *vec) vec {
	var x vec
	for i := dim - 1; i >= 0; i-- {
		s := y[i]
		for k := i + 1; k < dim; k++ {
			s -= l[k][i] * x[k]
		}
		x[i] = s / l[i][i]
	}
	return x
}

// symEigen returns the eigenvalues w and eigenvectors (the columns of v) of
// the symmetric matrix a, by cyclic Jacobi rotations: a = v·diag(w)·vᵀ.
func symEigen(a mat) (w vec, v mat) {
	v = identity(1)
	for range 64 {
		var off, diag float64
		for p := range dim {
			diag += a[p][p] * a[p][p]
			for q := p + 1; q < dim; q++ {
				off += a[p][q] * a[p][q]
			}
		}
		if off <= 1e-30*diag || !(off == off) {
			break
		}
		for p := range dim - 1 {
			for q := p + 1; q < dim; q++ {
				apq := a[p][q]
				if math.Abs(apq) < 1e-300 {
					continue
				}
				theta := (a[q][q] - a[p][p]) / (2 * apq)
				t := 1 / (math.Abs(theta) + math.Sqrt(theta*theta+1))
				if theta < 0 {
					t = -t
				}
				if math.IsInf(theta, 0) {
					t = 0
				}
				c := 1 / math.Sqrt(t*t+1)
				s := t * c
				for k := range dim { // a ← a·P (columns p, q)
					akp, akq := a[k][p], a[k][q]
					a[k][p], a[k][q] = c*akp-s*akq, s*akp+c*akq
				}
				for k := range dim { // a ← Pᵀ·a (rows p, q)
					apk, aqk := a[p][k], a[q][k]
					a[p][k], a[q][k] = c*apk-s*aqk, s*apk+c*aqk
				}
				for k := range dim { // v ← v·P
					vkp, vkq := v[k][p], v[k][q]
					v[k][p], v[k][q] = c*vkp-s*vkq, s*vkp+c*vkq
				}
			}
		}
	}
	for i := range dim {
		w[i] = a[i][i]
	}
	return w, v
}
