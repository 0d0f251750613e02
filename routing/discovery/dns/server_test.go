package dns_test

import (
	"context"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/dns/dnsmessage"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/dns"
)

// authServer is a small authoritative DNS server on 127.0.0.1 (UDP): it
// answers A and AAAA questions for the names in its table, NXDOMAIN for
// others, and SERVFAIL for everything while failing.
type authServer struct {
	pc      net.PacketConn
	mu      sync.Mutex
	table   map[string][]netip.Addr // fully qualified, lower case
	failing bool
	queries int
}

func startAuthServer(t *testing.T) *authServer {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &authServer{pc: pc, table: map[string][]netip.Addr{}}
	done := make(chan struct{})
	go func() { defer close(done); s.serve() }()
	t.Cleanup(func() { pc.Close(); <-done })
	return s
}

func (s *authServer) set(name string, addrs ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.table[name] = nil
	for _, a := range addrs {
		s.table[name] = append(s.table[name], netip.MustParseAddr(a))
	}
}

func (s *authServer) setFailing(f bool) {
	s.mu.Lock()
	s.failing = f
	s.mu.Unlock()
}

func (s *authServer) serve() {
	buf := make([]byte, 1500)
	for {
		n, from, err := s.pc.ReadFrom(buf)
		if err != nil {
			return
		}
		if out, ok := s.answer(buf[:n]); ok {
			_, _ = s.pc.WriteTo(out, from)
		}
	}
}

func (s *authServer) answer(q []byte) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(q)
	if err != nil {
		return nil, false
	}
	qs, err := p.AllQuestions()
	if err != nil || len(qs) != 1 {
		return nil, false
	}
	question := qs[0]
	s.mu.Lock()
	s.queries++
	addrs, known := s.table[question.Name.String()]
	failing := s.failing
	s.mu.Unlock()
	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired}
	switch {
	case failing:
		rh.RCode = dnsmessage.RCodeServerFailure
	case !known:
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.EnableCompression()
	if err := b.StartQuestions(); err != nil {
		return nil, false
	}
	if err := b.Question(question); err != nil {
		return nil, false
	}
	if err := b.StartAnswers(); err != nil {
		return nil, false
	}
	if !failing {
		rrh := dnsmessage.ResourceHeader{Name: question.Name, Class: dnsmessage.ClassINET, TTL: 1}
		for _, a := range addrs {
			switch {
			case question.Type == dnsmessage.TypeA && a.Is4():
				err = b.AResource(rrh, dnsmessage.AResource{A: a.As4()})
			case question.Type == dnsmessage.TypeAAAA && a.Is6():
				err = b.AAAAResource(rrh, dnsmessage.AAAAResource{AAAA: a.As16()})
			}
			if err != nil {
				return nil, false
			}
		}
	}
	out, err := b.Finish()
	return out, err == nil
}

// TestResolvesThroughARealDNSServer resolves with Go's own DNS client
// against the server above: endpoints follow the answers between
// refreshes, and while the server fails the set is kept and the failure
// counted.
func TestResolvesThroughARealDNSServer(t *testing.T) {
	srv := startAuthServer(t)
	srv.set("workers.kvbandit.test.", "127.0.0.11", "127.0.0.10", "fd00::a")
	res := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", srv.pc.LocalAddr().String())
	}}
	reg := prometheus.NewRegistry()
	clk := clock.NewVirtual(time.Unix(1e9, 0))
	x, err := dns.New(dns.Config{Refresh: time.Second, Timeout: 2 * time.Second}, dns.Deps{Resolver: res, Clock: clk, Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	set, err := discovery.ParseEndpointList("workers.kvbandit.test.:8000")
	if err != nil {
		t.Fatal(err)
	}
	sk := newSink()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- x.Wrap(discovery.Static{Set: set}).Run(ctx, sk) }()
	defer func() { cancel(); <-done }()
	step := func() (*routing.EndpointSet, error) { clk.Step(time.Second); return sk.round(t) }

	got, derr := sk.round(t)
	if derr != nil || !slices.Equal(keys(got), []string{"127.0.0.10:8000", "127.0.0.11:8000", "[fd00::a]:8000"}) {
		t.Fatalf("first answer: %v %v", keys(got), derr)
	}
	srv.set("workers.kvbandit.test.", "127.0.0.10", "127.0.0.12")
	if got, derr := step(); derr != nil || !slices.Equal(keys(got), []string{"127.0.0.10:8000", "127.0.0.12:8000"}) {
		t.Fatalf("changed answer: %v %v", keys(got), derr)
	}
	srv.setFailing(true)
	before := counter(t, reg, "kvbandit_dns_resolutions_total", dns.ResultError)
	if got, derr := step(); got != nil || derr == nil {
		t.Fatalf("SERVFAIL: published %v, degraded %v", keys(got), derr)
	}
	if after := counter(t, reg, "kvbandit_dns_resolutions_total", dns.ResultError); after != before+1 {
		t.Errorf("error counter %v -> %v", before, after)
	}
	srv.setFailing(false)
	srv.set("workers.kvbandit.test.") // NXDOMAIN-free but empty: also kept
	if got, derr := step(); got != nil || derr == nil {
		t.Fatalf("empty answer: published %v, degraded %v", keys(got), derr)
	}
	srv.set("workers.kvbandit.test.", "127.0.0.13")
	if got, derr := step(); derr != nil || !slices.Equal(keys(got), []string{"127.0.0.13:8000"}) {
		t.Fatalf("recovered: %v %v", keys(got), derr)
	}
	if n := counter(t, reg, "kvbandit_dns_resolutions_total", dns.ResultSuccess); n != 3 {
		t.Errorf("success counter = %v, want 3", n)
	}
}
