package etcd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvbandit/kvbandit/internal/testenv/etcdenv"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/dns"
)

// fakeSink records what a source reports.
type fakeSink struct {
	mu       sync.Mutex
	sets     []routing.EndpointSet
	at       []time.Time
	degraded []error // every SetDegraded call, nil included
	skipped  map[string]int
	onSet    func(routing.EndpointSet, time.Time)
}

var _ discovery.Sink = (*fakeSink)(nil)

func newFakeSink() *fakeSink { return &fakeSink{skipped: map[string]int{}} }

func (f *fakeSink) Publish(set routing.EndpointSet) error {
	now := time.Now()
	set.Endpoints = slices.Clone(set.Endpoints)
	if err := set.Validate(); err != nil {
		return err
	}
	f.mu.Lock()
	f.sets = append(f.sets, set)
	f.at = append(f.at, now)
	on := f.onSet
	f.mu.Unlock()
	if on != nil {
		on(set, now)
	}
	return nil
}

func (f *fakeSink) SetDegraded(source string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.degraded = append(f.degraded, err)
}

func (f *fakeSink) Skipped(source, reason string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.skipped[reason]++
}

func (f *fakeSink) last() (routing.EndpointSet, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.sets) == 0 {
		return routing.EndpointSet{}, 0
	}
	return f.sets[len(f.sets)-1], len(f.sets)
}

func (f *fakeSink) lastAddrs() []string {
	set, n := f.last()
	if n == 0 {
		return nil
	}
	return addrs(set)
}

func (f *fakeSink) skips(reason string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.skipped[reason]
}

// degradedState returns the last SetDegraded argument and the call count.
func (f *fakeSink) degradedState() (error, int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.degraded) == 0 {
		return nil, 0
	}
	return f.degraded[len(f.degraded)-1], len(f.degraded)
}

func addrs(set routing.EndpointSet) []string {
	out := make([]string, 0, len(set.Endpoints))
	for _, ep := range set.Endpoints {
		out = append(out, string(ep.Key))
	}
	return out
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func testConfig(srv *etcdenv.Server) Config {
	return Config{Endpoints: []string{srv.Addr()}, Prefix: "/test", Pool: "p"}
}

// startSource runs src until the test ends and checks that Run returns nil
// promptly then.
func startSource(t *testing.T, src *Source, sink discovery.Sink) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, sink) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Errorf("Run did not return within 5s of cancel")
		}
	})
}

func newSource(t *testing.T, cfg Config) *Source {
	t.Helper()
	src, err := New(cfg, Deps{Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	return src
}

func put(t *testing.T, cli *clientv3.Client, key, value string, opts ...clientv3.OpOption) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, key, value, opts...); err != nil {
		t.Fatalf("put %s: %v", key, err)
	}
}

func del(t *testing.T, cli *clientv3.Client, key string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if _, err := cli.Delete(ctx, key); err != nil {
		t.Fatalf("delete %s: %v", key, err)
	}
}

func rec(addr string) string {
	return fmt.Sprintf(`{"address":%q,"engine":"vllm","models":["m"]}`, addr)
}

func TestEtcdConfigValidate(t *testing.T) {
	ok := Config{Endpoints: []string{"127.0.0.1:2379"}}
	ok.Defaults()
	if err := ok.Validate(); err != nil {
		t.Fatalf("defaulted config: %v", err)
	}
	if got, want := ok.EndpointsPrefix(), "/kvbandit/v1/default/endpoints/"; got != want {
		t.Errorf("EndpointsPrefix = %q, want %q", got, want)
	}
	for name, mut := range map[string]func(*Config){
		"no endpoints":     func(c *Config) { c.Endpoints = nil },
		"empty endpoint":   func(c *Config) { c.Endpoints = []string{""} },
		"relative prefix":  func(c *Config) { c.Prefix = "kv" },
		"pool with slash":  func(c *Config) { c.Pool = "a/b" },
		"negative timeout": func(c *Config) { c.DialTimeoutSecs = -1 },
		"password only":    func(c *Config) { c.Password = "x" },
		"cert without key": func(c *Config) { c.TLS.Cert = "c.pem" },
		"key without cert": func(c *Config) { c.TLS.Key = "k.pem" },
		"nan dial timeout": func(c *Config) { c.DialTimeoutSecs = math.NaN() },
		"empty pool":       func(c *Config) { c.Pool = "" },
	} {
		c := ok
		mut(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %+v", name, c)
		}
	}
	if _, err := New(Config{}, Deps{}); err == nil {
		t.Error("New accepted a config without endpoints")
	}
	c := Config{Endpoints: []string{"x:1"}, Prefix: "/a/b/"}
	c.Defaults()
	if got, want := c.EndpointsPrefix(), "/a/b/default/endpoints/"; got != want {
		t.Errorf("EndpointsPrefix with trailing slash = %q, want %q", got, want)
	}
}

func TestEtcdInitialListWatchPutDelete(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	pfx := cfg.Prefix + "/p/endpoints/"
	put(t, cli, pfx+"b", rec("10.0.0.2:8000"))
	put(t, cli, pfx+"a", rec("10.0.0.1:8000"))
	put(t, cli, "/test/other/endpoints/x", rec("10.9.9.9:1")) // another pool

	sink := newFakeSink()
	startSource(t, newSource(t, cfg), sink)
	waitFor(t, 10*time.Second, "initial set", func() bool { return len(sink.lastAddrs()) == 2 })
	set, _ := sink.last()
	if set.Source != "etcd" {
		t.Errorf("Source = %q, want etcd", set.Source)
	}
	if got := addrs(set); !slices.Equal(got, []string{"10.0.0.1:8000", "10.0.0.2:8000"}) {
		t.Errorf("initial set = %v, want sorted by id", got)
	}
	if set.Endpoints[0].Engine != "vllm" || !slices.Equal(set.Endpoints[0].Models, []routing.ModelName{"m"}) {
		t.Errorf("record fields not decoded: %+v", set.Endpoints[0])
	}

	put(t, cli, pfx+"c", rec("10.0.0.3:8000"))
	waitFor(t, 5*time.Second, "put seen", func() bool { return len(sink.lastAddrs()) == 3 })

	put(t, cli, pfx+"c", `{"address":"10.0.0.3:8000","engine":"sglang","block_size":32,"role":"prefill"}`)
	waitFor(t, 5*time.Second, "update seen", func() bool {
		set, _ := sink.last()
		return len(set.Endpoints) == 3 && set.Endpoints[2].Engine == "sglang" && set.Endpoints[2].BlockSize == 32 && set.Endpoints[2].Role == routing.RolePrefill
	})

	del(t, cli, pfx+"a")
	waitFor(t, 5*time.Second, "delete seen", func() bool {
		return slices.Equal(sink.lastAddrs(), []string{"10.0.0.2:8000", "10.0.0.3:8000"})
	})

	// All deregistered: an empty set is published (the engine answers 503).
	del(t, cli, pfx+"b")
	del(t, cli, pfx+"c")
	waitFor(t, 5*time.Second, "empty set", func() bool {
		set, n := sink.last()
		return n > 0 && len(set.Endpoints) == 0
	})
	if err, _ := sink.degradedState(); err != nil {
		t.Errorf("degraded without a failure: %v", err)
	}
}

func TestEtcdEmptyPrefixPublishesEmptySet(t *testing.T) {
	srv := etcdenv.Start(t)
	sink := newFakeSink()
	startSource(t, newSource(t, testConfig(srv)), sink)
	waitFor(t, 10*time.Second, "first set", func() bool { _, n := sink.last(); return n == 1 })
	if set, _ := sink.last(); len(set.Endpoints) != 0 || set.Source != "etcd" {
		t.Errorf("first set = %+v, want empty etcd set", set)
	}
}

func TestEtcdLeaseExpiryRemovesRecord(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	sink := newFakeSink()
	startSource(t, newSource(t, cfg), sink)
	waitFor(t, 10*time.Second, "first set", func() bool { _, n := sink.last(); return n > 0 })

	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	g, err := cli.Grant(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	put(t, cli, cfg.EndpointsPrefix()+"w", rec("10.0.0.7:8000"), clientv3.WithLease(g.ID))
	put(t, cli, cfg.EndpointsPrefix()+"stays", rec("10.0.0.8:8000"))
	waitFor(t, 5*time.Second, "leased record", func() bool { return len(sink.lastAddrs()) == 2 })
	start := time.Now()
	// Nobody renews the lease: etcd deletes the record when it expires.
	waitFor(t, 10*time.Second, "lease expiry", func() bool {
		return slices.Equal(sink.lastAddrs(), []string{"10.0.0.8:8000"})
	})
	t.Logf("leased record gone %v after it was seen (TTL 2s)", time.Since(start).Round(time.Millisecond))
}

func TestEtcdSkipsBadRecords(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	pfx := cfg.EndpointsPrefix()
	put(t, cli, pfx+"good", rec("10.0.0.1:8000"))
	put(t, cli, pfx+"malformed", `{"address": "10.0.0.2:8000",`)
	put(t, cli, pfx+"engine", `{"address":"10.0.0.3:8000","engine":"tgi"}`)
	put(t, cli, pfx+"invalid", `{"address":"10.0.0.4:8000","block_size":-1}`)
	put(t, cli, pfx+"hostname", `{"address":"wor ker:8000"}`) // not a valid host name
	put(t, cli, pfx+"role", `{"address":"10.0.0.6:8000","role":"encode"}`)

	sink := newFakeSink()
	startSource(t, newSource(t, cfg), sink)
	waitFor(t, 10*time.Second, "first set", func() bool { _, n := sink.last(); return n > 0 })
	if got := sink.lastAddrs(); !slices.Equal(got, []string{"10.0.0.1:8000"}) {
		t.Fatalf("set = %v, want only the good record", got)
	}
	want := map[string]int{discovery.ReasonMalformed: 1, discovery.ReasonUnknownEngine: 1, discovery.ReasonInvalid: 2, discovery.ReasonUnknownRole: 1}
	for reason, n := range want {
		if got := sink.skips(reason); got != n {
			t.Errorf("Skipped(%s) = %d, want %d", reason, got, n)
		}
	}

	// A bad update of a good record removes it; others keep working.
	put(t, cli, pfx+"good", `not json`)
	put(t, cli, pfx+"new", rec("10.0.0.5:8000"))
	waitFor(t, 5*time.Second, "bad update", func() bool {
		return slices.Equal(sink.lastAddrs(), []string{"10.0.0.5:8000"})
	})
	if got := sink.skips(discovery.ReasonMalformed); got != 2 {
		t.Errorf("Skipped(malformed) = %d, want 2", got)
	}
	// Fixing the record brings it back.
	put(t, cli, pfx+"malformed", rec("10.0.0.2:8000"))
	waitFor(t, 5*time.Second, "fixed record", func() bool {
		return slices.Equal(sink.lastAddrs(), []string{"10.0.0.2:8000", "10.0.0.5:8000"})
	})
}

func TestEtcdDuplicateAddressKeepsLowestKey(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	pfx := cfg.EndpointsPrefix()
	put(t, cli, pfx+"b", `{"address":"10.0.0.1:8000","engine":"sglang"}`)
	put(t, cli, pfx+"a", `{"address":"10.0.0.1:8000","engine":"vllm"}`)

	sink := newFakeSink()
	startSource(t, newSource(t, cfg), sink)
	waitFor(t, 10*time.Second, "first set", func() bool { _, n := sink.last(); return n > 0 })
	set, _ := sink.last()
	if len(set.Endpoints) != 1 || set.Endpoints[0].Engine != "vllm" {
		t.Fatalf("set = %+v, want the record of key a", set.Endpoints)
	}
	if got := sink.skips(discovery.ReasonDuplicate); got != 1 {
		t.Errorf("Skipped(duplicate) = %d, want 1", got)
	}
	// Further changes do not count the same duplicate again.
	put(t, cli, pfx+"c", rec("10.0.0.2:8000"))
	waitFor(t, 5*time.Second, "put", func() bool { return len(sink.lastAddrs()) == 2 })
	if got := sink.skips(discovery.ReasonDuplicate); got != 1 {
		t.Errorf("Skipped(duplicate) after another change = %d, want 1", got)
	}
	// The winner leaves: the other record takes the address.
	del(t, cli, pfx+"a")
	waitFor(t, 5*time.Second, "fallback to b", func() bool {
		set, _ := sink.last()
		return len(set.Endpoints) == 2 && set.Endpoints[0].Engine == "sglang"
	})
}

// TestEtcdCompactedWatchRelists makes the source's watch start at a
// revision etcd has already compacted away. That happens for real when the
// history is compacted between a list and the watch that follows it (or
// while a watch lags); the test-only afterList hook runs exactly in that
// window, writes two records and compacts to the current revision, so the
// watch from list-revision+1 is answered with CompactRevision by the real
// server. The source must list again and see both records.
func TestEtcdCompactedWatchRelists(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	pfx := cfg.EndpointsPrefix()
	put(t, cli, pfx+"a", rec("10.0.0.1:8000"))

	src := newSource(t, cfg)
	var lists atomic.Int32
	src.afterList = func(rev int64) {
		if lists.Add(1) != 1 {
			return
		}
		put(t, cli, pfx+"b", rec("10.0.0.2:8000"))
		put(t, cli, pfx+"c", rec("10.0.0.3:8000"))
		if got := srv.Compact(t, cli); got < rev+2 {
			t.Errorf("compacted to %d, want at least %d", got, rev+2)
		}
	}
	sink := newFakeSink()
	startSource(t, src, sink)
	waitFor(t, 10*time.Second, "re-listed set", func() bool { return len(sink.lastAddrs()) == 3 })
	if n := lists.Load(); n < 2 {
		t.Errorf("listed %d times, want a re-list after the compaction", n)
	}
	if err, n := sink.degradedState(); n != 0 {
		t.Errorf("a compaction is not degradation: SetDegraded(%v) called %d times", err, n)
	}
	// The new watch works.
	put(t, cli, pfx+"d", rec("10.0.0.4:8000"))
	waitFor(t, 5*time.Second, "watch after re-list", func() bool { return len(sink.lastAddrs()) == 4 })
}

func TestEtcdDegradedWhileDownThenRecovers(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	pfx := cfg.EndpointsPrefix()
	put(t, cli, pfx+"a", rec("10.0.0.1:8000"))
	sink := newFakeSink()
	startSource(t, newSource(t, cfg), sink)
	waitFor(t, 10*time.Second, "first set", func() bool { return len(sink.lastAddrs()) == 1 })
	_, before := sink.last()

	srv.Kill()
	killed := time.Now()
	// Normally within probeInterval + probeTimeout (3 s); the deadline is
	// generous because a loaded CI machine once took over 10 s.
	waitFor(t, 30*time.Second, "degraded", func() bool { err, _ := sink.degradedState(); return err != nil })
	t.Logf("degraded %v after SIGKILL", time.Since(killed).Round(time.Millisecond))
	time.Sleep(500 * time.Millisecond)
	if _, n := sink.last(); n != before {
		t.Errorf("published %d sets while etcd was down", n-before)
	}
	if got := sink.lastAddrs(); !slices.Equal(got, []string{"10.0.0.1:8000"}) {
		t.Errorf("last set = %v, want it kept", got)
	}

	srv.Restart()
	waitFor(t, 15*time.Second, "recovered", func() bool {
		err, n := sink.degradedState()
		return n > 0 && err == nil
	})
	put(t, cli, pfx+"b", rec("10.0.0.2:8000"))
	waitFor(t, 10*time.Second, "change after restart", func() bool { return len(sink.lastAddrs()) == 2 })
}

func TestEtcdUnreachableAtStartIsDegraded(t *testing.T) {
	srv := etcdenv.Start(t)
	cfg := testConfig(srv)
	srv.Kill()
	sink := newFakeSink()
	startSource(t, newSource(t, cfg), sink)
	waitFor(t, 15*time.Second, "degraded", func() bool { err, _ := sink.degradedState(); return err != nil })
	if _, n := sink.last(); n != 0 {
		t.Errorf("published %d sets without etcd", n)
	}
	srv.Restart()
	waitFor(t, 15*time.Second, "first set after start", func() bool { _, n := sink.last(); return n > 0 })
	if err, _ := sink.degradedState(); err != nil {
		t.Errorf("still degraded: %v", err)
	}
}

// TestEtcdWatchToPublishLatency measures put → Publish over 200 puts, one
// at a time, against a real local etcd. It reports and does not assert.
func TestEtcdWatchToPublishLatency(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	pfx := cfg.EndpointsPrefix()
	sink := newFakeSink()
	seen := make(chan time.Time, 1)
	var want atomic.Int64
	sink.onSet = func(set routing.EndpointSet, at time.Time) {
		if int64(len(set.Endpoints)) == want.Load() {
			seen <- at
		}
	}
	startSource(t, newSource(t, cfg), sink)
	waitFor(t, 10*time.Second, "first set", func() bool { _, n := sink.last(); return n > 0 })

	const n = 200
	lat := make([]time.Duration, 0, n)
	for i := range n {
		want.Store(int64(i + 1))
		start := time.Now()
		put(t, cli, fmt.Sprintf("%sw%03d", pfx, i), rec(fmt.Sprintf("10.1.%d.%d:8000", i/250, i%250+1)))
		select {
		case at := <-seen:
			lat = append(lat, at.Sub(start))
		case <-time.After(5 * time.Second):
			t.Fatalf("put %d not published", i)
		}
	}
	slices.Sort(lat)
	t.Logf("put → Publish over %d puts: p50 %v, p90 %v, p99 %v, max %v",
		n, lat[n/2], lat[n*90/100], lat[n*99/100], lat[n-1])
}

func TestEtcdRegistrar(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	ep := routing.Endpoint{Key: "10.0.0.9:8000", Engine: "vllm", Models: []routing.ModelName{"m"}}
	var regs atomic.Int32
	r, err := NewRegistrar(cfg, Registration{ID: "w1", Endpoint: ep, TTL: 2 * time.Second,
		OnRegistered: func(int64) { regs.Add(1) }}, Deps{Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if r.Key() != "/test/p/endpoints/w1" {
		t.Errorf("Key = %q", r.Key())
	}
	// A source sees the registration come and go.
	sink := newFakeSink()
	startSource(t, newSource(t, cfg), sink)

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	waitFor(t, 10*time.Second, "registered", r.Registered)
	waitFor(t, 5*time.Second, "source sees the record", func() bool {
		return slices.Equal(sink.lastAddrs(), []string{"10.0.0.9:8000"})
	})
	set, _ := sink.last()
	if !set.Endpoints[0].Equal(&ep) {
		t.Errorf("record = %+v, want %+v", set.Endpoints[0], ep)
	}

	// The keepalive holds the record well past 3×TTL.
	time.Sleep(7 * time.Second)
	gctx, gcancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer gcancel()
	resp, err := cli.Get(gctx, r.Key())
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("record after 3.5×TTL: %v %v", resp, err)
	}
	lease := clientv3.LeaseID(resp.Kvs[0].Lease)
	if lease == 0 {
		t.Error("record not under a lease")
	}
	if n := regs.Load(); n != 1 {
		t.Errorf("registered %d times, want once", n)
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	resp, err = cli.Get(gctx, r.Key())
	if err != nil || len(resp.Kvs) != 0 {
		t.Errorf("record after cancel: %v %v", resp.Kvs, err)
	}
	ttl, err := cli.TimeToLive(gctx, lease)
	if err != nil || ttl.TTL != -1 {
		t.Errorf("lease after cancel: ttl %v err %v, want revoked", ttl, err)
	}
	waitFor(t, 5*time.Second, "source sees the deletion", func() bool {
		set, _ := sink.last()
		return len(set.Endpoints) == 0
	})
	if r.Registered() {
		t.Error("Registered after Run returned")
	}
}

func TestEtcdRegistrarSurvivesRestart(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	ep := routing.Endpoint{Key: "10.0.0.9:8000"}
	const ttl = 2 * time.Second
	r, err := NewRegistrar(cfg, Registration{ID: "w1", Endpoint: ep, TTL: ttl}, Deps{Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("Run did not return after cancel")
		}
	}()
	waitFor(t, 10*time.Second, "registered", r.Registered)

	present := func() (clientv3.LeaseID, bool) {
		gctx, gcancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer gcancel()
		resp, err := cli.Get(gctx, r.Key())
		if err != nil || len(resp.Kvs) != 1 {
			return 0, false
		}
		return clientv3.LeaseID(resp.Kvs[0].Lease), true
	}

	// A short outage: the data dir keeps the lease, the keepalive resumes.
	srv.Kill()
	srv.Restart()
	time.Sleep(3 * ttl)
	if _, ok := present(); !ok {
		t.Fatal("record lost after a short restart")
	}

	// A long outage: the keepalive gives up; the registrar grants a new
	// lease and writes the record again (the old lease, restored from the
	// data dir, is revoked or expires without taking the record along).
	first := clientv3.LeaseID(r.lease.Load())
	srv.Kill()
	waitFor(t, 10*time.Second, "keepalive gives up", func() bool { return !r.Registered() })
	srv.Restart()
	waitFor(t, 15*time.Second, "registered again", func() bool {
		lease, ok := present()
		return ok && r.Registered() && lease == clientv3.LeaseID(r.lease.Load())
	})
	time.Sleep(3 * ttl)
	lease, ok := present()
	if !ok {
		t.Fatal("record lost after re-registration")
	}
	if lease == first {
		t.Logf("note: the record kept its first lease %x", int64(first))
	}
}

func TestEtcdNewRegistrarRejectsBadRecords(t *testing.T) {
	cfg := Config{Endpoints: []string{"127.0.0.1:2379"}}
	for name, reg := range map[string]Registration{
		"no id":        {Endpoint: routing.Endpoint{Key: "10.0.0.1:80"}},
		"no address":   {ID: "x"},
		"bad hostname": {ID: "x", Endpoint: routing.Endpoint{Key: "wor..ker:80"}},
		"engine":       {ID: "x", Endpoint: routing.Endpoint{Key: "10.0.0.1:80", Engine: "tgi"}},
		"negative ttl": {ID: "x", Endpoint: routing.Endpoint{Key: "10.0.0.1:80"}, TTL: -time.Second},
	} {
		if _, err := NewRegistrar(cfg, reg, Deps{}); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if _, err := NewRegistrar(Config{}, Registration{ID: "x", Endpoint: routing.Endpoint{Key: "10.0.0.1:80"}}, Deps{}); err == nil {
		t.Error("accepted a config without endpoints")
	}
	r, err := NewRegistrar(cfg, Registration{ID: "x", Endpoint: routing.Endpoint{Key: "[::ffff:10.0.0.1]:80"}}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(r.value), `"10.0.0.1:80"`) {
		t.Errorf("address not canonicalised: %s", r.value)
	}
	var re *discovery.RecordError
	_, err = NewRegistrar(cfg, Registration{ID: "x", Endpoint: routing.Endpoint{Key: "10.0.0.1:80", Engine: "tgi"}}, Deps{})
	if !errors.As(err, &re) || re.Reason != discovery.ReasonUnknownEngine {
		t.Errorf("error %v does not wrap the record error", err)
	}
}

// TestEtcdListOverLimit: a pool whose list is larger than MaxListBytes is
// refused by the client instead of being received whole: the source is
// degraded and publishes nothing, and recovers when the list shrinks.
func TestEtcdListOverLimit(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	cfg.MaxListBytes = 256 << 10
	pfx := cfg.EndpointsPrefix()
	put(t, cli, pfx+"a", rec("10.0.0.1:8000"))
	// Junk under the prefix: 3 values of 100 KiB make a 300 KiB list.
	junk := strings.Repeat("x", 100<<10)
	for i := range 3 {
		put(t, cli, fmt.Sprintf("%sjunk-%d", pfx, i), junk)
	}
	sink := newFakeSink()
	startSource(t, newSource(t, cfg), sink)
	waitFor(t, 20*time.Second, "degraded by the oversized list", func() bool {
		err, _ := sink.degradedState()
		return err != nil && strings.Contains(err.Error(), "larger than max")
	})
	if _, n := sink.last(); n != 0 {
		t.Errorf("published %d sets from an oversized list", n)
	}
	for i := range 3 {
		if _, err := cli.Delete(t.Context(), fmt.Sprintf("%sjunk-%d", pfx, i)); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, 20*time.Second, "first set after the list shrank", func() bool { return len(sink.lastAddrs()) == 1 })
	if err, _ := sink.degradedState(); err != nil {
		t.Errorf("still degraded: %v", err)
	}
}

// TestEtcdRecordsWithHostNames: a record may name its worker by DNS name;
// wrapped by the dns package, the source publishes one endpoint per
// address (localhost resolves through /etc/hosts), with kv_events naming
// the same host rewritten to the IP, and follows the record's removal.
func TestEtcdRecordsWithHostNames(t *testing.T) {
	local, err := net.DefaultResolver.LookupNetIP(t.Context(), "ip", "localhost")
	if err != nil {
		t.Fatalf("localhost does not resolve: %v", err)
	}
	var want []string
	for _, a := range local {
		want = append(want, netip.AddrPortFrom(a.Unmap(), 8000).String())
	}
	slices.Sort(want)
	want = slices.Compact(want)
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	cfg := testConfig(srv)
	pfx := cfg.Prefix + "/p/endpoints/"
	put(t, cli, pfx+"a", `{"address":"LOCALHOST:8000","engine":"vllm","models":["m"],"kv_events":"tcp://localhost:5557"}`)
	put(t, cli, pfx+"b", rec("10.0.0.2:8000"))
	x, err := dns.New(dns.Config{Refresh: 100 * time.Millisecond}, dns.Deps{Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	sink := newFakeSink()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- x.Wrap(newSource(t, cfg)).Run(ctx, sink) }()
	defer func() { cancel(); <-done }()
	waitFor(t, 10*time.Second, "resolved set", func() bool { return slices.Equal(sink.lastAddrs(), append(slices.Clone(want), "10.0.0.2:8000")) })
	set, _ := sink.last()
	if ep := set.Endpoints[0]; ep.Engine != "vllm" || ep.KVEvents != "tcp://"+netip.AddrPortFrom(ep.Addr().Addr(), 5557).String() {
		t.Errorf("resolved record: %+v", ep)
	}
	del(t, cli, pfx+"a")
	waitFor(t, 5*time.Second, "named record removed", func() bool { return slices.Equal(sink.lastAddrs(), []string{"10.0.0.2:8000"}) })
}
