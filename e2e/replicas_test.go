package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
)

// The active-active suite (issue 12): three real `kvbandit serve` replicas
// share their in-flight decisions and outcomes over one real nats-server,
// each behind its own envoysim, in front of four workers; requests enter
// through a replica chosen at random (seeded).

// Sync timings of the suite's replicas (the config's sync section): a
// short peer TTL so that the dead-replica phase stays short.
const (
	replicasPeerTTL   = 1500 * time.Millisecond
	replicasHeartbeat = 250 * time.Millisecond
	replicasSnapshot  = 500 * time.Millisecond
)

// replicaFleet is the suite's deployment.
type replicaFleet struct {
	nats    *natsenv.Server
	ws      []*worker.Worker
	addrs   []string
	reps    []*kvb
	proxies []*envoysim.Proxy
	alive   []bool
	c       *http.Client
	rng     *rand.Rand // used by the test goroutine only
}

func startReplicaFleet(t *testing.T, policy string) *replicaFleet {
	t.Helper()
	f := &replicaFleet{nats: startSyncNATS(t), c: httpClient(t), rng: rand.New(rand.NewPCG(12, 1))}
	// 20 ms per token: a 50-token request is in flight for a second.
	// Workers prefill as engines do (4 ms per uncached block, one
	// prefill at a time): a cached prefix is worth something, and a
	// worker's first token comes later the more prefill it queues.
	f.ws, f.addrs = startWorkers(t, 4, worker.Config{TokenDelay: 20 * time.Millisecond, PrefillDelay: 4 * time.Millisecond})
	cfg := filepath.Join(t.TempDir(), "kvbandit.yaml")
	yaml := fmt.Sprintf("sync:\n%s  peer_ttl_ms: %d\n  heartbeat_interval_ms: %d\n  snapshot_interval_ms: %d\n",
		syncNATSYAML(), replicasPeerTTL.Milliseconds(), replicasHeartbeat.Milliseconds(), replicasSnapshot.Milliseconds())
	if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		k := startKvbandit(t, f.addrs, "--policy", policy, "--config", cfg,
			"--sync-nats", f.nats.URL(), "--replica-id", fmt.Sprintf("replica-%d", i))
		f.reps = append(f.reps, k)
		f.proxies = append(f.proxies, startProxy(t, k, envoysim.Config{}))
		f.alive = append(f.alive, true)
	}
	// Every replica hears its two peers before the test starts.
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	for i, k := range f.reps {
		err := poll(ctx, func() (bool, string) {
			st, err := k.replicaStatus(ctx)
			if err != nil {
				return false, err.Error()
			}
			return st.Connected && len(st.Peers) == 2, fmt.Sprintf("replica %d: connected %v, %d peers", i, st.Connected, len(st.Peers))
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// replicaStatus is the part of /debug/replicas the suite reads.
type replicaStatus struct {
	Enabled   bool   `json:"enabled"`
	Replica   string `json:"replica"`
	Connected bool   `json:"connected"`
	Peers     []struct {
		Replica string `json:"replica"`
	} `json:"peers"`
}

func (k *kvb) getJSON(ctx context.Context, path string, v any) error {
	req, err := http.NewRequestWithContext(ctx, "GET", "http://"+k.metricsAddr+path, nil)
	if err != nil {
		return err
	}
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", path, resp.Status)
	}
	return json.NewDecoder(resp.Body).Decode(v)
}

func (k *kvb) replicaStatus(ctx context.Context) (replicaStatus, error) {
	var st replicaStatus
	err := k.getJSON(ctx, "/debug/replicas", &st)
	return st, err
}

// inflightRow is one endpoint of /debug/endpoints.
type inflightRow struct {
	Address        string `json:"address"`
	InFlight       int64  `json:"inflight"`
	RemoteInFlight int64  `json:"remote_inflight"`
	FleetInFlight  int64  `json:"fleet_inflight"`
}

func (k *kvb) inflight(ctx context.Context) (map[string]inflightRow, error) {
	var body struct {
		Endpoints []inflightRow `json:"endpoints"`
	}
	if err := k.getJSON(ctx, "/debug/endpoints", &body); err != nil {
		return nil, err
	}
	m := map[string]inflightRow{}
	for _, r := range body.Endpoints {
		m[r.Address] = r
	}
	return m, nil
}

// live are the replicas still running.
func (f *replicaFleet) live() []*kvb {
	var out []*kvb
	for i, k := range f.reps {
		if f.alive[i] {
			out = append(out, k)
		}
	}
	return out
}

// converged reports whether every live replica's fleet in-flight equals,
// per endpoint, the truth: the sum of the live replicas' own (local)
// in-flight; want >= 0 also requires that truth in total.
func (f *replicaFleet) converged(ctx context.Context, want int64) (bool, string) {
	live := f.live()
	views := make([]map[string]inflightRow, len(live))
	for i, k := range live {
		v, err := k.inflight(ctx)
		if err != nil {
			return false, err.Error()
		}
		views[i] = v
	}
	truth := map[string]int64{}
	var total int64
	for _, v := range views {
		for a, r := range v {
			truth[a] += r.InFlight
			total += r.InFlight
		}
	}
	if want >= 0 && total != want {
		return false, fmt.Sprintf("local in-flight %d in total, want %d (%v)", total, want, truth)
	}
	for i, v := range views {
		for _, a := range f.addrs {
			if v[a].FleetInFlight != truth[a] || v[a].InFlight+v[a].RemoteInFlight != v[a].FleetInFlight {
				return false, fmt.Sprintf("replica %s sees %s at %+v, the truth is %d (all: %v)", live[i].grpcAddr, a, v[a], truth[a], truth)
			}
		}
	}
	return true, ""
}

// waitConverged polls converged until it holds or within passes, and
// returns how long it took.
func (f *replicaFleet) waitConverged(t *testing.T, what string, want int64, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), within)
	defer cancel()
	if err := poll(ctx, func() (bool, string) { return f.converged(ctx, want) }); err != nil {
		t.Fatalf("%s: not converged within %v: %v", what, within, err)
	}
	return time.Since(start)
}

// pick is a live replica's proxy chosen at random.
func (f *replicaFleet) pick() *envoysim.Proxy {
	for {
		if i := f.rng.IntN(len(f.reps)); f.alive[i] {
			return f.proxies[i]
		}
	}
}

// hold opens a streaming request through p that generates for minutes and
// returns once its first event arrived (the decision is in flight); cancel
// ends it.
type held struct {
	cancel context.CancelFunc
	resp   *http.Response
}

func (f *replicaFleet) hold(t *testing.T, p *envoysim.Proxy) *held {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	resp, rd := openStream(t, ctx, f.c, p.URL()+chatPath, streamRequest(10000))
	if _, err := rd.ReadString('\n'); err != nil {
		cancel()
		t.Fatal(err)
	}
	h := &held{cancel, resp}
	t.Cleanup(h.release)
	return h
}

func (h *held) release() {
	h.cancel()
	_, _ = io.Copy(io.Discard, h.resp.Body)
	h.resp.Body.Close()
}

// burstRequest is request i of a burst: a shared system prompt, then a
// question of its own.
func burstRequest(i int) []byte {
	b, _ := json.Marshal(map[string]any{"model": "test-model", "max_tokens": 50, "messages": []map[string]string{
		{"role": "system", "content": strings.Repeat("You are the support assistant of a large retailer; answer briefly and politely. ", 30)},
		{"role": "user", "content": fmt.Sprintf("question %d: where is my order number %d?", i, 1000+i)},
	}})
	return b
}

// streaming makes a JSON request body a streaming one ("stream": true), as
// chat clients and agents send them: the time to first token the replicas
// learn from is then the worker's prefill, not its whole answer.
func streaming(body []byte) []byte {
	return append([]byte(`{"stream":true,`), body[1:]...)
}

// burst sends n concurrent burst requests, request i through proxies[i],
// and returns how many each worker served.
func burst(t *testing.T, c *http.Client, proxies []*envoysim.Proxy) map[string]int {
	t.Helper()
	var mu sync.Mutex
	served := map[string]int{}
	var wg sync.WaitGroup
	errs := make(chan error, len(proxies))
	for i, p := range proxies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, err := http.NewRequestWithContext(t.Context(), "POST", p.URL()+chatPath, strings.NewReader(string(streaming(burstRequest(i)))))
			if err != nil {
				errs <- err
				return
			}
			req.Header.Set("Content-Type", "application/json")
			resp, err := c.Do(req)
			if err != nil {
				errs <- err
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				errs <- fmt.Errorf("burst request %d: %s", i, resp.Status)
				return
			}
			mu.Lock()
			served[resp.Header.Get(worker.HeaderWorker)]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	return served
}

// maxShare is the largest fraction of requests one worker served.
func maxShare(served map[string]int) float64 {
	n, top := 0, 0
	for _, v := range served {
		n += v
		top = max(top, v)
	}
	if n == 0 {
		return 0
	}
	return float64(top) / float64(n)
}

func sortedCounts(served map[string]int) []int {
	var out []int
	for _, v := range served {
		out = append(out, v)
	}
	slices.Sort(out)
	slices.Reverse(out)
	return out
}

// distance is how many requests apart two distributions are: the sum of
// the differences of their sorted per-worker counts (busiest against
// busiest, and so on).
func distance(a, b map[string]int) int {
	x, y := sortedCounts(a), sortedCounts(b)
	d := 0
	for i := range max(len(x), len(y)) {
		var u, v int
		if i < len(x) {
			u = x[i]
		}
		if i < len(y) {
			v = y[i]
		}
		d += max(u-v, v-u)
	}
	return d
}

// TestReplicas is issue 12's end-to-end suite: three active-active
// replicas over one nats-server share the fleet's load and learning, ride
// out NATS's death and a replica's, and end with nothing in flight.
func TestReplicas(t *testing.T) {
	const policy = "kvbandit"
	f := startReplicaFleet(t, policy)

	t.Run("burst spreads like one replica", func(t *testing.T) {
		// The same burst through one replica of its own (no sync), on
		// the same workers...
		one := startKvbandit(t, f.addrs, "--policy", policy)
		p := startProxy(t, one, envoysim.Config{})
		single := burst(t, f.c, slices.Repeat([]*envoysim.Proxy{p}, 64))
		one.waitReleased(t)
		one.terminate(t)
		one.waitExit(t, 30*time.Second)
		// ...and through the three synced replicas at random.
		var ps []*envoysim.Proxy
		for range 64 {
			ps = append(ps, f.pick())
		}
		shared := burst(t, f.c, ps)
		dist := distance(single, shared)
		t.Logf("burst of 64: one replica %v (max share %.2f), three synced replicas %v (max share %.2f); sorted counts differ by %d requests",
			sortedCounts(single), maxShare(single), sortedCounts(shared), maxShare(shared), dist)
		// One replica's own spread of this burst varies from run to run
		// (max share 0.33 to 0.50 seen): the tolerance covers that.
		const tolerance = 0.20
		if maxShare(shared) > maxShare(single)+tolerance {
			t.Errorf("three replicas piled the burst up: max share %.2f, one replica %.2f (tolerance %.2f)", maxShare(shared), maxShare(single), tolerance)
		}
		if len(shared) < len(single) {
			t.Errorf("three replicas used %d workers, one replica %d", len(shared), len(single))
		}
		f.waitConverged(t, "after the burst", 0, 10*time.Second)
	})

	t.Run("fleet in-flight equals the truth", func(t *testing.T) {
		var hs []*held
		for range 12 {
			hs = append(hs, f.hold(t, f.pick()))
		}
		took := f.waitConverged(t, "12 requests in flight", 12, time.Second)
		t.Logf("fleet in-flight equal to the truth on every replica %v after the 12th request started", took.Round(time.Millisecond))
		for _, h := range hs {
			h.release()
		}
		f.waitConverged(t, "released", 0, 10*time.Second)
	})

	t.Run("sessions keep their worker across replicas", func(t *testing.T) {
		const sessions, turns = 16, 6
		// The route of every turn is drawn up front: the goroutines do
		// not share the generator.
		route := make([][]*envoysim.Proxy, sessions)
		for s := range route {
			for range turns {
				route[s] = append(route[s], f.pick())
			}
		}
		served := make([][]string, sessions)
		var wg sync.WaitGroup
		errs := make(chan error, sessions)
		// Four sessions at a time on four workers: a session's worker is
		// rarely too busy to keep it, as on one replica.
		slots := make(chan struct{}, 4)
		for s := range sessions {
			wg.Add(1)
			go func() {
				defer wg.Done()
				slots <- struct{}{}
				defer func() { <-slots }()
				for turn := 1; turn <= turns; turn++ {
					req, _ := http.NewRequestWithContext(t.Context(), "POST", route[s][turn-1].URL()+chatPath, strings.NewReader(string(streaming(conversation(100+s, turn)))))
					req.Header.Set("Content-Type", "application/json")
					req.Header.Set("x-prefix-id", fmt.Sprintf("agent-%d", s))
					req.Header.Set("x-prefix-total-requests", fmt.Sprint(turns))
					resp, err := f.c.Do(req)
					if err != nil {
						errs <- err
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						errs <- fmt.Errorf("session %d turn %d: %s", s, turn, resp.Status)
						return
					}
					served[s] = append(served[s], resp.Header.Get(worker.HeaderWorker))
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		kept, homes := 0, map[string]int{}
		for s := range sessions {
			counts := map[string]int{}
			top, home := 0, ""
			for _, w := range served[s] {
				counts[w]++
				if counts[w] > top {
					top, home = counts[w], w
				}
			}
			kept += top
			homes[home]++
			if top < turns {
				t.Logf("session %d moved: %v", s, served[s])
			}
		}
		share := float64(kept) / float64(sessions*turns)
		t.Logf("agent sessions: %d of %d turns (%.1f%%) on their session's worker; sessions per worker %v", kept, sessions*turns, 100*share, sortedCounts(homes))
		// Through one replica these sessions keep 98-99% of their turns
		// on their worker; through three at random 87-98% (20 runs): a
		// replica whose own latency fit puts a low price on prefill
		// gives a turn's affinity credit little weight against the
		// speed factors (a known gap, docs/bench.md). Below 85% the
		// replicas have lost each other's sessions.
		if share < 0.85 {
			t.Errorf("only %.1f%% of the turns stayed on their session's worker, want >= 85%%", 100*share)
		}
		f.waitConverged(t, "after the sessions", 0, 10*time.Second)
	})

	t.Run("NATS killed and restarted", func(t *testing.T) {
		// Load: four clients send short requests through random
		// replicas until stopped; not one may fail.
		var sent, failed atomic.Int64
		var firstErr atomic.Value
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for g := range 4 {
			rng := rand.New(rand.NewPCG(42, uint64(g)))
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					p := f.proxies[rng.IntN(len(f.proxies))]
					err := func() error {
						req, _ := http.NewRequestWithContext(t.Context(), "POST", p.URL()+chatPath, strings.NewReader(string(chatRequest(400+i%50, `"max_tokens":4,`))))
						req.Header.Set("Content-Type", "application/json")
						resp, err := f.c.Do(req)
						if err != nil {
							return err
						}
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						if resp.StatusCode != http.StatusOK {
							return errors.New(resp.Status)
						}
						return nil
					}()
					sent.Add(1)
					if err != nil {
						failed.Add(1)
						firstErr.CompareAndSwap(nil, err)
					}
				}
			}()
		}
		stopLoad := sync.OnceFunc(func() { close(stop); wg.Wait() })
		defer stopLoad()
		waitSent := func(n int64) {
			t.Helper()
			ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
			defer cancel()
			if err := poll(ctx, func() (bool, string) { return sent.Load() >= n, fmt.Sprintf("%d requests sent", sent.Load()) }); err != nil {
				t.Fatal(err)
			}
		}
		waitSent(20)
		f.nats.Kill()
		killedAt := sent.Load()
		for i, k := range f.reps {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			err := poll(ctx, func() (bool, string) {
				s, err := k.scrape(ctx)
				if err != nil {
					return false, err.Error()
				}
				return metric(s, "kvbandit_sync_degraded", nil) == 1, fmt.Sprintf("replica %d: kvbandit_sync_degraded not 1", i)
			})
			cancel()
			if err != nil {
				t.Fatal(err)
			}
		}
		// Requests decided while NATS is down: peers learn of them only
		// from the snapshots after the restart.
		var hs []*held
		for range 6 {
			hs = append(hs, f.hold(t, f.pick()))
		}
		waitSent(killedAt + 20)
		stopLoad()
		if n := failed.Load(); n != 0 {
			t.Fatalf("%d of %d requests failed while NATS was down (first: %v)", n, sent.Load(), firstErr.Load())
		}
		t.Logf("%d requests, none failed, %d of them after nats-server was killed", sent.Load(), sent.Load()-killedAt)

		f.nats.Restart(t)
		took := f.waitConverged(t, "after the NATS restart", 6, 10*time.Second)
		t.Logf("converged %v after nats-server accepted connections again", took.Round(time.Millisecond))
		if took > 2*time.Second {
			t.Errorf("convergence after the NATS restart took %v, want <= 2 s", took)
		}
		for i, k := range f.reps {
			s, err := k.scrape(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if v := metric(s, "kvbandit_sync_degraded", nil); v != 0 {
				t.Errorf("replica %d: kvbandit_sync_degraded %v after converging", i, v)
			}
		}
		for _, h := range hs {
			h.release()
		}
		f.waitConverged(t, "released", 0, 10*time.Second)
	})

	t.Run("a SIGKILLed replica's load expires", func(t *testing.T) {
		var hs []*held
		for i := range 9 {
			hs = append(hs, f.hold(t, f.proxies[i%3]))
		}
		f.waitConverged(t, "9 requests in flight", 9, 5*time.Second)
		f.reps[2].kill(t)
		f.alive[2] = false
		took := f.waitConverged(t, "after replica-2's death", 6, 10*time.Second)
		t.Logf("replica-2's 3 decisions gone from its peers %v after SIGKILL (peer TTL %v)", took.Round(time.Millisecond), replicasPeerTTL)
		// Its peers last heard it before the kill and sweep every
		// min(heartbeat, TTL/4): the bound is the TTL plus one sweep, plus
		// slack for a loaded machine.
		if bound := replicasPeerTTL + min(replicasHeartbeat, replicasPeerTTL/4) + time.Second; took > bound {
			t.Errorf("the dead replica's load lasted %v, want within the peer TTL %v (bound %v)", took, replicasPeerTTL, bound)
		}
		for _, h := range hs {
			h.release()
		}
		f.waitConverged(t, "released", 0, 10*time.Second)
	})

	// Nothing in flight anywhere at the end, local or remote.
	f.waitConverged(t, "at the end", 0, 10*time.Second)
}
