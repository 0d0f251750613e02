package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os/exec"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/internal/testenv/etcdenv"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/etcd"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
)

// registrar is one `kvbandit register` process.
type registrar struct {
	cmd    *exec.Cmd
	out    *syncBuffer
	exited chan struct{}
	err    error
}

func startRegister(t *testing.T, etcdAddr, id, addr string, extra ...string) *registrar {
	t.Helper()
	args := append([]string{"register", "--etcd-endpoints", etcdAddr, "--id", id, "--address", addr,
		"--engine", "vllm", "--ttl", "2s", "--health-interval", "50ms"}, extra...)
	r := &registrar{out: &syncBuffer{}, exited: make(chan struct{})}
	r.cmd = exec.Command(kvbanditBin, args...)
	r.cmd.Stdout, r.cmd.Stderr = r.out, r.out
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { r.err = r.cmd.Wait(); close(r.exited) }()
	t.Cleanup(func() {
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-r.exited:
		case <-time.After(10 * time.Second):
			_ = r.cmd.Process.Kill()
			<-r.exited
		}
		if t.Failed() {
			t.Logf("register %s output:\n%s", id, r.out)
		}
	})
	return r
}

// debugEndpoints returns the addresses kvbandit picks from now.
func (k *kvb) debugEndpoints(ctx context.Context) ([]string, map[string]any, error) {
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+k.metricsAddr+"/debug/endpoints", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Endpoints []struct {
			Address string `json:"address"`
		} `json:"endpoints"`
		Discovery map[string]any `json:"discovery"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, nil, err
	}
	var out []string
	for _, e := range body.Endpoints {
		out = append(out, e.Address)
	}
	sort.Strings(out)
	return out, body.Discovery, nil
}

func (k *kvb) waitEndpoints(t *testing.T, want []string, within time.Duration) {
	t.Helper()
	want = slices.Clone(want)
	sort.Strings(want)
	ctx, cancel := context.WithTimeout(t.Context(), within)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		got, _, err := k.debugEndpoints(ctx)
		if err != nil {
			return false, err.Error()
		}
		return slices.Equal(got, want), fmt.Sprintf("endpoints %v, want %v", got, want)
	}); err != nil {
		t.Fatalf("%v\n%s", err, k.out)
	}
}

func (k *kvb) readiness(t *testing.T) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	conn, err := grpc.NewClient(k.healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "readiness"})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetStatus()
}

// sendAll sends n requests through px and returns how many each worker
// served; every one must succeed.
func sendAll(t *testing.T, c *http.Client, px *envoysim.Proxy, n int) map[string]int {
	t.Helper()
	got := map[string]int{}
	for i := range n {
		r := send(t, c, "POST", px.URL()+"/v1/chat/completions", chatRequest(300+i, ""), nil)
		if r.status != 200 {
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
		got[r.worker()]++
	}
	return got
}

// TestEtcdDiscoveryEndToEnd runs kvbandit on a real etcd with workers
// registered by `kvbandit register`: registration, deregistration on
// SIGTERM, lease expiry after a SIGKILLed register, an etcd outage (routing
// continues on the last set, readiness stays SERVING, the degraded metric
// says so) and recovery without a restart.
func TestEtcdDiscoveryEndToEnd(t *testing.T) {
	srv := etcdenv.Start(t)
	_, addrs := startWorkers(t, 3, worker.Config{})
	k := startKvbandit(t, nil, "--etcd-endpoints", srv.Addr(), "--scrape-interval", "0")
	k.endpoints = addrs
	px := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)

	regs := []*registrar{
		startRegister(t, srv.Addr(), "w0", addrs[0]),
		startRegister(t, srv.Addr(), "w1", addrs[1]),
	}
	k.waitEndpoints(t, addrs[:2], 20*time.Second)
	if got := sendAll(t, c, px, 6); got[addrs[0]] != 3 || got[addrs[1]] != 3 {
		t.Fatalf("round robin over two registered workers: %v", got)
	}
	regs = append(regs, startRegister(t, srv.Addr(), "w2", addrs[2]))
	k.waitEndpoints(t, addrs, 20*time.Second)

	// SIGTERM: the record is deleted at once.
	if err := regs[0].cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	<-regs[0].exited
	if regs[0].err != nil {
		t.Fatalf("register exited with %v:\n%s", regs[0].err, regs[0].out)
	}
	k.waitEndpoints(t, addrs[1:], 5*time.Second)

	// SIGKILL: the record goes when its 2 s lease expires.
	killed := time.Now()
	if err := regs[1].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-regs[1].exited
	k.waitEndpoints(t, addrs[2:], 15*time.Second)
	t.Logf("lease expiry removed a killed register's record after %v (TTL 2 s)", time.Since(killed).Round(100*time.Millisecond))
	if got := sendAll(t, c, px, 3); got[addrs[2]] != 3 {
		t.Fatalf("after deregistration: %v", got)
	}

	// etcd down: the last set keeps serving, readiness stays SERVING.
	srv.Kill()
	k.waitMetric(t, "kvbandit_discovery_degraded", map[string]string{"source": "etcd"}, 1)
	if st := k.readiness(t); st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("readiness during the etcd outage: %v", st)
	}
	if got := sendAll(t, c, px, 3); got[addrs[2]] != 3 {
		t.Fatalf("during the outage: %v", got)
	}
	// etcd back: recovery without a restart of kvbandit or register.
	srv.Restart()
	k.waitMetric(t, "kvbandit_discovery_degraded", map[string]string{"source": "etcd"}, 0)
	cli := srv.Client(t)
	rec, _ := json.Marshal(routing.Endpoint{Key: routing.EndpointKey(addrs[0]), Engine: "sglang"})
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, "/kvbandit/v1/default/endpoints/manual", string(rec)); err != nil {
		t.Fatal(err)
	}
	// A malformed record next to it is skipped and counted.
	if _, err := cli.Put(ctx, "/kvbandit/v1/default/endpoints/bad", "{not json"); err != nil {
		t.Fatal(err)
	}
	k.waitEndpoints(t, []string{addrs[0], addrs[2]}, 15*time.Second)
	k.waitMetric(t, "kvbandit_discovery_skipped_records_total", map[string]string{"source": "etcd", "reason": "malformed"}, 1)
	if got := sendAll(t, c, px, 4); got[addrs[0]] != 2 || got[addrs[2]] != 2 {
		t.Fatalf("after recovery: %v", got)
	}
	if !strings.Contains(k.out.String(), "discovery degraded") || !strings.Contains(k.out.String(), "discovery recovered") {
		t.Errorf("the logs do not say degraded and recovered:\n%s", k.out)
	}
}

// TestEtcdDiscoveryLatency measures how long an etcd put or delete takes to
// reach a new engine snapshot on loopback (real etcd, the etcd source, the
// hub and a real engine); reported, not asserted.
func TestEtcdDiscoveryLatency(t *testing.T) {
	srv := etcdenv.Start(t)
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New("round_robin", policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	eng := engine.Must(p, engine.Options{}, engine.Deps{Rand: rnd})
	defer eng.Close()
	published := make(chan int, 1024)
	hub := discovery.NewHub(discovery.HubDeps{Engine: eng, OnPublish: func(s routing.EndpointSet, _ time.Time) { published <- len(s.Endpoints) }})
	src, err := etcd.New(etcd.Config{Endpoints: []string{srv.Addr()}}, etcd.Deps{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx, hub) }()
	defer func() { cancel(); <-done }()
	wait := func(want int) {
		t.Helper()
		for {
			select {
			case n := <-published:
				if n == want {
					return
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("no snapshot with %d endpoints", want)
			}
		}
	}
	wait(0)
	cli := srv.Client(t)
	var lat []time.Duration
	for i := range 200 {
		key := fmt.Sprintf("/kvbandit/v1/default/endpoints/w%d", i%10)
		start := time.Now()
		if i%20 < 10 {
			if _, err := cli.Put(ctx, key, fmt.Sprintf(`{"address":"10.0.0.%d:8000"}`, i%10+1)); err != nil {
				t.Fatal(err)
			}
			wait(i%10 + 1)
		} else {
			if _, err := cli.Delete(ctx, key); err != nil {
				t.Fatal(err)
			}
			wait(9 - i%10)
		}
		lat = append(lat, time.Since(start))
	}
	slices.Sort(lat)
	q := func(f float64) time.Duration { return lat[int(f*float64(len(lat)-1))] }
	t.Logf("etcd put/delete -> engine snapshot on loopback, %d changes: p50 %v p90 %v p99 %v max %v (goal p99 < 100 ms)",
		len(lat), q(0.5).Round(10*time.Microsecond), q(0.9).Round(10*time.Microsecond), q(0.99).Round(10*time.Microsecond), lat[len(lat)-1].Round(10*time.Microsecond))
}
