// Package sync shares a kvbandit replica's in-flight decisions and
// outcomes with the other replicas of its pool over NATS Core (issue 12),
// and applies theirs to the local routing engine, so that every replica
// routes with the whole fleet's load and learning.
//
// # Overview
//
// A [Syncer] has a local side and a remote side. The local side is three
// hooks the serve wiring connects to engine.Deps (OnDecision, OnFirst,
// OnDone): each turns the event into a wire item (a Start from
// Decision.Share, a First, an End and an Outcome from
// Decision.ShareOutcome) and queues it without blocking. A flusher
// goroutine publishes the queue as one Batch message BatchInterval (2 ms)
// after the first queued item, or at once when the queue nears a
// message's size (1 MiB), so that under load one message carries many
// decisions. It also keeps this replica's in-flight set (decision number
// → Start) and publishes it as a Snapshot every SnapshotInterval and right
// after every (re)connect, and a Heartbeat every HeartbeatInterval.
//
// The remote side subscribes to one wildcard subject, <prefix>.* (the
// prefix defaults to "kvbandit.<pool>"; messages are published on
// <prefix>.batch, <prefix>.snapshot, <prefix>.heartbeat), decodes every
// message with a wire.Decoder, drops its own messages (same replica id and
// epoch), messages of another pool and undecodable ones (counted), and
// keeps, per peer replica, its epoch, when it was last heard (this
// replica's clock: durations only, never a peer's wall clock) and its
// decisions applied with Engine.StartRemote. A Start is applied, a First
// marks its decision prefilled, an End releases it, an Outcome goes to
// Engine.LearnRemote. A Snapshot replaces the peer's contribution: the
// decisions it lists that are not known yet are started, known ones
// missing from it are ended, and the ones already applied are left alone
// (starting them again would spend a session's budget twice). A new epoch
// is a restarted peer: its old decisions end. A peer silent for PeerTTL
// (3 s) is forgotten and its decisions end.
//
// A disaggregated decision's Start names its prefill endpoint, rank and
// cached prompt tokens too (wire flags bit 1; see routing/sync/wire,
// "Compatibility", for a rolling upgrade): the peer's engine holds its
// prefill tokens on the prefill endpoint until the First, and only its
// blocks on the decode endpoint, as the deciding replica does. Its
// Outcome leaves the time to first token out: that time is the prefill
// endpoint's, which an outcome cannot name.
//
// # KV events
//
// A worker that dials a router's bound KV-event socket (llm-d-inference-
// sim style) reaches one replica. That replica republishes each of the
// worker's messages with [Syncer.PublishKVEvents] (one KindKVEvents
// message on <prefix>.kv_events each, queued for the flusher within
// Config.MaxKVQueueBytes, 8 MiB, never blocking); its peers hand them to
// Deps.OnKVEvents, which feeds their own subscriber for the endpoint
// (kvevents.Sub.Push: the same sequence checks, so a lost message is a gap
// and makes the peer's view approximate, as it would for a local drop).
// Republished messages are not republished again.
//
// NATS Core is at-most-once: a lost message is repaired by the next
// snapshot (at most SnapshotInterval later), and a queue that overflows
// drops items the same way (counted). NATS unreachable at start or later
// never blocks serving: the replica routes on local state, the
// kvbandit_sync_degraded gauge is 1 and a log line says so, the client
// reconnects forever and sends a snapshot as soon as it is back. Peers'
// decisions already applied stay until their peer's TTL expires.
//
// # Warm start
//
// A replica that starts (or restarts) asks a live peer for its state
// (warm.go, issue 22): [Syncer.FetchState] picks the peer heard last
// within the peer TTL (waiting up to WarmConfig.PeerWait to hear one) and
// sends a state request on the peer's own subject, <prefix>.state.<id>;
// the peer answers on the request's reply subject with the chunks of its
// state (routing/warmstate values: per endpoint the KV-event stream's
// sequence number and trust with the index entries exported at that same
// point, the latency model, the policy's posteriors, the sessions), each
// one message of at most 1 MiB, WarmConfig.Window at a time, the next
// window on request. A refusal, NATS's no-responders answer, a window
// late by WarmConfig.WindowTimeout, a chunk that does not decode or
// breaks the exchange (another transfer, another sender, out of order, a
// changing total) or a transfer over WarmConfig.MaxBytes ends the attempt
// and the next peer is tried, within WarmConfig.Timeout. A peer serves one
// transfer at a time and starts at most WarmConfig.Burst, then one per
// WarmConfig.ServeEvery; the rest are refused and counted. What to do
// with the state (import it, resume the KV-event streams at its sequence
// numbers) is the caller's: internal/app's warm start.
//
// # Limits
//
// Every incoming message is at most 1 MiB (the server's max_payload and
// the decoder both enforce it), the subscription holds at most
// Config.MaxPendingBytes before NATS drops (counted as slow_consumer),
// at most Config.MaxPeers peers are tracked, state transfers are bounded
// as the warm start says, block keys are copied out
// of each message so that one retained decision never pins a whole
// message, and the engine bounds peers' open decisions and held block
// keys (routing.ErrRemoteLimit, counted). A snapshot that would not fit
// in one message leaves out block keys, then starts.
//
// # Trust
//
// Peers are authenticated by NATS: New refuses a Config without
// credentials (user/password, token, nkey seed file, creds file or an mTLS
// client certificate) unless AllowAnonymous is set, and then Start logs a
// warning. Even an authenticated peer is bounded (trust.go, vouch.go):
//
//   - caps: at most MaxPeerInFlight open decisions and MaxPeerPrefillTokens
//     prompt tokens not prefilled yet per peer, at most MaxRemoteTokens
//     per decision and no more than the endpoint's scraped KV capacity
//     (num_gpu_blocks × block size); a TTL is required and cut to
//     MaxRemoteTTL; over-cap Starts are refused and counted by reason;
//   - claims checked against the workers: at each fresh scrape of an
//     endpoint (routing/engine ScrapedLoads), the peers' decisions there
//     beyond what the worker's own running + waiting count vouches for
//     (minus this replica's own decisions, plus slack for decisions made
//     since and for sync delay) are refuted: they end, the largest
//     claimants first (max-min fair shares), and a peer refuted again and
//     again, or by 32 decisions at once, is quarantined for a minute;
//   - outcomes: learnt only for the peer's own decisions applied here, not
//     refuted, once each, with that decision's endpoint and rank, and with
//     a TTFT and latency that fit how long the decision was open on this
//     replica's clock; where the endpoint's load is fresh, vouched for by
//     the workers: a success on an endpoint that exports its count of
//     finished requests (vllm:request_success_total,
//     sglang:num_requests_total) waits in a bounded queue for the next
//     scrape, whose increase, less this replica's own outcomes there,
//     is how many of the peers' outcomes are learnt (max-min fair
//     between peers, oldest first; the rest dropped, and the peer that
//     loses the most gets a strike: completions.go), and any other
//     outcome needs a scrape that counted its decision open (vouch.go);
//     RemoteOutcome.Peer names the peer, and the engine forgets a peer's
//     teaching (Engine.ForgetPeer) when the peer goes silent, is evicted
//     as a newcomer or is quarantined;
//   - identity: another epoch of a live peer's id is taken for its restart
//     only once that epoch alone has been heard for two heartbeat
//     intervals, so a client that flips a real peer's epoch cannot end the
//     peer's decisions at every message.
//
// Without fresh load (no /metrics, stale or failed scrapes) only the caps
// apply. Peers' outcomes held for a count are learnt up to a scrape
// interval (and a sweep) late. docs/security.md lists every bound with the test that proves it.
//
// # Concurrency
//
// The hooks take one short mutex (no I/O, no allocation but the in-flight
// map's) and may be called from any goroutine. One flusher goroutine
// publishes; NATS delivers incoming messages on one goroutine, in order;
// the peer table is guarded by a mutex shared with the peer sweeper and
// [Syncer.Peers]. Close flushes the queue, drains the connection, ends
// every peer decision and waits for its goroutines: call it before the
// engine's Close.
package sync
