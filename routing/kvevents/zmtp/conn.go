package zmtp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"
)

// Options configure connections and sockets. Zero fields take the
// defaults.
type Options struct {
	// Limits bound frames, messages and commands.
	Limits Limits
	// HandshakeTimeout bounds the greeting and READY exchange; default 5 s.
	HandshakeTimeout time.Duration
	// WriteTimeout bounds every write; default 5 s.
	WriteTimeout time.Duration
	// Heartbeat is how often ZMTP 3.1 peers are sent a PING; default
	// 10 s, negative disables. (ZMTP 3.0 peers, go-zeromq among them, do
	// not know PING.)
	Heartbeat time.Duration
	// HeartbeatTimeout closes a connection to a pinged (3.1) peer that has
	// sent nothing for this long; default 3 × Heartbeat.
	HeartbeatTimeout time.Duration
	// IdleTimeout closes any connection whose peer has sent nothing for
	// this long; default none, since a quiet 3.0 publisher cannot be told
	// from a dead one (TCP keep-alives find dead hosts).
	IdleTimeout time.Duration
	// Identity is the Identity property a DEALER sends; empty lets a
	// ROUTER peer pick one.
	Identity []byte
	// MaxConns caps a bound socket's connections, handshaking ones
	// included. Default 64. A connection beyond it takes the place of the
	// accepted connection that has gone longest without a message (see
	// EvictAfter), or is closed at once when there is none.
	MaxConns int
	// EvictAfter is how long an accepted connection must have gone without
	// a message (since it was accepted, if it never sent one) before a new
	// connection may take its place at MaxConns; default 2 s, negative
	// never evicts. A quiet ZMTP 3.0 peer cannot be told from a squatter,
	// but a publisher that was dropped reconnects, and it publishes
	// whenever it has news, so squatters are what goes first; the minimum
	// keeps a flood of new connections from evicting each other, or a busy
	// publisher.
	EvictAfter time.Duration
	// DialTimeout bounds one connection attempt; default 5 s.
	DialTimeout time.Duration
	// MinBackoff and MaxBackoff bound the wait between connection attempts
	// of a connecting socket, doubling from one to the other; defaults
	// 50 ms and 2 s.
	MinBackoff, MaxBackoff time.Duration
	// Logger; nil discards.
	Logger *slog.Logger
}

func (o Options) withDefaults() Options {
	o.Limits = o.Limits.withDefaults()
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&o.HandshakeTimeout, 5*time.Second)
	def(&o.WriteTimeout, 5*time.Second)
	def(&o.Heartbeat, 10*time.Second)
	def(&o.HeartbeatTimeout, 3*o.Heartbeat)
	def(&o.DialTimeout, 5*time.Second)
	def(&o.EvictAfter, 2*time.Second)
	def(&o.MinBackoff, 50*time.Millisecond)
	def(&o.MaxBackoff, 2*time.Second)
	if o.MaxConns <= 0 {
		o.MaxConns = 64
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// Conn is one ZMTP connection after its handshake.
type Conn struct {
	nc   net.Conn
	dr   *deadlineReader
	rd   *Reader
	opts Options
	peer Peer

	wmu    sync.Mutex // serialises writes and guards the fields below
	closed bool
	ping   *time.Timer
}

// Handshake runs the ZMTP handshake on nc as a socket of type typ, under
// opts.HandshakeTimeout, and returns the connection. It closes nc when it
// fails.
func Handshake(nc net.Conn, typ SocketType, opts Options) (*Conn, error) {
	c := newConn(nc, opts)
	if err := c.handshake(typ); err != nil {
		_ = nc.Close()
		return nil, err
	}
	return c, nil
}

func newConn(nc net.Conn, opts Options) *Conn {
	opts = opts.withDefaults()
	c := &Conn{nc: nc, opts: opts, dr: &deadlineReader{nc: nc}}
	c.rd = NewReader(bufio.NewReaderSize(c.dr, 4096), opts.Limits)
	return c
}

func (c *Conn) handshake(typ SocketType) error {
	_ = c.nc.SetDeadline(time.Now().Add(c.opts.HandshakeTimeout))
	br := c.rd.r
	p, err := handshake(c.nc, br, c.rd, typ, c.opts.Identity)
	if err != nil {
		return fmt.Errorf("zmtp: handshake with %s: %w", c.nc.RemoteAddr(), err)
	}
	c.peer = p
	_ = c.nc.SetDeadline(time.Time{})
	idle := c.opts.IdleTimeout
	if p.Minor >= 1 && c.opts.Heartbeat > 0 {
		if idle <= 0 || c.opts.HeartbeatTimeout < idle {
			idle = c.opts.HeartbeatTimeout
		}
		c.wmu.Lock()
		c.ping = time.AfterFunc(c.opts.Heartbeat, c.sendPing)
		c.wmu.Unlock()
	}
	c.dr.idle = idle // read by the goroutine that ran the handshake
	return nil
}

// deadlineReader sets a read deadline idle from now before every read, so
// a peer that stops sending is dropped after idle, whatever it was in the
// middle of.
type deadlineReader struct {
	nc   net.Conn
	idle time.Duration
}

func (r *deadlineReader) Read(p []byte) (int, error) {
	if r.idle > 0 {
		_ = r.nc.SetReadDeadline(time.Now().Add(r.idle))
	}
	return r.nc.Read(p)
}

// Peer returns what the peer said about itself in the handshake.
func (c *Conn) Peer() Peer { return c.peer }

// RemoteAddr is the peer's address.
func (c *Conn) RemoteAddr() net.Addr { return c.nc.RemoteAddr() }

// Recv returns the next message. It answers PINGs, ignores other commands
// and returns an error wrapping ErrPeerError on an ERROR command. Call it
// from one goroutine at a time.
func (c *Conn) Recv() ([][]byte, error) {
	for {
		msg, cmd, err := c.rd.Next()
		if err != nil {
			return nil, c.readErr(err)
		}
		if cmd == nil {
			return msg, nil
		}
		switch cmd.Name {
		case "PING":
			// TTL (2 bytes), then a context of up to 16 bytes to echo.
			var ctx []byte
			if len(cmd.Data) > 2 {
				ctx = cmd.Data[2:min(len(cmd.Data), 2+16)]
			}
			if err := c.write(appendCommand(nil, "PONG", ctx)); err != nil {
				return nil, err
			}
		case "ERROR":
			return nil, fmt.Errorf("%w: %s", ErrPeerError, errorReason(cmd.Data))
		}
		// PONG, SUBSCRIBE, CANCEL and unknown commands: the bytes
		// already count as traffic.
	}
}

func (c *Conn) readErr(err error) error {
	c.wmu.Lock()
	closed := c.closed
	c.wmu.Unlock()
	if closed {
		return ErrClosed
	}
	return err
}

// Send sends one message of the given frames.
func (c *Conn) Send(frames ...[]byte) error {
	n := 0
	for _, f := range frames {
		n += 9 + len(f)
	}
	buf := make([]byte, 0, n)
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = FlagMore
		}
		buf = appendFrame(buf, flags, f)
	}
	return c.write(buf)
}

func (c *Conn) write(b []byte) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.closed {
		return ErrClosed
	}
	_ = c.nc.SetWriteDeadline(time.Now().Add(c.opts.WriteTimeout))
	_, err := c.nc.Write(b)
	return err
}

// sendPing runs on the heartbeat timer.
func (c *Conn) sendPing() {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.closed {
		return
	}
	_ = c.nc.SetWriteDeadline(time.Now().Add(c.opts.WriteTimeout))
	// TTL 0: we ask the peer for no timeout of its own (a SUB sends
	// nothing but PINGs, so a TTL would only add a way to fail).
	if _, err := c.nc.Write(appendCommand(nil, "PING", []byte{0, 0})); err != nil {
		_ = c.nc.Close() // Recv sees it and reports the connection lost
		return
	}
	c.ping.Reset(c.opts.Heartbeat)
}

// Close closes the connection; a Recv in progress returns ErrClosed.
func (c *Conn) Close() error {
	c.wmu.Lock()
	if c.closed {
		c.wmu.Unlock()
		return nil
	}
	c.closed = true
	if c.ping != nil {
		c.ping.Stop()
	}
	c.wmu.Unlock()
	return c.nc.Close()
}

// DialDealer connects to a ROUTER (or DEALER, REP) at endpoint as a
// DEALER and runs the handshake. ctx bounds the dial and the handshake;
// closing the Conn is the caller's.
func DialDealer(ctx context.Context, endpoint string, opts Options) (*Conn, error) {
	network, addr, err := ParseEndpoint(endpoint, false)
	if err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	d := net.Dialer{Timeout: opts.DialTimeout}
	nc, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("zmtp: dial %s: %w", endpoint, err)
	}
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < opts.HandshakeTimeout {
		opts.HandshakeTimeout = max(time.Until(dl), time.Millisecond)
	}
	stop := context.AfterFunc(ctx, func() { _ = nc.Close() })
	c, err := Handshake(nc, TypeDEALER, opts)
	if !stop() {
		if c != nil {
			_ = c.Close()
		}
		return nil, fmt.Errorf("zmtp: dial %s: %w", endpoint, context.Cause(ctx))
	}
	return c, err
}

// ErrEndpoint means an endpoint string is not one we can use.
var ErrEndpoint = errors.New("zmtp: bad endpoint")

// ParseEndpoint turns a ZMQ endpoint into a Go network and address:
// "tcp://host:port" (host "*" binds every interface) and "ipc:///path"
// (a Unix socket).
func ParseEndpoint(endpoint string, bind bool) (network, address string, err error) {
	scheme, rest, ok := strings.Cut(endpoint, "://")
	if !ok {
		return "", "", fmt.Errorf("%w: %q has no transport (tcp:// or ipc://)", ErrEndpoint, endpoint)
	}
	switch scheme {
	case "tcp":
		host, port, err := net.SplitHostPort(rest)
		if err != nil || port == "" {
			return "", "", fmt.Errorf("%w: %q: want tcp://host:port", ErrEndpoint, endpoint)
		}
		if host == "*" {
			if !bind {
				return "", "", fmt.Errorf("%w: %q: cannot connect to *", ErrEndpoint, endpoint)
			}
			host = ""
		}
		return "tcp", net.JoinHostPort(host, port), nil
	case "ipc":
		if rest == "" {
			return "", "", fmt.Errorf("%w: %q: empty path", ErrEndpoint, endpoint)
		}
		return "unix", rest, nil
	}
	return "", "", fmt.Errorf("%w: %q: transport %q is not supported", ErrEndpoint, endpoint, scheme)
}
