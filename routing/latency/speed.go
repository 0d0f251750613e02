package latency

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing"
)

// belief is one endpoint rank's factor posterior, replaced whole on each
// update.
type belief struct {
	mu sync.Mutex // writers only
	v  atomic.Pointer[posterior]
}

// posterior is a Normal belief over the log speed factor: mean m,
// precision p.
type posterior struct {
	m, p float64
	n    int
	seen time.Time
	// run is a moving average of the running sequences at this replica's
	// own decisions on the endpoint (peers' outcomes do not carry them).
	run float64
}

// runAlpha is the weight of one local outcome in posterior.run.
const runAlpha = 0.1

// recentRunning returns the endpoint's average running sequences at
// recent local decisions (0 when unknown).
func (m *Model) recentRunning(k key) float64 {
	if bi, ok := m.speeds.Load(k); ok {
		if v := bi.(*belief).v.Load(); v != nil {
			return v.run
		}
	}
	return 0
}

// belief returns the candidate's belief, from its memo (lock-free) or the
// model's map (then memoised); nil when nothing was learned yet. The memo
// slot is the policy's (one policy, hence one model, per engine).
func (m *Model) belief(c *routing.Candidate) *belief {
	memo := c.Memo()
	if v := memo.Load(); v != nil {
		if b, ok := (*v).(*belief); ok {
			return b
		}
	}
	bi, ok := m.speeds.Load(key{c.Key(), c.DPRank})
	if !ok {
		return nil
	}
	var v any = bi
	memo.Store(&v)
	return bi.(*belief)
}

// Factor returns the candidate's log speed factor posterior: mean and
// standard deviation (the prior for an endpoint not seen yet).
func (m *Model) Factor(c *routing.Candidate) (mean, sd float64) {
	if b := m.belief(c); b != nil {
		if v := b.v.Load(); v != nil {
			return v.m, 1 / math.Sqrt(v.p)
		}
	}
	return 0, m.cfg.PriorSigma
}

// Draw returns the candidate's speed factor: a Thompson draw from its
// posterior, or its mean when mean is set, bounded by MaxFactor.
func (m *Model) Draw(c *routing.Candidate, rng *rand.Rand, mean bool) float64 {
	mu, sd := m.Factor(c)
	if mean {
		sd = 0
	}
	f := math.Exp(mu + sd*rng.NormFloat64())
	return min(max(f, 1/m.cfg.MaxFactor), m.cfg.MaxFactor)
}

// observeSpeed folds one log ratio (measured over pooled prediction) into
// the endpoint's factor.
func (m *Model) observeSpeed(k key, rel float64, at time.Time, running float64, local bool) {
	if math.IsNaN(rel) || math.IsInf(rel, 0) {
		return
	}
	bi, _ := m.speeds.LoadOrStore(k, &belief{})
	b := bi.(*belief)
	b.mu.Lock()
	defer b.mu.Unlock()
	prev := b.v.Load()
	if prev == nil {
		pp := 1e12 // PriorSigma 0: the prior is certain
		if m.cfg.PriorSigma > 0 {
			pp = 1 / (m.cfg.PriorSigma * m.cfg.PriorSigma)
		}
		prev = &posterior{p: pp}
	}
	obs := 1 / (m.cfg.ObsSigma * m.cfg.ObsSigma)
	kept := m.cfg.SpeedForget * prev.p
	next := &posterior{p: kept + obs, n: prev.n + 1, seen: at, run: prev.run}
	if local && running >= 0 && !math.IsInf(running, 0) {
		if prev.n == 0 {
			next.run = running
		} else {
			next.run += runAlpha * (running - prev.run)
		}
	}
	next.m = (kept*prev.m + obs*rel) / next.p
	b.v.Store(next)
}

// Speed is one endpoint rank's factor for metrics and debugging.
type Speed struct {
	Endpoint routing.EndpointKey
	DPRank   int
	// Factor is exp(mean): > 1 means slower than the fleet's pooled fit.
	Factor       float64
	Sigma        float64
	Observations int
}

// Speeds returns the current factors, sorted by endpoint and rank.
func (m *Model) Speeds() []Speed {
	var out []Speed
	m.speeds.Range(func(kk, val any) bool {
		k := kk.(key)
		if v := val.(*belief).v.Load(); v != nil {
			out = append(out, Speed{Endpoint: k.ep, DPRank: k.rank, Factor: math.Exp(v.m), Sigma: 1 / math.Sqrt(v.p), Observations: v.n})
		}
		return true
	})
	slices.SortFunc(out, func(a, b Speed) int {
		if a.Endpoint != b.Endpoint {
			if a.Endpoint < b.Endpoint {
				return -1
			}
			return 1
		}
		return a.DPRank - b.DPRank
	})
	return out
}

// Forget drops the factors of endpoints not observed since before.
func (m *Model) Forget(before time.Time) {
	m.speeds.Range(func(k, val any) bool {
		if v := val.(*belief).v.Load(); v != nil && v.seen.Before(before) {
			m.speeds.Delete(k)
		}
		return true
	})
}
