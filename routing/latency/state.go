package latency

import (
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/evidence"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file holds the warm start's side of the model (issue 22): the
// pooled fit and the speed factors exported for a peer replica that
// starts, and imported from one.

// maxFitValue bounds an imported fit's sums: a real fit's entries are
// sums of at most 1/(1-Forget) observations of regressors and times in
// milliseconds, far below it.
const maxFitValue = 1e15

// ExportState adds the model's pooled fit and speed factors to dst, with
// the factors' ages relative to now.
func (m *Model) ExportState(dst *warmstate.Snapshot, now time.Time) {
	m.mu.Lock()
	k := *m.coef.Load()
	l := &warmstate.Latency{
		Coefficients: [7]float64{k.PerBatch, k.PerStep, k.Base, k.DecodeShare, k.PerWaiting, k.DecodeBase, k.DecodePerRunning},
		Observations: uint64(max(k.Observations, 0)),
		TTFT:         warmstate.Fit{S: append([]float64(nil), m.tt.s...), XY: append([]float64(nil), m.tt.xy...)},
		Decode:       warmstate.Fit{S: append([]float64(nil), m.dec.s...), XY: append([]float64(nil), m.dec.xy...)},
	}
	m.mu.Unlock()
	dst.Latency = l
	m.speeds.Range(func(kk, val any) bool {
		k := kk.(key)
		if v := val.(*belief).v.Load(); v != nil {
			dst.Speeds = append(dst.Speeds, warmstate.Speed{
				Endpoint: string(k.ep), Rank: int32(k.rank), Mean: v.m, Precision: v.p, Running: v.run,
				Observations: uint32(min(v.n, math.MaxUint32)), AgeMillis: ageMillis(now.Sub(v.seen)),
			})
		}
		return true
	})
}

func ageMillis(d time.Duration) uint32 {
	return uint32(min(max(d.Milliseconds(), 0), math.MaxUint32))
}

// ImportState takes a peer's pooled fit when it folded in more outcomes
// than this model's (the coefficients are solved again from the fit's
// sums, not taken as sent), and its speed factors for the endpoint ranks
// known says are in the endpoint set and this model has learnt less of.
// Values out of range (a fit of the wrong size, a non-finite or huge sum,
// a negative diagonal; a factor beyond MaxFactor, a precision not
// positive and finite, a negative running average) are refused and
// counted as malformed, never applied.
func (m *Model) ImportState(src *warmstate.Snapshot, now time.Time, known func(routing.EndpointKey, int) bool) warmstate.Imported {
	var out warmstate.Imported
	if l := src.Latency; l != nil {
		switch {
		case !validFit(&l.TTFT, warmstate.FitDimTTFT) || !validFit(&l.Decode, warmstate.FitDimDecode):
			out.Malformed++
		case m.importFit(l):
			out.Latency = true
		default:
			out.Skipped++
		}
	}
	lim := math.Log(m.cfg.MaxFactor)
	for i := range src.Speeds {
		sp := &src.Speeds[i]
		switch {
		case !finite(sp.Mean) || math.Abs(sp.Mean) > lim || !finite(sp.Precision) || sp.Precision <= 0 || sp.Precision > 1e12 ||
			!finite(sp.Running) || sp.Running < 0 || sp.Running > 1e9 || sp.Rank < -1 || sp.Rank > warmstate.MaxRank ||
			len(sp.Endpoint) > warmstate.MaxStringLen:
			out.Malformed++
		case known != nil && !known(routing.EndpointKey(sp.Endpoint), int(sp.Rank)):
			out.Skipped++
		case m.importSpeed(sp, now):
			out.Speeds++
		default:
			out.Skipped++
		}
	}
	return out
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

func validFit(f *warmstate.Fit, n int) bool {
	if len(f.S) != n*n || len(f.XY) != n {
		return false
	}
	for _, v := range append(f.S[:len(f.S):len(f.S)], f.XY...) {
		if !finite(v) || math.Abs(v) > maxFitValue {
			return false
		}
	}
	for i := range n {
		if f.S[i*n+i] < 0 {
			return false
		}
	}
	return true
}

// importFit replaces the pooled fit with l's if l has more observations.
func (m *Model) importFit(l *warmstate.Latency) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := *m.coef.Load()
	if l.Observations <= uint64(max(k.Observations, 0)) {
		return false
	}
	copy(m.tt.s, l.TTFT.S)
	copy(m.tt.xy, l.TTFT.XY)
	copy(m.dec.s, l.Decode.S)
	copy(m.dec.xy, l.Decode.XY)
	t, d := m.tt.solve(), m.dec.solve()
	k.PerBatch, k.PerStep, k.Base, k.DecodeShare, k.PerWaiting = t[0], t[1], t[2], t[3], t[4]
	k.DecodeBase, k.DecodePerRunning = d[0], d[1]
	k.Observations = int(min(l.Observations, math.MaxInt32))
	m.coef.Store(&k)
	return true
}

// importSpeed sets one endpoint rank's factor unless this model has
// learnt as much of it already.
func (m *Model) importSpeed(sp *warmstate.Speed, now time.Time) bool {
	k := key{routing.EndpointKey(sp.Endpoint), int(sp.Rank)}
	bi, _ := m.speeds.LoadOrStore(k, &belief{})
	b := bi.(*belief)
	b.mu.Lock()
	defer b.mu.Unlock()
	prev := b.v.Load()
	if prev != nil && prev.n >= int(sp.Observations) {
		return false
	}
	next := &posterior{m: sp.Mean, p: sp.Precision, n: int(sp.Observations), run: sp.Running,
		seen: now.Add(-time.Duration(sp.AgeMillis) * time.Millisecond)}
	// The imported factor becomes this replica's own evidence (the parts
	// must sum to the posterior, routing/evidence): forgetting a peer later
	// leaves it in place, and what this replica's peers taught before the
	// import is replaced by it.
	b.ev.Reset()
	b.ev.Add(evidence.Local, next.p, next.p*next.m, next.n)
	b.v.Store(next)
	if prev == nil {
		m.adjustFleet(next.m, 1)
	} else {
		m.adjustFleet(next.m-prev.m, 0)
	}
	return true
}
