package routing

import "context"

// Picker chooses an endpoint for one request. Pick does not block, does no
// I/O and may be called from many goroutines at once. Every returned
// Decision must be ended with Decision.Done exactly once.
type Picker interface {
	Pick(ctx context.Context, req *Request) (*Decision, error)
}

// Scorer scores the candidates for a request without side effects: no slot
// accounting, no reuse budget spent, no learning.
type Scorer interface {
	Score(ctx context.Context, req *Request) (*Decision, error)
}

// Choice is a policy's answer: the index of the chosen candidate in
// Scoring.Candidates, further candidates in preference order for fallbacks
// (may be nil), optional per-candidate scores aligned with the candidates,
// and policy-private state that comes back with the decision in Done.
type Choice struct {
	Index  int
	Ranked []int
	Scores []float64
	// HigherIsBetter says the Scores rank candidates highest first (the
	// policy picks the highest); false: they are costs, lower is better.
	HigherIsBetter bool
	// State is kept in the Decision and handed back to the policy's Done.
	State any
	// Sticky is set when the request stayed on its session's previous
	// endpoint (prefix affinity), for metrics and the decision log.
	Sticky bool
	// Session is where the request went relative to its session (a policy
	// that keeps sessions sets it for requests with a prefix id).
	Session SessionTurn
	// Predicted is each candidate's predicted TTFT (a [Predictor]'s
	// means), filled when Scoring.WantPredicted is set; Prediction is the
	// chosen candidate's, for a policy that predicts, when Predicted is
	// not filled. Both are optional.
	Predicted  []Prediction
	Prediction Prediction
}

// Policy chooses among eligible candidates. Implementations are safe for
// concurrent use and never block.
type Policy interface {
	// Name is the --policy value.
	Name() string
	// Choose picks one of s.Candidates (never empty). When commit is false
	// the call must have no side effects (Score): no learning, no budget
	// spent, no counters moved. s.Candidates is the engine's pooled buffer:
	// it is reused once Choose and the decision's making return, so a
	// policy must not keep it (or pointers into it) beyond the call.
	Choose(s *Scoring, commit bool) (Choice, error)
	// Done receives the outcome of a committed decision, exactly once.
	Done(d *Decision, o Outcome)
}

// PrefillChooser is implemented by policies that choose a disaggregated
// request's prefill endpoint with a cost of their own (kv, kvbandit,
// round_robin). s.Candidates are the prefill and both candidates; commit is
// as in [Policy.Choose]. The Choice's State comes back with
// [Decision.PrefillState]. Policies without it get Choose(s, false).
type PrefillChooser interface {
	ChoosePrefill(s *Scoring, commit bool) (Choice, error)
}

// Predictor is implemented by policies that predict each candidate's time
// to first token. Predict has no side effects (no learning, no sampling
// state kept) and returns one Prediction per candidate of s, in order;
// predictions are posterior means, not Thompson draws.
type Predictor interface {
	Predict(s *Scoring) []Prediction
}

// RemoteStarter is implemented by policies that record state when they
// commit a decision, beyond the engine's slot and index accounting: the
// prefix (session) state of hint-aware policies. StartRemote records what
// the policy's Choose would have recorded had it chosen s.Endpoint for req
// itself (spending the session's reuse budget and pinning the session to
// the endpoint), so that the session's next request follows it on this
// replica too. req is built from s (model, tenant, session hints, ISL as
// TokenCount); it is only called when s.PrefixID is set. Implementations
// must be safe for concurrent use with Choose and must not block.
type RemoteStarter interface {
	StartRemote(req *Request, s *RemoteStart)
}

// RemoteLearner is implemented by policies that learn from outcomes.
// LearnRemote applies a peer's outcome as Done would have applied the
// same outcome of a local decision on o.Endpoint, from o's decision-time
// numbers instead of the decision's private state; each implementation
// documents what differs. The engine has checked o.Endpoint, o.DPRank and
// o.Served against its endpoint set. Implementations must be safe for
// concurrent use and must not block.
type RemoteLearner interface {
	LearnRemote(o *RemoteOutcome)
}

// PeerForgetter is implemented by policies that keep what each peer
// replica taught them apart ([RemoteOutcome.Peer]), so that a peer's
// effect on the learned state can be undone. ForgetPeer drops everything
// learnt from peer's outcomes; the transport calls it when the peer leaves
// (silent past its TTL, or evicted). Implementations must be safe for
// concurrent use and must not block.
type PeerForgetter interface {
	ForgetPeer(peer string)
}

// OutcomeAware is implemented by policies that need outcomes (in-flight
// counts, rewards) to work well; kvbandit warns when response processing
// is off for such a policy.
type OutcomeAware interface {
	NeedsOutcomes() bool
}
