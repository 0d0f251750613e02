// Package routing is the vocabulary every part of kvbandit's router speaks:
// the value types of a routing decision and the interfaces between its
// parts, with small pure helpers on them. It holds no machine: the engine
// that uses the vocabulary is routing/engine, and the policies, the KV
// index, discovery and the rest are sibling packages that import this one.
//
//   - Endpoints: [Endpoint], [EndpointSet] (checked by
//     [EndpointSet.Validate] before any swap), [EndpointKey], [Role], and
//     [EndpointState] with its [Live] counters that outlive snapshots.
//   - Requests: [Request] with its [Hints], [Subset] and precomputed
//     [BlockKeys].
//   - Scoring: what a [Policy] sees ([Scoring], [Candidate], [Load]) and
//     answers ([Choice], [Prediction]); optional policy abilities
//     ([PrefillChooser], [Predictor], [RemoteStarter], [RemoteLearner],
//     [OutcomeAware]).
//   - Decisions: [Decision], ended exactly once by [Decision.Done] with an
//     [Outcome]; the engine's side of it is a [Ticket]. [Picker] and
//     [Scorer] are what callers of the engine use.
//   - Replicas: [RemoteStart] and [RemoteOutcome], what peers exchange,
//     with their bounds.
//   - Errors the ext_proc layer maps to statuses: [ErrNoEndpoints],
//     [ErrSubsetEmpty], [ErrModelNotFound], [ErrOverloaded].
//
// This package imports nothing of kvbandit but routing/slots (the in-flight
// slot a [Rank] holds).
package routing
