package sync

import (
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// DefaultMaxKVQueueBytes bounds the KV-event payloads waiting to be
// republished.
const DefaultMaxKVQueueBytes = 8 << 20

// kvOverhead is an upper bound of a KVEvents message's bytes besides its
// endpoint and payload (envelope with pool and replica, lengths, seq).
const kvOverhead = 2*wire.MaxIDLen + 64

// PublishKVEvents republishes one message of a worker's KV events (its
// sequence number and msgpack payload, as received on this replica's
// socket) for the peers whose workers do not reach them. It never blocks:
// the message is queued for the flusher, or dropped and counted in
// kvbandit_sync_dropped_total (reason too_large: the message would not fit
// in one NATS message; kv_queue: the queued payloads would pass
// Config.MaxKVQueueBytes; disconnected). payload is retained until sent
// and must not be modified.
func (s *Syncer) PublishKVEvents(endpoint string, seq uint64, payload []byte) {
	if len(endpoint) > wire.MaxStringLen || len(payload) > wire.MaxPayload ||
		len(payload)+len(endpoint)+kvOverhead > wire.MaxMessage {
		s.m.dropped.WithLabelValues("too_large").Inc()
		return
	}
	if !s.connected.Load() {
		// Peers resync at the gap they will see.
		s.m.dropped.WithLabelValues("disconnected").Inc()
		return
	}
	n := len(payload) + len(endpoint)
	s.lmu.Lock()
	if s.kvBytes+n > s.cfg.MaxKVQueueBytes {
		s.lmu.Unlock()
		s.m.dropped.WithLabelValues("kv_queue").Inc()
		return
	}
	s.kvQueue = append(s.kvQueue, wire.KVEvents{Endpoint: endpoint, Payload: payload, Seq: seq})
	s.kvBytes += n
	first := len(s.kvQueue) == 1
	s.lmu.Unlock()
	if first {
		s.signal(s.kvKick)
	}
}

// flushKV publishes the queued KV-event messages, one NATS message each
// (they are large), in the order they were queued.
func (s *Syncer) flushKV() {
	s.lmu.Lock()
	q := s.kvQueue
	s.kvQueue, s.kvBytes = nil, 0
	s.lmu.Unlock()
	if len(q) == 0 {
		return
	}
	if !s.connected.Load() {
		s.m.dropped.WithLabelValues("disconnected").Add(float64(len(q)))
		return
	}
	for i := range q {
		m := wire.Message{Kind: wire.KindKVEvents, KVEvents: q[i]}
		_ = s.publish(&m)
	}
}

// receiveKV hands a peer's republished KV events to Deps.OnKVEvents
// (s.rmu held). Without the callback they are dropped (reason
// unsupported); an error of the callback is counted as a rejection
// (routing.ErrUnknownEndpoint: reason unknown_endpoint).
func (s *Syncer) receiveKV(e *wire.KVEvents) {
	if s.onKV == nil {
		s.m.dropped.WithLabelValues("unsupported").Inc()
		return
	}
	if err := s.onKV(e.Endpoint, e.Seq, e.Payload); err != nil {
		s.reject(err)
	}
}
