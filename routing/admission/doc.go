// Package admission is kvbandit's admission queue: when every candidate
// endpoint is saturated, a request waits in a bounded queue instead of being
// routed onto an overloaded worker, is admitted in policy order when capacity
// frees, and is rejected (HTTP 429 after the engine's mapping) when the queue
// is full or its wait exceeds the maximum.
//
// # Overview
//
// It adapts the router queue of NVIDIA Dynamo (lib/kv-router/src/scheduling,
// queue.rs and policy.rs; summarised in research/dynamo-router.md §3.6).
// The caller owns the definition of saturation and passes it as a
// [Saturation]; for the engine that is "every candidate's active prefill tokens exceed
// Threshold × its max_num_batched_tokens, stale load counting as saturated
// unless every endpoint is stale". The queue only asks "saturated now?" and
// never learns why.
//
//   - [Queue.Admit] returns nil at once when the system is not saturated and
//     nobody is queued. Otherwise a sheddable request (priority < 0) is
//     rejected with [ErrShed], a request that finds the queue full with
//     [ErrQueueFull], and anything else waits until it is admitted (nil),
//     its wait reaches MaxWait ([ErrWaitExceeded]), or its context ends
//     (ctx.Err(); the waiter is removed).
//   - [Queue.Wake] is called by the engine whenever saturation may have
//     eased (prefill completed, a decision's Done, an endpoint-set or load
//     update). It admits queued requests in order while not saturated.
//
// # Ordering
//
// The queue pops the highest key first. The keys mirror Dynamo's
// SchedulingPolicy::enqueue_key, with priority_jump = [Item.HeadStart] in
// seconds (max(priority, 0), or latency_sensitivity when no priority was
// given; negative values are clamped to 0 as Dynamo does):
//
//   - fcfs: key = priority_jump − arrival_offset, i.e. the earliest
//     effective arrival (Arrival − HeadStart) goes first. A priority-5
//     request behaves as if it had arrived five seconds earlier.
//   - wspt (Smith's rule, weighted shortest processing time):
//     key = (1 + priority_jump) / max(1, new_tokens), where new_tokens is
//     [Item.Cost], the prompt tokens the request is expected to prefill
//     (ISL minus the tokens expected to be cached). Dynamo's classic docs
//     use the best candidate's overlap, its 2026 code the p75 overlap over
//     workers; computing Cost is the caller's choice.
//
// Dynamo breaks ties arbitrarily (a binary heap). Here ties are broken by
// effective arrival (wspt only), then by TTFT-objective deadline
// ([Item.Deadline], earliest first, requests without one last) and then by
// enqueue order, so the order is deterministic. Dynamo's strict_priority tiers and per-class queues are not
// implemented. Keys are computed once at enqueue, as in Dynamo; wspt can
// therefore starve long prompts under sustained load, which MaxWait bounds.
//
// Fairness: a newcomer never overtakes a queued request because load
// happened to be free at the instant it arrived. If anyone is queued, Admit
// first admits waiters in order while not saturated, and the newcomer goes
// through only if the queue then drains completely and the system is still
// not saturated; otherwise it is queued in its place (or shed when
// sheddable). Dynamo's enqueue, by contrast, schedules a newcomer at once
// whenever some worker has room.
//
// Dynamo's scheduler books a request's load before it tests saturation for
// the next one. [Item.OnAdmit] provides the same hook: it runs at the
// moment of admission, before the queue evaluates saturation for the next
// waiter, so the engine can charge the request's prefill tokens there (or
// run its non-blocking Pick there) and a single Wake does not admit a burst
// that the load counters have not yet seen.
//
// # Concurrency
//
// All methods are safe for concurrent use. The common case (queue enabled,
// nobody queued, not saturated) takes no lock: one atomic load, the
// Saturation call and OnAdmit. Everything else runs under one mutex that
// also covers the Saturation and OnAdmit calls made for queued requests, so
// these must be quick, must not block and must not call back into the
// Queue. Max-wait timers run on the injected [clock.Clock]: with
// clock.NewVirtual, expiry happens inside Advance/Step, so tests and
// virtual-time benchmarks are deterministic. The queue starts no goroutines
// of its own; each waiting request blocks in its caller's goroutine.
//
// # Errors
//
// [ErrShed], [ErrQueueFull] and [ErrWaitExceeded] all wrap [ErrRejected].
// This package does not import routing (the engine imports this package);
// the engine wraps these errors with routing.ErrOverloaded so that the
// ext_proc layer answers 429.
package admission
