package routing

import "time"

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
	// OutcomeNoResponsePhase: the data plane ended the stream right after
	// the request phase and sends no response phase (NGINX Gateway
	// Fabric's endpoint picker shim), so the request's end is never seen.
	// Like OutcomeAbandoned it is neither a success nor a failure: policies
	// learn nothing from it.
	OutcomeNoResponsePhase
)

// LastOutcomeKind is the highest defined OutcomeKind.
const LastOutcomeKind = OutcomeNoResponsePhase

var outcomeNames = [...]string{"success", "upstream_error", "cancelled", "reset", "abandoned", "rejected", "expired", "no_response_phase"}

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
