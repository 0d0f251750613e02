// Package kvevents receives vLLM-compatible KV cache events over ZMQ and
// turns them into [kvindex.Event] values.
//
// # Overview
//
// [Decode] reads one 3-frame message (topic, 8-byte big-endian sequence
// number, msgpack EventBatch) in either encoding vLLM emits: msgspec
// array_like tagged tuples or maps with a "type" key. It reads msgpack
// with a small reader of its own that checks every declared length
// against the bytes present and the limits ([MaxEventsPerBatch] and the
// others) before it allocates. [Subscribe] runs one ZMTP SUB socket
// (package routing/kvevents/zmtp) per endpoint, bound or connected, and feeds the
// decoded events to an Apply callback in the worker's order.
//
// # Concurrency
//
// Each [Sub] has one goroutine per ZMTP connection (one when it connects;
// as many as publishers, up to Config.MaxConns, when it binds) plus the
// socket's accept or dial loop. They only move messages into a queue
// bounded in messages and bytes (dropping and counting when it is full).
// One applier goroutine checks sequence numbers, replays gaps and calls
// Apply; Apply, OnTrust, OnResync, OnMessage and OnResumeGap are called
// from it only. The warm start's calls (Export, Resume, Release, Hold)
// run on it too, between two messages (warm.go).
//
// # Republished events
//
// A worker that dials a router's bound socket reaches one replica only.
// That replica's Deps.OnMessage tap sees every message from the worker
// (received or replayed) that passed the sequence checks and decoded, and
// republishes it (routing/sync); its peers feed it to their own Sub for
// the endpoint with [Sub.Push], which queues it like a received message
// (same bounds, same sequence checks, never blocking). Pushed messages are
// not tapped, so nothing is republished twice, and a Sub ignores them
// while its own socket has a connection (counted as PushIgnored).
//
// # Lifecycle
//
// The first message decides trust: sequence 0 means we saw the worker from
// its start. A later first message, a gap, dropped or undecodable messages
// make the view approximate (OnResync, then OnTrust(false)) unless replay
// from the worker's replay_endpoint fills the gap. So does an event the
// index refuses as over its limits (kvindex.ErrWorkerFull,
// kvindex.ErrTooManyBlockSizes), without a resync: no replay brings the
// refused blocks back. A sequence number going
// backwards is a worker restart: every rank seen gets a Cleared event, and
// a restart at sequence 0 is exact again; so is an AllBlocksCleared event.
// An untrusted view is trusted again once the worker has stored a whole
// GPU cache's worth of blocks since the last hole (Config.CacheBlocks,
// SetCacheBlocks; see warm.go for exactly what it may still miss). With
// Config.Hold a Sub queues its stream until a peer replica's state
// resumes it at a known sequence number with a known trust (Resume) or
// it is released to start as above (Release): the warm start, warm.go.
// Close stops every goroutine of the Sub.
package kvevents
