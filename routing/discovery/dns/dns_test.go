package dns_test

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/dns"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeResolver answers from a table that tests change; a name mapped to
// block waits for the lookup's deadline.
type fakeResolver struct {
	mu      sync.Mutex
	answers map[string][]netip.Addr
	errs    map[string]error
	block   map[string]bool
	calls   int
}

func newFakeResolver() *fakeResolver {
	return &fakeResolver{answers: map[string][]netip.Addr{}, errs: map[string]error{}, block: map[string]bool{}}
}

func (r *fakeResolver) set(name string, addrs ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.errs, name)
	r.answers[name] = nil
	for _, a := range addrs {
		r.answers[name] = append(r.answers[name], netip.MustParseAddr(a))
	}
}

func (r *fakeResolver) fail(name string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs[name] = err
}

func (r *fakeResolver) LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error) {
	r.mu.Lock()
	r.calls++
	a, err, block := r.answers[host], r.errs[host], r.block[host]
	r.mu.Unlock()
	if network != "ip" {
		return nil, errors.New("unexpected network " + network)
	}
	if block {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	if err != nil {
		return nil, err
	}
	if a == nil {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	return slices.Clone(a), nil
}

// event is one call on the sink: a published set, or a degraded report
// for the "dns" source (the end of every resolution round).
type event struct {
	set      *routing.EndpointSet
	degraded error
}

type sink struct {
	ch      chan event
	mu      sync.Mutex
	skipped map[string]int
	engine  *routing.EndpointSet
}

func newSink() *sink { return &sink{ch: make(chan event, 64), skipped: map[string]int{}} }

// Publish validates like the hub does: a set holding a name is refused.
func (s *sink) Publish(set routing.EndpointSet) error {
	if err := set.Validate(); err != nil {
		return err
	}
	s.ch <- event{set: &set}
	return nil
}

func (s *sink) SetDegraded(source string, err error) {
	if source == dns.SourceName {
		s.ch <- event{degraded: err}
	}
}

func (s *sink) Skipped(_, reason string) {
	s.mu.Lock()
	s.skipped[reason]++
	s.mu.Unlock()
}

func (s *sink) next(t *testing.T) event {
	t.Helper()
	select {
	case e := <-s.ch:
		return e
	case <-time.After(10 * time.Second):
		t.Fatal("no sink call within 10 s")
		return event{}
	}
}

// round waits for the end of a resolution round and returns the set
// published in it, if any, and the degraded report that closed it.
func (s *sink) round(t *testing.T) (*routing.EndpointSet, error) {
	t.Helper()
	var set *routing.EndpointSet
	for {
		e := s.next(t)
		if e.set != nil {
			set = e.set
			continue
		}
		return set, e.degraded
	}
}

func keys(set *routing.EndpointSet) []string {
	if set == nil {
		return nil
	}
	var out []string
	for _, e := range set.Endpoints {
		out = append(out, string(e.Key))
	}
	return out
}

func counter(t *testing.T, reg *prometheus.Registry, name, result string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if result == "" {
				return m.GetGauge().GetValue()
			}
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == result {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	t.Fatalf("metric %s{result=%q} not found", name, result)
	return 0
}

type harness struct {
	res  *fakeResolver
	clk  *clock.Virtual
	reg  *prometheus.Registry
	sink *sink
}

// start runs a static set of addrs through an Expander until the test ends.
func start(t *testing.T, cfg dns.Config, res *fakeResolver, eps ...routing.Endpoint) *harness {
	t.Helper()
	h := &harness{res: res, clk: clock.NewVirtual(time.Unix(1e9, 0)), reg: prometheus.NewRegistry(), sink: newSink()}
	if cfg.Refresh == 0 {
		cfg.Refresh = time.Second
	}
	x, err := dns.New(cfg, dns.Deps{Resolver: res, Clock: h.clk, Registry: h.reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	src := x.Wrap(discovery.Static{Set: routing.EndpointSet{Source: "static", Endpoints: eps}})
	go func() { done <- src.Run(ctx, h.sink) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return h
}

// refresh moves the clock past one refresh and waits for its round.
func (h *harness) refresh(t *testing.T) (*routing.EndpointSet, error) {
	t.Helper()
	h.clk.Step(time.Second)
	return h.sink.round(t)
}

func TestFanOutCopiesRecordsAndRewritesTheirURLs(t *testing.T) {
	res := newFakeResolver()
	// Unsorted, an IPv4-mapped duplicate, an unusable address, IPv6.
	res.set("workers.llm.svc", "10.0.0.2", "10.0.0.1", "::ffff:10.0.0.1", "0.0.0.0", "fd00::1")
	res.set("other", "10.0.0.2") // the same IP on another port: a distinct endpoint
	named := routing.Endpoint{Key: "workers.llm.svc:8000", Models: []routing.ModelName{"m"}, Engine: "vllm",
		Labels: map[string]string{"zone": "a"}, KVEvents: "tcp://Workers.LLM.svc:5557", MetricsURL: "http://workers.llm.svc:8000/metrics",
		KVEventsReplay: "tcp://replay.example:5558"}
	h := start(t, dns.Config{}, res, named,
		routing.Endpoint{Key: "10.0.0.9:8000"},
		routing.Endpoint{Key: "10.0.0.1:8000"}, // also an address of the name: kept once
		routing.Endpoint{Key: "other:9000"})
	set, derr := h.sink.round(t)
	if derr != nil {
		t.Fatalf("degraded: %v", derr)
	}
	want := []string{"10.0.0.1:8000", "10.0.0.2:8000", "[fd00::1]:8000", "10.0.0.9:8000", "10.0.0.2:9000"}
	if !slices.Equal(keys(set), want) {
		t.Fatalf("endpoints %v, want %v", keys(set), want)
	}
	for _, e := range set.Endpoints[:3] {
		ip := e.Addr().Addr()
		if e.Engine != "vllm" || e.Models[0] != "m" || e.Labels["zone"] != "a" {
			t.Errorf("%s: metadata not copied: %+v", e.Key, e)
		}
		if want := "tcp://" + netip.AddrPortFrom(ip, 5557).String(); e.KVEvents != want {
			t.Errorf("%s: kv_events %q, want %q", e.Key, e.KVEvents, want)
		}
		if want := "http://" + netip.AddrPortFrom(ip, 8000).String() + "/metrics"; e.MetricsURL != want {
			t.Errorf("%s: metrics_url %q, want %q", e.Key, e.MetricsURL, want)
		}
		if e.KVEventsReplay != "tcp://replay.example:5558" {
			t.Errorf("%s: a URL naming another host changed: %q", e.Key, e.KVEventsReplay)
		}
	}
	// Answers in another order change nothing: no new set.
	res.set("workers.llm.svc", "fd00::1", "10.0.0.1", "10.0.0.2")
	if set, _ := h.refresh(t); set != nil {
		t.Fatalf("reordered answers published %v", keys(set))
	}
}

func TestFailuresKeepTheLastGoodAddresses(t *testing.T) {
	res := newFakeResolver()
	res.set("workers", "10.0.0.1", "10.0.0.2")
	h := start(t, dns.Config{}, res, routing.Endpoint{Key: "workers:8000"})
	if set, err := h.sink.round(t); err != nil || len(keys(set)) != 2 {
		t.Fatalf("first round: %v %v", keys(set), err)
	}
	// Scale up, then down: the set follows.
	res.set("workers", "10.0.0.1", "10.0.0.2", "10.0.0.3")
	if set, _ := h.refresh(t); !slices.Equal(keys(set), []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}) {
		t.Fatalf("scale up: %v", keys(set))
	}
	res.set("workers", "10.0.0.3")
	if set, _ := h.refresh(t); !slices.Equal(keys(set), []string{"10.0.0.3:8000"}) {
		t.Fatalf("scale down: %v", keys(set))
	}
	// SERVFAIL, NXDOMAIN, an empty answer: nothing published, degraded,
	// counted by result.
	for _, c := range []struct {
		err    error
		result string
	}{
		{&net.DNSError{Err: "server misbehaving", Name: "workers", IsTemporary: true}, dns.ResultError},
		{&net.DNSError{Err: "no such host", Name: "workers", IsNotFound: true}, dns.ResultNotFound},
		{nil, dns.ResultNotFound},
	} {
		before := counter(t, h.reg, "kvbandit_dns_resolutions_total", c.result)
		if c.err != nil {
			res.fail("workers", c.err)
		} else {
			res.set("workers", "0.0.0.0") // only an unusable address
		}
		set, derr := h.refresh(t)
		if set != nil || derr == nil {
			t.Fatalf("%v: published %v, degraded %v", c.err, keys(set), derr)
		}
		if got := counter(t, h.reg, "kvbandit_dns_resolutions_total", c.result); got != before+1 {
			t.Errorf("%v: %s counter %v -> %v", c.err, c.result, before, got)
		}
		if got := counter(t, h.reg, "kvbandit_dns_failing_names", ""); got != 1 {
			t.Errorf("failing names gauge = %v", got)
		}
	}
	// Recovery publishes the new answer and clears the degraded state.
	res.set("workers", "10.0.0.4")
	if set, derr := h.refresh(t); derr != nil || !slices.Equal(keys(set), []string{"10.0.0.4:8000"}) {
		t.Fatalf("recovery: %v %v", keys(set), derr)
	}
	if got := counter(t, h.reg, "kvbandit_dns_failing_names", ""); got != 0 {
		t.Errorf("failing names gauge after recovery = %v", got)
	}
}

func TestANameThatNeverResolvedPublishesNothing(t *testing.T) {
	res := newFakeResolver()
	h := start(t, dns.Config{}, res, routing.Endpoint{Key: "nowhere:8000"})
	if set, derr := h.sink.round(t); set != nil || derr == nil {
		t.Fatalf("unresolved name: published %v, degraded %v", keys(set), derr)
	}
	res.set("nowhere", "10.0.0.1")
	if set, derr := h.refresh(t); derr != nil || !slices.Equal(keys(set), []string{"10.0.0.1:8000"}) {
		t.Fatalf("resolved later: %v %v", keys(set), derr)
	}

	// Next to a literal address, an unresolved name does not hold the
	// literal back.
	res2 := newFakeResolver()
	h2 := start(t, dns.Config{}, res2, routing.Endpoint{Key: "10.0.0.9:8000"}, routing.Endpoint{Key: "nowhere:8000"})
	if set, derr := h2.sink.round(t); derr == nil || !slices.Equal(keys(set), []string{"10.0.0.9:8000"}) {
		t.Fatalf("literal next to an unresolved name: %v %v", keys(set), derr)
	}
}

func TestBounds(t *testing.T) {
	res := newFakeResolver()
	var many []string
	for i := range 100 {
		many = append(many, netip.AddrFrom4([4]byte{10, 1, 0, byte(99 - i)}).String())
	}
	res.set("big", many...)
	res.set("a", "10.2.0.1")
	res.set("b", "10.2.0.2")
	res.mu.Lock()
	res.block["slow"] = true
	res.mu.Unlock()
	h := start(t, dns.Config{MaxAddrs: 8, MaxNames: 3, Timeout: 50 * time.Millisecond}, res,
		routing.Endpoint{Key: "big:1"}, routing.Endpoint{Key: "slow:1"}, routing.Endpoint{Key: "a:1"},
		routing.Endpoint{Key: "b:1"}, routing.Endpoint{Key: "b:2"})
	began := time.Now()
	set, derr := h.sink.round(t)
	if time.Since(began) > 5*time.Second {
		t.Errorf("a blocking lookup held the round for %v (timeout 50 ms)", time.Since(began))
	}
	if derr == nil {
		t.Error("a timed-out lookup did not degrade the source")
	}
	var want []string
	for i := range 8 {
		want = append(want, netip.AddrFrom4([4]byte{10, 1, 0, byte(i)}).String()+":1")
	}
	want = append(want, "10.2.0.1:1")
	if !slices.Equal(keys(set), want) {
		t.Fatalf("endpoints %v, want the 8 lowest of big and a (b is the 4th name)", keys(set))
	}
	if got := counter(t, h.reg, "kvbandit_dns_resolutions_total", dns.ResultTimeout); got != 1 {
		t.Errorf("timeouts = %v", got)
	}
	h.sink.mu.Lock()
	skipped := h.sink.skipped[dns.ReasonTooManyNames]
	h.sink.mu.Unlock()
	if skipped != 2 {
		t.Errorf("records skipped past max names = %d, want 2", skipped)
	}
	res.mu.Lock()
	calls := res.calls
	res.mu.Unlock()
	if calls != 3 {
		t.Errorf("%d lookups, want 3 (names past the limit are not resolved)", calls)
	}
}

func TestSetsWithoutNamesPassThrough(t *testing.T) {
	res := newFakeResolver()
	h := start(t, dns.Config{}, res, routing.Endpoint{Key: "10.0.0.1:8000"}, routing.Endpoint{Key: "[fd00::1]:8000"})
	if set, derr := h.sink.round(t); derr != nil || !slices.Equal(keys(set), []string{"10.0.0.1:8000", "[fd00::1]:8000"}) {
		t.Fatalf("%v %v", keys(set), derr)
	}
	h.clk.Step(time.Second) // nothing to refresh: no lookup, no round
	res.mu.Lock()
	calls := res.calls
	res.mu.Unlock()
	if calls != 0 {
		t.Errorf("%d lookups for a set without names", calls)
	}
}

// TestAFailingNameKeepsItsAddressesInNewSets checks that the last good
// addresses are really kept (not merely left unpublished): another name's
// change publishes a new set, and it still holds the failing name's
// addresses.
func TestAFailingNameKeepsItsAddressesInNewSets(t *testing.T) {
	res := newFakeResolver()
	res.set("a", "10.0.0.1", "10.0.0.2")
	res.set("b", "10.0.1.1")
	h := start(t, dns.Config{}, res, routing.Endpoint{Key: "a:1"}, routing.Endpoint{Key: "b:1"})
	if set, derr := h.sink.round(t); derr != nil || len(keys(set)) != 3 {
		t.Fatalf("first round: %v %v", keys(set), derr)
	}
	res.fail("a", &net.DNSError{Err: "i/o timeout", Name: "a", IsTimeout: true})
	res.set("b", "10.0.1.2")
	set, derr := h.refresh(t)
	if derr == nil || !slices.Equal(keys(set), []string{"10.0.0.1:1", "10.0.0.2:1", "10.0.1.2:1"}) {
		t.Fatalf("a failing, b changed: %v %v", keys(set), derr)
	}
	if got := counter(t, h.reg, "kvbandit_dns_resolutions_total", dns.ResultTimeout); got != 1 {
		t.Errorf("timeouts = %v", got)
	}
}
