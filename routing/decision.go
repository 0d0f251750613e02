package routing

import (
	"sync/atomic"
	"time"
)

// Score is one endpoint's score in a decision (higher is better unless the
// policy documents otherwise).
type Score struct {
	Endpoint EndpointKey `json:"endpoint"`
	DPRank   int         `json:"dp_rank,omitempty"`
	Score    float64     `json:"score"`
	// Predicted is the policy's prediction for the endpoint (policies
	// that predict, Engine.Score only); its fields appear inline in JSON.
	*Predicted
}

// Predicted is a candidate's predicted time to first token and its parts,
// in milliseconds, as /v1/route and Engine.Score show them.
type Predicted struct {
	PredictedTTFTMs float64 `json:"predicted_ttft_ms"`
	WaitMs          float64 `json:"wait_ms"`
	PrefillMs       float64 `json:"prefill_ms"`
	ImpactMs        float64 `json:"impact_ms"`
}

// PredictedOf converts p to milliseconds.
func PredictedOf(p Prediction) Predicted {
	msOf := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	return Predicted{PredictedTTFTMs: msOf(p.TTFT), WaitMs: msOf(p.Wait), PrefillMs: msOf(p.Prefill), ImpactMs: msOf(p.Impact)}
}

// Decision is the engine's answer for one request. Its exported fields are
// read-only for callers.
type Decision struct {
	// ID identifies the decision in logs and the decision log.
	ID string
	// Policy is the name of the policy that decided.
	Policy string
	// Endpoint is the chosen endpoint.
	Endpoint EndpointKey
	// Fallbacks are further endpoints in preference order (--fallbacks).
	Fallbacks []EndpointKey
	// DPRank is the chosen data-parallel rank, or -1 when the endpoint has
	// a single rank.
	DPRank int
	// Overlap is the predicted number of cached prefix blocks.
	Overlap int
	// OverlapCPU and OverlapDisk are the chosen candidate's lower-tier
	// blocks after Overlap (see Candidate.OverlapCPU).
	OverlapCPU, OverlapDisk int
	// Candidates is the number of candidates the policy chose from.
	Candidates int
	// Scores are the per-candidate scores, when the policy produces them;
	// ScoresHigherIsBetter says the highest is best (false: costs, lower is
	// better).
	Scores               []Score
	ScoresHigherIsBetter bool
	// At is when the decision was made.
	At time.Time
	// Sticky is set when the policy kept the request on its session's
	// previous endpoint.
	Sticky bool
	// Session is where the request went relative to its session, from a
	// policy that keeps sessions (SessionUntracked otherwise).
	Session SessionTurn
	// Objective is the request's TTFT objective (Hints.TTFTObjective);
	// 0 means none.
	Objective time.Duration
	// Predicted is the policy's predicted TTFT on the chosen candidate,
	// with its parts (zero when the policy does not predict).
	Predicted Prediction
	// Prefill is the endpoint that runs the request's prefill when the
	// request is disaggregated (PD is PDDisaggregated), "" when it is
	// aggregated on Endpoint. PrefillRank is its data-parallel rank (-1
	// for a single rank) and PrefillOverlap its cached prefix blocks.
	Prefill        EndpointKey
	PrefillRank    int
	PrefillOverlap int
	// PD is whether the decision was disaggregated and, if not, why.
	PD PDOutcome

	// state is the policy's private per-decision state (Choice.State) and
	// preState a disaggregated decision's prefill choice's; ticket is the
	// engine's hold on a committed decision (nil otherwise).
	state     any
	preState  any
	ticket    Ticket
	done      atomic.Bool
	prefilled atomic.Bool
}

// Ticket is the engine's side of a committed decision: the load it holds
// and what ending it releases. The engine that made the decision
// implements it; [Decision] calls First at most once, on the first
// Prefilled before Done, and End exactly once, on the first Done.
type Ticket interface {
	// First reports the first generated content.
	First(d *Decision)
	// End releases the decision's load and hands o to the policy.
	End(d *Decision, o Outcome)
	// ReleasePrefill releases a disaggregated decision's prefill hold;
	// it is idempotent and does nothing for an aggregated one.
	ReleasePrefill()
	// PrefillHeld reports whether the prefill hold is still held.
	PrefillHeld() bool
	// Number is the decision's number on this replica (ID in base 36).
	Number() uint64
	// Share and ShareOutcome describe the decision and its outcome for
	// peer replicas (see [Decision.Share]).
	Share(d *Decision) RemoteStart
	ShareOutcome(d *Decision, o Outcome) (RemoteOutcome, bool)
}

// Bind attaches the policy-private states (the Choice's, and a
// disaggregated decision's prefill choice's) and the engine's ticket to d,
// once, before the engine returns d. A nil ticket marks d finished: a
// decision of Score, whose Done does nothing.
func (d *Decision) Bind(state, preState any, t Ticket) {
	d.state, d.preState, d.ticket = state, preState, t
	if t == nil {
		d.done.Store(true)
	}
}

// Prefilled reports that the response's first generated content arrived:
// the request's prompt has been prefilled, so its tokens stop counting as
// prefill load, and a disaggregated decision's prefill endpoint is
// released (only the decode endpoint carries the request from then on).
// Calls after the first, or after Done, do nothing.
func (d *Decision) Prefilled() {
	if d == nil || d.done.Load() || !d.prefilled.CompareAndSwap(false, true) {
		return
	}
	if d.ticket != nil {
		d.ticket.First(d)
	}
}

// ReleasePrefill releases a disaggregated decision's prefill endpoint
// without marking the prompt prefilled: the prefill stage failed and the
// decode endpoint serves the request aggregated, prefilling it itself
// (the standalone proxy's fallback). It does nothing when the decision is
// aggregated or the hold is already released.
func (d *Decision) ReleasePrefill() {
	if d != nil && d.ticket != nil {
		d.ticket.ReleasePrefill()
	}
}

// Done reports the request's outcome. The first call releases the
// decision's load accounting and feeds the policy; later calls do nothing
// and return false.
func (d *Decision) Done(o Outcome) bool {
	if d == nil || !d.done.CompareAndSwap(false, true) {
		return false
	}
	if d.ticket != nil {
		d.ticket.End(d, o)
	}
	return true
}

// PolicyState returns the policy-private state the policy attached in its
// Choice. Only the policy that made the decision should call it.
func (d *Decision) PolicyState() any { return d.state }

// PrefillState returns the policy state of a disaggregated decision's
// prefill choice ([PrefillChooser]); nil otherwise.
func (d *Decision) PrefillState() any { return d.preState }

// PrefillHeld reports whether a disaggregated decision still holds its
// prefill endpoint (no first token and no Done yet).
func (d *Decision) PrefillHeld() bool { return d.ticket != nil && d.ticket.PrefillHeld() }

// Finished reports whether Done was called.
func (d *Decision) Finished() bool { return d.done.Load() }

// Number is the decision's number on this replica (its ID in base 36),
// unique per engine; 0 for a decision that was not committed.
func (d *Decision) Number() uint64 {
	if d.ticket == nil {
		return 0
	}
	return d.ticket.Number()
}

// Share returns what a peer replica needs to carry this decision's load
// and session (the engine's StartRemote). Blocks is the decision's own
// block key slice, shared: neither side may modify it. A tenant, prefix id
// or model longer than [MaxRemoteString] is left out (a long tenant or
// prefix id drops the session: the other replicas then give the session no
// affinity, never someone else's). A disaggregated decision's prefill
// endpoint, rank and cached prompt tokens are in it too. Share does not
// allocate; it is the zero RemoteStart for a decision that was not
// committed.
func (d *Decision) Share() RemoteStart {
	if d.ticket == nil {
		return RemoteStart{}
	}
	return d.ticket.Share(d)
}

// ShareOutcome returns what a peer replica needs to learn from this
// decision's outcome o as the engine handed it to the policy (the engine's
// OnDone hook receives it so). ok is false when the outcome teaches
// nothing anywhere: it was served by an endpoint outside the set
// (Outcome.ServedUnknown), or the decision was not committed. A
// disaggregated decision's outcome has no TTFT: it was the prefill
// endpoint's, and a RemoteOutcome names the decode endpoint only.
func (d *Decision) ShareOutcome(o Outcome) (RemoteOutcome, bool) {
	if d.ticket == nil {
		return RemoteOutcome{}, false
	}
	return d.ticket.ShareOutcome(d, o)
}

// NewTestDecision returns a decision for endpoint ep carrying the policy
// state st, as a policy's Done receives it. It is for policy unit tests,
// which run without an engine: they call the policy's Done with it.
func NewTestDecision(ep EndpointKey, st any, at time.Time) *Decision {
	return &Decision{Endpoint: ep, DPRank: -1, PrefillRank: -1, At: at, state: st}
}

// SessionTurn is where a request with a prefix id went relative to its
// session, as reported by a policy that keeps per-session state (kvbandit,
// thompson).
type SessionTurn uint8

const (
	// SessionUntracked: the request has no prefix id, or the policy keeps
	// no session state.
	SessionUntracked SessionTurn = iota
	// SessionFirst: the session had no endpoint yet (its first request, or
	// its state expired), so there was nothing to stay on.
	SessionFirst
	// SessionSticky: the request stayed on the session's previous
	// endpoint.
	SessionSticky
	// SessionSwitch: the request moved away from the session's previous
	// endpoint.
	SessionSwitch
)

// String is the turn's metric label: "", "first", "sticky" or "switch".
func (t SessionTurn) String() string {
	switch t {
	case SessionFirst:
		return "first"
	case SessionSticky:
		return "sticky"
	case SessionSwitch:
		return "switch"
	}
	return ""
}

// SessionTurnOf classifies a request of a known session: hadLast says
// whether the session had a previous endpoint, stayed whether the request
// went back to it.
func SessionTurnOf(hadLast, stayed bool) SessionTurn {
	switch {
	case !hadLast:
		return SessionFirst
	case stayed:
		return SessionSticky
	}
	return SessionSwitch
}

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
	// PDOutcomeCount is the number of P/D outcomes.
	PDOutcomeCount
)

var pdNames = [PDOutcomeCount]string{"no_prefill_endpoints", "disaggregated", "no_body", "below_threshold", "no_eligible_prefill"}

// String is the outcome's metric label.
func (o PDOutcome) String() string {
	if o < PDOutcomeCount {
		return pdNames[o]
	}
	return "unknown"
}
