package kvevents

import (
	"errors"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// bound is a Sub bound to a free loopback port that no worker dials, fed
// with Push.
func bound(t *testing.T, cfg Config, r *recorder) *Sub {
	t.Helper()
	cfg.Address, cfg.Bind = "tcp://127.0.0.1:0", true
	return subscribe(t, cfg, r)
}

// hashes returns the engine hashes of the Stored events r was given.
func hashes(r *recorder) []uint64 {
	events, _, _ := r.snapshot()
	var out []uint64
	for _, ev := range events {
		for _, b := range ev.Blocks {
			out = append(out, b.EngineHash)
		}
	}
	return out
}

// TestResumeAtPeerState: a held Sub applies nothing; resumed at a peer's
// sequence number 6, it imports the peer's state before any event, drops
// the queued messages the state covers (5, 6), applies the next (7, whose
// parent came with the state) and takes the peer's trust; the stream
// then goes on as usual.
func TestResumeAtPeerState(t *testing.T) {
	r := &recorder{}
	s := bound(t, Config{Hold: true}, r)
	for seq := uint64(5); seq <= 7; seq++ {
		push(t, s, storedMsg(t, seq, 100+seq, 100+seq-1))
	}
	eventually(t, "3 pushed", func() bool { return s.Stats().Pushed == 3 })
	if st := s.Stats(); st.Messages != 0 || !st.Holding {
		t.Fatalf("a held Sub applied %d messages (holding %v)", st.Messages, st.Holding)
	}
	var restored atomic.Int32
	err := s.Resume(t.Context(), Resume{StreamState: StreamState{Started: true, Trusted: true, Seq: 6}, Restore: func() error {
		if len(hashes(r)) != 0 {
			t.Error("an event was applied before the state was restored")
		}
		restored.Add(1)
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	push(t, s, storedMsg(t, 8, 108, 107))
	eventually(t, "7 and 8 applied", func() bool { return s.Stats().Messages == 2 })
	st := s.Stats()
	if restored.Load() != 1 || !st.Trusted || st.Covered != 2 || st.Gaps != 0 || st.Holding {
		t.Errorf("restored %d, stats %+v; want one restore, trusted, 2 covered, no gap", restored.Load(), st)
	}
	if got := hashes(r); !slices.Equal(got, []uint64{107, 108}) {
		t.Errorf("applied blocks %v, want [107 108]", got)
	}
	if _, trust, _ := r.snapshot(); !slices.Equal(trust, []bool{true}) {
		t.Errorf("trust %v, want [true]", trust)
	}
	if err := s.Resume(t.Context(), Resume{StreamState: StreamState{Started: true}}); err == nil {
		t.Error("resume of a running Sub: no error")
	}
}

// TestResumeBehind: a queued stream ahead of the peer's state (its first
// message 10 > 5+1: messages 6..9 are missing) is refused with ErrBehind
// and the Sub keeps holding; a fresher state (9) resumes it, trusted.
func TestResumeBehind(t *testing.T) {
	r := &recorder{}
	s := bound(t, Config{Hold: true}, r)
	push(t, s, storedMsg(t, 10, 110, nil))
	push(t, s, storedMsg(t, 11, 111, 110))
	eventually(t, "2 pushed", func() bool { return s.Stats().Pushed == 2 })
	calls := 0
	restore := func() error { calls++; return nil }
	err := s.Resume(t.Context(), Resume{StreamState: StreamState{Started: true, Trusted: true, Seq: 5}, Restore: restore})
	if !errors.Is(err, ErrBehind) || calls != 0 || !s.Stats().Holding {
		t.Fatalf("resume behind: %v, %d restores, holding %v", err, calls, s.Stats().Holding)
	}
	if err := s.Resume(t.Context(), Resume{StreamState: StreamState{Started: true, Trusted: true, Seq: 9}, Restore: restore}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "10, 11 applied", func() bool { return s.Stats().Messages == 2 })
	if st := s.Stats(); !st.Trusted || st.Gaps != 0 || calls != 1 {
		t.Errorf("stats %+v, %d restores", st, calls)
	}
}

// TestResumeThenGap: resumed with nothing queued, the first message after
// the state leaves a gap: the view turns untrusted (no replay) and
// OnResumeGap is called once, so that the caller can fetch again (Hold,
// Resume), which makes it trusted again.
func TestResumeThenGap(t *testing.T) {
	r := &recorder{}
	var gaps atomic.Int32
	d := r.deps()
	d.OnResumeGap = func(string) { gaps.Add(1) }
	s, err := Subscribe(t.Context(), Config{Endpoint: "w1", Address: "tcp://127.0.0.1:0", Bind: true, Hold: true}, d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	if err := s.Resume(t.Context(), Resume{StreamState: StreamState{Started: true, Trusted: true, Seq: 5}}); err != nil {
		t.Fatal(err)
	}
	push(t, s, storedMsg(t, 8, 108, nil))
	push(t, s, storedMsg(t, 10, 110, nil))
	eventually(t, "2 messages", func() bool { return s.Stats().Messages == 2 })
	if st := s.Stats(); st.Trusted || st.Gaps != 2 || gaps.Load() != 1 {
		t.Fatalf("stats %+v, %d resume gaps; want untrusted, 2 gaps, 1 resume gap", st, gaps.Load())
	}
	if err := s.Hold(t.Context()); err != nil {
		t.Fatal(err)
	}
	push(t, s, storedMsg(t, 11, 111, 110))
	if err := s.Resume(t.Context(), Resume{StreamState: StreamState{Started: true, Trusted: true, Seq: 10}}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "11 applied", func() bool { return s.Stats().Messages == 3 })
	if st := s.Stats(); !st.Trusted || gaps.Load() != 1 {
		t.Errorf("stats %+v after a fresh resume", st)
	}
}

// TestResumeUntrusted: the peer's untrusted view stays untrusted here, as
// does one that did not import whole; a state that never started
// releases the Sub (the first message decides).
func TestResumeUntrusted(t *testing.T) {
	for name, rs := range map[string]Resume{
		"peer untrusted": {StreamState: StreamState{Started: true, Seq: 3}},
		"import refused": {StreamState: StreamState{Started: true, Trusted: true, Seq: 3}, Restore: func() error { return kvindex.ErrWorkerFull }},
	} {
		r := &recorder{}
		s := bound(t, Config{Hold: true}, r)
		if err := s.Resume(t.Context(), rs); err != nil {
			t.Fatal(err)
		}
		push(t, s, storedMsg(t, 4, 104, nil))
		eventually(t, "4 applied", func() bool { return s.Stats().Messages == 1 })
		if st := s.Stats(); st.Trusted || st.Gaps != 0 {
			t.Errorf("%s: stats %+v, want untrusted without a gap", name, st)
		}
	}
	r := &recorder{}
	s := bound(t, Config{Hold: true}, r)
	push(t, s, storedMsg(t, 3, 103, nil))
	if err := s.Resume(t.Context(), Resume{}); err != nil {
		t.Fatal(err)
	}
	eventually(t, "3 applied", func() bool { return s.Stats().Messages == 1 })
	if st := s.Stats(); st.Trusted || st.Resyncs != 1 {
		t.Errorf("not started: stats %+v, want a late start (untrusted, 1 resync)", st)
	}
}

// TestReleaseAndExport: Release starts a held Sub as without Hold (a first
// message at FirstSeq is trusted); Export sees the stream between two
// messages, not started while holding.
func TestReleaseAndExport(t *testing.T) {
	r := &recorder{}
	s := bound(t, Config{Hold: true, FirstSeq: 1}, r)
	var got StreamState
	if err := s.Export(t.Context(), func(st StreamState) { got = st }); err != nil || got.Started {
		t.Fatalf("export while holding: %+v, %v", got, err)
	}
	push(t, s, storedMsg(t, 1, 101, nil))
	push(t, s, storedMsg(t, 2, 102, 101))
	if err := s.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	eventually(t, "2 applied", func() bool { return s.Stats().Messages == 2 })
	if err := s.Export(t.Context(), func(st StreamState) { got = st }); err != nil {
		t.Fatal(err)
	}
	if want := (StreamState{Started: true, Trusted: true, Seq: 2}); got != want {
		t.Errorf("export %+v, want %+v", got, want)
	}
	s.Close()
	if err := s.Export(t.Context(), func(StreamState) {}); !errors.Is(err, ErrClosed) {
		t.Errorf("export after Close: %v", err)
	}
}

// TestTurnoverRegainsTrust: a late start is untrusted until the worker has
// stored a whole cache's worth of GPU blocks (4) since; a gap starts the
// count again; a worker whose blocks the index refused over its caps
// never regains trust that way.
func TestTurnoverRegainsTrust(t *testing.T) {
	r := &recorder{}
	s := bound(t, Config{CacheBlocks: 4}, r)
	seq := uint64(50)
	next := func() { push(t, s, storedMsg(t, seq, 1000+seq, nil)); seq++ }
	next() // late start: 1 block
	next()
	next()
	eventually(t, "3 messages", func() bool { return s.Stats().Messages == 3 })
	if s.Stats().Trusted {
		t.Fatal("trusted after 3 of 4 blocks")
	}
	seq++ // a gap: the count starts again
	next()
	next()
	next()
	eventually(t, "6 messages", func() bool { return s.Stats().Messages == 6 })
	if s.Stats().Trusted {
		t.Fatal("trusted 3 blocks after a gap")
	}
	next()
	eventually(t, "trusted", func() bool { return s.Stats().Trusted })
	if st := s.Stats(); st.Turnovers != 1 {
		t.Errorf("turnovers %d, want 1", st.Turnovers)
	}

	full := &recorder{err: kvindex.ErrWorkerFull}
	s2 := bound(t, Config{}, full)
	s2.SetCacheBlocks(2)
	for q := uint64(10); q < 20; q++ {
		push(t, s2, storedMsg(t, q, q, nil))
	}
	eventually(t, "10 messages", func() bool { return s2.Stats().Messages == 10 })
	if st := s2.Stats(); st.Trusted || st.Turnovers != 0 {
		t.Errorf("index at its cap: stats %+v, want untrusted", st)
	}
}
