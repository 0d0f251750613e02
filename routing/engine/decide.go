package engine

import (
	"github.com/kvbandit/kvbandit/routing"

	"cmp"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// This file is the decision pipeline: candidates → cache overlap → roles
// (disaggregation's split) → objectives → policy → decision →
// disaggregation → commit. Each stage is a function; decide runs them in
// order. Admission (Pick) wraps the whole pipeline.

// pass is one decision in the making: what each stage hands the next.
type pass struct {
	req    *routing.Request
	commit bool
	sc     *routing.Scoring
	// info is aligned with sc.Candidates: each candidate's key space and
	// rank state.
	info []candInfo
	// spaces are the request's key spaces, one per block size among the
	// candidates (almost always one), in the pooled scratch.
	spaces []keySpace
	seed   uint64
	// pre and preInfo are the prefill candidates of a pool with
	// prefill-role endpoints (nil otherwise).
	pre     *routing.Scoring
	preInfo []candInfo

	timed bool
	tm    Timings
	t0    time.Time
}

// candInfo is what the engine keeps beside a candidate: the index of its
// key space in pass.spaces, its endpoint and its rank's state.
type candInfo struct {
	space int8
	ep    *endpoint
	rank  *rankState
}

// keySpace is one block size's view of the request.
type keySpace struct {
	bs    int
	keys  []uint64
	index []kvindex.Match
}

// scratch holds per-call buffers, pooled: nothing in them outlives the
// decide call that took them (Policy.Choose keeps no candidate).
type scratch struct {
	index      []kvindex.Match
	candidates []routing.Candidate
	info       []candInfo
	spaces     []keySpace
}

// release clears the first n candidates, their infos and the key spaces
// p used (so a pooled buffer keeps no endpoint state or keys alive) and
// returns sb to the pool.
func (e *Engine) release(sb *scratch, p *pass, n int) {
	clear(sb.candidates[:n])
	clear(sb.info[:n])
	clear(p.spaces)
	sb.spaces = p.spaces[:0]
	e.bufs.Put(sb)
}

func (e *Engine) decide(req *routing.Request, commit bool) (*routing.Decision, error) {
	snap := e.snap.Load()
	now := e.clk.Now()
	pdRoles := snap.prefillRole && e.deps.PD != nil
	eps, err := e.eligible(snap, req, pdRoles, now)
	if err != nil {
		return nil, err
	}
	n := 0
	for _, st := range eps {
		n += len(st.ranks)
	}
	sb := e.bufs.Get().(*scratch)
	sb.candidates, sb.info = slices.Grow(sb.candidates[:0], n), slices.Grow(sb.info[:0], n)
	p := &pass{req: req, commit: commit, info: sb.info, spaces: sb.spaces[:0], seed: kvindex.Seed(req.LoRA, req.CacheSalt), timed: commit && e.deps.OnTimings != nil}
	defer e.release(sb, p, n)
	p.sc = &routing.Scoring{Req: req, ISL: req.TokenCount, Rand: e.rnd, Now: now, Candidates: sb.candidates, WantRanked: e.opts.Fallbacks > 0, WantPredicted: !commit, TierWeights: e.opts.TierWeights}
	if p.timed {
		p.t0 = time.Now()
	}
	e.lookup(p, sb, eps)
	var tLook time.Time
	if p.timed {
		tLook = time.Now()
		p.tm.Lookup = tLook.Sub(p.t0) - p.tm.Hash
	}
	if pdRoles {
		if p.pre, p.preInfo, p.info, err = splitRoles(p.sc, p.info); err != nil {
			return nil, err
		}
	}
	if err := e.objectives(p); err != nil {
		return nil, err
	}
	ch, err := e.policy.Choose(p.sc, commit)
	if p.timed {
		p.tm.Score = time.Since(tLook)
	}
	if err != nil {
		return nil, err
	}
	if ch.Index < 0 || ch.Index >= len(p.sc.Candidates) {
		return nil, fmt.Errorf("policy %s chose index %d of %d: %w", e.policy.Name(), ch.Index, len(p.sc.Candidates), routing.ErrNoEndpoints)
	}
	cm := e.newDecision(p, &ch)
	preState := e.disaggregate(cm, &p.sc.Candidates[ch.Index], p, commit)
	if !commit {
		cm.Bind(ch.State, preState, nil)
		return &cm.Decision, nil
	}
	cm.Bind(ch.State, preState, cm)
	e.commit(p, cm, ch.Index)
	return &cm.Decision, nil
}

// eligible is the candidates stage: the snapshot's endpoints that serve the
// request's model within its subset hint, without ejected ones (by role in
// a pool with prefill endpoints) unless ejection is off.
func (e *Engine) eligible(snap *snapshot, req *routing.Request, pdRoles bool, now time.Time) ([]*endpoint, error) {
	health := !e.opts.Ejection.Disabled
	eps, err := snap.candidates(req, e.opts.PassThroughUnknownModels, health && !pdRoles, now.UnixNano())
	if err != nil {
		return nil, err
	}
	if pdRoles && health {
		eps = healthyByRole(eps, now.UnixNano())
	}
	return eps, nil
}

// lookup is the cache-overlap stage: it keys the prompt once per block
// size among eps, reads the KV index and each rank's in-flight load, and
// fills p.sc.Candidates (p.info aligned).
func (e *Engine) lookup(p *pass, sb *scratch, eps []*endpoint) {
	for _, st := range eps {
		si := e.space(p, sb, e.blockSize(st))
		ks := &p.spaces[si]
		ld := st.load()
		var rankLoads []routing.Load
		if len(st.ranks) > 1 {
			if rl := st.rankLoads.Load(); rl != nil && len(*rl) == len(st.ranks) {
				rankLoads = *rl
			}
		}
		for r, rs := range st.ranks {
			c := routing.Candidate{State: &st.EndpointState, DPRank: -1, NewBlocks: len(ks.keys)}
			if len(st.ranks) > 1 {
				c.DPRank = r
			}
			if i, found := slices.BinarySearchFunc(ks.index, rs.worker, func(m kvindex.Match, w kvindex.WorkerID) int { return cmp.Compare(m.Worker, w) }); found {
				c.Overlap = ks.index[i].Blocks
			}
			c.OverlapCPU, c.OverlapDisk = e.index.TierOverlap(rs.worker, ks.bs, ks.keys, c.Overlap)
			// Always, not only when some candidate caches a block: exact
			// ties between endpoints that cache nothing of the prompt (an
			// idle fleet, fresh prompts) go to the less cached one too.
			c.TreeSize = e.index.Size(rs.worker)
			if !e.opts.DisableActiveBlocks {
				c.NewBlocks = len(ks.keys) - rs.slot.ActivePrefix(ks.keys)
			}
			c.ActivePrefillTokens = rs.slot.PrefillTokens()
			c.ActiveBlocks = rs.slot.Blocks()
			c.Load = ld
			if rankLoads != nil {
				c.Load.Waiting, c.Load.Running, c.Load.KVUsage = rankLoads[r].Waiting, rankLoads[r].Running, rankLoads[r].KVUsage
			}
			p.sc.Candidates = append(p.sc.Candidates, c)
			p.info = append(p.info, candInfo{space: int8(si), ep: st, rank: rs})
		}
	}
	if len(p.spaces) > 0 {
		p.sc.BlockSize = p.spaces[0].bs
		p.sc.Blocks = p.spaces[0].keys
	}
}

// space returns the index in p.spaces of the key space for blocks of bs
// tokens, keying the prompt (the request's Keys when they fit, else
// hashing) and reading the index the first time bs is seen.
func (e *Engine) space(p *pass, sb *scratch, bs int) int {
	for i := range p.spaces {
		if p.spaces[i].bs == bs {
			return i
		}
	}
	var th time.Time
	if p.timed {
		th = time.Now()
	}
	ks := keySpace{bs: bs}
	var given bool
	if ks.keys, given = p.req.Keys.For(bs, p.seed, p.req.Tokens); !given {
		ks.keys = kvindex.AppendBlockKeys(nil, p.req.Tokens, bs, p.seed)
		p.tm.HashedBlocks += len(ks.keys)
	}
	if p.timed {
		p.tm.Hash += time.Since(th)
	}
	if len(p.spaces) == 0 {
		if int64(bs) != e.keyBlockSize.Load() {
			e.keyBlockSize.Store(int64(bs))
		}
		ks.index = e.index.Overlaps(bs, ks.keys, sb.index[:0])
		sb.index = ks.index
	} else {
		ks.index = e.index.Overlaps(bs, ks.keys, nil)
	}
	// Candidates find their overlap by binary search on the worker id.
	byWorker := func(a, b kvindex.Match) int { return cmp.Compare(a.Worker, b.Worker) }
	if !slices.IsSortedFunc(ks.index, byWorker) {
		slices.SortFunc(ks.index, byWorker)
	}
	p.spaces = append(p.spaces, ks)
	return len(p.spaces) - 1
}

// objectives is the TTFT-objective stage: with a gate and a request that
// has an objective, it narrows the candidates to those the gate keeps, or
// rejects the request.
func (e *Engine) objectives(p *pass) error {
	if e.deps.Gate == nil || p.req.Hints.TTFTObjective <= 0 {
		return nil
	}
	keep, err := e.deps.Gate.Filter(p.sc, e.policy, p.commit)
	if err != nil {
		return err
	}
	p.sc.Candidates, p.info = narrow(p.sc.Candidates, p.info, keep)
	return nil
}

// newDecision is the decision stage: it turns the policy's choice into a
// decision (not yet bound or committed) with its scores, predictions and
// fallbacks.
func (e *Engine) newDecision(p *pass, ch *routing.Choice) *commitment {
	sc := p.sc
	c := &sc.Candidates[ch.Index]
	cm := &commitment{e: e}
	d := &cm.Decision
	d.Policy, d.Endpoint, d.DPRank, d.Overlap, d.At = e.policy.Name(), c.State.Key, c.DPRank, c.Overlap, sc.Now
	// How many the policy chose from (spans report it).
	d.Candidates = len(sc.Candidates)
	// The lower tiers' blocks, reported beside Overlap.
	d.OverlapCPU, d.OverlapDisk = c.OverlapCPU, c.OverlapDisk
	d.Sticky, d.Objective = ch.Sticky, p.req.Hints.TTFTObjective
	d.Session, d.PrefillRank = ch.Session, -1
	d.Predicted = ch.Prediction
	if len(ch.Predicted) == len(sc.Candidates) {
		d.Predicted = ch.Predicted[ch.Index]
	}
	if ch.Scores != nil {
		d.Scores, d.ScoresHigherIsBetter = scores(sc, ch), ch.HigherIsBetter
	}
	if e.opts.Fallbacks > 0 {
		d.Fallbacks = e.fallbacks(sc, ch.Ranked, c.State.Key)
	}
	return cm
}

// scores are the choice's per-candidate scores, with each candidate's
// prediction when the policy made them all.
func scores(sc *routing.Scoring, ch *routing.Choice) []routing.Score {
	out := make([]routing.Score, len(sc.Candidates))
	var pred []routing.Predicted
	if len(ch.Predicted) == len(sc.Candidates) {
		pred = make([]routing.Predicted, len(sc.Candidates))
	}
	for i := range sc.Candidates {
		out[i] = routing.Score{Endpoint: sc.Candidates[i].Key(), DPRank: sc.Candidates[i].DPRank, Score: ch.Scores[i]}
		if pred != nil {
			pred[i] = routing.PredictedOf(ch.Predicted[i])
			out[i].Predicted = &pred[i]
		}
	}
	return out
}

// fallbacks are up to Options.Fallbacks endpoints other than chosen, in
// the policy's ranking order.
func (e *Engine) fallbacks(sc *routing.Scoring, ranked []int, chosen routing.EndpointKey) []routing.EndpointKey {
	var out []routing.EndpointKey
	for _, i := range ranked {
		if len(out) == e.opts.Fallbacks {
			break
		}
		if i >= 0 && i < len(sc.Candidates) {
			k := sc.Candidates[i].Key()
			if k != chosen && !slices.Contains(out, k) {
				out = append(out, k)
			}
		}
	}
	return out
}

// commit is the last stage: it numbers the decision, charges the chosen
// rank's slot and the approximate index, arms the stale-decision timer
// and calls the Deps hooks.
func (e *Engine) commit(p *pass, cm *commitment, chosen int) {
	sc, d := p.sc, &cm.Decision
	c := &sc.Candidates[chosen]
	cm.num = e.ids.Add(1)
	e.burst.Local(sc.Now)
	d.ID = strconv.FormatUint(cm.num, 36)
	cm.live, cm.rt = c.State.Live, p.info[chosen].ep.runtime
	c.State.InFlight.Add(1)
	c.State.Decisions.Add(1)
	rs := p.info[chosen].rank
	ks := p.spaces[p.info[chosen].space]
	if !e.opts.DisableActiveBlocks || sc.ISL > 0 {
		keys := ks.keys
		if e.opts.DisableActiveBlocks {
			keys = nil
		}
		cm.entry = rs.slot.Add(keys, cm.decodeISL(sc.ISL), c.Overlap, ks.bs)
	}
	e.insertApprox(rs, ks.bs, ks.keys, sc.Now)
	cm.share = shareInfo{keys: ks.keys, bs: ks.bs, isl: sc.ISL, queued: c.ActivePrefillTokens, req: shared(p.req)}
	cm.timer = e.clk.AfterFunc(e.opts.StaleAfter, func() {
		if d.Done(routing.NoUsage(routing.OutcomeExpired)) {
			e.expired.Add(1)
		}
	})
	if e.deps.OnDecision != nil {
		e.deps.OnDecision(p.req, d)
	}
	if p.timed {
		p.tm.Total = time.Since(p.t0)
		e.deps.OnTimings(p.tm)
	}
}

// narrow keeps the candidates (and their infos) at the ascending indexes
// keep; nil or invalid keep lists change nothing.
func narrow(cs []routing.Candidate, info []candInfo, keep []int) ([]routing.Candidate, []candInfo) {
	if len(keep) == 0 || len(keep) > len(cs) {
		return cs, info
	}
	for j, i := range keep {
		if i < j || i >= len(cs) || (j > 0 && i <= keep[j-1]) {
			return cs, info
		}
	}
	for j, i := range keep {
		cs[j], info[j] = cs[i], info[i]
	}
	return cs[:len(keep)], info[:len(keep)]
}
