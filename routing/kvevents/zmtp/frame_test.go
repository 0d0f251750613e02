package zmtp

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"runtime/metrics"
	"slices"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvevents/zmtp/zmtptest"
)

// heapAllocs is the process's cumulative heap allocation in bytes.
func heapAllocs() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

func longHeader(flags byte, size uint64) []byte {
	return binary.BigEndian.AppendUint64([]byte{flags | FlagLong}, size)
}

func TestReaderMessagesAndCommands(t *testing.T) {
	t.Parallel()
	big := bytes.Repeat([]byte{7}, 300_000) // long frame, read in chunks
	var s []byte
	s = append(s, zmtptest.Frame(FlagMore, []byte("topic"))...)
	s = append(s, zmtptest.Frame(FlagCommand, []byte("\x04PING\x00\x00ctx"))...) // between frames
	s = append(s, zmtptest.Frame(FlagMore, []byte{0, 0, 0, 0, 0, 0, 0, 1})...)
	s = append(s, zmtptest.Frame(0, big)...)
	s = append(s, zmtptest.Frame(0, nil)...)
	r := NewReader(bytes.NewReader(s), Limits{})

	msg, cmd, err := r.Next()
	if err != nil || msg != nil || cmd == nil || cmd.Name != "PING" || string(cmd.Data) != "\x00\x00ctx" {
		t.Fatalf("Next = %q, %+v, %v; want the PING", msg, cmd, err)
	}
	msg, cmd, err = r.Next()
	if err != nil || cmd != nil || len(msg) != 3 || string(msg[0]) != "topic" || !bytes.Equal(msg[2], big) {
		t.Fatalf("Next = %d frames, %+v, %v; want the 3-frame message", len(msg), cmd, err)
	}
	msg, _, err = r.Next()
	if err != nil || len(msg) != 1 || len(msg[0]) != 0 {
		t.Fatalf("Next = %q, %v; want one empty frame", msg, err)
	}
	if _, _, err := r.Next(); err != io.EOF {
		t.Fatalf("at the end: %v, want io.EOF", err)
	}
}

// TestReaderLimits: every limit is checked on the declared length, before
// anything is allocated.
func TestReaderLimits(t *testing.T) {
	lim := Limits{MaxFrameSize: 1000, MaxMessageSize: 1500, MaxFrames: 3, MaxCommandSize: 100}
	cat := func(parts ...[]byte) []byte { return slices.Concat(parts...) }
	f := zmtptest.Frame
	for _, tc := range []struct {
		name   string
		stream []byte
		want   error
	}{
		{"8-byte length of 2^63", longHeader(0, 1<<63), ErrTooLarge},
		{"8-byte length of 2^64-1", longHeader(0, ^uint64(0)), ErrTooLarge},
		{"4 GiB frame", longHeader(0, 4<<30), ErrTooLarge},
		{"frame over MaxFrameSize", longHeader(0, 1001), ErrTooLarge},
		{"message over MaxMessageSize", cat(f(FlagMore, make([]byte, 1000)), longHeader(0, 501)), ErrTooLarge},
		{"too many frames", cat(f(FlagMore, nil), f(FlagMore, nil), f(FlagMore, nil), f(0, nil)), ErrTooLarge},
		{"command over MaxCommandSize", longHeader(FlagCommand, 101), ErrTooLarge},
		{"huge command", longHeader(FlagCommand, 1<<62), ErrTooLarge},
		{"reserved flags", []byte{0x08, 0}, ErrProtocol},
		{"command with MORE", f(FlagCommand|FlagMore, []byte("\x04PING")), ErrProtocol},
		{"empty command", f(FlagCommand, nil), ErrProtocol},
		{"command name past the end", f(FlagCommand, []byte("\x09PING")), ErrProtocol},
		{"EOF inside a header", []byte{0x02, 0, 0}, io.ErrUnexpectedEOF},
		{"EOF inside a body", []byte{0, 10, 1, 2}, io.ErrUnexpectedEOF},
		{"EOF inside a message", f(FlagMore, []byte("a")), io.ErrUnexpectedEOF},
		{"EOF inside a long body", longHeader(0, 900), io.ErrUnexpectedEOF},
	} {
		r := NewReader(bytes.NewReader(tc.stream), lim)
		before := heapAllocs()
		var err error
		for err == nil {
			_, _, err = r.Next()
		}
		if alloc := heapAllocs() - before; alloc > 1<<20 {
			t.Fatalf("%s: allocated %d bytes", tc.name, alloc)
		}
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
		}
	}
}

// TestReadBodyGrowsWithData: a frame declaring 16 MiB whose peer sends
// 100 KiB costs about 200 KiB, not 16 MiB.
func TestReadBodyGrowsWithData(t *testing.T) {
	stream := append(longHeader(0, 16<<20), make([]byte, 100<<10)...)
	before := heapAllocs()
	_, _, err := NewReader(bytes.NewReader(stream), Limits{}).Next()
	if alloc := heapAllocs() - before; alloc > 1<<20 {
		t.Errorf("allocated %d bytes for 100 KiB of a 16 MiB frame", alloc)
	}
	if !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("err = %v, want io.ErrUnexpectedEOF", err)
	}
}

func checkMessage(t *testing.T, msg [][]byte, lim Limits) {
	t.Helper()
	if len(msg) > lim.MaxFrames {
		t.Fatalf("message of %d frames, limit %d", len(msg), lim.MaxFrames)
	}
	n := 0
	for _, f := range msg {
		if len(f) > lim.MaxFrameSize {
			t.Fatalf("frame of %d bytes, limit %d", len(f), lim.MaxFrameSize)
		}
		n += len(f)
	}
	if n > lim.MaxMessageSize {
		t.Fatalf("message of %d bytes, limit %d", n, lim.MaxMessageSize)
	}
}

func knownErr(err error) bool {
	return err == io.EOF || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, ErrProtocol) || errors.Is(err, ErrPeerError)
}

// FuzzFrames reads any byte stream as ZMTP frames under small and default
// limits: no panic, only known errors, no message over the limits, and
// allocation that follows the bytes present, never the lengths declared.
func FuzzFrames(f *testing.F) {
	f.Add(slices.Concat(zmtptest.Frame(FlagMore, []byte("kv")), zmtptest.Frame(FlagMore, make([]byte, 8)), zmtptest.Frame(0, []byte{0x90})))
	f.Add(zmtptest.Frame(FlagCommand, []byte("\x04PING\x00\x0a0123456789abcdef")))
	f.Add(longHeader(0, 1<<62))
	f.Add(append(longHeader(FlagMore, 300), make([]byte, 300)...))
	f.Fuzz(func(t *testing.T, stream []byte) {
		for _, lim := range []Limits{
			{MaxFrameSize: 64, MaxMessageSize: 100, MaxFrames: 3, MaxCommandSize: 32},
			Limits{}.withDefaults(),
		} {
			before := heapAllocs()
			r := NewReader(bytes.NewReader(stream), lim)
			for {
				msg, cmd, err := r.Next()
				if err != nil {
					if !knownErr(err) {
						t.Fatalf("unexpected error: %v", err)
					}
					break
				}
				if cmd != nil && 1+len(cmd.Name)+len(cmd.Data) > lim.MaxCommandSize {
					t.Fatalf("command of %d bytes, limit %d", 1+len(cmd.Name)+len(cmd.Data), lim.MaxCommandSize)
				}
				checkMessage(t, msg, lim)
			}
			if alloc, bound := heapAllocs()-before, 4*uint64(len(stream))+4<<20; alloc > bound {
				t.Fatalf("reading %d bytes allocated %d, bound %d", len(stream), alloc, bound)
			}
		}
	})
}

// fakeConn is a net.Conn over a byte slice: reads come from in, writes
// are counted and dropped, deadlines are ignored.
type fakeConn struct {
	in      *bytes.Reader
	written int
}

func (c *fakeConn) Read(p []byte) (int, error)         { return c.in.Read(p) }
func (c *fakeConn) Write(p []byte) (int, error)        { c.written += len(p); return len(p), nil }
func (c *fakeConn) Close() error                       { return nil }
func (c *fakeConn) LocalAddr() net.Addr                { return &net.TCPAddr{} }
func (c *fakeConn) RemoteAddr() net.Addr               { return &net.TCPAddr{} }
func (c *fakeConn) SetDeadline(t time.Time) error      { return nil }
func (c *fakeConn) SetReadDeadline(t time.Time) error  { return nil }
func (c *fakeConn) SetWriteDeadline(t time.Time) error { return nil }

// FuzzHandshake plays any bytes as a peer to a SUB: greeting, READY and
// whatever follows (PINGs are answered into the void).
func FuzzHandshake(f *testing.F) {
	f.Add(slices.Concat(zmtptest.Greeting(1), zmtptest.Ready("PUB"), zmtptest.Frame(FlagCommand, []byte("\x04PING\x00\x00ab")),
		zmtptest.Frame(FlagMore, []byte("kv")), zmtptest.Frame(0, []byte("x"))))
	f.Add(slices.Concat(zmtptest.Greeting(0), zmtptest.Ready("XPUB")))
	f.Add(slices.Concat(zmtptest.Greeting(1), zmtptest.Frame(FlagCommand, []byte("\x05ERROR\x03bad"))))
	f.Add(slices.Concat(zmtptest.Greeting(1), zmtptest.Ready("ROUTER")))
	f.Fuzz(func(t *testing.T, stream []byte) {
		lim := Limits{MaxFrameSize: 256, MaxMessageSize: 512, MaxFrames: 4, MaxCommandSize: 128}
		before := heapAllocs()
		c, err := Handshake(&fakeConn{in: bytes.NewReader(stream)}, TypeSUB, Options{Limits: lim, Heartbeat: -1})
		for err == nil {
			var msg [][]byte
			if msg, err = c.Recv(); err == nil {
				checkMessage(t, msg, lim.withDefaults())
			}
		}
		if !knownErr(err) && !errors.Is(err, ErrIncompatible) {
			t.Fatalf("unexpected error: %v", err)
		}
		if alloc, bound := heapAllocs()-before, 4*uint64(len(stream))+4<<20; alloc > bound {
			t.Fatalf("%d bytes allocated %d, bound %d", len(stream), alloc, bound)
		}
	})
}

func TestHandshakeRejects(t *testing.T) {
	t.Parallel()
	g1 := zmtptest.Greeting(1)
	bad := func(mod func(g []byte)) []byte {
		g := slices.Clone(g1)
		mod(g)
		return g
	}
	for _, tc := range []struct {
		name   string
		stream []byte
		want   error
	}{
		{"ZMTP 2", bad(func(g []byte) { g[10] = 1 }), ErrProtocol},
		{"no signature", bad(func(g []byte) { g[0] = 'G' }), ErrProtocol},
		{"CURVE", slices.Concat(bad(func(g []byte) { copy(g[12:], "CURVE") }), zmtptest.Ready("PUB")), ErrProtocol},
		{"PLAIN", bad(func(g []byte) { copy(g[12:], "PLAIN") }), ErrProtocol},
		{"a message before READY", slices.Concat(g1, zmtptest.Frame(0, []byte("x"))), ErrProtocol},
		{"ERROR instead of READY", slices.Concat(g1, zmtptest.Frame(FlagCommand, []byte("\x05ERROR\x03bad"))), ErrPeerError},
		{"READY from a SUB", slices.Concat(g1, zmtptest.Ready("SUB")), ErrIncompatible},
		{"READY without Socket-Type", slices.Concat(g1, zmtptest.Frame(FlagCommand, []byte("\x05READY"))), ErrProtocol},
		{"READY property past the end", slices.Concat(g1, zmtptest.Frame(FlagCommand, []byte("\x05READY\x0bSocket-Type\xff\xff\xff\xffPUB"))), ErrProtocol},
		{"short greeting", g1[:40], io.ErrUnexpectedEOF},
	} {
		if _, err := Handshake(&fakeConn{in: bytes.NewReader(tc.stream)}, TypeSUB, Options{}); !errors.Is(err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
		}
	}
}

func TestParseEndpoint(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ep            string
		bind          bool
		network, addr string
		ok            bool
	}{
		{"tcp://127.0.0.1:5557", false, "tcp", "127.0.0.1:5557", true},
		{"tcp://*:5557", true, "tcp", ":5557", true},
		{"tcp://*:5557", false, "", "", false},
		{"tcp://[::1]:5557", false, "tcp", "[::1]:5557", true},
		{"tcp://worker-0.svc:5557", false, "tcp", "worker-0.svc:5557", true},
		{"ipc:///tmp/kv.sock", true, "unix", "/tmp/kv.sock", true},
		{"tcp://127.0.0.1", false, "", "", false},
		{"127.0.0.1:5557", false, "", "", false},
		{"inproc://x", false, "", "", false},
	} {
		n, a, err := ParseEndpoint(tc.ep, tc.bind)
		if (err == nil) != tc.ok || n != tc.network || a != tc.addr {
			t.Errorf("ParseEndpoint(%q, %v) = %q, %q, %v", tc.ep, tc.bind, n, a, err)
		}
		if err != nil && !errors.Is(err, ErrEndpoint) {
			t.Errorf("ParseEndpoint(%q): %v does not wrap ErrEndpoint", tc.ep, err)
		}
	}
}
