// Package slo applies per-request time-to-first-token objectives
// (routing.Hints.TTFTObjective) to a routing decision and counts how often
// they are met.
//
// # The rule
//
// A request without an objective, or routed by a policy that does not
// implement [routing.Predictor], is untouched. Otherwise the [Gate] asks the
// policy for each candidate's predicted TTFT (posterior means, no side
// effects) and:
//
//   - keeps the candidates predicted to meet the objective
//     (TTFT <= Headroom x objective) and, among them, those with the most
//     cache: the largest Overlap, near-ties within NearTie of it kept, so
//     the policy's Choose still picks (and learns) among them;
//   - when no candidate is predicted to meet it, rejects a sheddable
//     request (priority < 0) with an error wrapping routing.ErrOverloaded
//     (HTTP 429 "overloaded"), and leaves every other request to the
//     policy over all candidates: it is routed normally. (Waiting happens
//     before the decision, in routing/admission, ordered by priority and
//     then by deadline.)
//
// # Metrics
//
// [Gate.Observe] receives each committed decision's outcome; the gate
// counts kvbandit_objective_total{result="met"|"missed"|"shed"}: met when
// the first token came within the objective, missed when it came later or
// the worker failed before any token, shed when the gate rejected the
// request. Outcomes that say nothing about the worker (client cancel,
// stream reset, shutdown, local rejection) are not counted.
//
// # Concurrency
//
// A Gate is immutable after [New] except for its atomic counters; Filter
// and Observe are safe for concurrent use and never block.
package slo
