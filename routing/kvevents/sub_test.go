package kvevents

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// recorder is a fake engine: it records what the Sub hands it.
type recorder struct {
	mu      sync.Mutex
	events  []kvindex.Event
	ranks   []int
	trust   []bool
	resyncs int
	err     error         // returned by Apply
	block   chan struct{} // when set, Apply waits on it
}

func (r *recorder) deps() Deps {
	return Deps{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Apply: func(ep string, rank int, ev kvindex.Event) error {
			if r.block != nil {
				<-r.block
			}
			r.mu.Lock()
			defer r.mu.Unlock()
			r.events = append(r.events, ev)
			r.ranks = append(r.ranks, rank)
			return r.err
		},
		OnTrust: func(ep string, t bool) {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.trust = append(r.trust, t)
		},
		OnResync: func(string) {
			r.mu.Lock()
			defer r.mu.Unlock()
			r.resyncs++
		},
	}
}

func (r *recorder) snapshot() (events []kvindex.Event, trust []bool, resyncs int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events), slices.Clone(r.trust), r.resyncs
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// storedMsg is a BlockStored batch of one block with engine hash h.
func storedMsg(t testing.TB, seq uint64, h uint64, parent any) [][]byte {
	return frames(t, seq, []any{1.0, []any{storedArray([]any{h}, parent, toks(4, int(h)), 4)}, 0})
}

func newPub(t *testing.T) (zmq4.Socket, string) {
	t.Helper()
	pub := zmq4.NewPub(t.Context())
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return pub, "tcp://" + pub.Addr().String()
}

func send(t *testing.T, pub zmq4.Socket, f [][]byte) {
	t.Helper()
	if err := pub.Send(zmq4.NewMsgFrom(f...)); err != nil {
		t.Fatal(err)
	}
}

// join repeats f until the Sub has taken one message (PUB/SUB drops
// messages sent before the subscription arrives). Repeats count as
// duplicates.
func join(t *testing.T, pub zmq4.Socket, s *Sub, f [][]byte) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.Stats().Messages+s.Stats().Malformed == 0 {
		if time.Now().After(deadline) {
			t.Fatal("subscriber never joined")
		}
		send(t, pub, f)
		time.Sleep(5 * time.Millisecond)
	}
}

func subscribe(t *testing.T, cfg Config, r *recorder) *Sub {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "w1"
	}
	s, err := Subscribe(t.Context(), cfg, r.deps())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

func TestSubscribeConnect(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{}
	s := subscribe(t, Config{Address: addr}, r)
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 1, 11, 10))
	send(t, pub, frames(t, 2, []any{1.0, []any{[]any{"BlockRemoved", []any{10}, "GPU"}}, 0}))
	eventually(t, "3 events", func() bool { return s.Stats().Events == 3 })
	events, trust, resyncs := r.snapshot()
	if got := []kvindex.EventKind{events[0].Kind, events[1].Kind, events[2].Kind}; !slices.Equal(got, []kvindex.EventKind{kvindex.Stored, kvindex.Stored, kvindex.Removed}) {
		t.Errorf("kinds = %v", got)
	}
	if !events[1].HasParent || events[1].Parent != 10 {
		t.Errorf("second event parent = %v %d", events[1].HasParent, events[1].Parent)
	}
	if !slices.Equal(trust, []bool{true}) || resyncs != 0 {
		t.Errorf("trust %v, resyncs %d; want [true], 0", trust, resyncs)
	}
	if st := s.Stats(); !st.Trusted || st.Gaps != 0 || st.Blocks != 2 {
		t.Errorf("stats %+v", st)
	}
}

func TestSubscribeBind(t *testing.T) {
	r := &recorder{}
	s := subscribe(t, Config{Address: "tcp://127.0.0.1:0", Bind: true}, r)
	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	if err := pub.Dial("tcp://" + s.Addr().String()); err != nil {
		t.Fatal(err)
	}
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 1, 11, 10))
	eventually(t, "2 events", func() bool { return s.Stats().Events == 2 })
	if st := s.Stats(); !st.Trusted || st.Duplicates == 0 && st.Messages != 2 {
		t.Errorf("stats %+v", st)
	}
}

func TestGapMakesUntrusted(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{}
	s := subscribe(t, Config{Address: addr}, r)
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 5, 11, nil))
	eventually(t, "gap", func() bool { return s.Stats().Messages == 2 })
	_, trust, resyncs := r.snapshot()
	if !slices.Equal(trust, []bool{true, false}) || resyncs != 1 {
		t.Errorf("trust %v, resyncs %d; want [true false], 1", trust, resyncs)
	}
	if st := s.Stats(); st.Gaps != 1 || st.Trusted || st.Resyncs != 1 {
		t.Errorf("stats %+v", st)
	}
	// AllBlocksCleared makes the view exact again.
	send(t, pub, frames(t, 6, []any{1.0, []any{[]any{"AllBlocksCleared"}}, 0}))
	eventually(t, "trusted again", func() bool { return s.Stats().Trusted })
}

func TestLateStartUntrusted(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{}
	s := subscribe(t, Config{Address: addr}, r)
	join(t, pub, s, storedMsg(t, 42, 10, nil))
	_, trust, resyncs := r.snapshot()
	if !slices.Equal(trust, []bool{false}) || resyncs != 1 {
		t.Errorf("trust %v, resyncs %d; want [false], 1", trust, resyncs)
	}
}

func TestRestartClears(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{}
	s := subscribe(t, Config{Address: addr}, r)
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 1, 11, 10))
	send(t, pub, storedMsg(t, 0, 20, nil)) // the worker came back
	eventually(t, "restart", func() bool { return s.Stats().Restarts == 1 && s.Stats().Messages == 3 })
	events, trust, resyncs := r.snapshot()
	if events[2].Kind != kvindex.Cleared || events[3].Kind != kvindex.Stored {
		t.Errorf("events after restart: %v, %v; want cleared, stored", events[2].Kind, events[3].Kind)
	}
	if !slices.Equal(trust, []bool{true}) || resyncs != 1 {
		t.Errorf("trust %v, resyncs %d; want [true], 1", trust, resyncs)
	}
}

func TestMalformedCountedAndSocketKeepsWorking(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{}
	s := subscribe(t, Config{Address: addr}, r)
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, [][]byte{[]byte("kv"), []byte("junk")})                  // bad frames: no seq
	send(t, pub, [][]byte{[]byte("kv"), seqFrame(1), []byte{0xc1, 0x00}}) // bad payload
	send(t, pub, storedMsg(t, 2, 11, nil))
	eventually(t, "message after junk", func() bool { return s.Stats().Messages == 2 })
	st := s.Stats()
	if st.Malformed != 2 || st.Gaps != 0 || st.Trusted || st.Resyncs != 1 {
		t.Errorf("stats %+v; want 2 malformed, no gap, untrusted, 1 resync", st)
	}
}

func TestApplyErrorsCounted(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{err: fmt.Errorf("wrapped: %w", kvindex.ErrUnknownParent)}
	s := subscribe(t, Config{Address: addr}, r)
	join(t, pub, s, storedMsg(t, 0, 10, 99))
	if st := s.Stats(); st.UnknownParent != 1 {
		t.Errorf("UnknownParent = %d, want 1", st.UnknownParent)
	}
}

func TestQueueOverflowDrops(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{block: make(chan struct{})}
	s := subscribe(t, Config{Address: addr, QueueSize: 2}, r)
	// The first message blocks in Apply; send until the queue overflows.
	deadline := time.Now().Add(5 * time.Second)
	seq := uint64(0)
	for s.Stats().Dropped == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no drops")
		}
		send(t, pub, storedMsg(t, seq, 1000+seq, nil))
		seq++
		time.Sleep(time.Millisecond)
	}
	close(r.block)
	// Messages after a gap, one at a time until the subscriber sees it: one
	// sent while the queue is still full is dropped too, and only a message
	// that arrives shows the gap.
	next := seq + 5
	eventually(t, "gap after drops", func() bool {
		send(t, pub, storedMsg(t, next, 1, nil))
		next++
		time.Sleep(time.Millisecond)
		return s.Stats().Gaps >= 1 && !s.Stats().Trusted
	})
	if _, _, resyncs := r.snapshot(); resyncs == 0 {
		t.Error("no resync after drops")
	}
}

// TestQueueBytesBound: messages that would take the queue over
// QueueBytes are dropped, however few are queued.
func TestQueueBytesBound(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{}
	s := subscribe(t, Config{Address: addr, QueueBytes: 64}, r)
	eventually(t, "a drop", func() bool {
		send(t, pub, storedMsg(t, 0, 10, nil)) // about 90 bytes
		time.Sleep(5 * time.Millisecond)
		return s.Stats().Dropped > 0
	})
	if st := s.Stats(); st.Messages != 0 {
		t.Errorf("stats %+v; want every message dropped", st)
	}
}

// replayServer is a stand-in for vLLM's replay ROUTER serving recorded
// batches.
func replayServer(t *testing.T, recorded map[uint64][]byte) string {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	router := zmq4.NewRouter(ctx)
	if err := router.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			msg, err := router.Recv()
			if err != nil {
				return
			}
			if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
				t.Errorf("replay request frames %q", msg.Frames)
				continue
			}
			id := msg.Frames[0]
			start := uint64(0)
			for _, b := range msg.Frames[2] {
				start = start<<8 | uint64(b)
			}
			seqs := make([]uint64, 0, len(recorded))
			for q := range recorded {
				seqs = append(seqs, q)
			}
			slices.Sort(seqs)
			for _, q := range seqs {
				if q >= start {
					_ = router.Send(zmq4.NewMsgFrom(id, []byte{}, seqFrame(q), recorded[q]))
				}
			}
			_ = router.Send(zmq4.NewMsgFrom(id, []byte{}, seqFrame(endSeq), []byte{}))
		}
	}()
	t.Cleanup(func() { cancel(); router.Close(); wg.Wait() })
	return "tcp://" + router.Addr().String()
}

func TestReplayFillsGap(t *testing.T) {
	pub, addr := newPub(t)
	rec := map[uint64][]byte{}
	for q := uint64(0); q < 4; q++ {
		var parent any
		if q > 0 {
			parent = 10 + q - 1
		}
		rec[q] = storedMsg(t, q, 10+q, parent)[2]
	}
	r := &recorder{}
	s := subscribe(t, Config{Address: addr, ReplayAddress: replayServer(t, rec)}, r)
	join(t, pub, s, [][]byte{[]byte("kv"), seqFrame(0), rec[0]})
	send(t, pub, [][]byte{[]byte("kv"), seqFrame(3), rec[3]}) // 1 and 2 were lost
	eventually(t, "replayed", func() bool { return s.Stats().Messages == 4 })
	events, trust, resyncs := r.snapshot()
	var hashes []uint64
	for _, ev := range events {
		hashes = append(hashes, ev.Blocks[0].EngineHash)
	}
	if !slices.Equal(hashes, []uint64{10, 11, 12, 13}) {
		t.Errorf("applied hashes %v, want 10..13 in order", hashes)
	}
	if !slices.Equal(trust, []bool{true}) || resyncs != 1 {
		t.Errorf("trust %v, resyncs %d; want [true], 1", trust, resyncs)
	}
	if st := s.Stats(); st.Replays != 1 || st.ReplayFailures != 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestReplayBufferTooShort(t *testing.T) {
	pub, addr := newPub(t)
	rec := map[uint64][]byte{2: storedMsg(t, 2, 12, nil)[2]} // 1 has left the buffer
	r := &recorder{}
	s := subscribe(t, Config{Address: addr, ReplayAddress: replayServer(t, rec)}, r)
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 3, 13, nil))
	eventually(t, "replay done", func() bool { return s.Stats().Messages == 3 })
	if st := s.Stats(); st.Trusted || st.ReplayFailures != 1 {
		t.Errorf("stats %+v; want untrusted after a failed replay", st)
	}
}

func TestReplayUnreachable(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{}
	s := subscribe(t, Config{Address: addr, ReplayAddress: "tcp://127.0.0.1:1", ReplayTimeout: 300 * time.Millisecond}, r)
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 3, 13, nil))
	eventually(t, "replay failure", func() bool { return s.Stats().ReplayFailures == 1 && s.Stats().Messages == 2 })
	if s.Stats().Trusted {
		t.Error("trusted after a failed replay")
	}
}

func TestSubscribeErrors(t *testing.T) {
	r := &recorder{}
	if _, err := Subscribe(t.Context(), Config{Address: "tcp://127.0.0.1:0"}, Deps{}); err == nil {
		t.Error("no error without Apply")
	}
	if _, err := Subscribe(t.Context(), Config{}, r.deps()); err == nil {
		t.Error("no error without Address")
	}
	if _, err := Subscribe(t.Context(), Config{Address: "bogus://x", Bind: true}, r.deps()); err == nil {
		t.Error("no error for a bad bind address")
	}
	if _, err := Subscribe(t.Context(), Config{Address: "tcp://*:5557"}, r.deps()); err == nil {
		t.Error("no error for connecting to a wildcard address")
	}
	_ = errors.New
}

func TestReconnectAfterWorkerRestart(t *testing.T) {
	pub, addr := newPub(t)
	r := &recorder{}
	s := subscribe(t, Config{Address: addr}, r)
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 1, 11, 10))
	eventually(t, "2 messages", func() bool { return s.Stats().Messages == 2 })
	pub.Close()

	// The worker comes back on the same address and starts again at 0.
	pub2 := zmq4.NewPub(t.Context())
	defer pub2.Close()
	if err := pub2.Listen(addr); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Stats().Restarts == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no restart seen after reconnecting")
		}
		send(t, pub2, storedMsg(t, 0, 20, nil))
		time.Sleep(10 * time.Millisecond)
	}
	events, trust, _ := r.snapshot()
	if events[2].Kind != kvindex.Cleared || !slices.Equal(trust, []bool{true}) {
		t.Errorf("after restart: event %v, trust %v; want cleared, [true]", events[2].Kind, trust)
	}
}
