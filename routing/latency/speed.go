package latency

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/evidence"
)

// belief is one endpoint rank's factor posterior, replaced whole on each
// update (v: what Factor and Draw read, lock-free), and the evidence it
// sums, kept apart by source (ev: this replica's outcomes with the prior,
// and each peer's), so that a peer's can be taken out (ForgetPeer).
//
// v is updated by the single-posterior recursion itself, so that it is
// bit for bit what it was before sources were kept apart (one replica's
// routing is unchanged); ev is updated beside it, and v is rebuilt from
// ev only when a part is removed. The two agree up to rounding
// (TestSpeedPartsSumToPosterior).
type belief struct {
	mu sync.Mutex // writers only; guards ev
	v  atomic.Pointer[posterior]
	ev evidence.Set // precision W and precision-weighted log factor S
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

// priorPrecision is the precision of an unseen endpoint's factor.
func (m *Model) priorPrecision() float64 {
	if m.cfg.PriorSigma > 0 {
		return 1 / (m.cfg.PriorSigma * m.cfg.PriorSigma)
	}
	return 1e12 // PriorSigma 0: the prior is certain
}

// observeSpeed folds one log ratio (measured over pooled prediction) from
// src into the endpoint's factor. Every part of the belief is discounted
// as the posterior is (SpeedForget, or SpeedForget^RemoteWeight for a
// peer's outcome) and src's part gains the outcome's precision.
func (m *Model) observeSpeed(k key, rel float64, at time.Time, running float64, src evidence.Source) {
	if math.IsNaN(rel) || math.IsInf(rel, 0) {
		return
	}
	local := src == evidence.Local
	obs := 1 / (m.cfg.ObsSigma * m.cfg.ObsSigma)
	keep := m.cfg.SpeedForget
	if !local {
		// A peer's outcome counts as RemoteWeight local ones: that much
		// evidence, that much forgetting.
		w := m.cfg.RemoteWeight
		if w == 0 {
			return
		}
		obs *= w
		keep = math.Pow(m.cfg.SpeedForget, w)
	}
	bi, _ := m.speeds.LoadOrStore(k, &belief{})
	b := bi.(*belief)
	b.mu.Lock()
	defer b.mu.Unlock()
	prev := b.v.Load()
	fresh := prev == nil
	if fresh {
		prev = &posterior{p: m.priorPrecision(), m: m.fleetPrior()}
		b.ev.Reset()
		b.ev.Add(evidence.Local, prev.p, prev.p*prev.m, 0) // the prior is this replica's
	}
	kept := keep * prev.p
	b.ev.Scale(keep)
	b.ev.Add(src, obs, obs*rel, 1)
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

// ForgetPeer takes what peer's outcomes taught out of every endpoint's
// factor (routing.PeerForgetter): each factor becomes the sum of its other
// parts, this replica's own evidence with the prior and the other peers'.
// What stays is what peer's outcomes made the other parts forget (they
// discount every part, as any outcome does): when the parts left are less
// certain than the prior, they are scaled up to its precision, their mean
// kept, so that an endpoint a flood of forged outcomes made this replica
// forget keeps what its own outcomes said with a fresh endpoint's
// certainty, no wider. An endpoint only peer taught is unseen again. It is safe for
// concurrent use with everything else; it blocks the learning of peers'
// outcomes (not reads, nor local outcomes) while it runs, O(endpoints).
func (m *Model) ForgetPeer(peer string) { m.sources.Forget(peer, m.forgetSource) }

// forgetSource removes src's part from every belief.
func (m *Model) forgetSource(src evidence.Source) {
	m.speeds.Range(func(_, val any) bool {
		m.forgetIn(val.(*belief), src)
		return true
	})
}

func (m *Model) forgetIn(b *belief, src evidence.Source) {
	b.mu.Lock()
	defer b.mu.Unlock()
	prev := b.v.Load()
	if prev == nil {
		return
	}
	if _, ok := b.ev.Remove(src); !ok {
		return
	}
	if b.ev.Peers() == 0 && b.ev.Part(evidence.Local).N == 0 {
		// Nothing left but the prior: unseen again.
		b.ev.Reset()
		b.v.Store(nil)
		m.adjustFleet(-prev.m, -1)
		return
	}
	tot := b.ev.Total()
	if pp := m.priorPrecision(); !(tot.W >= pp) {
		if tot.W > 0 {
			b.ev.Scale(pp / tot.W) // the mean left, at the prior's certainty
		} else {
			b.ev.Reset() // nothing left at all (underflow): the prior
			b.ev.Add(evidence.Local, pp, pp*m.fleetPrior(), 0)
		}
		tot = b.ev.Total()
	}
	next := &posterior{m: tot.Mean(), p: tot.W, n: tot.N, seen: prev.seen, run: prev.run}
	b.v.Store(next)
	m.adjustFleet(next.m-prev.m, 0)
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
