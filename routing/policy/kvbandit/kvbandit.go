// Package kvbandit implements the kvbandit policy: Dynamo's KV cost model as
// the backbone, refined by Thompson sampling on what a cost model cannot
// know, and by hint-driven prefix affinity.
//
// For candidate w the policy computes
//
//	cost_w = ŝ_w · prefill_w + δ · decode_w + β · O_w − A_w
//
// where prefill_w + decode_w is Dynamo's cost (routing/policy/kv): the
// prefill work w would have (its in-flight prefill plus this request's
// uncached tokens, in blocks, weighted) and the decode blocks it would hold.
// δ (decode_weight, 1/32) puts the two in time units: in a chunked-prefill
// engine the decodes ride along with prefill steps, so a held block delays a
// new request's first token far less than a block to prefill; with Dynamo's
// δ = 1 a busy worker's decode blocks outweigh a cached prefix.
// O_w is the work still announced by the agent sessions pinned to w (reuse
// budget × blocks per request, from the prefix hints; it places new
// sessions and sessionless requests, and does not move a pinned session),
// and A_w an affinity credit for the endpoint the request's session last
// went to, which shrinks with the session's remaining reuse budget and
// decays with the time since its last request (on the scale of its
// inter-arrival hint). The lowest cost wins; ties go to the smaller cache
// tree, then at random.
//
// ŝ_w is how slow w prefills relative to the fleet, as a log-normal
// posterior learned from time to first token per unit of prefill work at
// decision time; it is sampled per request (Thompson sampling), or taken at
// its mean for a session already in progress, whose cache should not be
// gambled on an exploratory draw. It scales only the prefill term: the
// decode-block term is memory pressure, common to every endpoint for an
// idle fleet, and scaling it would turn the sampling noise into a bias
// against cache hits. The posterior forgets (a worker that slows down
// mid-run is found out, a recovered one tried again), and sampling keeps
// several kvbandit replicas, or a burst of identical requests, from herding
// onto one endpoint.
package kvbandit

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/policy/kv"
)

// Name is the --policy value.
const Name = "kvbandit"

// Config holds the policy's parameters.
type Config struct {
	// OverlapScoreWeight is the kv backbone's prefill weight.
	OverlapScoreWeight float64 `json:"overlap_score_weight"`
	// DecodeWeight scales the decode-block term (Dynamo's kv uses 1).
	DecodeWeight float64 `json:"decode_weight"`
	// Speed is the Thompson-sampled speed posterior.
	Speed SpeedConfig `json:"speed"`
	// Affinity is the hint-driven prefix affinity.
	Affinity AffinityConfig `json:"affinity"`
}

// SpeedConfig parameterises the per-endpoint speed posterior (log space).
type SpeedConfig struct {
	// PriorSigma is the prior standard deviation of log speed (0.15: a
	// worker is believed within about ×0.86–×1.16 of the fleet until its
	// outcomes say otherwise; wider priors make an untried worker's draws
	// outweigh a modest cache advantage).
	PriorSigma float64 `json:"prior_sigma"`
	// ObsSigma is the noise of one observation's log time-per-work.
	ObsSigma float64 `json:"obs_sigma"`
	// Forget discounts the posterior precision per observation (0.97: the
	// last ~30 observations dominate).
	Forget float64 `json:"forget"`
	// BaselineAlpha is the EMA rate of the fleet baseline.
	BaselineAlpha float64 `json:"baseline_alpha"`
	// MaxFactor bounds a sampled factor to [1/MaxFactor, MaxFactor].
	MaxFactor float64 `json:"max_factor"`
}

// AffinityConfig parameterises prefix affinity from hints.
type AffinityConfig struct {
	// Weight scales the credit, in blocks, per block of the prompt.
	Weight float64 `json:"weight"`
	// OutstandingWeight (β) scales pinned sessions' announced work.
	OutstandingWeight float64 `json:"outstanding_weight"`
	// DecayLowSeconds, DecayMediumSeconds and DecayHighSeconds are the
	// affinity decay times for the inter-arrival hint levels.
	DecayLowSeconds    float64 `json:"decay_low_seconds"`
	DecayMediumSeconds float64 `json:"decay_medium_seconds"`
	DecayHighSeconds   float64 `json:"decay_high_seconds"`
}

// DefaultDecodeWeight is the decode-block term's weight. Decode work
// barely delays a new request's first token in a chunked-prefill engine
// (prefill steps run at prefill speed with the decodes riding along), so
// in time units one held block weighs far less than one block to prefill;
// Dynamo's 1 lets a busy worker's decode blocks outweigh a cached prefix
// and scatters sessions. The value comes from `kvbandit bench` (docs/bench.md).
const DefaultDecodeWeight = 1.0 / 32

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{
		OverlapScoreWeight: 1,
		DecodeWeight:       DefaultDecodeWeight,
		Speed:              SpeedConfig{PriorSigma: 0.15, ObsSigma: 0.35, Forget: 0.97, BaselineAlpha: 0.05, MaxFactor: 8},
		Affinity:           AffinityConfig{Weight: 1, OutstandingWeight: 0.1, DecayLowSeconds: 2, DecayMediumSeconds: 10, DecayHighSeconds: 60},
	}
}

// Validate checks the parameters, naming the bad field.
func (c Config) Validate() error {
	var errs []error
	check := func(name string, v, lo, hi float64, loOpen bool) {
		if math.IsNaN(v) || v < lo || v > hi || (loOpen && v == lo) {
			errs = append(errs, fmt.Errorf("kvbandit.%s: %v out of range", name, v))
		}
	}
	inf := math.Inf(1)
	check("overlap_score_weight", c.OverlapScoreWeight, 0, 1e6, false)
	check("decode_weight", c.DecodeWeight, 0, 1e6, false)
	check("speed.prior_sigma", c.Speed.PriorSigma, 0, 10, false)
	check("speed.obs_sigma", c.Speed.ObsSigma, 0, 10, true)
	check("speed.forget", c.Speed.Forget, 0, 1, true)
	check("speed.baseline_alpha", c.Speed.BaselineAlpha, 0, 1, true)
	check("speed.max_factor", c.Speed.MaxFactor, 1, inf, false)
	check("affinity.weight", c.Affinity.Weight, 0, 1e6, false)
	check("affinity.outstanding_weight", c.Affinity.OutstandingWeight, 0, 1e6, false)
	check("affinity.decay_low_seconds", c.Affinity.DecayLowSeconds, 0, inf, true)
	check("affinity.decay_medium_seconds", c.Affinity.DecayMediumSeconds, 0, inf, true)
	check("affinity.decay_high_seconds", c.Affinity.DecayHighSeconds, 0, inf, true)
	return errors.Join(errs...)
}

// Session is what the policy learns from the prefix state for one request.
type Session struct {
	// Reuse is the reuse budget left after this request (0: none).
	Reuse int
	// Last is where the session's previous request went ("" if none).
	Last routing.EndpointKey
	// LastRank is that request's data-parallel rank.
	LastRank int
	// Since is the time since the session's previous request.
	Since time.Duration
}

// Prefixes is the prefix state the policy needs (routing/prefixstate
// provides it). Implementations are safe for concurrent use.
type Prefixes interface {
	// Arrive counts a request of the session (when commit) and reports its
	// state; ok is false for requests without a prefix id.
	Arrive(req *routing.Request, commit bool) (Session, bool)
	// Pin records where the session's request went and the work (in
	// blocks) its remaining requests are expected to bring.
	Pin(req *routing.Request, ep routing.EndpointKey, rank, reuse int, work float64)
	// Outstanding is the announced work (blocks) of sessions pinned to ep.
	Outstanding(ep routing.EndpointKey) float64
}

// Policy is the kvbandit policy.
type Policy struct {
	cfg      Config
	prefixes Prefixes

	// post maps postKey → *belief. Reads on the request path are lock-free
	// (sync.Map load, atomic pointer load); Done serialises writers per key.
	post sync.Map
	// baseline is the fleet-wide EMA of log time-per-work (float64 bits);
	// haveBase is set once it holds a value.
	baseline atomic.Uint64
	haveBase atomic.Bool
}

// belief is one endpoint rank's posterior, replaced whole on each update.
type belief struct {
	mu sync.Mutex // writers only
	v  atomic.Pointer[posterior]
}

type postKey struct {
	ep   routing.EndpointKey
	rank int
}

// posterior is a Normal belief over log speed: mean m, precision p.
type posterior struct {
	m, p float64
	n    int
	seen time.Time
}

var (
	_ routing.Policy       = (*Policy)(nil)
	_ routing.OutcomeAware = (*Policy)(nil)
)

// New returns the policy. prefixes may be nil (no affinity, no outstanding
// work).
func New(cfg Config, prefixes Prefixes) (*Policy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Policy{cfg: cfg, prefixes: prefixes}, nil
}

// Name implements [routing.Policy].
func (*Policy) Name() string { return Name }

// NeedsOutcomes implements [routing.OutcomeAware].
func (*Policy) NeedsOutcomes() bool { return true }

// decision is the per-decision state kept for Done.
type decision struct {
	key  postKey
	work float64 // 1 + prefill blocks (in flight + uncached) at decision time
}

// Choose implements [routing.Policy]. Scores are the sampled costs (lower
// is better).
func (p *Policy) Choose(s *routing.Scoring, commit bool) (routing.Choice, error) {
	var sess Session
	var hasSess bool
	if p.prefixes != nil {
		sess, hasSess = p.prefixes.Arrive(s.Req, commit)
	}
	rng := rand.New(s.Rand)
	// Announced work places new work: a request that starts (or has no)
	// session. A pinned session's later requests are not moved by it (their
	// own history is cached where they are; the kv cost and the affinity
	// decide), or sessions would hop whenever another one is pinned.
	placing := p.prefixes != nil && !(hasSess && sess.Last != "")
	costs := make([]float64, len(s.Candidates))
	bs := max(s.BlockSize, 1)
	promptBlocks := float64(s.ISL) / float64(bs)
	for i := range s.Candidates {
		c := &s.Candidates[i]
		prefill := p.cfg.OverlapScoreWeight * prefillBlocks(s, c)
		cost := p.factor(c, rng, !placing)*prefill + p.cfg.DecodeWeight*float64(c.ActiveBlocks+int64(c.NewBlocks))
		if placing && p.cfg.Affinity.OutstandingWeight > 0 {
			cost += p.cfg.Affinity.OutstandingWeight * p.prefixes.Outstanding(c.Key())
		}
		costs[i] = cost
		if hasSess && sess.Reuse > 0 && sess.Last == c.Key() && (sess.LastRank == c.DPRank || c.DPRank < 0) {
			costs[i] -= p.affinity(sess, s.Req.Hints.IAT) * promptBlocks
		}
	}
	idx := kv.Select(costs, s.Candidates, 0, s.Rand)
	c := &s.Candidates[idx]
	if commit && hasSess && p.prefixes != nil {
		p.prefixes.Pin(s.Req, c.Key(), c.DPRank, sess.Reuse, float64(sess.Reuse)*(promptBlocks+outputBlocks(s.Req, bs)))
	}
	st := &decision{key: postKey{c.Key(), c.DPRank}, work: 1 + prefillBlocks(s, c)}
	ch := routing.Choice{Index: idx, Scores: costs, State: st, Sticky: hasSess && sess.Last != "" && sess.Last == c.Key()}
	if s.WantRanked {
		ch.Ranked = kv.Rank(costs, idx)
	}
	return ch, nil
}

// prefillBlocks is the prefill work on c if the request goes there: its
// in-flight prefill plus the request's uncached tokens, in blocks.
func prefillBlocks(s *routing.Scoring, c *routing.Candidate) float64 {
	return prefillWork(c.ActivePrefillTokens, s.ISL, c.Overlap, s.BlockSize)
}

// prefillWork is the prefill work, in blocks of bs tokens, of a request of
// isl tokens with overlap cached blocks on an endpoint rank with queued
// prompt tokens in flight.
func prefillWork(queued int64, isl, overlap, bs int) float64 {
	bs = max(bs, 1)
	return (float64(queued) + float64(max(isl-overlap*bs, 0))) / float64(bs)
}

// outputBlocks estimates a request's generated blocks from its hints.
func outputBlocks(r *routing.Request, bs int) float64 {
	switch {
	case r.Hints.OSLTokens > 0:
		return float64(r.Hints.OSLTokens) / float64(bs)
	case r.MaxTokens > 0:
		return float64(min(r.MaxTokens, 1024)) / float64(bs)
	}
	return 256 / float64(bs)
}

// affinity is the credit (per prompt block) for the session's last endpoint.
func (p *Policy) affinity(s Session, iat routing.Level) float64 {
	tau := p.cfg.Affinity.DecayMediumSeconds
	switch iat {
	case routing.LevelLow:
		tau = p.cfg.Affinity.DecayLowSeconds
	case routing.LevelHigh:
		tau = p.cfg.Affinity.DecayHighSeconds
	}
	r := float64(s.Reuse)
	return p.cfg.Affinity.Weight * r / (r + 1) * math.Exp(-s.Since.Seconds()/tau)
}

// belief returns the candidate's belief, from its memo (lock-free) or the
// policy's map (then memoised); nil when nothing was learned yet.
func (p *Policy) belief(c *routing.Candidate) *belief {
	memo := c.Memo()
	if v := memo.Load(); v != nil {
		if b, ok := (*v).(*belief); ok {
			return b
		}
	}
	bi, ok := p.post.Load(postKey{c.Key(), c.DPRank})
	if !ok {
		return nil
	}
	var v any = bi
	memo.Store(&v)
	return bi.(*belief)
}

// factor is c's speed factor: a draw from its posterior (the prior for an
// endpoint not seen yet) or, with mean set, the posterior mean. Requests of
// a session in progress use the mean: exploring on them would move a session
// away from its cache on a whim; new sessions and sessionless requests do
// the exploring (and the spreading that sampling gives).
func (p *Policy) factor(c *routing.Candidate, rng *rand.Rand, mean bool) float64 {
	m, sd := 0.0, p.cfg.Speed.PriorSigma
	if b := p.belief(c); b != nil {
		if v := b.v.Load(); v != nil {
			m, sd = v.m, 1/math.Sqrt(v.p)
		}
	}
	if mean {
		sd = 0
	}
	f := math.Exp(m + sd*rng.NormFloat64())
	return min(max(f, 1/p.cfg.Speed.MaxFactor), p.cfg.Speed.MaxFactor)
}

// Done implements [routing.Policy]: a successful response's time to first
// token per unit of prefill work at decision time updates the endpoint's
// speed posterior and the fleet baseline. Other outcomes teach nothing
// about speed, nor does one served by an endpoint outside the set
// (Outcome.ServedUnknown): its time belongs to no endpoint the policy
// knows. A success served by another endpoint of the set is charged to the
// decision's endpoint and rank, whose work it was measured against.
func (p *Policy) Done(d *routing.Decision, o routing.Outcome) {
	st, ok := d.PolicyState().(*decision)
	if !ok || o.ServedUnknown || o.Kind != routing.OutcomeSuccess || o.TTFT <= 0 {
		return
	}
	y := math.Log(o.TTFT.Seconds() * 1000 / st.work)
	if math.IsNaN(y) || math.IsInf(y, 0) {
		return
	}
	p.observe(st.key, y, d.At)
}

// observe folds one log time-per-work observation into the baseline and
// the endpoint's posterior.
func (p *Policy) observe(k postKey, y float64, at time.Time) {
	sc := p.cfg.Speed
	var base float64
	for {
		old := p.baseline.Load()
		cur := math.Float64frombits(old)
		if !p.haveBase.Load() {
			cur = y
		}
		base = cur
		next := cur + sc.BaselineAlpha*(y-cur)
		if p.baseline.CompareAndSwap(old, math.Float64bits(next)) {
			p.haveBase.Store(true)
			break
		}
	}
	rel := y - base
	bi, _ := p.post.LoadOrStore(k, &belief{})
	b := bi.(*belief)
	b.mu.Lock()
	defer b.mu.Unlock()
	prev := b.v.Load()
	if prev == nil {
		prior := 1e12 // PriorSigma 0: the prior is certain
		if sc.PriorSigma > 0 {
			prior = 1 / (sc.PriorSigma * sc.PriorSigma)
		}
		prev = &posterior{p: prior}
	}
	obsPrec := 1 / (sc.ObsSigma * sc.ObsSigma)
	kept := sc.Forget * prev.p
	next := &posterior{p: kept + obsPrec, n: prev.n + 1, seen: at}
	next.m = (kept*prev.m + obsPrec*rel) / next.p
	b.v.Store(next)
}

// Posterior is one endpoint's speed belief for metrics and debugging.
type Posterior struct {
	Endpoint routing.EndpointKey
	DPRank   int
	// Factor is exp(mean): > 1 means slower than the fleet.
	Factor       float64
	Sigma        float64
	Observations int
}

// Posteriors returns the current beliefs, sorted by endpoint.
func (p *Policy) Posteriors() []Posterior {
	var out []Posterior
	p.post.Range(func(key, val any) bool {
		k := key.(postKey)
		if v := val.(*belief).v.Load(); v != nil {
			out = append(out, Posterior{Endpoint: k.ep, DPRank: k.rank, Factor: math.Exp(v.m), Sigma: 1 / math.Sqrt(v.p), Observations: v.n})
		}
		return true
	})
	slices.SortFunc(out, func(a, b Posterior) int {
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

// Forget drops the beliefs about endpoints not observed since before.
func (p *Policy) Forget(before time.Time) {
	p.post.Range(func(key, val any) bool {
		if v := val.(*belief).v.Load(); v != nil && v.seen.Before(before) {
			p.post.Delete(key)
		}
		return true
	})
}
