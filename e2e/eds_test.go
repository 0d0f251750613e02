package e2e

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	edsv3 "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/eds"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
)

// edsEnvoy follows kvbandit's EDS the way Envoy's EDS cluster does: it asks
// for the cluster, applies each assignment to its host set, then ACKs it.
// While paused it stops between receiving a response and applying it, and
// it waits delay before applying each one (an Envoy slow to take a version).
type edsEnvoy struct {
	t      *testing.T
	stream grpc.BidiStreamingClient[discoveryv3.DiscoveryRequest, discoveryv3.DiscoveryResponse]
	paused atomic.Bool
	delay  atomic.Int64 // nanoseconds
	// received counts responses received (applied or not).
	received atomic.Int64

	mu      sync.Mutex
	hosts   map[string]bool // the cluster's hosts now
	ever    map[string]bool // every host the cluster has had
	version string
	errs    []string
}

func followEDS(t *testing.T, conn *grpc.ClientConn, node string) *edsEnvoy {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	st, err := edsv3.NewEndpointDiscoveryServiceClient(conn).StreamEndpoints(ctx)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	e := &edsEnvoy{t: t, stream: st, hosts: map[string]bool{}, ever: map[string]bool{}}
	req := &discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: node, Cluster: "kvbandit"},
		TypeUrl: eds.TypeURL, ResourceNames: []string{eds.DefaultCluster}}
	if err := st.Send(req); err != nil {
		cancel()
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			resp, err := st.Recv()
			if err != nil {
				return
			}
			e.received.Add(1)
			time.Sleep(time.Duration(e.delay.Load()))
			for e.paused.Load() && ctx.Err() == nil {
				time.Sleep(time.Millisecond)
			}
			e.apply(resp)
			ack := &discoveryv3.DiscoveryRequest{TypeUrl: eds.TypeURL, ResourceNames: []string{eds.DefaultCluster},
				VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}
			if st.Send(ack) != nil {
				return
			}
		}
	})
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		e.mu.Lock()
		defer e.mu.Unlock()
		for _, msg := range e.errs {
			t.Error(msg)
		}
	})
	return e
}

// apply replaces the host set with resp's assignment.
func (e *edsEnvoy) apply(resp *discoveryv3.DiscoveryResponse) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var cla endpointv3.ClusterLoadAssignment
	if len(resp.GetResources()) != 1 || resp.GetResources()[0].UnmarshalTo(&cla) != nil || cla.GetClusterName() != eds.DefaultCluster {
		e.errs = append(e.errs, fmt.Sprintf("bad EDS response %v", resp))
		return
	}
	prev, _ := strconv.Atoi(e.version)
	if v, err := strconv.Atoi(resp.GetVersionInfo()); err != nil || v <= prev {
		e.errs = append(e.errs, fmt.Sprintf("version %q after %q", resp.GetVersionInfo(), e.version))
	}
	e.hosts = map[string]bool{}
	for _, loc := range cla.GetEndpoints() {
		for _, lbe := range loc.GetLbEndpoints() {
			sa := lbe.GetEndpoint().GetAddress().GetSocketAddress()
			h := net.JoinHostPort(sa.GetAddress(), strconv.Itoa(int(sa.GetPortValue())))
			if lbe.GetHealthStatus() != corev3.HealthStatus_HEALTHY {
				e.errs = append(e.errs, fmt.Sprintf("host %s is %v", h, lbe.GetHealthStatus()))
			}
			e.hosts[h], e.ever[h] = true, true
		}
	}
	e.version = resp.GetVersionInfo()
}

// has reports whether the cluster has host now; hadEver whether it ever had.
func (e *edsEnvoy) has(host string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.hosts[host]
}

func (e *edsEnvoy) hadEver(host string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.ever[host]
}

func (e *edsEnvoy) hostList() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]string, 0, len(e.hosts))
	for h := range e.hosts {
		out = append(out, h)
	}
	slices.Sort(out)
	return out
}

// edsStack is discovery as serve runs it with EDS: a real engine, the hub,
// and the EDS server on a real gRPC listener as the hub's gate.
type edsStack struct {
	engine *engine.Engine
	hub    *discovery.Hub
	srv    *eds.Server
	conn   *grpc.ClientConn
}

func newEDSStack(t *testing.T) *edsStack {
	t.Helper()
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New("round_robin", policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	s := &edsStack{engine: engine.Must(p, engine.Options{}, engine.Deps{Rand: rnd, Logger: slog.New(slog.DiscardHandler)})}
	t.Cleanup(s.engine.Close)
	var hub atomic.Pointer[discovery.Hub]
	s.srv = eds.New(eds.Config{}, eds.Deps{OnChange: func() { hub.Load().Refresh() }})
	s.hub = discovery.NewHub(discovery.HubDeps{Engine: s.engine, Gate: s.srv})
	hub.Store(s.hub)

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	s.srv.Register(g)
	var wg sync.WaitGroup
	wg.Go(func() { _ = g.Serve(lis) })
	s.conn, err = grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.srv.Close()
		g.GracefulStop() // returns at once: Close ended the xDS streams
		wg.Wait()
		s.conn.Close()
	})
	return s
}

func (s *edsStack) publish(t *testing.T, keys ...string) {
	t.Helper()
	set := routing.EndpointSet{Source: "test"}
	for _, k := range keys {
		set.Endpoints = append(set.Endpoints, routing.Endpoint{Key: routing.EndpointKey(k)})
	}
	if err := s.hub.Publish(set); err != nil {
		t.Fatal(err)
	}
}

func (s *edsStack) serving() []string {
	var out []string
	for _, st := range s.engine.Endpoints() {
		out = append(out, string(st.Key))
	}
	slices.Sort(out)
	return out
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// TestEDSEngineFollowsEnvoy: kvbandit picks a new worker only once Envoy's
// cluster has it, and a worker that leaves with a request in flight stays in
// Envoy's cluster until the request ends.
func TestEDSEngineFollowsEnvoy(t *testing.T) {
	const a, b, c = "127.0.0.1:8001", "127.0.0.1:8002", "[::1]:8003"
	s := newEDSStack(t)
	s.publish(t, a, b)
	if got := s.serving(); !slices.Equal(got, []string{a, b}) {
		t.Fatalf("no Envoy yet: engine serves %v, want both", got)
	}
	envoy := followEDS(t, s.conn, "envoy-1")
	waitFor(t, "Envoy has a and b", func() bool { return envoy.has(a) && envoy.has(b) })

	// Envoy is slow to take the next version: c must not be picked.
	envoy.paused.Store(true)
	got := envoy.received.Load()
	s.publish(t, a, b, c)
	waitFor(t, "Envoy received the version with c", func() bool { return envoy.received.Load() > got })
	for range 20 {
		d, err := s.engine.Pick(t.Context(), &routing.Request{})
		if err != nil {
			t.Fatal(err)
		}
		if d.Endpoint == c {
			t.Errorf("picked %s before Envoy's cluster had it", c)
		}
		d.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
	envoy.paused.Store(false)
	waitFor(t, "the engine serves c after Envoy's ACK", func() bool { return slices.Equal(s.serving(), []string{a, b, c}) })

	// b leaves while a request to it is in flight.
	var held *routing.Decision
	for held == nil {
		d, err := s.engine.Pick(t.Context(), &routing.Request{})
		if err != nil {
			t.Fatal(err)
		}
		if d.Endpoint == b {
			held = d
			continue
		}
		d.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
	s.publish(t, a, c)
	if got := s.serving(); !slices.Equal(got, []string{a, c}) {
		t.Errorf("engine serves %v, want [%s %s]", got, a, c)
	}
	if !envoy.has(b) {
		t.Errorf("Envoy dropped %s with a request in flight: %v", b, envoy.hostList())
	}
	held.Done(routing.NoUsage(routing.OutcomeSuccess))
	s.hub.Refresh() // serve runs hub.Run, which does this periodically
	waitFor(t, "Envoy drops b", func() bool { return !envoy.has(b) && envoy.has(a) && envoy.has(c) })

	// The Envoy applies a version before it ACKs it: wait for the server to
	// have the ACK.
	waitFor(t, "the server has the ACK of the last version", func() bool {
		st := s.srv.Stats()
		return len(st.Streams) == 1 && st.Streams[0].AckedVersion == st.Version
	})
	if st := s.srv.Stats(); st.NACKs != 0 || st.ACKs < 3 {
		t.Errorf("EDS stats %+v", st)
	}
}

// TestEDSNoPickOutsideEnvoysCluster churns the endpoint set while picking
// and two Envoys follow at different speeds: every pick is a host that
// every ACKing Envoy's cluster has had (override_host can reach it).
func TestEDSNoPickOutsideEnvoysCluster(t *testing.T) {
	s := newEDSStack(t)
	pool := []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "[2001:db8::4]:8000", "[2001:db8::5]:8000", "10.0.0.6:8000"}
	s.publish(t, pool[:2]...)
	fast := followEDS(t, s.conn, "envoy-fast")
	slow := followEDS(t, s.conn, "envoy-slow")
	waitFor(t, "both Envoys have the first set", func() bool { return fast.has(pool[0]) && slow.has(pool[0]) })
	slow.delay.Store(int64(3 * time.Millisecond))

	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var picks, bad atomic.Int64
	wg.Go(func() {
		for ctx.Err() == nil {
			d, err := s.engine.Pick(ctx, &routing.Request{})
			if err != nil {
				continue
			}
			picks.Add(1)
			k := string(d.Endpoint)
			if !fast.hadEver(k) || !slow.hadEver(k) {
				bad.Add(1)
				t.Errorf("picked %s: fast Envoy had it %v, slow %v; server %+v", k, fast.hadEver(k), slow.hadEver(k), s.srv.Stats())
			}
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
		}
	})
	r := rand.New(rand.NewPCG(1, 2))
	for range 40 {
		n := 1 + r.IntN(len(pool))
		perm := r.Perm(len(pool))[:n]
		var keys []string
		for _, i := range perm {
			keys = append(keys, pool[i])
		}
		s.publish(t, keys...)
		time.Sleep(time.Duration(r.IntN(4)) * time.Millisecond)
	}
	s.publish(t, pool...)
	waitFor(t, "both Envoys and the engine have every worker", func() bool {
		return len(fast.hostList()) == len(pool) && len(slow.hostList()) == len(pool) && len(s.serving()) == len(pool)
	})
	cancel()
	wg.Wait()
	if picks.Load() == 0 || bad.Load() != 0 {
		t.Errorf("%d picks, %d outside Envoy's cluster", picks.Load(), bad.Load())
	}
}

// TestEDSThroughServe runs `kvbandit serve --endpoints-file --eds-addr`
// with an Envoy-like EDS client: the client's cluster follows the file,
// and a worker added to the file is picked only after the client has
// acknowledged an assignment that contains it.
func TestEDSThroughServe(t *testing.T) {
	_, addrs := startWorkers(t, 3, worker.Config{})
	path := filepath.Join(t.TempDir(), "endpoints.yaml")
	recs := func(as ...string) []map[string]any {
		var out []map[string]any
		for _, a := range as {
			out = append(out, map[string]any{"address": a})
		}
		return out
	}
	writeEndpoints(t, path, recs(addrs[:2]...))
	xdsAddr := freeAddr(t)
	k := startKvbandit(t, nil, "--endpoints-file", path, "--eds-addr", xdsAddr, "--scrape-interval", "0")
	k.endpoints = addrs
	conn, err := grpc.NewClient(xdsAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	envoy := followEDS(t, conn, "envoy-0")
	waitFor(t, "the first assignment", func() bool { return slices.Equal(envoy.hostList(), sortedCopy(addrs[:2])) })
	k.waitMetric(t, "kvbandit_eds_responses_total", map[string]string{"result": "ack"}, 1)

	// Envoy takes its time with the next version: the new worker is
	// discovered but not pickable until it is acknowledged.
	envoy.paused.Store(true)
	n := envoy.received.Load()
	writeEndpoints(t, path, recs(addrs...))
	waitFor(t, "the new assignment to be sent", func() bool { return envoy.received.Load() > n })
	px := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)
	got := sendAll(t, c, px, 6)
	if got[addrs[2]] != 0 {
		t.Fatalf("worker %s picked before Envoy acknowledged it: %v", addrs[2], got)
	}
	if eps, disc, err := k.debugEndpoints(t.Context()); err != nil || len(eps) != 2 || disc["desired"] != 3.0 {
		t.Fatalf("debug endpoints %v discovery %v err %v", eps, disc, err)
	}
	envoy.paused.Store(false)
	k.waitEndpoints(t, addrs, 10*time.Second)
	if got := sendAll(t, c, px, 6); got[addrs[2]] != 2 {
		t.Fatalf("after the ack: %v", got)
	}
	// Removal: the worker leaves the assignment (no decisions in flight).
	writeEndpoints(t, path, recs(addrs[1:]...))
	waitFor(t, "the removal", func() bool { return slices.Equal(envoy.hostList(), sortedCopy(addrs[1:])) })
	k.waitEndpoints(t, addrs[1:], 10*time.Second)
}

func sortedCopy(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}
