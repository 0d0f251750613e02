package thompson

import (
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/evidence"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file holds the warm start's side of the policy (issue 22): the
// LinTS arms, the Beta bandits, the latency baselines and the sessions
// exported for a peer replica that starts, and imported from one.

// maxLearnt bounds an imported learner's values: a real arm's A and b are
// discounted sums of features within ±maxFeatureAb, a Beta's parameters
// sums of rewards in [0, 1], a baseline a latency in milliseconds.
const maxLearnt = 1e12

// ExportState implements the engine's state export (engine.StatefulPolicy):
// the learners that learnt something and every session of the prefix
// store.
func (p *Policy) ExportState(dst *warmstate.Snapshot, _ time.Time) {
	learned := p.learned.Load()
	for k, a := range learned.arms {
		wa := warmstate.Arm{Endpoint: string(k.endpoint), Rank: int32(k.rank)}
		a.mu.Lock()
		if a.updates == 0 {
			a.mu.Unlock()
			continue // the prior: nothing to hand over
		}
		wa.Updates = a.updates
		for i := range dim {
			for j := range dim {
				wa.A[i*dim+j] = a.a[i][j]
			}
			wa.B[i] = a.b[i]
		}
		a.mu.Unlock()
		dst.Arms = append(dst.Arms, wa)
	}
	p.emaMu.Lock()
	defer p.emaMu.Unlock()
	for k, ep := range learned.endpoints {
		b := ep.beta.Load()
		wb := warmstate.Beta{Endpoint: string(k), Alpha: b.alpha, Beta: b.beta}
		ep.mu.Lock()
		wb.Rewards, wb.LastReward = ep.rewards, ep.lastReward
		ep.mu.Unlock()
		if wb.Rewards == 0 {
			continue
		}
		for i := range 3 {
			for j := range 3 {
				for t := range 2 {
					e := ep.bucket[i][j][t]
					wb.Buckets[(i*3+j)*2+t] = warmstate.EMA{V: e.v, OK: e.ok}
				}
			}
		}
		for t := range 2 {
			wb.Overall[t] = warmstate.EMA{V: ep.overall[t].v, OK: ep.overall[t].ok}
		}
		dst.Betas = append(dst.Betas, wb)
	}
	dst.Baselines = &warmstate.Baselines{Global: [2]warmstate.EMA{{V: p.global[0].v, OK: p.global[0].ok}, {V: p.global[1].v, OK: p.global[1].ok}}}
	dst.Sessions = append(dst.Sessions, p.prefix.Export(0)...)
}

// ImportState implements the engine's state import (engine.StatefulPolicy):
// a peer's arms for the
// endpoint ranks known says are in the set and that have learnt nothing
// here yet (the posterior is computed again from A and b), its Beta
// bandits and baselines for the endpoints that have none here, the
// fleet's baselines when this replica has none, and its sessions.
// Non-finite or huge values, a Beta parameter not positive, a negative
// baseline are refused and counted as malformed.
func (p *Policy) ImportState(src *warmstate.Snapshot, _ time.Time, known func(routing.EndpointKey, int) bool) warmstate.Imported {
	var out warmstate.Imported
	now := p.clk.Now().UnixNano()
	for i := range src.Arms {
		wa := &src.Arms[i]
		switch {
		case !validArm(wa):
			out.Malformed++
		case known != nil && !known(routing.EndpointKey(wa.Endpoint), int(wa.Rank)):
			out.Skipped++
		case p.importArm(wa, now):
			out.Arms++
		default:
			out.Skipped++
		}
	}
	for i := range src.Betas {
		wb := &src.Betas[i]
		switch {
		case !validBeta(wb):
			out.Malformed++
		case known != nil && !known(routing.EndpointKey(wb.Endpoint), warmstate.AnyRank):
			out.Skipped++
		case p.importBeta(wb, now):
			out.Betas++
		default:
			out.Skipped++
		}
	}
	if g := src.Baselines; g != nil {
		if validEMA(g.Global[0]) && validEMA(g.Global[1]) {
			p.emaMu.Lock()
			for t := range 2 {
				if !p.global[t].ok {
					p.global[t] = ema{v: g.Global[t].V, ok: g.Global[t].OK}
				}
			}
			p.emaMu.Unlock()
		} else {
			out.Malformed++
		}
	}
	n, skipped, bad := p.prefix.Import(src.Sessions)
	out.Sessions, out.Skipped, out.Malformed = n, out.Skipped+skipped, out.Malformed+bad
	return out
}

func learnt(v float64) bool { return !math.IsNaN(v) && math.Abs(v) <= maxLearnt }

func validArm(wa *warmstate.Arm) bool {
	if wa.Rank < -1 || wa.Rank > warmstate.MaxRank || len(wa.Endpoint) > warmstate.MaxStringLen || wa.Endpoint == "" {
		return false
	}
	for _, v := range wa.A {
		if !learnt(v) {
			return false
		}
	}
	for i := range dim {
		if !learnt(wa.B[i]) || wa.A[i*dim+i] <= 0 {
			return false
		}
	}
	return true
}

func validEMA(e warmstate.EMA) bool { return !e.OK || (learnt(e.V) && e.V >= 0) }

func validBeta(wb *warmstate.Beta) bool {
	if wb.Endpoint == "" || len(wb.Endpoint) > warmstate.MaxStringLen || !learnt(wb.Alpha) || !learnt(wb.Beta) ||
		wb.Alpha <= 0 || wb.Beta <= 0 || !(wb.LastReward >= 0 && wb.LastReward <= 1) {
		return false
	}
	for _, e := range wb.Buckets {
		if !validEMA(e) {
			return false
		}
	}
	return validEMA(wb.Overall[0]) && validEMA(wb.Overall[1])
}

// importArm sets an arm that has learnt nothing here to a peer's.
func (p *Policy) importArm(wa *warmstate.Arm, now int64) bool {
	a := p.armFor(armKey{routing.EndpointKey(wa.Endpoint), int(wa.Rank)}, now)
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.updates > 0 {
		return false
	}
	for i := range dim {
		for j := range dim {
			a.a[i][j] = wa.A[i*dim+j]
		}
		a.b[i] = wa.B[i]
	}
	a.a.symmetrize()
	a.updates = wa.Updates
	post, fellBack := computePosterior(&a.a, &a.b)
	if fellBack {
		p.eigenFallbacks.Add(1)
	}
	a.post.Store(post)
	return true
}

// importBeta sets an endpoint's bandit and baselines, if it has learnt no
// reward here yet.
func (p *Policy) importBeta(wb *warmstate.Beta, now int64) bool {
	ep := p.endpointFor(routing.EndpointKey(wb.Endpoint), now)
	ep.mu.Lock()
	if ep.rewards > 0 {
		ep.mu.Unlock()
		return false
	}
	ep.beta.Store(&betaParams{wb.Alpha, wb.Beta})
	// The imported bandit becomes this replica's own evidence (α = 1 + S,
	// β = 1 + W − S), so that forgetting a peer later leaves it in place.
	ep.betaEv.Reset()
	ep.betaEv.Add(evidence.Local, max(wb.Alpha+wb.Beta-betaPrior.alpha-betaPrior.beta, 0), max(wb.Alpha-betaPrior.alpha, 0), int(min(wb.Rewards, 1<<30)))
	ep.rewards, ep.lastReward = wb.Rewards, wb.LastReward
	ep.mu.Unlock()
	p.emaMu.Lock()
	defer p.emaMu.Unlock()
	for i := range 3 {
		for j := range 3 {
			for t := range 2 {
				e := wb.Buckets[(i*3+j)*2+t]
				ep.bucket[i][j][t] = importedEMA(e.V, e.OK)
			}
		}
	}
	for t := range 2 {
		ep.overall[t] = importedEMA(wb.Overall[t].V, wb.Overall[t].OK)
	}
	return true
}

// importedEMA is an average taken from a peer at start, as this
// replica's own (its only part, of weight 1).
func importedEMA(v float64, ok bool) ema {
	e := ema{v: v, ok: ok}
	if ok {
		e.ev.Add(evidence.Local, 1, v, 1)
	}
	return e
}
