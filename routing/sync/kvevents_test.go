package sync

import (
	"bytes"
	"fmt"
	stdsync "sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// kvSink records the republished KV events a node receives.
type kvSink struct {
	mu   stdsync.Mutex
	got  []wire.KVEvents
	fail string // endpoint answered with routing.ErrUnknownEndpoint
}

func (k *kvSink) on(endpoint string, seq uint64, payload []byte) error {
	if endpoint == k.fail {
		return fmt.Errorf("%w: %s", routing.ErrUnknownEndpoint, endpoint)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	k.got = append(k.got, wire.KVEvents{Endpoint: endpoint, Seq: seq, Payload: payload})
	return nil
}

func (k *kvSink) received() []wire.KVEvents {
	k.mu.Lock()
	defer k.mu.Unlock()
	return append([]wire.KVEvents(nil), k.got...)
}

// TestKVEventsRepublished: what A publishes reaches B's OnKVEvents in
// order and intact (a payload near the message bound included), not A's
// own; an endpoint B refuses is counted; a peer without the callback
// drops them (counted).
func TestKVEventsRepublished(t *testing.T) {
	srv := startNATS(t)
	sa, sb := &kvSink{}, &kvSink{fail: "10.9.9.9:1"}
	a := newNodeDeps(t, testConfig(srv, "a"), engine.Options{}, true, Deps{OnKVEvents: sa.on})
	b := newNodeDeps(t, testConfig(srv, "b"), engine.Options{}, true, Deps{OnKVEvents: sb.on})
	c := newNode(t, testConfig(srv, "c"), engine.Options{})
	waitConnected(t, a, b, c)

	big := bytes.Repeat([]byte{0xab}, wire.MaxMessage-kvOverhead-len("10.0.0.1:8000"))
	want := []wire.KVEvents{
		{Endpoint: "10.0.0.1:8000", Seq: 1, Payload: []byte("first")},
		{Endpoint: "10.0.0.1:8000", Seq: 2, Payload: big},
		{Endpoint: "10.0.0.2:8000", Seq: 7, Payload: []byte("other worker")},
	}
	for _, e := range want {
		a.s.PublishKVEvents(e.Endpoint, e.Seq, e.Payload)
	}
	a.s.PublishKVEvents("10.9.9.9:1", 1, []byte("unknown here"))
	waitFor(t, 5*time.Second, "B rejects the unknown endpoint", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "unknown_endpoint") == 1
	})
	got := sb.received()
	if len(got) != len(want) {
		t.Fatalf("B received %d messages, want %d", len(got), len(want))
	}
	for i := range want {
		if got[i].Endpoint != want[i].Endpoint || got[i].Seq != want[i].Seq || !bytes.Equal(got[i].Payload, want[i].Payload) {
			t.Errorf("message %d: %s seq %d (%d bytes), want %s seq %d (%d bytes)", i, got[i].Endpoint, got[i].Seq, len(got[i].Payload), want[i].Endpoint, want[i].Seq, len(want[i].Payload))
		}
	}
	waitFor(t, 5*time.Second, "C drops them", func() bool {
		return c.counter(t, "kvbandit_sync_dropped_total", "reason", "unsupported") == 4
	})
	if n := len(sa.received()); n != 0 {
		t.Errorf("A received %d of its own messages", n)
	}
	if n := a.counter(t, "kvbandit_sync_messages_total", "direction", "sent", "kind", wire.KindKVEvents.String()); n != 4 {
		t.Errorf("A sent %v kv-event messages, want 4", n)
	}
	// Over the message bound: dropped at once, not sent.
	a.s.PublishKVEvents("10.0.0.1:8000", 3, make([]byte, wire.MaxPayload+1))
	a.s.PublishKVEvents("10.0.0.1:8000", 3, append(big, 0))
	if n := a.counter(t, "kvbandit_sync_dropped_total", "reason", "too_large"); n != 2 {
		t.Errorf("too_large drops = %v, want 2", n)
	}
}

// TestKVEventsQueueBound: while the flusher does not keep up, the queued
// payloads stay within MaxKVQueueBytes and the excess is dropped
// (kv_queue), never blocking the caller.
func TestKVEventsQueueBound(t *testing.T) {
	cfg := Config{Servers: []string{"nats://127.0.0.1:1"}, Pool: "p", Replica: "a", Token: "t", MaxKVQueueBytes: 4 << 20}
	s, err := New(cfg, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	s.connected.Store(true) // not started: nothing drains the queue
	payload := make([]byte, 900<<10)
	for i := range 100 {
		s.PublishKVEvents("10.0.0.1:8000", uint64(i), payload)
	}
	s.lmu.Lock()
	queued, size := len(s.kvQueue), s.kvBytes
	s.lmu.Unlock()
	if queued != 4 || size > cfg.MaxKVQueueBytes {
		t.Errorf("queued %d messages, %d bytes; want 4, ≤ %d", queued, size, cfg.MaxKVQueueBytes)
	}
	var m dto.Metric
	if err := s.m.dropped.WithLabelValues("kv_queue").Write(&m); err != nil {
		t.Fatal(err)
	}
	if got := m.GetCounter().GetValue(); got != 96 {
		t.Errorf("kv_queue drops = %v, want 96", got)
	}
}
