package zmtp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Sub is a SUB socket subscribed to every topic. It may bind, connect, or
// both, and hands every message from any peer to its handler.
type Sub struct {
	opts   Options
	handle func(frames [][]byte)
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	start  time.Time // origin of peer.last
	mu     sync.Mutex
	closed bool
	lns    []net.Listener
	conns  map[*Conn]*peer // open connections, handshaking ones included
	active int             // slots (of MaxConns) held by accepted connections

	st struct {
		accepted, rejected, evicted, dialed, handshakeFailures, failures, messages atomic.Uint64
	}
}

// peer is what a Sub knows of one of its connections.
type peer struct {
	accepted bool // by a bound endpoint: it holds a slot and may be evicted
	// evicted: closed to make room for a new connection, which took its
	// slot. Guarded by Sub.mu.
	evicted bool
	// last is when the last message arrived, or the connection was made,
	// as time since Sub.start.
	last atomic.Int64
}

// SubStats are a Sub's counters since NewSub.
type SubStats struct {
	Conns             int64  // connections open now, handshaking ones included
	Accepted          uint64 // connections accepted by bound endpoints
	Rejected          uint64 // connections closed at once: MaxConns reached, none to evict
	Evicted           uint64 // accepted connections closed to make room for a new one (see Options.EvictAfter)
	Dialed            uint64 // connections made by connecting endpoints
	HandshakeFailures uint64 // connections whose handshake failed or timed out
	Failures          uint64 // connections ended by a protocol error, a limit or silence
	Messages          uint64 // messages handed to the handler
}

// NewSub returns a SUB socket that calls handle with every message it
// receives. handle is called from connection goroutines (concurrently
// when several peers are connected) and must not block; it owns the
// frames.
func NewSub(opts Options, handle func(frames [][]byte)) *Sub {
	s := &Sub{opts: opts.withDefaults(), handle: handle, conns: map[*Conn]*peer{}, start: time.Now()}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s
}

// Listen binds endpoint and accepts publishers on it until Close. It
// returns the bound address (useful with port 0).
func (s *Sub) Listen(endpoint string) (net.Addr, error) {
	network, addr, err := ParseEndpoint(endpoint, true)
	if err != nil {
		return nil, err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(s.ctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("zmtp: listen %s: %w", endpoint, err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = ln.Close()
		return nil, ErrClosed
	}
	s.lns = append(s.lns, ln)
	s.wg.Add(1)
	s.mu.Unlock()
	go s.accept(ln)
	return ln.Addr(), nil
}

// Dial connects to the publisher at endpoint in the background, and
// reconnects whenever the connection ends, with backoff, until Close. It
// only fails for a malformed endpoint.
func (s *Sub) Dial(endpoint string) error {
	network, addr, err := ParseEndpoint(endpoint, false)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	s.wg.Add(1)
	go s.dial(endpoint, network, addr)
	return nil
}

// Close closes every listener and connection and waits for the socket's
// goroutines.
func (s *Sub) Close() error {
	s.cancel()
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		for _, ln := range s.lns {
			_ = ln.Close()
		}
		for c := range s.conns {
			_ = c.Close()
		}
	}
	s.mu.Unlock()
	s.wg.Wait()
	return nil
}

// Stats returns the counters; safe to call concurrently.
func (s *Sub) Stats() SubStats {
	s.mu.Lock()
	conns := int64(len(s.conns))
	s.mu.Unlock()
	return SubStats{
		Conns: conns, Accepted: s.st.accepted.Load(), Rejected: s.st.rejected.Load(), Evicted: s.st.evicted.Load(), Dialed: s.st.dialed.Load(),
		HandshakeFailures: s.st.handshakeFailures.Load(), Failures: s.st.failures.Load(), Messages: s.st.messages.Load(),
	}
}

func (s *Sub) accept(ln net.Listener) {
	defer s.wg.Done()
	log := s.opts.Logger.With("listen", ln.Addr().String())
	delay := s.opts.MinBackoff
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of file descriptors and the like: wait, then go on.
			log.Warn("zmtp: accept", "err", err)
			if !s.sleep(delay) {
				return
			}
			delay = min(2*delay, s.opts.MaxBackoff)
			continue
		}
		delay = s.opts.MinBackoff
		if !s.admit(nc, log) {
			_ = nc.Close()
			continue
		}
		s.st.accepted.Add(1)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serve(nc, false)
		}()
	}
}

// since is the time since s.start, on the monotonic clock.
func (s *Sub) since() time.Duration { return time.Since(s.start) }

// admit takes a slot for the accepted connection nc. When all MaxConns
// are taken, it closes the accepted connection that has gone longest
// without a message and gives nc its slot, if that one has been silent
// for EvictAfter; otherwise nc is refused (false).
func (s *Sub) admit(nc net.Conn, log *slog.Logger) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.active < s.opts.MaxConns {
		s.active++
		return true
	}
	if s.opts.EvictAfter > 0 {
		var victim *Conn
		var vp *peer
		for c, p := range s.conns {
			if p.accepted && !p.evicted && (vp == nil || p.last.Load() < vp.last.Load()) {
				victim, vp = c, p
			}
		}
		if vp != nil {
			if silent := s.since() - time.Duration(vp.last.Load()); silent >= s.opts.EvictAfter {
				vp.evicted = true // the slot passes to nc
				s.st.evicted.Add(1)
				log.Debug("zmtp: too many connections, closing the one silent longest", "closed", victim.RemoteAddr().String(),
					"silent", silent, "new", nc.RemoteAddr().String(), "max", s.opts.MaxConns)
				_ = victim.Close()
				return true
			}
		}
	}
	s.st.rejected.Add(1)
	log.Debug("zmtp: too many connections, closing a new one", "peer", nc.RemoteAddr().String(), "max", s.opts.MaxConns)
	return false
}

// wasEvicted reports whether p was closed to make room.
func (s *Sub) wasEvicted(p *peer) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return p.evicted
}

func (s *Sub) dial(endpoint, network, addr string) {
	defer s.wg.Done()
	log := s.opts.Logger.With("connect", endpoint)
	delay := s.opts.MinBackoff
	for {
		d := net.Dialer{Timeout: s.opts.DialTimeout}
		nc, err := d.DialContext(s.ctx, network, addr)
		if err == nil {
			s.st.dialed.Add(1)
			if s.serve(nc, true) {
				delay = s.opts.MinBackoff
			}
		} else if s.ctx.Err() == nil {
			log.Debug("zmtp: dial", "err", err)
		}
		if !s.sleep(delay) {
			return
		}
		delay = min(2*delay, s.opts.MaxBackoff)
	}
}

// sleep waits d; false means the socket was closed.
func (s *Sub) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-s.ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// serve runs one connection until it ends; it reports whether the
// handshake succeeded.
func (s *Sub) serve(nc net.Conn, dialed bool) bool {
	c := newConn(nc, s.opts)
	p := &peer{accepted: !dialed}
	p.last.Store(int64(s.since()))
	s.mu.Lock()
	if s.closed {
		s.release(p)
		s.mu.Unlock()
		_ = nc.Close()
		return false
	}
	s.conns[c] = p
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.release(p)
		s.mu.Unlock()
		_ = c.Close()
	}()
	log := s.opts.Logger.With("peer", nc.RemoteAddr().String())

	if err := c.handshake(TypeSUB); err != nil {
		if s.ctx.Err() == nil && !s.wasEvicted(p) {
			s.st.handshakeFailures.Add(1)
			if dialed {
				log.Warn("zmtp: handshake failed", "err", err)
			} else {
				log.Debug("zmtp: handshake failed", "err", err)
			}
		}
		return false
	}
	// Subscribe to everything: a ZMTP 3.0 subscription message, which 3.1
	// publishers accept too.
	if err := c.Send([]byte{1}); err != nil {
		if s.ctx.Err() == nil && !s.wasEvicted(p) {
			s.st.failures.Add(1)
			log.Info("zmtp: cannot subscribe", "err", err)
		}
		return true
	}
	log.Debug("zmtp: connected", "peer_type", c.peer.Type, "zmtp", fmt.Sprintf("3.%d", c.peer.Minor))
	for {
		msg, err := c.Recv()
		if err != nil {
			switch {
			case s.ctx.Err() != nil || errors.Is(err, ErrClosed):
			case errors.Is(err, io.EOF):
				log.Info("zmtp: the peer closed the connection")
			default:
				s.st.failures.Add(1)
				log.Info("zmtp: connection lost", "err", err)
			}
			return true
		}
		p.last.Store(int64(s.since()))
		s.st.messages.Add(1)
		s.handle(msg)
	}
}

// release gives back the slot of an accepted connection that ends,
// unless it was evicted (its slot went to another). The caller holds mu.
func (s *Sub) release(p *peer) {
	if p.accepted && !p.evicted {
		s.active--
	}
}
