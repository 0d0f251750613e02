// Package kvbandit implements the kvbandit policy: it routes each request
// where its predicted time to first token is lowest, from an online-learned
// latency model (routing/latency), with Thompson sampling on each endpoint's
// learned speed and hint-driven prefix affinity.
//
// For candidate w the default cost (cost: ttft) is, in milliseconds,
//
//	cost_w = ŝ_w · T_w + ι · Impact_w + ρ · R_w + β · O_w − A_w
//
// T_w is the model's TTFT at the fleet's pooled speed: the prefill work
// already ahead on w plus the request's uncached tokens, in steps of the
// engine's batch budget, the decode step in progress and the requests
// blocked on full KV memory (see routing/latency). ŝ_w is w's speed factor
// relative to the pooled fit, a log-normal posterior: sampled per request
// (Thompson sampling) for new sessions and sessionless requests, taken at
// its mean for a session already in progress, whose cache should not be
// gambled on an exploratory draw. Impact_w = running_w × ŝ_w·prefill_w is
// the delay this request's prefill adds to the sequences decoding on w (they
// stall during prefill steps), weighted by ι (impact_weight). R_w is the
// fleet's cost of recomputing what another candidate has cached: the pooled
// prefill time of (max overlap − overlap_w) blocks, weighted by ρ
// (recompute_weight); it keeps a conversation where its cache is unless the
// wait there outweighs the GPU time a move costs the fleet. O_w is the work
// still announced by the agent sessions pinned to w (reuse budget × blocks
// per request, from the prefix hints, in pooled prefill time; it places new
// sessions and sessionless requests and does not move a pinned session),
// and A_w an affinity credit for the endpoint the request's session last
// went to: the prompt's pooled prefill time × weight × R/(R+1), R the
// session's remaining reuse budget, decaying with the time since its last
// request (on the scale of its inter-arrival hint). A session that
// announces its total (x-prefix-total-requests) has R = total − seen, and
// its affinity ends with its last request; a session id alone is assumed
// to continue, R = min(seen, 8) (routing/prefixstate, Store.Arrive): its
// credit grows from 1/2 to 8/9 of the full weight and it announces no
// work. The lowest cost
// wins; ties go to the smaller cache tree, then at random.
//
// The previous formulation (cost: blocks, registered as kvbandit_blocks)
// is Dynamo's KV cost refined the same way:
//
//	cost_w = ŝ_w · prefill_w + δ · decode_w + β · O_w − A_w
//
// with prefill_w + decode_w Dynamo's cost (routing/policy/kv) in blocks and
// δ (decode_weight, 1/32) putting held decode blocks in prefill units.
//
// Both costs learn the same model from every outcome, and the policy
// implements [routing.Predictor] (posterior means).
package kvbandit

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/latency"
	"github.com/kvbandit/kvbandit/routing/policy/kv"
)

// Name is the --policy value of the default (cost: ttft); BlocksName
// that of the previous formulation (cost: blocks).
const (
	Name       = "kvbandit"
	BlocksName = "kvbandit_blocks"
)

// The costs.
const (
	CostTTFT   = "ttft"
	CostBlocks = "blocks"
)

// Config holds the policy's parameters.
type Config struct {
	// Cost is ttft (predicted time to first token, the default) or blocks
	// (the KV cost model in blocks).
	Cost string `json:"cost"`
	// ImpactWeight (ι) scales the delay the request adds to the sequences
	// decoding on a candidate (cost: ttft).
	ImpactWeight float64 `json:"impact_weight"`
	// RecomputeWeight (ρ) scales the fleet's cost of recomputing what
	// another candidate caches (cost: ttft).
	RecomputeWeight float64 `json:"recompute_weight"`
	// OverlapScoreWeight is the kv backbone's prefill weight (cost: blocks).
	OverlapScoreWeight float64 `json:"overlap_score_weight"`
	// DecodeWeight scales the decode-block term (cost: blocks; Dynamo's kv
	// uses 1).
	DecodeWeight float64 `json:"decode_weight"`
	// Speed is the Thompson-sampled speed posterior.
	Speed SpeedConfig `json:"speed"`
	// Latency is the rest of the latency model.
	Latency LatencyConfig `json:"latency"`
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
	// ObsSigma is the noise of one observation's log TTFT ratio.
	ObsSigma float64 `json:"obs_sigma"`
	// Forget discounts the posterior precision per observation (0.9: a
	// change of speed is 90% known after 22 of the endpoint's outcomes).
	Forget float64 `json:"forget"`
	// MaxFactor bounds a sampled factor to [1/MaxFactor, MaxFactor].
	MaxFactor float64 `json:"max_factor"`
	// RemoteWeight is what a peer replica's outcome counts for, in local
	// outcomes (see routing/latency Config.RemoteWeight).
	RemoteWeight float64 `json:"remote_weight"`
}

// LatencyConfig parameterises the pooled latency fit (routing/latency).
type LatencyConfig struct {
	// BatchTokens is the workers' prompt-token budget per step (vLLM's
	// max_num_batched_tokens).
	BatchTokens int `json:"batch_tokens"`
	// Forget is the pooled fit's weight kept per outcome.
	Forget float64 `json:"forget"`
	// Ridge is the prior's weight in outcomes.
	Ridge float64 `json:"ridge"`
	// MemoryFull is the KV usage above which waiting requests count as
	// blocked on memory.
	MemoryFull float64 `json:"memory_full"`
}

// AffinityConfig parameterises prefix affinity from hints.
type AffinityConfig struct {
	// Weight scales the credit per prompt block (per prompt prefill time
	// with cost: ttft).
	Weight float64 `json:"weight"`
	// OutstandingWeight (β) scales pinned sessions' announced work.
	OutstandingWeight float64 `json:"outstanding_weight"`
	// DecayLowSeconds, DecayMediumSeconds and DecayHighSeconds are the
	// affinity decay times for the inter-arrival hint levels.
	DecayLowSeconds    float64 `json:"decay_low_seconds"`
	DecayMediumSeconds float64 `json:"decay_medium_seconds"`
	DecayHighSeconds   float64 `json:"decay_high_seconds"`
}

// DefaultDecodeWeight is the decode-block term's weight (cost: blocks).
// Decode work barely delays a new request's first token in a
// chunked-prefill engine (prefill steps run at prefill speed with the
// decodes riding along), so in time units one held block weighs far less
// than one block to prefill; Dynamo's 1 lets a busy worker's decode blocks
// outweigh a cached prefix and scatters sessions. The value comes from
// `kvbandit bench` (docs/bench.md).
const DefaultDecodeWeight = 1.0 / 32

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	lc := latency.DefaultConfig()
	return Config{
		Cost:               CostTTFT,
		ImpactWeight:       DefaultImpactWeight,
		RecomputeWeight:    DefaultRecomputeWeight,
		OverlapScoreWeight: 1,
		DecodeWeight:       DefaultDecodeWeight,
		Speed:              SpeedConfig{PriorSigma: lc.PriorSigma, ObsSigma: lc.ObsSigma, Forget: lc.SpeedForget, MaxFactor: lc.MaxFactor, RemoteWeight: lc.RemoteWeight},
		Latency:            LatencyConfig{BatchTokens: lc.BatchTokens, Forget: lc.Forget, Ridge: lc.Ridge, MemoryFull: lc.MemoryFull},
		Affinity:           AffinityConfig{Weight: 1, OutstandingWeight: 0.1, DecayLowSeconds: 2, DecayMediumSeconds: 10, DecayHighSeconds: 60},
	}
}

// DefaultImpactWeight and DefaultRecomputeWeight are ι and ρ, from
// `kvbandit bench` and the e2e suite (see the README): ρ = 8 brings the
// Mooncake trace to 97% of the finite-cache bound's hit rate (ρ = 0: 77%);
// ι = 0.02 keeps new agent sessions that share a system prompt from piling
// onto the worker that caches it (their decode load barely shows in TTFT):
// without it three synced replicas put all 16 sessions of the e2e test on
// one worker in about one run in four; it costs Mooncake's p90 598 → 606 ms.
const (
	DefaultImpactWeight    = 0.02
	DefaultRecomputeWeight = 8.0
)

// model returns the latency model's parameters.
func (c Config) model() latency.Config {
	return latency.Config{
		BatchTokens: c.Latency.BatchTokens, Forget: c.Latency.Forget, Ridge: c.Latency.Ridge, MemoryFull: c.Latency.MemoryFull,
		PriorSigma: c.Speed.PriorSigma, ObsSigma: c.Speed.ObsSigma, SpeedForget: c.Speed.Forget, MaxFactor: c.Speed.MaxFactor, RemoteWeight: c.Speed.RemoteWeight,
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
	if c.Cost != CostTTFT && c.Cost != CostBlocks {
		errs = append(errs, fmt.Errorf("kvbandit.cost: %q is not ttft or blocks", c.Cost))
	}
	check("impact_weight", c.ImpactWeight, 0, 1e6, false)
	check("recompute_weight", c.RecomputeWeight, 0, 1e6, false)
	check("overlap_score_weight", c.OverlapScoreWeight, 0, 1e6, false)
	check("decode_weight", c.DecodeWeight, 0, 1e6, false)
	check("affinity.weight", c.Affinity.Weight, 0, 1e6, false)
	check("affinity.outstanding_weight", c.Affinity.OutstandingWeight, 0, 1e6, false)
	check("affinity.decay_low_seconds", c.Affinity.DecayLowSeconds, 0, inf, true)
	check("affinity.decay_medium_seconds", c.Affinity.DecayMediumSeconds, 0, inf, true)
	check("affinity.decay_high_seconds", c.Affinity.DecayHighSeconds, 0, inf, true)
	check("speed.prior_sigma", c.Speed.PriorSigma, 0, 10, false)
	check("speed.obs_sigma", c.Speed.ObsSigma, 0, 10, true)
	check("speed.forget", c.Speed.Forget, 0, 1, true)
	check("speed.max_factor", c.Speed.MaxFactor, 1, inf, false)
	check("speed.remote_weight", c.Speed.RemoteWeight, 0, 1, false)
	check("latency.batch_tokens", float64(c.Latency.BatchTokens), 1, 1<<24, false)
	check("latency.forget", c.Latency.Forget, 0, 1, true)
	check("latency.ridge", c.Latency.Ridge, 0, 1e6, true)
	check("latency.memory_full", c.Latency.MemoryFull, 0, 1, false)
	if len(errs) == 0 {
		if err := c.model().Validate(); err != nil { // the same bounds; kept in step
			errs = append(errs, fmt.Errorf("kvbandit: %w", err))
		}
	}
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
	// Open is set when the request announced no total: Reuse is then the
	// prefix state's assumption (a session id alone is assumed to
	// continue, see prefixstate.Store.Arrive), which earns the affinity
	// credit but is not announced work (O_w).
	Open bool
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
	name     string
	prefixes Prefixes
	model    *latency.Model
}

var (
	_ routing.Policy         = (*Policy)(nil)
	_ routing.OutcomeAware   = (*Policy)(nil)
	_ routing.Predictor      = (*Policy)(nil)
	_ routing.PrefillChooser = (*Policy)(nil)
)

// New returns the policy. prefixes may be nil (no affinity, no outstanding
// work).
func New(cfg Config, prefixes Prefixes) (*Policy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m, err := latency.New(cfg.model())
	if err != nil {
		return nil, err
	}
	name := Name
	if cfg.Cost == CostBlocks {
		name = BlocksName
	}
	return &Policy{cfg: cfg, name: name, prefixes: prefixes, model: m}, nil
}

// Name implements [routing.Policy]: kvbandit, or kvbandit_blocks with
// cost: blocks.
func (p *Policy) Name() string { return p.name }

// Model returns the policy's latency model.
func (p *Policy) Model() *latency.Model { return p.model }

// NeedsOutcomes implements [routing.OutcomeAware].
func (*Policy) NeedsOutcomes() bool { return true }

// decision is the per-decision state kept for Done.
type decision struct {
	ep   routing.EndpointKey
	rank int
	feat latency.Features
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
	// own history is cached where they are; the cost and the affinity
	// decide), or sessions would hop whenever another one is pinned.
	placing := p.prefixes != nil && !(hasSess && sess.Last != "")
	costs := make([]float64, len(s.Candidates))
	bs := max(s.BlockSize, 1)
	promptBlocks := float64(s.ISL) / float64(bs)
	// unit is the cost of one block to prefill: 1 in blocks, its pooled
	// prefill time (ms) in ttft.
	unit := 1.0
	ttft := p.cfg.Cost == CostTTFT
	maxOverlap, recompute := 0.0, 0.0
	if ttft {
		k := p.model.Coefficients()
		unit = max(k.PerBatch, 0) * float64(bs) / float64(p.cfg.Latency.BatchTokens)
		for i := range s.Candidates {
			maxOverlap = max(maxOverlap, s.Candidates[i].EffectiveOverlap(s.TierWeights))
		}
		// With prefix hints the policy knows whose cache it is: a new
		// session pays nothing (what it shares with others, a system
		// prompt, is popular and worth copying; its own history will be
		// cached wherever it starts). See recomputes for the rest.
		if !hasSess || sess.Last != "" {
			recompute = p.cfg.RecomputeWeight * unit
		}
	}
	inSession := hasSess && sess.Last != ""
	for i := range s.Candidates {
		c := &s.Candidates[i]
		f := p.model.Draw(c, rng, !placing)
		var cost float64
		if ttft {
			e := p.model.Estimate(latency.FromCandidate(c, s.ISL, bs, s.TierWeights))
			cost = f*e.Total + p.cfg.ImpactWeight*e.Running*f*e.Own +
				recomputes(c, inSession)*recompute*(maxOverlap-c.EffectiveOverlap(s.TierWeights))
		} else {
			cost = f*p.cfg.OverlapScoreWeight*prefillBlocks(s, c) + p.cfg.DecodeWeight*float64(c.ActiveBlocks+int64(c.NewBlocks))
		}
		if placing && p.cfg.Affinity.OutstandingWeight > 0 {
			cost += p.cfg.Affinity.OutstandingWeight * unit * p.prefixes.Outstanding(c.Key())
		}
		costs[i] = cost
		if hasSess && sess.Reuse > 0 && sess.Last == c.Key() && (sess.LastRank == c.DPRank || c.DPRank < 0) {
			costs[i] -= p.affinity(sess, s.Req.Hints.IAT) * promptBlocks * unit
		}
	}
	idx := kv.Select(costs, s.Candidates, 0, s.Rand)
	c := &s.Candidates[idx]
	if commit && hasSess && p.prefixes != nil {
		work := 0.0
		if !sess.Open {
			work = float64(sess.Reuse) * (promptBlocks + outputBlocks(s.Req, bs))
		}
		p.prefixes.Pin(s.Req, c.Key(), c.DPRank, sess.Reuse, work)
	}
	feat := latency.FromCandidate(c, s.ISL, bs, s.TierWeights)
	ch := routing.Choice{Index: idx, Scores: costs, Sticky: hasSess && sess.Last != "" && sess.Last == c.Key()}
	if hasSess {
		ch.Session = routing.SessionTurnOf(sess.Last != "", ch.Sticky)
	}
	if s.WantPredicted {
		ch.Predicted = p.Predict(s)
	} else {
		ch.Prediction = p.model.Predict(c, feat)
	}
	if commit {
		ch.State = &decision{ep: c.Key(), rank: c.DPRank, feat: feat}
	}
	if s.WantRanked {
		ch.Ranked = kv.Rank(costs, idx)
	}
	return ch, nil
}

// ChoosePrefill implements [routing.PrefillChooser]: the prefill
// candidate with the lowest predicted time to first token, ŝ_w · T_w (the
// prefill work ahead there plus the request's tokens it does not cache,
// at its Thompson-sampled speed). Prefix affinity, announced work and the
// impact on running sequences belong to the decode endpoint and do not
// count. Scores are the sampled costs.
func (p *Policy) ChoosePrefill(s *routing.Scoring, commit bool) (routing.Choice, error) {
	rng := rand.New(s.Rand)
	bs := max(s.BlockSize, 1)
	costs := make([]float64, len(s.Candidates))
	for i := range s.Candidates {
		c := &s.Candidates[i]
		costs[i] = p.model.Draw(c, rng, false) * p.model.Estimate(latency.FromCandidate(c, s.ISL, bs, s.TierWeights)).Total
	}
	idx := kv.Select(costs, s.Candidates, 0, s.Rand)
	ch := routing.Choice{Index: idx, Scores: costs}
	if commit {
		c := &s.Candidates[idx]
		ch.State = &decision{ep: c.Key(), rank: c.DPRank, feat: latency.FromCandidate(c, s.ISL, bs, s.TierWeights)}
	}
	return ch, nil
}

// Predict implements [routing.Predictor]: each candidate's predicted TTFT
// and its parts at its speed factor's posterior mean.
func (p *Policy) Predict(s *routing.Scoring) []routing.Prediction {
	out := make([]routing.Prediction, len(s.Candidates))
	for i := range s.Candidates {
		c := &s.Candidates[i]
		out[i] = p.model.Predict(c, latency.FromCandidate(c, s.ISL, s.BlockSize, s.TierWeights))
	}
	return out
}

// recomputes reports whether recomputing a prefix cached elsewhere counts
// against c (1) or not (0). It costs the fleet GPU time only where that
// time is contended: an idle candidate's time is free, so a burst that
// shares a prompt still reaches idle workers, while on a busy fleet
// conversations stay where their history is cached. A session in progress
// pays everywhere: its history is its own, so moving it duplicates cache
// that only it will reuse.
func recomputes(c *routing.Candidate, inSession bool) float64 {
	if inSession || c.InFlight() > 0 || c.ActivePrefillTokens > 0 || c.ActiveBlocks > 0 {
		return 1
	}
	return 0
}

// prefillBlocks is the prefill work on c if the request goes there: its
// in-flight prefill plus the request's uncached tokens, in blocks.
func prefillBlocks(s *routing.Scoring, c *routing.Candidate) float64 {
	bs := max(s.BlockSize, 1)
	return (float64(c.ActivePrefillTokens) + max(float64(s.ISL)-c.EffectiveOverlap(s.TierWeights)*float64(bs), 0)) / float64(bs)
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

// Done implements [routing.Policy]: a successful response's time to first
// token (and its decode time) with the features recorded at decision time
// teach the latency model: the pooled fit and the endpoint's speed
// factor. Other outcomes teach nothing about speed, nor does one served by
// an endpoint outside the set (Outcome.ServedUnknown): its time belongs to
// no endpoint the policy knows. A success served by another endpoint of
// the set is charged to the decision's endpoint and rank, whose load it
// was measured against.
//
// A disaggregated decision's time to first token is the prefill
// endpoint's (its prefill, then the KV transfer): it teaches the prefill
// endpoint's speed factor and the pooled fit with the features recorded
// when the prefill endpoint was chosen; the decode endpoint learns
// nothing from it, and the decode time is not fed to the pooled decode
// fit (it ran on another endpoint than those features describe).
func (p *Policy) Done(d *routing.Decision, o routing.Outcome) {
	if d.Prefill != "" {
		st, ok := d.PrefillState().(*decision)
		if !ok || o.ServedUnknown || o.Kind != routing.OutcomeSuccess || o.TTFT <= 0 {
			return
		}
		p.model.Observe(latency.Observation{Endpoint: st.ep, DPRank: st.rank, Features: st.feat, TTFT: o.TTFT, At: d.At})
		return
	}
	st, ok := d.PolicyState().(*decision)
	if !ok || o.ServedUnknown || o.Kind != routing.OutcomeSuccess || o.TTFT <= 0 {
		return
	}
	p.model.Observe(latency.Observation{
		Endpoint: st.ep, DPRank: st.rank, Features: st.feat,
		TTFT: o.TTFT, Latency: o.Latency, Output: o.CompletionTokens, At: d.At,
	})
}

// Posterior is one endpoint's speed belief for metrics and debugging.
type Posterior struct {
	Endpoint routing.EndpointKey
	DPRank   int
	// Factor is exp(mean): > 1 means slower than the fleet's pooled fit.
	Factor float64
	// Relative is Factor over the fleet's geometric mean: 1 is the fleet's
	// average speed, > 1 slower (see latency.Speed).
	Relative     float64
	Sigma        float64
	Observations int
}

// Posteriors returns the current beliefs, sorted by endpoint.
func (p *Policy) Posteriors() []Posterior {
	sp := p.model.Speeds()
	out := make([]Posterior, len(sp))
	for i, v := range sp {
		out[i] = Posterior(v)
	}
	return out
}

// Forget drops the beliefs about endpoints not observed since before.
func (p *Policy) Forget(before time.Time) { p.model.Forget(before) }
