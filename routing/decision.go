package routing

import (
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/slots"
)

// OutcomeKind says how a request ended.
type OutcomeKind uint8

// Outcome kinds.
const (
	// OutcomeSuccess: the worker answered 2xx and the response completed.
	OutcomeSuccess OutcomeKind = iota
	// OutcomeUpstreamError: the worker (or Envoy on its behalf) answered
	// with an error status.
	OutcomeUpstreamError
	// OutcomeCancelled: the client went away or the stream's context ended.
	OutcomeCancelled
	// OutcomeReset: the ext_proc stream broke (Envoy reset it).
	OutcomeReset
	// OutcomeAbandoned: the server shut down before the response finished,
	// or response processing was turned off so the end was never seen.
	OutcomeAbandoned
	// OutcomeRejected: the decision was made but the request was answered
	// locally (for example 503 at shutdown) and never reached the worker.
	OutcomeRejected
	// OutcomeExpired: the sweeper released a decision whose Done never came.
	OutcomeExpired
)

var outcomeNames = [...]string{"success", "upstream_error", "cancelled", "reset", "abandoned", "rejected", "expired"}

// String returns the kind's metric label.
func (k OutcomeKind) String() string {
	if int(k) < len(outcomeNames) {
		return outcomeNames[k]
	}
	return "unknown"
}

// Outcome is what happened to a routed request.
type Outcome struct {
	Kind OutcomeKind
	// Served is the endpoint that really served the request, from the data
	// plane's x-gateway-destination-endpoint-served; empty when unknown.
	// The engine hands a policy's Done only a Served that is the chosen
	// endpoint or one of the current endpoint set; any other value is
	// cleared and ServedUnknown set, so that a forged value creates no
	// state.
	Served EndpointKey
	// ServedUnknown is set by the engine (callers of Decision.Done leave
	// it false) when the data plane reported a served endpoint outside the
	// endpoint set. The outcome then describes no endpoint the policy
	// knows: policies must learn nothing from it (they still release the
	// decision's state). The engine counts these outcomes
	// (kvbandit_served_unknown_total).
	ServedUnknown bool
	// Status is the HTTP status from the worker; 0 when none arrived.
	Status int
	// TTFT is the time from the decision to the first generated content.
	TTFT time.Duration
	// Latency is the time from the decision to the end of the response.
	Latency time.Duration
	// PromptTokens, CompletionTokens and CachedTokens come from the usage
	// the worker reported; -1 when not reported.
	PromptTokens     int
	CompletionTokens int
	CachedTokens     int
}

// NoUsage returns an Outcome of kind k with the token counts marked unknown.
func NoUsage(k OutcomeKind) Outcome {
	return Outcome{Kind: k, PromptTokens: -1, CompletionTokens: -1, CachedTokens: -1}
}

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
	// Scores are the per-candidate scores, when the policy produces them.
	Scores []Score
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

	// state is the policy's private per-decision state (Choice.State).
	state any
	// num is the engine's decision number (ID in base 36).
	num uint64
	// share is what a peer replica needs to reproduce the decision's load
	// and learn from its outcome ([Decision.Share]); set at commit.
	share     shareInfo
	live      *Live
	entry     *slots.Entry
	timer     clock.Timer
	done      atomic.Bool
	onEnd     func(*Decision, Outcome)
	onFirst   func()
	prefilled atomic.Bool
	// pre is a disaggregated decision's hold on its prefill endpoint and
	// preState the prefill choice's policy state.
	pre      *prefillHold
	preState any
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
	d.pre.release()
	if d.onFirst != nil {
		d.onFirst()
	}
}

// ReleasePrefill releases a disaggregated decision's prefill endpoint
// without marking the prompt prefilled: the prefill stage failed and the
// decode endpoint serves the request aggregated, prefilling it itself
// (the standalone proxy's fallback). It does nothing when the decision is
// aggregated or the hold is already released.
func (d *Decision) ReleasePrefill() {
	if d != nil {
		d.pre.release()
	}
}

// Done reports the request's outcome. The first call releases the
// decision's load accounting and feeds the policy; later calls do nothing
// and return false.
func (d *Decision) Done(o Outcome) bool {
	if d == nil || !d.done.CompareAndSwap(false, true) {
		return false
	}
	if d.live != nil {
		d.live.InFlight.Add(-1)
	}
	d.pre.release()
	if d.onEnd != nil {
		d.onEnd(d, o)
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
func (d *Decision) PrefillHeld() bool { return d.pre != nil && !d.pre.released.Load() }

// Finished reports whether Done was called.
func (d *Decision) Finished() bool { return d.done.Load() }

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
