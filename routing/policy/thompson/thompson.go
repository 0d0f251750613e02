// Package thompson implements the thompson policy: a Go port of the
// Thompson-sampling, hint-aware router of NVIDIA NeMo Agent Toolkit
// (external/dynamo/components/router.py), kept faithful to its maths and
// shipped defaults, with three of its defects fixed by default (see
// [CompatConfig]).
//
// For each request the policy reads the prefix hints (prefix id, total
// requests, output length, inter-arrival level), spends one unit of the
// prefix's reuse budget R in a [prefixstate.Store] and builds, for every
// candidate, a 9-feature context x. Each candidate's score is a sample of a
// per-(endpoint, rank) linear Thompson sampler θᵀx, plus a small Beta
// Thompson term per endpoint, plus an affinity bonus for the prefix's last
// endpoint, minus a switching cost for the others, scaled by a load
// modifier; the endpoint is then drawn from a softmax whose temperature
// falls as R grows. Outcomes come back through Done as a latency reward in
// [0, 1] relative to exponentially averaged baselines.
//
// # Concurrency
//
// Choose takes no policy-wide lock. Posteriors are immutable values
// published with atomic.Pointer and rebuilt by Done (a 9×9 Cholesky, about a
// microsecond) under a per-(endpoint, rank) mutex; Beta parameters are
// swapped the same way. The only shared locks on the request path are the
// prefix store's shard mutex and a pending-set shard mutex, each held for a
// few pointer updates. Latency baselines share one mutex that Done holds for
// a few float operations.
package thompson

import (
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/evidence"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// Name is the --policy value.
const Name = "thompson"

// Reference constants (research notes §3.1, §3.3, §3.6, §3.8).
const (
	outstandingScale = 0.1  // feature 4: tanh(0.1·work)
	decodeScale      = 3.0  // feature 5: decode_cost/3
	iatScale         = 1.5  // feature 7: iat_factor/1.5
	reuseScale       = 0.25 // feature 8: tanh(0.25·R)
	pendingGPUScale  = 20.0 // unknown load: gpu = min(1, pending/20)
	badScore         = -1e9 // NaN/Inf scores
	minTemperature   = 1e-6
	minBaseline      = 1e-3
)

var (
	decodeCosts = [3]float64{1, 2, 3}     // osl LOW, MEDIUM, HIGH
	iatFactors  = [3]float64{1.5, 1, 0.6} // iat LOW, MEDIUM, HIGH
)

// Deps are the policy's injected dependencies. Nil fields get defaults.
type Deps struct {
	// Clock runs the feedback timeouts (nil: the real clock).
	Clock clock.Clock
	// Rand is used when a Scoring carries no random source.
	Rand *routing.Rand
	// Prefix is the prefix state shared with other policies; nil makes a
	// private store (closed by [Policy.Close]).
	Prefix *prefixstate.Store
	// Logger (nil: slog.Default()).
	Logger *slog.Logger
	// OnReward, if set, is called synchronously for every reward the
	// learners apply (feedback and timeouts); it must be cheap.
	OnReward func(Reward)
}

// Reward describes one applied reward, for metrics.
type Reward struct {
	Endpoint routing.EndpointKey
	DPRank   int
	// Value is the reward in [0, 1].
	Value float64
	// Timeout is set when no outcome arrived in time (or the engine
	// expired the decision) and Value is feedback.timeout_reward.
	Timeout bool
	// Kind is the outcome's kind (OutcomeExpired for timeouts).
	Kind routing.OutcomeKind
	// Latency is the outcome's end-to-end latency (0 for timeouts).
	Latency time.Duration
	// Metric is the latency in ms, per output token when PerToken is set;
	// Baseline is what it was compared with.
	Metric, Baseline float64
	PerToken         bool
}

// Policy is the thompson routing policy. It is safe for concurrent use.
type Policy struct {
	cfg       Config
	compat    CompatConfig
	log       *slog.Logger
	clk       clock.Clock
	rnd       *routing.Rand
	prefix    *prefixstate.Store
	ownPrefix bool
	onReward  func(Reward)
	timeout   time.Duration
	idle      int64 // nanoseconds; 0 keeps state forever
	prior     *posterior

	// learned is the copy-on-write set of samplers, replaced under
	// learnedMu when an endpoint or rank is first seen or dropped as idle.
	learned   atomic.Pointer[learnedState]
	learnedMu sync.Mutex
	scratch   sync.Pool // *scratch
	startup   atomic.Pointer[map[routing.EndpointKey]struct{}]
	nextIdle  atomic.Int64

	emaMu  sync.Mutex
	global [2]ema // per_tok false, true

	// sources interns the peers whose outcomes the Beta bandits and the
	// baselines learnt (LearnRemote), for ForgetPeer.
	sources *evidence.Sources

	pending pendingSet
	seq     atomic.Uint64

	decisions, feedback, timeouts, late, noLearning atomic.Uint64
	remote                                          atomic.Uint64
	servedMismatch, eigenFallbacks, dropped         atomic.Uint64
}

var (
	_ routing.Policy       = (*Policy)(nil)
	_ routing.OutcomeAware = (*Policy)(nil)
)

// New validates cfg and returns the policy.
func New(cfg Config, deps Deps) (*Policy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p := &Policy{
		cfg:      cfg,
		compat:   cfg.compat(),
		log:      deps.Logger,
		clk:      clock.Or(deps.Clock),
		rnd:      deps.Rand,
		prefix:   deps.Prefix,
		onReward: deps.OnReward,
		timeout:  time.Duration(cfg.Feedback.TimeoutSeconds * float64(time.Second)),
		idle:     int64(cfg.IdleEndpointSeconds * float64(time.Second)),
		sources:  evidence.NewSources(evidence.MaxPeers),
	}
	if p.log == nil {
		p.log = slog.Default()
	}
	if p.rnd == nil {
		p.rnd = routing.NewRand(0)
	}
	if p.prefix == nil {
		st, err := prefixstate.New(prefixstate.Config{NoExpiry: p.compat.NoPrefixExpiry}, p.clk)
		if err != nil {
			return nil, err
		}
		p.prefix, p.ownPrefix = st, true
	}
	a := identity(cfg.LinTS.Lambda)
	p.prior, _ = computePosterior(&a, &vec{})
	p.learned.Store(&learnedState{arms: map[armKey]*arm{}, endpoints: map[routing.EndpointKey]*endpointState{}})
	p.scratch.New = func() any { return new(scratch) }
	return p, nil
}

// Name implements [routing.Policy].
func (*Policy) Name() string { return Name }

// NeedsOutcomes implements [routing.OutcomeAware]: without outcomes every
// decision times out and teaches timeout_reward.
func (*Policy) NeedsOutcomes() bool { return true }

// Prefix returns the prefix store the policy uses.
func (p *Policy) Prefix() *prefixstate.Store { return p.prefix }

// Close stops the pending feedback timers (decisions still pending then
// never time out) and closes the private prefix store, if any.
func (p *Policy) Close() error {
	p.pending.close()
	if p.ownPrefix {
		p.prefix.Close()
	}
	return nil
}

// requestTerms are the per-request quantities (§3.2).
type requestTerms struct {
	key         prefixstate.Key
	reuse       int
	last        prefixstate.Pin
	hasLast     bool
	osl         int // 0 LOW, 1 MEDIUM, 2 HIGH
	decodeCost  float64
	iatFactor   float64
	temperature float64
	eps         float64
}

// candidateTerms are one candidate's deterministic quantities (§3.3, §3.6).
type candidateTerms struct {
	overlap, gpu, queue, work float64
	prefill, jobCost          float64
	x                         vec
	loadMod                   float64
	affinity                  float64 // bonus, 0 unless the last endpoint and R > 0
	switching                 float64 // cost, 0 unless another endpoint is the last and R > 0
	isLast                    bool
}

// Choose implements [routing.Policy]. Scores are the final per-candidate
// values (after the load modifier and, by default, the switching cost);
// Ranked orders all candidates by descending score.
func (p *Policy) Choose(s *routing.Scoring, commit bool) (routing.Choice, error) {
	n := len(s.Candidates)
	if n == 0 {
		return routing.Choice{}, fmt.Errorf("thompson: %w", routing.ErrNoEndpoints)
	}
	now := s.Now
	if now.IsZero() {
		now = p.clk.Now()
	}
	sc := p.scratch.Get().(*scratch)
	defer p.scratch.Put(sc)
	sc.grow(n)
	terms, arms := sc.terms[:n], sc.arms[:n]
	clear(arms)
	defer clear(arms) // do not keep learners alive from the pool
	rq := p.terms(s, commit, terms)

	src := s.Rand
	if src == nil {
		src = p.rnd
	}
	rng := src.Local()
	scores := make([]float64, n)
	v := p.cfg.LinTS.V
	learned := p.learned.Load()
	for i := range s.Candidates {
		c := &s.Candidates[i]
		k := armKey{c.Key(), c.DPRank}
		post, beta := p.prior, &betaPrior
		if a := learned.arms[k]; a != nil {
			if commit {
				a.ep.touch(now.UnixNano())
				arms[i] = a
			}
			post, beta = a.post.Load(), a.ep.beta.Load()
		} else if commit {
			a = p.armFor(k, now.UnixNano())
			arms[i] = a
			post, beta = a.post.Load(), a.ep.beta.Load()
		} else if ep := learned.endpoints[k.endpoint]; ep != nil {
			beta = ep.beta.Load()
		}
		lin := post.sample(rng, v, &terms[i].x)
		pb := sampleBeta(rng, beta.alpha, beta.beta)
		scores[i] = assemble(&terms[i], lin, pb, rq.eps, p.compat.ScaledSwitchingCost)
	}
	chosen := p.draw(rng, scores, rq.temperature, sc.probs[:n])
	ranked := make([]int, n)
	for i := range ranked {
		ranked[i] = i
	}
	slices.SortFunc(ranked, func(a, b int) int {
		switch {
		case scores[a] > scores[b]:
			return -1
		case scores[a] < scores[b]:
			return 1
		}
		return a - b // stable: equal scores keep candidate order
	})
	ch := routing.Choice{Index: chosen, Ranked: ranked, Scores: scores, HigherIsBetter: true}
	if rq.key.PrefixID != "" {
		ch.Sticky = terms[chosen].isLast
		ch.Session = routing.SessionTurnOf(rq.hasLast, ch.Sticky)
	}
	if !commit {
		return ch, nil
	}

	c := &s.Candidates[chosen]
	ct := &terms[chosen]
	if rq.key.PrefixID != "" {
		p.prefix.Pin(rq.key, prefixstate.Pin{
			Endpoint: c.Key(), DPRank: c.DPRank,
			DecodeCost: rq.decodeCost, PrefillCost: ct.prefill, IATFactor: rq.iatFactor,
			At: now,
		}, rq.reuse)
	}
	rec := &decision{
		p:        p,
		seq:      p.seq.Add(1),
		arm:      arms[chosen],
		endpoint: c.Key(),
		rank:     c.DPRank,
		x:        ct.x,
		osl:      rq.osl,
		bin:      prefillBin(ct.prefill),
		prefix:   rq.key,
		at:       now,
	}
	if p.compat.RebuiltFeatures {
		rec.x[4] = math.Tanh(outstandingScale * p.prefix.OutstandingWork(c.Key()))
	}
	p.pending.add(rec, p.clk, p.timeout)
	p.decisions.Add(1)
	p.maybeDropIdle(now.UnixNano())
	ch.State = rec
	return ch, nil
}

// terms computes the deterministic part of a decision: the per-request
// quantities (spending one unit of the reuse budget when commit is set) and
// each candidate's features, load modifier, affinity and switching cost.
func (p *Policy) terms(s *routing.Scoring, commit bool, out []candidateTerms) requestTerms {
	var h routing.Hints
	var tenant string
	if s.Req != nil {
		h, tenant = s.Req.Hints, s.Req.Tenant
	}
	rq := requestTerms{osl: levelIndex(h.OSL)}
	rq.decodeCost = decodeCosts[rq.osl]
	rq.iatFactor = iatFactors[levelIndex(h.IAT)]
	if h.PrefixID != "" {
		rq.key = prefixstate.NewKey(tenant, h.PrefixID)
		rq.reuse, rq.last, rq.hasLast = p.prefix.Arrive(rq.key, p.total(h), commit)
	}
	r := float64(rq.reuse)
	div := 1 + r*rq.iatFactor
	t := p.cfg.Exploration.Temperature
	rq.temperature = min(max(t.Base/div, t.Min), t.Max)
	rq.eps = p.cfg.Exploration.BaseTSWeight / div

	var startup map[routing.EndpointKey]struct{}
	if p.compat.LateJoinersBlind {
		startup = p.startupSet(s, commit)
	}
	reuseFeature := math.Tanh(reuseScale * r)
	lb := &p.cfg.LoadBalancing
	aff, sw := &p.cfg.Affinity, &p.cfg.SwitchingCost
	for i := range s.Candidates {
		c := &s.Candidates[i]
		ct := &out[i]
		*ct = candidateTerms{}
		key := c.Key()
		ct.isLast = rq.hasLast && key == rq.last.Endpoint && c.DPRank == rq.last.DPRank
		ct.overlap = overlapFraction(s.ISL, c.Overlap, s.BlockSize)
		ct.gpu, ct.queue = candidateLoad(c)
		if startup != nil {
			if _, ok := startup[key]; !ok {
				ct.overlap = 0
				ct.gpu, ct.queue = pendingLoad(c)
			}
		}
		ct.work = p.prefix.OutstandingWork(key)
		ct.prefill = p.prefillCost(s.ISL, ct.overlap)
		ct.jobCost = rq.decodeCost + ct.prefill
		last := 0.0
		if ct.isLast {
			last = 1
		}
		ct.x = vec{
			1,
			1 / (1 + lb.GPUPenaltyWeight*ct.gpu + lb.QueuePenaltyWeight*ct.queue),
			ct.overlap,
			last,
			math.Tanh(outstandingScale * ct.work),
			rq.decodeCost / decodeScale,
			math.Tanh(ct.prefill),
			rq.iatFactor / iatScale,
			reuseFeature,
		}
		pen := lb.GPUPenaltyWeight*ct.gpu + lb.QueuePenaltyWeight*ct.queue +
			lb.OutstandingWorkWeight*max(0, ct.work) +
			lb.JobGPUCouplingWeight*ct.jobCost*ct.gpu + lb.JobQueueCouplingWeight*ct.jobCost*ct.queue
		ct.loadMod = 1 / (1 + max(0, pen))
		if rq.reuse > 0 {
			switch {
			case ct.isLast:
				ct.loadMod = max(ct.loadMod, aff.StickyLoadFloor)
				ct.affinity = (aff.Base + aff.ReuseWeight*r + aff.IATWeight*rq.iatFactor) * (0.5 + 0.5*ct.overlap)
			case rq.hasLast:
				ct.switching = sw.Base + sw.ReusePenalty*r + sw.IATPenalty*rq.iatFactor
			}
		}
	}
	return rq
}

// total is the request's announced total as the prefix store reads it:
// with compat.session_needs_total a missing one counts as 1 (no session).
func (p *Policy) total(h routing.Hints) int {
	if p.compat.SessionNeedsTotal {
		return max(h.TotalRequests, 1)
	}
	return h.TotalRequests
}

// overlapFraction is the share of a prompt of isl tokens that its overlap
// cached blocks of bs tokens cover, in [0, 1].
func overlapFraction(isl, overlap, bs int) float64 {
	if isl <= 0 || bs <= 0 || overlap <= 0 {
		return 0
	}
	return min(1, float64(overlap)*float64(bs)/float64(isl))
}

// prefillCost is the prefill feature's cost of a prompt of isl tokens of
// which the fraction overlap is cached (§3.3).
func (p *Policy) prefillCost(isl int, overlap float64) float64 {
	return float64(max(isl, 0)) * (1 - overlap) / p.cfg.Prefill.TokenScale * p.cfg.Prefill.Weight
}

// assemble adds the sampled terms to the deterministic ones (§3.6). The
// reference multiplies the whole sum, switching cost included, by the load
// modifier (scaledSwitch); by default the switching cost is subtracted
// after it, so a busier endpoint never pays less for breaking affinity.
func assemble(ct *candidateTerms, lin, pBeta, eps float64, scaledSwitch bool) float64 {
	val := lin + eps*pBeta + ct.affinity
	if scaledSwitch {
		val = (val - ct.switching) * ct.loadMod
	} else {
		val = val*ct.loadMod - ct.switching
	}
	if math.IsNaN(val) || math.IsInf(val, 0) {
		return badScore
	}
	return val
}

// scratch holds Choose's per-call buffers, pooled.
type scratch struct {
	terms []candidateTerms
	arms  []*arm
	probs []float64
}

func (s *scratch) grow(n int) {
	if cap(s.terms) < n {
		s.terms = make([]candidateTerms, n)
		s.arms = make([]*arm, n)
		s.probs = make([]float64, n)
	}
}

// draw samples an index from softmax((v − max v)/T) by a cumulative draw
// (§3.7); a degenerate distribution is uniform. probs is scratch space of
// len(vals).
func (p *Policy) draw(rng interface{ Float64() float64 }, vals []float64, temperature float64, probs []float64) int {
	t := p.cfg.Exploration.Temperature
	temperature = max(min(max(temperature, t.Min), t.Max), minTemperature)
	top := slices.Max(vals)
	var sum float64
	for i, v := range vals {
		probs[i] = math.Exp((v - top) / temperature)
		sum += probs[i]
	}
	if !(sum > 0) || math.IsInf(sum, 0) {
		for i := range probs {
			probs[i] = 1
		}
		sum = float64(len(probs))
	}
	u := rng.Float64()
	var cum float64
	for i, pr := range probs {
		cum += pr / sum
		if cum >= u {
			return i
		}
	}
	return 0
}

// candidateLoad returns (gpu, queue) for a candidate (§2.2): scraped KV
// usage and max(waiting, in-flight) when the load is known and fresh;
// otherwise the reference's pending fallback. A scrape with a non-finite
// value counts as unknown; negative values count as 0 and KV usage is
// clamped to [0, 1].
func candidateLoad(c *routing.Candidate) (gpu, queue float64) {
	l := c.Load
	if !l.Known || l.Stale || math.IsNaN(l.KVUsage) || math.IsInf(l.KVUsage, 0) ||
		math.IsNaN(l.Waiting) || math.IsInf(l.Waiting, 0) {
		return pendingLoad(c)
	}
	_, pending := pendingLoad(c)
	return min(max(l.KVUsage, 0), 1), max(l.Waiting, 0, pending)
}

// pendingLoad is the reference's fallback for a worker without metrics:
// gpu = min(1, pending/20), queue = pending, where pending is the
// endpoint's in-flight decisions (the engine's count, which excludes the
// request being decided, as the reference's pending table does; with
// active-active replicas it includes the peers' decisions the engine
// applied: routing.Live.FleetInFlight).
func pendingLoad(c *routing.Candidate) (gpu, queue float64) {
	var n int64
	if c.State != nil && c.State.Live != nil {
		n = max(c.State.FleetInFlight(), 0)
	}
	q := float64(n)
	return min(1, q/pendingGPUScale), q
}

// startupSet returns the endpoints of the first committed decision, which
// the reference treats as its startup fleet (compat LateJoinersBlind).
func (p *Policy) startupSet(s *routing.Scoring, commit bool) map[routing.EndpointKey]struct{} {
	if m := p.startup.Load(); m != nil {
		return *m
	}
	if !commit {
		return nil
	}
	m := make(map[routing.EndpointKey]struct{}, len(s.Candidates))
	for i := range s.Candidates {
		m[s.Candidates[i].Key()] = struct{}{}
	}
	if !p.startup.CompareAndSwap(nil, &m) {
		return *p.startup.Load()
	}
	return m
}

func levelIndex(l routing.Level) int {
	switch l {
	case routing.LevelLow:
		return 0
	case routing.LevelHigh:
		return 2
	}
	return 1 // MEDIUM, and missing or unknown hints
}

// prefillBin keys latency baselines: < 0.25 LOW, < 0.75 MEDIUM, else HIGH.
func prefillBin(cost float64) int {
	switch {
	case cost < 0.25:
		return 0
	case cost < 0.75:
		return 1
	}
	return 2
}

// endpointState is what the policy learns per endpoint: the Beta bandit and
// the latency baselines.
type endpointState struct {
	key      routing.EndpointKey
	lastSeen atomic.Int64 // clock nanoseconds of the last committed decision it was a candidate in
	beta     atomic.Pointer[betaParams]

	mu         sync.Mutex // serialises Beta updates and the reward fields
	rewards    uint64
	lastReward float64
	// betaEv is the Beta bandit's rewards by source (W: rewards, S: their
	// sum), so that a peer's can be taken out: α = 1 + S, β = 1 + W − S.
	// The published beta is updated by α += r, β += 1 − r itself and
	// rebuilt from betaEv only when a peer is forgotten.
	betaEv evidence.Set

	// Guarded by Policy.emaMu.
	bucket  [3][3][2]ema // osl level, prefill bin, per_tok
	overall [2]ema       // per_tok
}

type betaParams struct{ alpha, beta float64 }

var betaPrior = betaParams{1, 1}

// ema is an exponentially weighted average, v, and its terms by source
// (ev: W the weights, S the weighted values, summing to 1 and v): every
// value discounts every part by 1 − alpha and adds alpha to its source's,
// the first one weighs 1. v is updated by the recursion itself;
// forget rebuilds it from what is left.
type ema struct {
	v  float64
	ok bool
	ev evidence.Set
}

func (e *ema) add(x, alpha float64, src evidence.Source) {
	if !e.ok {
		e.v, e.ok = x, true
		e.ev.Reset()
		e.ev.Add(src, 1, x, 1)
		return
	}
	e.v = alpha*x + (1-alpha)*e.v
	e.ev.Scale(1 - alpha)
	e.ev.Add(src, alpha, alpha*x, 1)
}

// forget takes src's values out: the average becomes that of the other
// sources' values, with their weights relative to each other kept
// (renormalised to 1); with none left, it is unset.
func (e *ema) forget(src evidence.Source) {
	if _, ok := e.ev.Remove(src); !ok || !e.ok {
		return
	}
	tot := e.ev.Total()
	if !(tot.W > 0) {
		*e = ema{}
		return
	}
	e.ev.Scale(1 / tot.W)
	e.v = tot.Mean()
}

// observe applies a reward from src to the Beta bandit: α += r, β += 1 − r.
func (e *endpointState) observe(r float64, src evidence.Source) {
	e.mu.Lock()
	defer e.mu.Unlock()
	b := e.beta.Load()
	e.beta.Store(&betaParams{b.alpha + r, b.beta + 1 - r})
	e.betaEv.Add(src, 1, r, 1)
	e.rewards++
	e.lastReward = r
}

// forget takes src's rewards out of the Beta bandit.
func (e *endpointState) forget(src evidence.Source) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.betaEv.Remove(src); !ok {
		return
	}
	tot := e.betaEv.Total()
	e.beta.Store(&betaParams{betaPrior.alpha + tot.S, betaPrior.beta + tot.W - tot.S})
}

// learnedState is an immutable snapshot of the per-endpoint and
// per-(endpoint, rank) learners; the learners themselves are shared and
// updated in place.
type learnedState struct {
	arms      map[armKey]*arm
	endpoints map[routing.EndpointKey]*endpointState
}

// touch marks the endpoint seen at now. The write is skipped while the
// mark is fresh: every request touches every candidate.
func (e *endpointState) touch(now int64) {
	if now-e.lastSeen.Load() > int64(time.Second) {
		e.lastSeen.Store(now)
	}
}

// endpointFor returns the endpoint's state, creating it on first sight, and
// marks it seen at now.
func (p *Policy) endpointFor(k routing.EndpointKey, now int64) *endpointState {
	if ep := p.learned.Load().endpoints[k]; ep != nil {
		ep.touch(now)
		return ep
	}
	p.learnedMu.Lock()
	defer p.learnedMu.Unlock()
	old := p.learned.Load()
	if ep := old.endpoints[k]; ep != nil {
		ep.touch(now)
		return ep
	}
	ep := newEndpointState(k, now)
	next := &learnedState{arms: old.arms, endpoints: maps.Clone(old.endpoints)}
	next.endpoints[k] = ep
	p.learned.Store(next)
	return ep
}

// armFor returns the (endpoint, rank) sampler, creating it (and its
// endpoint's state) on first sight: endpoints that join late are tracked
// like any other.
func (p *Policy) armFor(k armKey, now int64) *arm {
	if a := p.learned.Load().arms[k]; a != nil {
		a.ep.touch(now)
		return a
	}
	p.learnedMu.Lock()
	defer p.learnedMu.Unlock()
	old := p.learned.Load()
	if a := old.arms[k]; a != nil {
		a.ep.touch(now)
		return a
	}
	next := &learnedState{arms: maps.Clone(old.arms), endpoints: old.endpoints}
	ep := old.endpoints[k.endpoint]
	if ep == nil {
		ep = newEndpointState(k.endpoint, now)
		next.endpoints = maps.Clone(old.endpoints)
		next.endpoints[k.endpoint] = ep
	}
	ep.touch(now)
	a := newArm(k, ep, p.prior, p.cfg.LinTS.Lambda)
	next.arms[k] = a
	p.learned.Store(next)
	return a
}

func newEndpointState(k routing.EndpointKey, now int64) *endpointState {
	ep := &endpointState{key: k}
	ep.beta.Store(&betaPrior)
	ep.lastSeen.Store(now)
	return ep
}

// maybeDropIdle drops, at most every idle/4, the state of endpoints that
// have not been candidates for the idle period. A decision still pending
// for such an endpoint (impossible unless the timeout exceeds the idle
// period, which Validate refuses) would update the orphaned learners.
func (p *Policy) maybeDropIdle(now int64) {
	if p.idle <= 0 {
		return
	}
	next := p.nextIdle.Load()
	if now < next || !p.nextIdle.CompareAndSwap(next, now+p.idle/4) || next == 0 {
		return
	}
	cutoff := now - p.idle
	idle := func(ep *endpointState) bool { return ep.lastSeen.Load() < cutoff }
	found := false
	for _, ep := range p.learned.Load().endpoints {
		if idle(ep) {
			found = true
			break
		}
	}
	if !found {
		return
	}
	p.learnedMu.Lock()
	defer p.learnedMu.Unlock()
	old := p.learned.Load()
	st := &learnedState{arms: maps.Clone(old.arms), endpoints: maps.Clone(old.endpoints)}
	maps.DeleteFunc(st.endpoints, func(_ routing.EndpointKey, ep *endpointState) bool {
		if idle(ep) {
			p.dropped.Add(1)
			return true
		}
		return false
	})
	maps.DeleteFunc(st.arms, func(_ armKey, a *arm) bool { return idle(a.ep) })
	p.learned.Store(st)
}
