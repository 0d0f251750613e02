package zmtp

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbandit/kvbandit/routing/kvevents/zmtp/zmtptest"
)

// inbox collects what a Sub hands over.
type inbox struct {
	mu   sync.Mutex
	msgs [][][]byte
}

func (b *inbox) handle(f [][]byte) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.msgs = append(b.msgs, f)
}

func (b *inbox) len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.msgs)
}

func (b *inbox) last() [][]byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.msgs[len(b.msgs)-1]
}

func eventually(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func newSub(t *testing.T, opts Options) (*Sub, *inbox) {
	t.Helper()
	in := &inbox{}
	s := NewSub(opts, in.handle)
	t.Cleanup(func() { _ = s.Close() })
	return s, in
}

var kvMsg = [][]byte{[]byte("kv@127.0.0.1:8000@m"), {0, 0, 0, 0, 0, 0, 0, 7}, bytes.Repeat([]byte{0x90}, 300)}

// sendUntil repeats send until the inbox has a message (PUB drops what it
// sends before the subscription arrives).
func sendUntil(t *testing.T, in *inbox, send func()) {
	t.Helper()
	eventually(t, "the first message", 10*time.Second, func() bool {
		send()
		time.Sleep(5 * time.Millisecond)
		return in.len() > 0
	})
}

func sameFrames(t *testing.T, got, want [][]byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("got %d frames, want %d", len(got), len(want))
	}
	for i := range got {
		if !bytes.Equal(got[i], want[i]) {
			t.Fatalf("frame %d = %q, want %q", i, got[i], want[i])
		}
	}
}

func TestSubConnectsToGoZeromqPub(t *testing.T) {
	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	s, in := newSub(t, Options{})
	if err := s.Dial("tcp://" + pub.Addr().String()); err != nil {
		t.Fatal(err)
	}
	sendUntil(t, in, func() { _ = pub.Send(zmq4.NewMsgFrom(kvMsg...)) })
	sameFrames(t, in.last(), kvMsg)
}

func TestGoZeromqPubConnectsToBoundSub(t *testing.T) {
	s, in := newSub(t, Options{})
	addr, err := s.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	if err := pub.Dial("tcp://" + addr.String()); err != nil {
		t.Fatal(err)
	}
	sendUntil(t, in, func() { _ = pub.Send(zmq4.NewMsgFrom(kvMsg...)) })
	sameFrames(t, in.last(), kvMsg)
	if st := s.Stats(); st.Accepted != 1 || st.Conns != 1 {
		t.Errorf("stats %+v", st)
	}
}

// TestLibzmqPub: libzmq 4.3 (pyzmq, as vLLM uses) publishes to our SUB,
// bound or connecting; its XPUB reports our subscription as one.
func TestLibzmqPub(t *testing.T) {
	t.Run("sub connects", func(t *testing.T) {
		peer := zmtptest.Start(t, "--bind", "--xpub")
		s, in := newSub(t, Options{})
		if err := s.Dial(peer.PubEndpoint); err != nil {
			t.Fatal(err)
		}
		if l := peer.Wait("sub ", 10*time.Second); l != "sub 01" {
			t.Fatalf("libzmq saw %q, want the subscription to everything (sub 01)", l)
		}
		peer.Raw(kvMsg...)
		eventually(t, "the message", 10*time.Second, func() bool { return in.len() > 0 })
		sameFrames(t, in.last(), kvMsg)
	})
	t.Run("pub connects", func(t *testing.T) {
		s, in := newSub(t, Options{})
		addr, err := s.Listen("tcp://127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		peer := zmtptest.Start(t, "--connect", "tcp://"+addr.String())
		sendUntil(t, in, func() { peer.Raw(kvMsg...) })
		sameFrames(t, in.last(), kvMsg)
	})
}

// TestLibzmqHeartbeats: a quiet 3 s must leave the one connection up,
// whichever side heartbeats. libzmq PINGs us and drops us after 1 s
// without our PONG; we PING libzmq and drop it after 1 s without its
// PONG.
func TestLibzmqHeartbeats(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		opts Options
	}{
		{"libzmq pings", []string{"--hb-ivl", "100", "--hb-timeout", "1000"}, Options{Heartbeat: -1}},
		{"we ping", nil, Options{Heartbeat: 100 * time.Millisecond, HeartbeatTimeout: time.Second}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			peer := zmtptest.Start(t, append([]string{"--bind", "--xpub"}, tc.args...)...)
			s, in := newSub(t, tc.opts)
			if err := s.Dial(peer.PubEndpoint); err != nil {
				t.Fatal(err)
			}
			peer.Wait("sub 01", 10*time.Second)
			time.Sleep(3 * time.Second)
			peer.Raw(kvMsg...)
			eventually(t, "the message", 10*time.Second, func() bool { return in.len() > 0 })
			peer.Sync()
			if st := s.Stats(); st.Dialed != 1 || st.Failures != 0 {
				t.Errorf("stats %+v: the connection did not survive a quiet 3 s", st)
			}
			if subs := strings.Count(strings.Join(peer.Lines(), "\n"), "sub 01"); subs != 1 {
				t.Errorf("libzmq saw %d subscriptions, want 1 (no reconnect)", subs)
			}
		})
	}
}

// TestSilentPeerIsDropped: a 3.1 publisher that handshakes and then never
// answers a PING is dropped after HeartbeatTimeout, and dialed again.
func TestSilentPeerIsDropped(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				if zmtptest.Handshake(c, "PUB", 1) == nil {
					_, _ = io.Copy(io.Discard, c) // read PINGs, answer nothing
				}
			}()
		}
	}()
	s, _ := newSub(t, Options{Heartbeat: 50 * time.Millisecond, HeartbeatTimeout: 200 * time.Millisecond})
	if err := s.Dial("tcp://" + ln.Addr().String()); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a redial", 10*time.Second, func() bool { st := s.Stats(); return st.Dialed >= 2 && st.Failures >= 1 })
	_ = s.Close()
	_ = ln.Close()
}

// TestBoundSubDropsHugeFrame: a peer that handshakes and then declares a
// 4 GiB frame is disconnected at once, having cost nothing.
func TestBoundSubDropsHugeFrame(t *testing.T) {
	s, _ := newSub(t, Options{})
	addr, err := s.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	for _, size := range []uint64{4 << 30, 1 << 62, ^uint64(0)} {
		c, err := zmtptest.DialPub(addr.String())
		if err != nil {
			t.Fatal(err)
		}
		before := heapAllocs()
		if _, err := c.Write(longHeader(FlagMore, size)); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = io.Copy(io.Discard, c) // the subscription, then EOF
		if err != nil {
			t.Errorf("size %d: the SUB did not close the connection: %v", size, err)
		}
		if alloc := heapAllocs() - before; alloc > 4<<20 {
			t.Errorf("size %d: allocated %d bytes", size, alloc)
		}
		c.Close()
	}
	eventually(t, "the failures counted", 5*time.Second, func() bool { return s.Stats().Failures == 3 })
}

// TestSilentConnectionDoesNotBlockOthers: a connection that never greets
// holds only itself; a publisher connecting after it is served at once,
// long before the silent one's handshake deadline.
func TestSilentConnectionDoesNotBlockOthers(t *testing.T) {
	s, in := newSub(t, Options{HandshakeTimeout: 30 * time.Second})
	addr, err := s.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	silent, err := net.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	if err := pub.Dial("tcp://" + addr.String()); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	sendUntil(t, in, func() { _ = pub.Send(zmq4.NewMsgFrom(kvMsg...)) })
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("first message after %v", d)
	}
}

// TestHandshakeDeadline: a connection that never greets is closed after
// HandshakeTimeout.
func TestHandshakeDeadline(t *testing.T) {
	s, _ := newSub(t, Options{HandshakeTimeout: 200 * time.Millisecond})
	addr, err := s.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil { // our greeting, then EOF
		t.Fatalf("not closed: %v", err)
	}
	eventually(t, "the failure counted", 5*time.Second, func() bool { return s.Stats().HandshakeFailures == 1 && s.Stats().Conns == 0 })
}

// TestMaxConns: with eviction off, connections beyond MaxConns are closed
// at once (TestEvictSilentLongest covers eviction).
func TestMaxConns(t *testing.T) {
	s, _ := newSub(t, Options{MaxConns: 3, EvictAfter: -1})
	addr, err := s.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for range 3 {
		c, err := net.Dial("tcp", addr.String())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, c)
	}
	eventually(t, "3 connections", 5*time.Second, func() bool { return s.Stats().Conns == 3 })
	extra, err := net.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	_ = extra.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := io.Copy(io.Discard, extra); err != nil || n != 0 {
		t.Fatalf("the 4th connection got %d bytes, %v; want closed at once", n, err)
	}
	if st := s.Stats(); st.Rejected != 1 {
		t.Errorf("stats %+v", st)
	}
}

// TestDealerLibzmqRouter: our DEALER talks to a libzmq ROUTER the way
// vLLM's replay socket expects: ["", start] in, ["", seq, payload]... out.
func TestDealerLibzmqRouter(t *testing.T) {
	peer := zmtptest.Start(t, "--bind", "--replay")
	for seq := range uint64(3) {
		peer.Publish(seq, "kv", []byte{byte(0x90 + seq)}, true)
	}
	peer.Sync()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	c, err := DialDealer(ctx, peer.ReplayEndpoint, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if p := c.Peer(); p.Type != TypeROUTER || p.Minor != 1 {
		t.Errorf("peer %+v, want a ZMTP 3.1 ROUTER", p)
	}
	if err := c.Send(nil, binary.BigEndian.AppendUint64(nil, 1)); err != nil {
		t.Fatal(err)
	}
	for _, want := range []uint64{1, 2, ^uint64(0)} {
		msg, err := c.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if len(msg) != 3 || len(msg[0]) != 0 || len(msg[1]) != 8 || binary.BigEndian.Uint64(msg[1]) != want {
			t.Fatalf("reply %q, want seq %d", msg, want)
		}
	}
	peer.Wait("replay 1", time.Second)
}

func TestDialDealerHonoursContext(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c // never greets
		}
	}()
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = DialDealer(ctx, "tcp://"+ln.Addr().String(), Options{})
	if err == nil || time.Since(start) > 3*time.Second {
		t.Fatalf("DialDealer = %v after %v; want an error at the context deadline", err, time.Since(start))
	}
	(<-accepted).Close()
}

func TestCloseStopsEverything(t *testing.T) {
	s := NewSub(Options{}, func([][]byte) {})
	addr, err := s.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Dial("tcp://127.0.0.1:1"); err != nil { // refused, retried
		t.Fatal(err)
	}
	c, err := zmtptest.DialPub(addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	eventually(t, "the connection", 5*time.Second, func() bool { return s.Stats().Conns == 1 })
	_ = s.Close()
	if err := s.Dial("tcp://127.0.0.1:1"); !errors.Is(err, ErrClosed) {
		t.Errorf("Dial after Close: %v", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Errorf("connection not closed by Close: %v", err)
	}
}

// TestEvictSilentLongest: with every slot of a bound socket taken, a new
// connection takes the place of the accepted connection that has gone
// longest without a message, if that one has been silent for EvictAfter;
// a peer that has just published is kept, and when every connection is
// younger than EvictAfter the new one is refused. ZMTP 3.0 peers, which
// are never pinged, are the case that needs it.
func TestEvictSilentLongest(t *testing.T) {
	const evictAfter = 2 * time.Second
	s, in := newSub(t, Options{MaxConns: 3, EvictAfter: evictAfter})
	addr, err := s.Listen("tcp://127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dial := func() net.Conn {
		t.Helper()
		c, err := zmtptest.DialPub(addr.String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	a, b, c := dial(), dial(), dial()
	eventually(t, "3 connections", 5*time.Second, func() bool { return s.Stats().Conns == 3 })
	time.Sleep(evictAfter + 200*time.Millisecond)
	// a publishes: it is no longer silent; b is now the one silent longest.
	if _, err := a.Write(append(zmtptest.Frame(0x01, kvMsg[0]), append(zmtptest.Frame(0x01, kvMsg[1]), zmtptest.Frame(0, []byte("x"))...)...)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a's message", 5*time.Second, func() bool { return in.len() == 1 })
	d := dial()
	if !closedSoon(b) {
		t.Fatal("b, silent longest, was not closed")
	}
	e := dial()
	if !closedSoon(c) {
		t.Fatal("c, silent next longest, was not closed")
	}
	// Now a published a moment ago and d, e are new: nobody to evict.
	f, err := net.Dial("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if !closedSoon(f) {
		t.Fatal("a fourth connection was not refused while every other was recent")
	}
	for name, conn := range map[string]net.Conn{"a": a, "d": d, "e": e} {
		_ = conn.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if _, err := io.Copy(io.Discard, conn); !errors.Is(err, os.ErrDeadlineExceeded) { // the subscription, then nothing
			t.Errorf("%s: %v; want it open", name, err)
		}
	}
	st := s.Stats()
	if st.Evicted != 2 || st.Rejected != 1 || st.Conns != 3 || st.HandshakeFailures != 0 || st.Failures != 0 {
		t.Errorf("stats %+v", st)
	}
}

// closedSoon reads c until the SUB closes it; false if still open after 5 s.
func closedSoon(c net.Conn) bool {
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err := io.Copy(io.Discard, c)
	return err == nil || !errors.Is(err, os.ErrDeadlineExceeded)
}
