package discovery_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newEngine(t *testing.T) *engine.Engine {
	t.Helper()
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New("round_robin", policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	e := engine.Must(p, engine.Options{}, engine.Deps{Rand: rnd})
	t.Cleanup(e.Close)
	return e
}

func keys(e *engine.Engine) []string {
	var out []string
	for _, st := range e.Endpoints() {
		out = append(out, string(st.Key))
	}
	return out
}

func set(src string, addrs ...string) routing.EndpointSet {
	s := routing.EndpointSet{Source: src}
	for _, a := range addrs {
		s.Endpoints = append(s.Endpoints, routing.Endpoint{Key: routing.EndpointKey(a)})
	}
	return s
}

func TestHubPublishesValidSetsAndKeepsTheLastOnError(t *testing.T) {
	e := newEngine(t)
	var followed []int
	var offered []time.Time
	h := discovery.NewHub(discovery.HubDeps{Engine: e, OnPublish: func(_ routing.EndpointSet, at time.Time) { offered = append(offered, at) }})
	h.Follow(func(s routing.EndpointSet) { followed = append(followed, len(s.Endpoints)) })
	if err := h.Publish(set("t", "10.0.0.1:8000", "10.0.0.2:8000")); err != nil {
		t.Fatal(err)
	}
	if err := h.Publish(set("t", "10.0.0.1:8000", "10.0.0.1:8000")); !errors.Is(err, routing.ErrInvalidEndpointSet) {
		t.Fatalf("duplicate set: err = %v", err)
	}
	if got := keys(e); !slices.Equal(got, []string{"10.0.0.1:8000", "10.0.0.2:8000"}) {
		t.Fatalf("engine = %v, want the last good set", got)
	}
	if !slices.Equal(followed, []int{2}) || len(offered) != 1 {
		t.Fatalf("followers saw %v, OnPublish %d times", followed, len(offered))
	}
	st := h.Stats()
	if st.Published != 1 || st.Rejected != 1 || st.Endpoints != 2 || st.Pickable != 2 {
		t.Fatalf("stats = %+v", st)
	}
	// A late follower gets the current set at once.
	var late int
	h.Follow(func(s routing.EndpointSet) { late = len(s.Endpoints) })
	if late != 2 {
		t.Fatalf("late follower got %d endpoints", late)
	}
}

func TestHubDegradedStateIsReportedNotPublished(t *testing.T) {
	e := newEngine(t)
	h := discovery.NewHub(discovery.HubDeps{Engine: e})
	if err := h.Publish(set("etcd", "10.0.0.1:8000")); err != nil {
		t.Fatal(err)
	}
	h.SetDegraded("etcd", errors.New("context deadline exceeded"))
	if !h.Degraded() || h.Stats().Degraded["etcd"] == "" {
		t.Fatal("not degraded")
	}
	if got := keys(e); len(got) != 1 {
		t.Fatalf("engine lost its set while degraded: %v", got)
	}
	h.SetDegraded("etcd", nil)
	if h.Degraded() {
		t.Fatal("still degraded after recovery")
	}
	h.Skipped("etcd", discovery.ReasonMalformed)
	h.Skipped("etcd", discovery.ReasonMalformed)
	if n := h.Stats().Skipped[[2]string{"etcd", discovery.ReasonMalformed}]; n != 2 {
		t.Fatalf("skipped = %d", n)
	}
}

// gate is a hand-written Gate: the data plane "acknowledges" the keys in
// acked.
type gate struct {
	mu        sync.Mutex
	acked     map[routing.EndpointKey]bool
	desired   []routing.Endpoint
	lingering []routing.Endpoint
}

func (g *gate) Offer(d, l []routing.Endpoint) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.desired, g.lingering = d, l
}

func (g *gate) Pickable(k routing.EndpointKey) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.acked[k]
}

func (g *gate) ack(k string) {
	g.mu.Lock()
	g.acked[routing.EndpointKey(k)] = true
	g.mu.Unlock()
}

func TestHubGateHoldsNewEndpointsAndLingersLeavingOnes(t *testing.T) {
	e := newEngine(t)
	g := &gate{acked: map[routing.EndpointKey]bool{"10.0.0.1:8000": true}}
	h := discovery.NewHub(discovery.HubDeps{Engine: e, Gate: g})
	if err := h.Publish(set("t", "10.0.0.1:8000", "10.0.0.2:8000")); err != nil {
		t.Fatal(err)
	}
	if got := keys(e); !slices.Equal(got, []string{"10.0.0.1:8000"}) {
		t.Fatalf("engine = %v before the data plane acknowledged .2", got)
	}
	g.ack("10.0.0.2:8000")
	h.Refresh()
	if got := keys(e); len(got) != 2 {
		t.Fatalf("engine = %v after the ack", got)
	}
	// A decision in flight to .2, then .2 leaves: it stays offered to the
	// data plane until the decision ends.
	var d *routing.Decision
	for d == nil || d.Endpoint != "10.0.0.2:8000" {
		var err error
		if d, err = e.Pick(context.Background(), &routing.Request{}); err != nil {
			t.Fatal(err)
		}
		if d.Endpoint != "10.0.0.2:8000" {
			d.Done(routing.Outcome{})
		}
	}
	if err := h.Publish(set("t", "10.0.0.1:8000")); err != nil {
		t.Fatal(err)
	}
	if got := keys(e); !slices.Equal(got, []string{"10.0.0.1:8000"}) {
		t.Fatalf("engine = %v: a removed endpoint must stop being picked at once", got)
	}
	if len(g.lingering) != 1 || g.lingering[0].Key != "10.0.0.2:8000" || h.Stats().Lingering != 1 {
		t.Fatalf("lingering = %v", g.lingering)
	}
	d.Done(routing.Outcome{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { h.Run(ctx, 5*time.Millisecond); close(done) }()
	deadline := time.Now().Add(5 * time.Second)
	for h.Stats().Lingering != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	<-done
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.lingering) != 0 {
		t.Fatalf("still lingering after the decision ended: %v", g.lingering)
	}
}

// sink records what a source reports.
type sink struct {
	mu       sync.Mutex
	sets     []routing.EndpointSet
	degraded []string
	skipped  map[string]int
	pubErr   error
}

func (s *sink) Publish(set routing.EndpointSet) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := set.Validate(); err != nil {
		return err
	}
	s.sets = append(s.sets, set)
	return s.pubErr
}

func (s *sink) SetDegraded(_ string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	if n := len(s.degraded); n == 0 || s.degraded[n-1] != msg {
		s.degraded = append(s.degraded, msg)
	}
}

func (s *sink) Skipped(_, reason string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.skipped == nil {
		s.skipped = map[string]int{}
	}
	s.skipped[reason]++
}

func (s *sink) last() (routing.EndpointSet, int, []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.sets) == 0 {
		return routing.EndpointSet{}, 0, slices.Clone(s.degraded)
	}
	return s.sets[len(s.sets)-1], len(s.sets), slices.Clone(s.degraded)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func TestFileSourceReloadsSkipsAndDegrades(t *testing.T) {
	path := filepath.Join(t.TempDir(), "endpoints.yaml")
	write := func(s string) {
		t.Helper()
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	s := &sink{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- discovery.File{Path: path, Interval: 2 * time.Millisecond}.Run(ctx, s) }()
	defer func() { cancel(); <-done }()

	// Missing at start: degraded, nothing published.
	waitFor(t, "degraded on a missing file", func() bool { _, _, d := s.last(); return len(d) > 0 && d[0] != "" })

	write(`
endpoints:
  - address: 10.0.0.1:8000
    engine: vllm
    models: [m]
    block_size: 32
  - address: 10.0.0.2:8000
    engine: tgi            # unknown engine: skipped
  - {address: "not an address"}
  - address: 10.0.0.1:8000 # duplicate: skipped
  - [1, 2]
`)
	waitFor(t, "first set", func() bool { _, n, _ := s.last(); return n == 1 })
	got, _, deg := s.last()
	if len(got.Endpoints) != 1 || got.Endpoints[0].BlockSize != 32 || got.Source != "file" {
		t.Fatalf("set = %+v", got)
	}
	if deg[len(deg)-1] != "" {
		t.Fatalf("still degraded: %v", deg)
	}
	s.mu.Lock()
	if s.skipped[discovery.ReasonUnknownEngine] != 1 || s.skipped[discovery.ReasonInvalid] != 1 || s.skipped[discovery.ReasonDuplicate] != 1 || s.skipped[discovery.ReasonMalformed] != 1 {
		t.Errorf("skipped = %v", s.skipped)
	}
	s.mu.Unlock()

	// Garbage: the last set stays, degraded.
	write("endpoints: [unclosed")
	waitFor(t, "degraded on garbage", func() bool { _, _, d := s.last(); return d[len(d)-1] != "" })
	if _, n, _ := s.last(); n != 1 {
		t.Fatalf("garbage published a set")
	}
	// A plain list works too, and recovery needs no restart.
	write(`[{"address": "[::1]:9000"}, {"address": "127.0.0.1:9001"}]`)
	waitFor(t, "reload", func() bool { _, n, _ := s.last(); return n == 2 })
	got, _, deg = s.last()
	if len(got.Endpoints) != 2 || got.Endpoints[0].Key != "[::1]:9000" || deg[len(deg)-1] != "" {
		t.Fatalf("set = %+v degraded = %v", got, deg)
	}
}

func TestDecodeRecordCanonicalises(t *testing.T) {
	ep, err := discovery.DecodeRecord([]byte(`{"address":"[::ffff:10.0.0.1]:80","models":["a"],"future_field":1}`))
	if err != nil || ep.Key != "10.0.0.1:80" {
		t.Fatalf("ep = %+v, err = %v", ep, err)
	}
	for in, reason := range map[string]string{
		`{`:                                      discovery.ReasonMalformed,
		`{"models":["a"]}`:                       discovery.ReasonMalformed,
		`{"address":"10.0.0.1:80","engine":"x"}`: discovery.ReasonUnknownEngine,
		`{"address":"ho st:80"}`:                 discovery.ReasonInvalid,
		`{"address":"10.0.0.1:80","block_size":-1}`: discovery.ReasonInvalid,
	} {
		if _, err := discovery.DecodeRecord([]byte(in)); discovery.SkipReason(err) != reason {
			t.Errorf("%s: err = %v, want reason %s", in, err, reason)
		}
	}
}

func FuzzDecodeRecord(f *testing.F) {
	f.Add([]byte(`{"address":"10.0.0.1:80","engine":"vllm","models":["m"],"data_parallel_size":2}`))
	f.Add([]byte(`{"address":"[::1]:1","labels":{"a":"b"}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		ep, err := discovery.DecodeRecord(data)
		if err != nil {
			if discovery.SkipReason(err) == "" {
				t.Fatal("no reason")
			}
			return
		}
		s := routing.EndpointSet{Endpoints: resolvePlaceholders(t, []routing.Endpoint{ep})}
		if err := s.Validate(); err != nil {
			t.Fatalf("accepted record fails set validation: %v", err)
		}
	})
}

// resolvePlaceholders stands in for routing/discovery/dns: a record may name
// its host (checked by CheckRecord), and the set reaches routing only with
// each name replaced by an IP. Here every name gets a distinct documentation
// address (2001:db8::/32) not otherwise in the set, keeping the port.
func resolvePlaceholders(t *testing.T, eps []routing.Endpoint) []routing.Endpoint {
	t.Helper()
	used := make(map[routing.EndpointKey]bool, len(eps))
	for _, e := range eps {
		used[e.Key] = true
	}
	out := slices.Clone(eps)
	next := 1
	for i := range out {
		name, port, err := discovery.ParseName(string(out[i].Key))
		if err != nil || name == "" {
			continue
		}
		for {
			k := routing.EndpointKey(net.JoinHostPort(fmt.Sprintf("2001:db8::%x", next), strconv.Itoa(int(port))))
			next++
			if !used[k] {
				used[k], out[i].Key = true, k
				break
			}
		}
	}
	return out
}

func FuzzParseEndpointsFile(f *testing.F) {
	f.Add([]byte("- address: 10.0.0.1:80\n  engine: vllm\n  models: [m]\n- address: 10.0.0.2:80\n"))
	f.Add([]byte(`{"endpoints":[{"address":"[::1]:1","labels":{"a":"b"}}]}`))
	f.Add([]byte("a: &a [x, x, x]\nb: &b [*a, *a, *a]\nendpoints: [*b, *b]\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		set, err := discovery.ParseEndpointsFile(data, nil)
		if err != nil {
			return
		}
		set.Endpoints = resolvePlaceholders(t, set.Endpoints)
		if err := set.Validate(); err != nil {
			t.Fatalf("parsed set fails validation: %v", err)
		}
	})
}

func TestHubDropsLinkLocalUnlessAllowed(t *testing.T) {
	e := newEngine(t)
	h := discovery.NewHub(discovery.HubDeps{Engine: e})
	if err := h.Publish(set("dns", "10.0.0.1:8000", "169.254.169.254:80", "[fe80::1]:8000")); err != nil {
		t.Fatal(err)
	}
	if got := keys(e); !slices.Equal(got, []string{"10.0.0.1:8000"}) {
		t.Fatalf("engine = %v, want the link-local endpoints dropped", got)
	}
	if n := h.Stats().Skipped[[2]string{"dns", discovery.ReasonLinkLocal}]; n != 2 {
		t.Fatalf("skipped link_local = %d, want 2", n)
	}
	e2 := newEngine(t)
	h2 := discovery.NewHub(discovery.HubDeps{Engine: e2, AllowLinkLocal: true})
	if err := h2.Publish(set("dns", "10.0.0.1:8000", "169.254.169.254:80")); err != nil {
		t.Fatal(err)
	}
	if got := keys(e2); len(got) != 2 {
		t.Fatalf("allowed: engine = %v", got)
	}
}

func TestHubLogsSayWhetherASetIsKnown(t *testing.T) {
	var buf bytes.Buffer
	h := discovery.NewHub(discovery.HubDeps{Engine: newEngine(t), Logger: slog.New(slog.NewTextHandler(&buf, nil))})
	h.SetDegraded("etcd", errors.New("down"))
	if s := buf.String(); !strings.Contains(s, "no endpoint set known yet") || strings.Contains(s, "serving the last known endpoint set") {
		t.Fatalf("degraded before any set: %s", s)
	}
	h.SetDegraded("etcd", nil)
	if err := h.Publish(set("etcd", "10.0.0.1:8000")); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(buf.String(), `msg="first endpoint set" source=etcd endpoints=1`) {
		t.Fatalf("first set not logged: %s", buf.String())
	}
	buf.Reset()
	h.SetDegraded("etcd", errors.New("down"))
	if !strings.Contains(buf.String(), "serving the last known endpoint set") {
		t.Fatalf("degraded with a set: %s", buf.String())
	}
}
