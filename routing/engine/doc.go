// Package engine decides which worker serves an inference request: it is
// the machine that speaks routing's vocabulary.
//
// # Overview
//
// The request path calls [Engine.Pick] with a [routing.Request] (model, token ids or
// an estimate, hints, subset, priority) and gets back a [*routing.Decision] naming
// the endpoint. The decision carries a Done callback: the caller reports the
// request's [routing.Outcome] through [routing.Decision.Done] exactly once, whatever way the
// request ends, so load accounting and learning need no second lookup.
//
// Which endpoint is chosen is up to a [routing.Policy]. Policies live in
// routing/policy/<name> and are registered in one place
// (routing/policy/registry.go). The engine does the parts every policy
// shares: candidate filtering by model and subset hint, in-flight
// accounting, decision ids and the exactly-once Done.
//
// # Concurrency
//
// Pick never blocks and never takes a lock shared with other requests. It
// reads an immutable [snapshot] published with atomic.Pointer by
// [Engine.Update]; discovery sources call Update from their own goroutines
// after the new [routing.EndpointSet] passed [routing.EndpointSet.Validate]. Live
// per-endpoint counters ([routing.EndpointState]) are carried by pointer from one
// snapshot to the next, so a swap never resets in-flight counts, and a
// decision whose endpoint was removed still decrements the right counter.
// Randomness comes from [routing.Rand], a lock-free seeded source.
//
// A decision hashes the prompt into chained block keys (routing/kvindex),
// reads the KV index (sharded read locks) and each candidate's in-flight
// load (routing/slots: one small lock per endpoint rank), and asks the
// policy. Committing it charges the chosen rank's slot and, for endpoints
// without KV events, queues an approximate index insert that the engine's
// index goroutine applies (inline with Options.SyncIndex, for virtual-time
// runs). The admission queue, when on, is the only place Pick may wait.
//
// # The pipeline
//
// decide (decide.go) runs named stages: eligible (model, subset hint,
// ejection) → lookup (block keys, KV index and in-flight overlap per
// candidate) → splitRoles (prefill candidates apart, disaggregation) →
// objectives (routing/slo's gate) → the policy's Choose → newDecision →
// disaggregate (routing/pd's split, the prefill hold) → commit (slot,
// approximate insert, stale timer, hooks). Pick wraps it in admission
// (routing/admission), the only place it may wait.
//
// # Lifecycle
//
// Pick increments the endpoint's in-flight count and returns a Decision
// bound to a commitment (the engine's [routing.Ticket]). Done(Outcome) decrements it and forwards the outcome to the policy's
// learner. Done is idempotent: the first call wins, later calls are counted
// and ignored. Callers (the ext_proc stream, the proxy) call Done on
// success, upstream error, client cancel, stream reset and shutdown.
//
// In a pool with prefill-role endpoints ([routing.Role]) and routing/pd's decider in
// Deps.PD, the policy chooses among the decode and both endpoints, and the
// disaggregator may name a prefill endpoint ([routing.Decision.Prefill]). That
// endpoint then counts the request in flight, with its prompt as prefill
// load, until [routing.Decision.Prefilled] (the first token) or Done, whichever
// comes first; the decode endpoint carries the request until Done, with no
// prefill tokens. A pool without prefill endpoints never reaches the
// disaggregator.
//
// # Peer replicas
//
// Replicas that route for the same fleet (active-active, over routing/sync)
// share their decisions: [routing.Decision.Share] describes a committed decision's
// load and session, and a peer applies it with [Engine.StartRemote], which
// charges the same slot, approximate index and prefix state a local
// decision would, and counts it in [routing.Live.RemoteInFlight]; the returned
// [RemoteDecision] is ended by the sync layer (the peer's end, a snapshot
// replacing the peer's set, the peer's TTL) or after Options.StaleAfter.
// Outcomes travel the same way ([routing.Decision.ShareOutcome],
// [Engine.LearnRemote]) to the policies that learn ([routing.RemoteLearner]);
// endpoint health stays local. A disaggregated decision is shared with
// both endpoints: a peer holds its prefill endpoint's prefill tokens (and
// one RemoteInFlight there) until Prefilled or End, and its decode
// endpoint's blocks without prefill tokens, as the deciding replica does;
// its shared outcome has no time to first token (the prefill endpoint's).
// A peer leaving ([Engine.ForgetPeer]) takes what its outcomes taught out
// of the policies that keep it apart ([routing.PeerForgetter]). Peers'
// decisions are bounded in number and held block keys
// (Options.MaxRemoteDecisions, Options.RemoteBlockBudget).
package engine
