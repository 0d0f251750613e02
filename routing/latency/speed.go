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
	return m.fleetPrior(), m.cfg.PriorSigma
}

// fleetMean is the mean log factor over the endpoints learnt so far: the prior
// mean of an endpoint not seen yet. The factors are relative to the pooled
// fit, which takes a while to find the fleet's scale; while it does, the
// endpoints that served first learn its error as their own speed. With a
// prior of 0 an unseen endpoint would then look slower (or faster) than
// every endpoint seen, for no reason of its own; starting it at the fleet's
// mean keeps cold endpoints level with the rest.
type fleetMean struct {
	mu   sync.Mutex
	sum  float64
	n    int
	mean atomic.Uint64 // float64 bits of sum/n (0 when n is 0)
}

// fleetPrior returns the fleet's mean log factor.
func (m *Model) fleetPrior() float64 { return math.Float64frombits(m.fleet.mean.Load()) }

// adjustFleet adds delta to the sum of the learnt means and dn to their count.
func (m *Model) adjustFleet(delta float64, dn int) {
	f := &m.fleet
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sum += delta
	f.n += dn
	mean := 0.0
	if f.n > 0 {
		mean = f.sum / float64(f.n)
	} else {
		f.sum = 0
	}
	f.mean.Store(math.Float64bits(mean))
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
	fresh := prev == nil
	if fresh {
		pp := 1e12 // PriorSigma 0: the prior is certain
		if m.cfg.PriorSigma > 0 {
			pp = 1 / (m.cfg.PriorSigma * m.cfg.PriorSigma)
		}
		prev = &posterior{p: pp, m: m.fleetPrior()}
	}
	obs := 1 / (m.cfg.ObsSigma * m.cfg.ObsSigma)
	kept := m.cfg.SpeedForget * prev.p
	if !local {
		// A peer's outcome counts as RemoteWeight local ones: that much
		// evidence, that much forgetting.
		w := m.cfg.RemoteWeight
		if w == 0 {
			return
		}
		obs *= w
		kept = math.Pow(m.cfg.SpeedForget, w) * prev.p
	}
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
	if fresh {
		m.adjustFleet(next.m, 1)
	} else {
		m.adjustFleet(next.m-prev.m, 0)
	}
}

// Speed is one endpoint rank's factor for metrics and debugging.
type Speed struct {
	Endpoint routing.EndpointKey
	DPRank   int
	// Factor is exp(mean): > 1 means slower than the fleet's pooled fit.
	// The pooled fit takes a while to find the fleet's scale, so every
	// endpoint's Factor can sit above (or below) 1 together.
	Factor float64
	// Relative is Factor over the fleet's geometric mean factor (the
	// endpoints learnt so far): 1 is the fleet's average speed, 2 twice as
	// slow, 0.5 twice as fast. On an even fleet every endpoint reads about 1.
	Relative     float64
	Sigma        float64
	Observations int
}

// Speeds returns the current factors, sorted by endpoint and rank.
func (m *Model) Speeds() []Speed {
	var out []Speed
	var logs []float64
	m.speeds.Range(func(kk, val any) bool {
		k := kk.(key)
		if v := val.(*belief).v.Load(); v != nil {
			out = append(out, Speed{Endpoint: k.ep, DPRank: k.rank, Factor: math.Exp(v.m), Sigma: 1 / math.Sqrt(v.p), Observations: v.n})
			logs = append(logs, v.m)
		}
		return true
	})
	// The fleet's mean log factor over this very snapshot (not fleetPrior,
	// which a concurrent update may have moved), so the Relative factors'
	// geometric mean is 1.
	var sum float64
	for _, l := range logs {
		sum += l
	}
	for i := range out {
		out[i].Relative = math.Exp(logs[i] - sum/float64(len(logs)))
	}
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
			if _, loaded := m.speeds.LoadAndDelete(k); loaded {
				m.adjustFleet(-v.m, -1)
			}
		}
		return true
	})
}
