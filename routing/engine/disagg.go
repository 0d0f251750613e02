package engine

import (
	"github.com/kvbandit/kvbandit/routing"

	"fmt"
	"slices"
	"sync/atomic"

	"github.com/kvbandit/kvbandit/routing/slots"
)

// prefillHold is a disaggregated decision's load on its prefill endpoint:
// one in-flight request (counted in inflight: the endpoint's Live.InFlight
// for a local decision, RemoteInFlight for a peer's) and its prompt's
// prefill tokens and blocks, until the first token or the end, whichever
// comes first. cached is the prompt tokens the endpoint had cached
// (Decision.Share passes it on).
type prefillHold struct {
	inflight *atomic.Int64
	entry    *slots.Entry
	cached   int
	released atomic.Bool
}

// release ends the hold; it is idempotent.
func (h *prefillHold) release() {
	if h == nil || !h.released.CompareAndSwap(false, true) {
		return
	}
	h.entry.Free()
	h.inflight.Add(-1)
}

// healthyByRole drops ejected endpoints (at now, unix nanos) from eps as
// the engine does without roles, but role by role for decoding: when every
// decode or both endpoint is ejected they all stay (the request routes
// anyway, as when the whole pool is ejected), while ejected prefill-only
// endpoints always go (the request then stays aggregated).
func healthyByRole(eps []*endpoint, now int64) []*endpoint {
	out := filterHealthy(eps, now, false)
	for _, st := range out {
		if st.Role.Decodes() {
			return out
		}
	}
	if len(out) == len(eps) {
		return out // no decode endpoint at all: splitRoles says so
	}
	out = slices.Clip(out)
	for _, st := range eps {
		if st.Role.Decodes() {
			out = append(out, st)
		}
	}
	return out
}

// splitRoles divides the candidates of a pool that has prefill-role
// endpoints: sc keeps the decode and both ones (the policy chooses among
// them) and pre gets the prefill and both ones with their infos.
// It fails with ErrNoEndpoints when no decode candidate is left.
func splitRoles(sc *routing.Scoring, info []candInfo) (pre *routing.Scoring, preInfo, decInfo []candInfo, err error) {
	p := *sc
	n := 0
	for i := range sc.Candidates {
		if sc.Candidates[i].State.Role.Prefills() {
			n++
		}
	}
	p.Candidates = make([]routing.Candidate, 0, n)
	p.WantRanked, p.WantPredicted = false, false
	keep := make([]int, 0, len(sc.Candidates)-n+1)
	for i := range sc.Candidates {
		r := sc.Candidates[i].State.Role
		if r.Prefills() {
			p.Candidates = append(p.Candidates, sc.Candidates[i])
			preInfo = append(preInfo, info[i])
		}
		if r.Decodes() {
			keep = append(keep, i)
		}
	}
	if len(keep) == 0 {
		return nil, nil, nil, fmt.Errorf("%w: no decode or both endpoint among %d candidates", routing.ErrNoEndpoints, len(sc.Candidates))
	}
	sc.Candidates, decInfo = narrow(sc.Candidates, info, keep)
	return &p, preInfo, decInfo, nil
}

// disaggregate is the disaggregation stage: it asks routing/pd where the
// request of cm (decode candidate c) prefills, records the answer in cm
// and, when committed and disaggregated, puts the prefill load on that
// endpoint. It returns the prefill choice's policy state. Nothing changes
// for a pool without prefill endpoints (p.pre nil).
func (e *Engine) disaggregate(cm *commitment, c *routing.Candidate, p *pass, commit bool) any {
	if p.pre == nil {
		if commit {
			e.pdCount[routing.PDNoPrefillEndpoints].Add(1)
		}
		return nil
	}
	d, pre := &cm.Decision, p.pre
	i, state, out := -1, any(nil), routing.PDNoEligiblePrefill
	if len(pre.Candidates) > 0 {
		i, state, out = e.deps.PD.Split(pre, c, e.policy, commit)
	}
	if out == routing.PDDisaggregated && (i < 0 || i >= len(pre.Candidates)) {
		out = routing.PDNoEligiblePrefill
	}
	d.PD = out
	if commit {
		e.pdCount[out].Add(1)
	}
	if out != routing.PDDisaggregated {
		return nil
	}
	pc := &pre.Candidates[i]
	d.Prefill, d.PrefillRank, d.PrefillOverlap = pc.Key(), pc.DPRank, pc.Overlap
	if !commit {
		return state
	}
	ks := p.spaces[p.preInfo[i].space]
	rs := p.preInfo[i].rank
	pc.State.InFlight.Add(1)
	pc.State.Decisions.Add(1)
	cm.pre = &prefillHold{inflight: &pc.State.InFlight, entry: rs.slot.Add(ks.keys, pre.ISL, pc.Overlap, ks.bs), cached: min(pc.Overlap*ks.bs, pre.ISL)}
	e.insertApprox(rs, ks.bs, ks.keys, pre.Now)
	return state
}

// pdCounts returns the committed decisions per PDOutcome.
func (e *Engine) pdCounts() [routing.PDOutcomeCount]int64 {
	var out [routing.PDOutcomeCount]int64
	for i := range out {
		out[i] = e.pdCount[i].Load()
	}
	return out
}
