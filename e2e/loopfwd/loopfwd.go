// Package loopfwd gives a server that binds every interface on one port its
// own loopback address: a Forwarder listens on ADDR:PORT (for example
// 127.0.0.5:8000) and relays each connection, bytes both ways, to the
// server's real address (127.0.0.1:18005). The live benchmark needs it
// because llm-d-inference-sim v0.10.2 listens on ":port" (every interface,
// tcp4), so eight of them cannot share one port on 127.0.0.2–9 in one network
// namespace, while an InferencePool names one target port for all its pods.
//
// Only tests and benchmarks use it. Every connection is relayed by two
// goroutines that end when either side closes; Close stops the listener,
// closes every open connection and waits for them.
package loopfwd

import (
	"errors"
	"io"
	"net"
	"sync"
	"time"
)

// DialTimeout bounds the connection to the target.
const DialTimeout = 5 * time.Second

// Forwarder relays connections from its listen address to a target.
type Forwarder struct {
	l      net.Listener
	target string

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

// Listen starts a forwarder on addr (it must be a loopback address) that
// relays to target.
func Listen(addr, target string) (*Forwarder, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		return nil, errors.New("loopfwd: listen address must be a loopback IP: " + addr)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	f := &Forwarder{l: l, target: target, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.accept()
	return f, nil
}

// Addr is the address the forwarder listens on.
func (f *Forwarder) Addr() string { return f.l.Addr().String() }

func (f *Forwarder) accept() {
	defer f.wg.Done()
	for {
		c, err := f.l.Accept()
		if err != nil {
			return
		}
		if !f.track(c) {
			c.Close()
			return
		}
		f.wg.Add(1)
		go f.relay(c)
	}
}

// track records c as open; false once the forwarder is closed.
func (f *Forwarder) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *Forwarder) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	c.Close()
}

// relay copies bytes both ways between the client c and a new connection
// to the target, until either side ends.
func (f *Forwarder) relay(c net.Conn) {
	defer f.wg.Done()
	defer f.untrack(c)
	u, err := net.DialTimeout("tcp", f.target, DialTimeout)
	if err != nil {
		return
	}
	if !f.track(u) {
		u.Close()
		return
	}
	defer f.untrack(u)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite() // pass the half-close on
		}
		done <- struct{}{}
	}
	go pipe(u, c)
	go pipe(c, u)
	<-done
	<-done
}

// Close stops accepting, closes every relayed connection and waits for
// the relays to end.
func (f *Forwarder) Close() error {
	f.mu.Lock()
	f.closed = true
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	err := f.l.Close()
	f.wg.Wait()
	return err
}
