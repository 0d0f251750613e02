package kvevents

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing/kvevents/zmtp/zmtptest"
)

// These tests play hostile peers to a bound SUB (kv_events_bind: anyone
// who can reach the port can connect). They use only the Subscribe API,
// so they ran against the go-zeromq subscriber too.

// hugeFrame is a frame header (MORE, LONG) declaring 4 GiB.
var hugeFrame = binary.BigEndian.AppendUint64([]byte{0x03}, 4<<30)

// TestBindDropsHugeFrameHeader: after a valid handshake, a 9-byte frame
// header declaring 4 GiB gets the connection closed at once, without the
// 4 GiB allocation go-zeromq made.
func TestBindDropsHugeFrameHeader(t *testing.T) {
	r := &recorder{}
	s := subscribe(t, Config{Address: "tcp://127.0.0.1:0", Bind: true}, r)
	c, err := zmtptest.DialPub(s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	before := heapAllocs()
	if _, err := c.Write(hugeFrame); err != nil {
		t.Fatal(err)
	}
	closed := closedByPeer(c) // the subscription, then EOF
	if alloc := heapAllocs() - before; alloc > 16<<20 {
		t.Errorf("the subscriber allocated %d bytes for a 9-byte header", alloc)
	}
	if !closed {
		t.Error("the connection was not closed")
	}
}

// TestBindSilentPeerDoesNotBlockPublisher: a connection that never sends
// its greeting must not keep a well-behaved publisher, connecting after
// it, from being served (go-zeromq ran handshakes one at a time in its
// accept loop, without a deadline).
func TestBindSilentPeerDoesNotBlockPublisher(t *testing.T) {
	r := &recorder{}
	s := subscribe(t, Config{Address: "tcp://127.0.0.1:0", Bind: true}, r)
	silent, err := net.Dial("tcp", s.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	// go-zeromq's Dial runs the handshake: it waits for our greeting.
	dialed := make(chan error, 1)
	go func() { dialed <- pub.Dial("tcp://" + s.Addr().String()) }()
	select {
	case err := <-dialed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(3 * time.Second):
		silent.Close() // let the blocked handshake go before failing
		<-dialed
		t.Fatal("the publisher's handshake got no answer while a silent connection was open")
	}
	// Well before the silent peer's handshake deadline (5 s).
	deadline := time.Now().Add(3 * time.Second)
	for s.Stats().Messages == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the publisher was not served while a silent connection was open")
		}
		send(t, pub, storedMsg(t, 0, 10, nil))
		time.Sleep(5 * time.Millisecond)
	}
}

// closedByPeer reads c until the subscriber closes it (EOF or a reset);
// false means it was still open after 10 s.
func closedByPeer(c net.Conn) bool {
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	return !errors.As(err, &ne) || !ne.Timeout()
}

// hostilePeer connects to addr and misbehaves in one of six ways. It
// returns the connection if it stays open on the peer's side (kinds 1
// and 4, which stall), else nil after the subscriber has closed it.
func hostilePeer(t *testing.T, addr string, kind int) net.Conn {
	t.Helper()
	var c net.Conn
	var err error
	switch kind {
	case 0, 3, 4, 5: // handshake first
		c, err = zmtptest.DialPub(addr)
	default:
		c, err = net.Dial("tcp", addr)
	}
	if err != nil {
		t.Fatalf("kind %d: %v", kind, err)
	}
	var payload []byte
	switch kind {
	case 0: // a 4 GiB frame header
		payload = hugeFrame
	case 1: // never greets
		return c
	case 2: // not ZMTP at all
		payload = []byte("GET / HTTP/1.1\r\nHost: kv-events.example\r\nUser-Agent: curl/8.0\r\nAccept: */*\r\n\r\n")
	case 3: // a command declaring 1 TiB
		payload = binary.BigEndian.AppendUint64([]byte{0x06}, 1<<40)
	case 4: // a 16 MiB frame of which 1 KiB arrives, then nothing
		payload = append(binary.BigEndian.AppendUint64([]byte{0x02}, 16<<20), make([]byte, 1024)...)
		if _, err := c.Write(payload); err != nil {
			t.Fatal(err)
		}
		return c
	case 5: // a message of 1,000 empty frames
		for range 1000 {
			payload = append(payload, 0x01, 0)
		}
	}
	if _, err := c.Write(payload); err != nil {
		return nil // already closed by the subscriber: fine
	}
	if !closedByPeer(c) {
		t.Errorf("kind %d: the subscriber did not close the connection", kind)
	}
	c.Close()
	return nil
}

// TestBindHostileConnectionsMemoryBudget: 200 hostile connections to a
// bound SUB (huge frame and command headers, silence, garbage, stalled
// frames, endless messages) leave the heap within 64 MiB of where it
// started, a publisher can still connect and deliver, and Close leaves no
// goroutine behind.
func TestBindHostileConnectionsMemoryBudget(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent(),
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse

	r := &recorder{}
	s, err := Subscribe(t.Context(), Config{Endpoint: "w1", Address: "tcp://127.0.0.1:0", Bind: true, HandshakeTimeout: time.Second, MaxConns: 256}, r.deps())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	addr := s.Addr().String()
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	stalled := 0
	for i := range 200 {
		if c := hostilePeer(t, addr, i%6); c != nil {
			held = append(held, c)
		}
		if i%6 == 4 {
			stalled++
		}
	}
	// The silent ones are gone after the handshake deadline; the stalled
	// ones are still open, each holding a part of a frame.
	eventually(t, "every connection but the stalled ones closed", func() bool {
		st := s.Stats()
		return st.Connections == int64(stalled) && st.ConnectionErrors == uint64(200-stalled)
	})
	runtime.GC()
	runtime.ReadMemStats(&ms)
	grew := int64(ms.HeapInuse) - int64(base)
	t.Logf("heap in use %+d KiB with %d stalled connections open; stats %+v", grew>>10, s.Stats().Connections, s.Stats())
	if grew > 64<<20 {
		t.Errorf("heap in use grew by %d MiB, bound 64 MiB", grew>>20)
	}

	pub := zmq4.NewPub(t.Context())
	defer pub.Close()
	if err := pub.Dial("tcp://" + addr); err != nil {
		t.Fatal(err)
	}
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	pub.Close()
	s.Close()
	for _, c := range held {
		c.Close()
	}
	held = nil
}

// TestBindSquattersDoNotLockOutPublisher: MaxConns peers that complete a
// ZMTP 3.0 handshake and then say nothing (3.0 has no PING, so nothing
// finds them out) take every slot of a bound socket; a publisher that
// connects afterwards, reconnecting as a worker does when dropped, must
// still be received within a few seconds: the socket makes room by
// closing the connection silent longest. Before, it was refused for as
// long as the squatters stayed.
func TestBindSquattersDoNotLockOutPublisher(t *testing.T) {
	r := &recorder{}
	s := subscribe(t, Config{Address: "tcp://127.0.0.1:0", Bind: true}, r)
	addr := s.Addr().String()
	const maxConns = 16 // Config.MaxConns default
	var squatters []net.Conn
	defer func() {
		for _, c := range squatters {
			c.Close()
		}
	}()
	for range maxConns {
		c, err := zmtptest.DialPub(addr)
		if err != nil {
			t.Fatal(err)
		}
		squatters = append(squatters, c)
	}
	eventually(t, "every slot taken", func() bool { return s.Stats().Connections == maxConns })

	// The worker: dial, and dial again whenever the connection is refused
	// (libzmq reconnects every 100 ms; go-zeromq's Dial fails at once when
	// the handshake is cut).
	deadline := time.Now().Add(10 * time.Second)
	var pub zmq4.Socket
	for {
		pub = zmq4.NewPub(t.Context())
		err := pub.Dial("tcp://" + addr)
		if err == nil {
			break
		}
		pub.Close()
		if time.Now().After(deadline) {
			t.Fatalf("the publisher was refused for 10 s while %d silent peers held the socket: %v (stats %+v)", maxConns, err, s.Stats())
		}
		time.Sleep(100 * time.Millisecond)
	}
	defer pub.Close()
	for s.Stats().Messages == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("no message from the publisher within 10 s; stats %+v", s.Stats())
		}
		send(t, pub, storedMsg(t, 0, 10, nil))
		time.Sleep(5 * time.Millisecond)
	}
	// One squatter made room; the publisher's connection stays.
	if st := s.Stats(); st.ConnectionsEvicted != 1 || st.Connections != maxConns {
		t.Errorf("stats %+v: want one squatter evicted, %d connections", st, maxConns)
	}
}
