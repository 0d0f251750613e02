package kvevents

import (
	"bytes"
	"slices"
	"sync"
	"testing"

	"github.com/go-zeromq/zmq4"
)

// tap records what OnMessage is given.
type tap struct {
	mu       sync.Mutex
	seqs     []uint64
	payloads [][]byte
}

func (tp *tap) on(_ string, seq uint64, payload []byte) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	tp.seqs = append(tp.seqs, seq)
	tp.payloads = append(tp.payloads, payload)
}

func (tp *tap) got() ([]uint64, [][]byte) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return slices.Clone(tp.seqs), slices.Clone(tp.payloads)
}

func subscribeTap(t *testing.T, cfg Config, r *recorder, tp *tap) *Sub {
	t.Helper()
	cfg.Endpoint = "w1"
	d := r.deps()
	d.OnMessage = tp.on
	s, err := Subscribe(t.Context(), cfg, d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// push feeds a message built like the worker's.
func push(t *testing.T, s *Sub, f [][]byte) { t.Helper(); s.Push(seqOfT(t, f), f[2]) }

func seqOfT(t *testing.T, f [][]byte) uint64 {
	t.Helper()
	seq, ok := seqOf(f)
	if !ok {
		t.Fatal("bad frames")
	}
	return seq
}

// TestPushSequenceChecks: pushed messages go through the socket's path:
// applied in order, a duplicate dropped, a gap makes the view approximate;
// none reaches OnMessage.
func TestPushSequenceChecks(t *testing.T) {
	r, tp := &recorder{}, &tap{}
	s := subscribeTap(t, Config{Address: "tcp://127.0.0.1:0", Bind: true}, r, tp)
	push(t, s, storedMsg(t, 0, 10, nil))
	push(t, s, storedMsg(t, 1, 11, 10))
	push(t, s, storedMsg(t, 1, 11, 10)) // duplicate
	eventually(t, "2 messages and a duplicate", func() bool { st := s.Stats(); return st.Messages == 2 && st.Duplicates == 1 })
	if st := s.Stats(); !st.Trusted || st.Pushed != 3 || st.Events != 2 {
		t.Errorf("stats %+v; want trusted, 3 pushed, 2 events", st)
	}
	push(t, s, storedMsg(t, 5, 12, nil)) // 2..4 lost
	eventually(t, "gap", func() bool { return s.Stats().Gaps == 1 })
	events, trust, resyncs := r.snapshot()
	if !slices.Equal(trust, []bool{true, false}) || resyncs != 1 || len(events) != 3 || events[1].Parent != 10 {
		t.Errorf("trust %v, resyncs %d, events %v; want [true false], 1, 3 events", trust, resyncs, events)
	}
	if seqs, _ := tp.got(); len(seqs) != 0 {
		t.Errorf("OnMessage got pushed messages %v", seqs)
	}
}

// TestOnMessageTapsWorkerMessages: OnMessage sees each message from the
// worker once (not the repeats of join), with its payload, but not an
// undecodable one; a Sub connected to the worker's PUB ignores pushes.
func TestOnMessageTapsWorkerMessages(t *testing.T) {
	pub, addr := newPub(t)
	r, tp := &recorder{}, &tap{}
	s := subscribeTap(t, Config{Address: addr}, r, tp)
	first := storedMsg(t, 0, 10, nil)
	join(t, pub, s, first)
	send(t, pub, [][]byte{[]byte("kv"), seqFrame(1), {0xc1, 0x00}}) // undecodable
	second := storedMsg(t, 2, 11, nil)
	send(t, pub, second)
	eventually(t, "worker messages", func() bool { return s.Stats().Messages == 2 })
	s.Push(3, storedMsg(t, 3, 12, 11)[2]) // connected to the worker: ignored
	eventually(t, "push ignored", func() bool { return s.Stats().PushIgnored == 1 })
	seqs, payloads := tp.got()
	if !slices.Equal(seqs, []uint64{0, 2}) {
		t.Fatalf("OnMessage seqs %v; want [0 2]", seqs)
	}
	if !bytes.Equal(payloads[0], first[2]) || !bytes.Equal(payloads[1], second[2]) {
		t.Error("OnMessage payloads differ from the published ones")
	}
}

// TestPushIgnoredWhileWorkerConnected: a bound Sub the worker reaches
// directly ignores peers' copies, which may arrive after the worker's own
// and would read as a restart.
func TestPushIgnoredWhileWorkerConnected(t *testing.T) {
	r, tp := &recorder{}, &tap{}
	s := subscribeTap(t, Config{Address: "tcp://127.0.0.1:0", Bind: true}, r, tp)
	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	if err := pub.Dial("tcp://" + s.Addr().String()); err != nil {
		t.Fatal(err)
	}
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 1, 11, 10))
	eventually(t, "2 messages", func() bool { return s.Stats().Messages == 2 })
	push(t, s, storedMsg(t, 0, 10, nil)) // a late copy
	eventually(t, "push ignored", func() bool { return s.Stats().PushIgnored == 1 })
	if st := s.Stats(); st.Restarts != 0 || !st.Trusted || st.Messages != 2 {
		t.Errorf("stats %+v; want no restart, trusted, 2 messages", st)
	}
	if seqs, _ := tp.got(); !slices.Equal(seqs, []uint64{0, 1}) {
		t.Errorf("OnMessage seqs %v; want [0 1]", seqs)
	}
}

// TestPushBounded: a pushed message over the queue's byte bound is
// dropped (counted), Push never blocks on a busy applier, and Push after
// Close is a no-op.
func TestPushBounded(t *testing.T) {
	r := &recorder{block: make(chan struct{})}
	s, err := Subscribe(t.Context(), Config{Endpoint: "w1", Address: "tcp://127.0.0.1:0", Bind: true, QueueSize: 2, QueueBytes: 1 << 10}, r.deps())
	if err != nil {
		t.Fatal(err)
	}
	s.Push(0, make([]byte, 2<<10)) // over QueueBytes
	if st := s.Stats(); st.Dropped != 1 || st.Pushed != 0 {
		t.Errorf("stats %+v; want 1 dropped, 0 pushed", st)
	}
	// Apply blocks on the first message: the rest fill the queue of 2,
	// then drop, without Push waiting.
	for seq := range uint64(10) {
		push(t, s, storedMsg(t, seq, 10+seq, nil))
	}
	if st := s.Stats(); st.Dropped < 7 {
		t.Errorf("stats %+v; want ≥ 7 dropped", st)
	}
	close(r.block)
	s.Close()
	s.Push(11, storedMsg(t, 11, 21, nil)[2]) // after Close: nothing, no panic
}
