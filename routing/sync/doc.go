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
