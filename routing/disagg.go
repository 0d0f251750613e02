package routing

import (
	"fmt"
	"slices"
	"sync/atomic"

	"github.com/kvbandit/kvbandit/routing/slots"
)

// PDOutcome says whether a decision was disaggregated (prefill on another
// endpoint) and, when it was not, why.
type PDOutcome uint8

// P/D outcomes. The zero value is PDNoPrefillEndpoints: the pool has no
// prefill-role endpoint, and the request is routed exactly as without
// roles.
const (
	PDNoPrefillEndpoints PDOutcome = iota
	// PDDisaggregated: Decision.Prefill names the prefill endpoint.
	PDDisaggregated
	// PDNoBody: the request has no prompt tokens to prefill.
	PDNoBody
	// PDBelowThreshold: the tokens left to prefill on the chosen decode
	// endpoint are below the threshold.
	PDBelowThreshold
	// PDNoEligiblePrefill: no prefill or both endpoint is eligible (model,
	// subset hint, ejection), or the only one is the decode endpoint.
	PDNoEligiblePrefill
	pdOutcomes
)

var pdNames = [pdOutcomes]string{"no_prefill_endpoints", "disaggregated", "no_body", "below_threshold", "no_eligible_prefill"}

// String is the outcome's metric label.
func (o PDOutcome) String() string {
	if o < pdOutcomes {
		return pdNames[o]
	}
	return "unknown"
}

// Disaggregator decides, after the policy has chosen the decode endpoint
// among the decode and both candidates, whether the request's prefill
// runs elsewhere and where (routing/pd implements it). Split returns the
// index in prefill.Candidates of the prefill endpoint with
// PDDisaggregated, or -1 and why the request stays aggregated. prefill
// holds the request's prefill and both candidates (never empty), decode the
// chosen decode candidate. With commit false it has no side effects. It is
// called concurrently and must not block. state is the prefill choice's
// policy state ([PrefillChooser]), handed back by [Decision.PrefillState].
type Disaggregator interface {
	Split(prefill *Scoring, decode *Candidate, p Policy, commit bool) (index int, state any, out PDOutcome)
}

// PrefillChooser is implemented by policies that choose a disaggregated
// request's prefill endpoint with a cost of their own (kv, kvbandit,
// round_robin). s.Candidates are the prefill and both candidates; commit is
// as in [Policy.Choose]. The Choice's State comes back with
// [Decision.PrefillState]. Policies without it get Choose(s, false).
type PrefillChooser interface {
	ChoosePrefill(s *Scoring, commit bool) (Choice, error)
}

// prefillHold is a disaggregated decision's load on its prefill endpoint:
// one in-flight request and its prompt's prefill tokens and blocks, until
// the first token or the end, whichever comes first.
type prefillHold struct {
	live     *Live
	entry    *slots.Entry
	released atomic.Bool
}

// release ends the hold; it is idempotent.
func (h *prefillHold) release() {
	if h == nil || !h.released.CompareAndSwap(false, true) {
		return
	}
	h.entry.Free()
	h.live.InFlight.Add(-1)
}

// healthyByRole drops ejected endpoints (at now, unix nanos) from eps as
// the engine does without roles, but role by role for decoding: when every
// decode or both endpoint is ejected they all stay (the request routes
// anyway, as when the whole pool is ejected), while ejected prefill-only
// endpoints always go (the request then stays aggregated).
func healthyByRole(eps []*EndpointState, now int64) []*EndpointState {
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
// them) and pre gets the prefill and both ones with their key spaces.
// It fails with ErrNoEndpoints when no decode candidate is left.
func splitRoles(sc *Scoring, spaceOf []int8) (pre *Scoring, preSpace, decSpace []int8, err error) {
	p := *sc
	n := 0
	for i := range sc.Candidates {
		if sc.Candidates[i].State.Role.Prefills() {
			n++
		}
	}
	p.Candidates = make([]Candidate, 0, n)
	p.WantRanked, p.WantPredicted = false, false
	keep := make([]int, 0, len(sc.Candidates)-n+1)
	for i := range sc.Candidates {
		r := sc.Candidates[i].State.Role
		if r.Prefills() {
			p.Candidates = append(p.Candidates, sc.Candidates[i])
			preSpace = append(preSpace, spaceOf[i])
		}
		if r.Decodes() {
			keep = append(keep, i)
		}
	}
	if len(keep) == 0 {
		return nil, nil, nil, fmt.Errorf("%w: no decode or both endpoint among %d candidates", ErrNoEndpoints, len(sc.Candidates))
	}
	sc.Candidates, decSpace = narrow(sc.Candidates, spaceOf, keep)
	return &p, preSpace, decSpace, nil
}

// disaggregate asks the Disaggregator where the request of d (decode
// candidate c) prefills, records the answer in d and, when committed and
// disaggregated, puts the prefill load on that endpoint. pre is nil for a
// pool without prefill endpoints (nothing changes).
func (e *Engine) disaggregate(d *Decision, c *Candidate, pre *Scoring, preSpace []int8, spaces []keySpace, commit bool) {
	if pre == nil {
		if commit {
			e.pdCount[PDNoPrefillEndpoints].Add(1)
		}
		return
	}
	i, state, out := -1, any(nil), PDNoEligiblePrefill
	if len(pre.Candidates) > 0 {
		i, state, out = e.deps.PD.Split(pre, c, e.policy, commit)
	}
	if out == PDDisaggregated && (i < 0 || i >= len(pre.Candidates)) {
		out = PDNoEligiblePrefill
	}
	d.PD = out
	if commit {
		e.pdCount[out].Add(1)
	}
	if out != PDDisaggregated {
		return
	}
	p := &pre.Candidates[i]
	d.Prefill, d.PrefillRank, d.PrefillOverlap, d.preState = p.Key(), p.DPRank, p.Overlap, state
	if !commit {
		return
	}
	ks := spaces[preSpace[i]]
	rs := p.rank()
	p.State.InFlight.Add(1)
	p.State.Decisions.Add(1)
	d.pre = &prefillHold{live: p.State.Live, entry: rs.slot.Add(ks.keys, pre.ISL, p.Overlap, ks.bs)}
	e.insertApprox(rs, ks.bs, ks.keys, pre.Now)
}

// decodeISL is the prompt tokens the decode endpoint prefills: isl, or 0
// when a prefill endpoint holds the prefill load.
func (d *Decision) decodeISL(isl int) int {
	if d.pre != nil {
		return 0
	}
	return isl
}

// pdCounts returns the committed decisions per PDOutcome.
func (e *Engine) pdCounts() [pdOutcomes]int64 {
	var out [pdOutcomes]int64
	for i := range out {
		out[i] = e.pdCount[i].Load()
	}
	return out
}
