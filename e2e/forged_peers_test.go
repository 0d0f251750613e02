package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// Issue 22's forged-peer cases, re-run with credentials enforced: three
// `kvbandit serve` replicas (the kvbandit policy, the admission queue on)
// share state over a real nats-server that requires a user and password,
// in front of four workers, under real traffic through envoysim. A rogue
// peer holds the replicas' own credentials (a nats.go client speaking
// routing/sync/wire) and tries each attack of the issue while the traffic
// runs; every phase is compared with the same traffic without it.
//
// Goals (issue 22): no 429 caused by it, routes spread within 10
// percentage points of the run without it, what it taught gone within the
// peer TTL after it leaves, RSS growth < 50 MiB, < 100 log lines a
// minute from it, a real new replica admitted within 5 s.

const (
	forgedPool      = "default"
	forgedPrefix    = "kvbandit." + forgedPool
	forgedPeerTTL   = 1500 * time.Millisecond
	forgedClients   = 16 // concurrent clients of the traffic
	forgedMaxTokens = 20 // tokens per response
	forgedSpreadTol = 0.10
)

// forgedTokenTimes are the workers' times per token, fastest first: a
// response takes 0.3 to 0.7 s.
var forgedTokenTimes = []time.Duration{15 * time.Millisecond, 20 * time.Millisecond, 27 * time.Millisecond, 35 * time.Millisecond}

// forgedFleet is the suite's deployment.
type forgedFleet struct {
	nats    *natsenv.Server
	ws      []*worker.Worker
	addrs   []string
	cfg     string // the replicas' config file
	policy  string
	reps    []*kvb
	proxies []*envoysim.Proxy
	c       *http.Client
}

func startForgedFleet(t *testing.T, policy string) *forgedFleet {
	t.Helper()
	f := &forgedFleet{nats: startSyncNATS(t), c: httpClient(t), policy: policy}
	// Workers of four speeds: the bandit learns a clear ranking, so its
	// spread is about the same from one phase to the next (on identical
	// workers it ranks them by noise, and the busiest one changes).
	for _, d := range forgedTokenTimes {
		ws, addrs := startWorkers(t, 1, worker.Config{TokenDelay: d})
		f.ws, f.addrs = append(f.ws, ws...), append(f.addrs, addrs...)
	}
	f.cfg = syncConfigFile(t, fmt.Sprintf("  peer_ttl_ms: %d\n  heartbeat_interval_ms: 250\n  snapshot_interval_ms: 500\n", forgedPeerTTL.Milliseconds()))
	for i := range 3 {
		f.addReplica(t, fmt.Sprintf("replica-%d", i))
	}
	f.waitPeers(t, 15*time.Second, f.reps, 2)
	return f
}

// addReplica starts one more replica with its envoysim.
func (f *forgedFleet) addReplica(t *testing.T, id string) *kvb {
	t.Helper()
	k := startKvbandit(t, f.addrs, "--policy", f.policy, "--config", f.cfg, "--router-queue-threshold", "1",
		"--sync-nats", f.nats.URL(), "--replica-id", id)
	f.reps = append(f.reps, k)
	f.proxies = append(f.proxies, startProxy(t, k, envoysim.Config{}))
	return k
}

// peersOf lists the replica ids k hears from.
func peersOf(ctx context.Context, k *kvb) ([]string, error) {
	var st struct {
		Peers []struct {
			Replica string `json:"replica"`
		} `json:"peers"`
	}
	if err := k.getJSON(ctx, "/debug/replicas", &st); err != nil {
		return nil, err
	}
	var ids []string
	for _, p := range st.Peers {
		ids = append(ids, p.Replica)
	}
	return ids, nil
}

// waitPeers waits until every replica of reps hears at least n peers.
func (f *forgedFleet) waitPeers(t *testing.T, within time.Duration, reps []*kvb, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), within)
	defer cancel()
	for i, k := range reps {
		if err := poll(ctx, func() (bool, string) {
			ids, err := peersOf(ctx, k)
			if err != nil {
				return false, err.Error()
			}
			return len(ids) >= n, fmt.Sprintf("replica %d hears %v", i, ids)
		}); err != nil {
			t.Fatal(err)
		}
	}
}

// phase is what one run of the traffic saw.
type phase struct {
	name     string
	took     time.Duration
	requests int
	served   map[string]int // by worker
	early    map[string]int // by worker, in the phase's first 3 s
	statuses map[int]int
	failed   int     // transport errors
	lines    int     // log lines the chattiest replica wrote during the phase
	rssGrow  float64 // MiB, the largest growth of a replica's RSS
}

func (p *phase) share(w string) float64 {
	if p.requests == 0 {
		return 0
	}
	return float64(p.served[w]) / float64(p.requests)
}

// busiest is the largest share of the requests one worker served. The
// spread is compared by it: which worker is busiest changes from run to
// run (the bandit's speed factors, learnt from noisy timings, rank
// identical workers differently), how busy the busiest one is much less,
// and herding shows there first (all routes to one endpoint: 100%).
func (p *phase) busiest() float64 {
	top := 0.0
	for w := range p.served {
		top = max(top, p.share(w))
	}
	return top
}

// spreadGap is how many shares of the requests p's busiest worker (or
// target, the worker an attack favours, when given) takes beyond base's
// busiest.
func spreadGap(p, base *phase, target string) float64 {
	gap := p.busiest() - base.busiest()
	if target != "" {
		gap = max(gap, p.share(target)-base.busiest())
	}
	return max(gap, 0)
}

func (p *phase) String() string {
	var parts []string
	keys := make([]string, 0, len(p.served))
	for w := range p.served {
		keys = append(keys, w)
	}
	slices.Sort(keys)
	for _, w := range keys {
		parts = append(parts, fmt.Sprintf("%.0f%%", 100*p.share(w)))
	}
	return fmt.Sprintf("%s: %d requests in %v, spread [%s], statuses %v, %d transport errors, %d log lines from the chattiest replica (%.0f a minute), RSS +%.1f MiB at most",
		p.name, p.requests, p.took.Round(100*time.Millisecond), strings.Join(parts, " "), p.statuses, p.failed, p.lines,
		float64(p.lines)/p.took.Minutes(), p.rssGrow)
}

// rssMiB is the process's resident set in MiB.
func rssMiB(pid int) float64 {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}

func (k *kvb) logLines() int {
	k.out.mu.Lock()
	defer k.out.mu.Unlock()
	return strings.Count(k.out.b.String(), "\n")
}

// traffic runs forgedClients clients for d through the first three
// replicas' proxies (one at random per request, seeded), while attack (if
// any) runs; attack's context ends with the traffic.
func (f *forgedFleet) traffic(t *testing.T, name string, d time.Duration, seed uint64, attack func(ctx context.Context)) *phase {
	t.Helper()
	p := &phase{name: name, served: map[string]int{}, early: map[string]int{}, statuses: map[int]int{}}
	reps := f.reps[:3]
	lines0, rss0 := make([]int, len(reps)), make([]float64, len(reps))
	for i, k := range reps {
		lines0[i], rss0[i] = k.logLines(), rssMiB(k.cmd.Process.Pid)
	}
	ctx, cancel := context.WithCancel(t.Context())
	var attacking sync.WaitGroup
	if attack != nil {
		attacking.Add(1)
		go func() { defer attacking.Done(); attack(ctx) }()
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	end := start.Add(d)
	var peak [3]atomic.Uint64 // MiB x 1000
	wg.Add(1)
	go func() { // RSS, sampled
		defer wg.Done()
		for time.Now().Before(end) {
			for i, k := range reps {
				v := uint64(rssMiB(k.cmd.Process.Pid) * 1000)
				if v > peak[i].Load() {
					peak[i].Store(v)
				}
			}
			time.Sleep(200 * time.Millisecond)
		}
	}()
	for c := range forgedClients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			for n := 0; time.Now().Before(end); n++ {
				px := f.proxies[rng.IntN(len(reps))]
				sent := time.Now()
				status, w, err := f.chat(ctx, px, fmt.Sprintf("%s-%d-%d-%d", name, c, n, rng.Uint64()))
				mu.Lock()
				if err == nil && status == http.StatusOK && sent.Sub(start) < 3*time.Second {
					p.early[w]++
				}
				p.requests++
				if err != nil {
					p.failed++
				} else {
					p.statuses[status]++
					if status == http.StatusOK {
						p.served[w]++
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	p.took = time.Since(start)
	cancel()
	attacking.Wait()
	for i, k := range reps {
		p.lines = max(p.lines, k.logLines()-lines0[i])
		p.rssGrow = max(p.rssGrow, float64(peak[i].Load())/1000-rss0[i])
	}
	t.Log(p)
	return p
}

// chat sends one streaming chat request with a prompt of its own (no
// prefix reuse: the spread is the load balance) and returns its status
// and serving worker.
func (f *forgedFleet) chat(ctx context.Context, px *envoysim.Proxy, tag string) (int, string, error) {
	body, _ := json.Marshal(map[string]any{"model": "test-model", "stream": true, "max_tokens": forgedMaxTokens,
		"messages": []map[string]string{{"role": "user", "content": "request " + tag + ": " + strings.Repeat(tag+" ", 8)}}})
	req, err := http.NewRequestWithContext(context.WithoutCancel(ctx), "POST", px.URL()+chatPath, strings.NewReader(string(body)))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := f.c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, resp.Header.Get(worker.HeaderWorker), err
}

// rogue is an authenticated client that speaks the sync protocol.
type rogue struct {
	nc  *nats.Conn
	seq atomic.Uint64
}

func newRogue(t *testing.T, srv *natsenv.Server) *rogue {
	t.Helper()
	nc, err := nats.Connect(srv.URL(), append(srv.ClientOptions(), nats.Name("rogue"))...)
	if err != nil {
		t.Fatalf("the rogue, with the replicas' credentials: %v", err)
	}
	t.Cleanup(nc.Close)
	return &rogue{nc: nc}
}

// publish sends m as replica (epoch) and counts it.
func (r *rogue) publish(replica string, epoch uint64, m *wire.Message) {
	m.Pool, m.Replica, m.Epoch, m.Seq = forgedPool, replica, epoch, r.seq.Add(1)
	b, err := wire.Append(nil, m)
	if err != nil {
		panic(err) // the test built a bad message
	}
	_ = r.nc.Publish(forgedPrefix+"."+m.Kind.String(), b)
}

func (r *rogue) heartbeat(replica string, epoch uint64) {
	r.publish(replica, epoch, &wire.Message{Kind: wire.KindHeartbeat, Heartbeat: wire.Heartbeat{InFlight: 1000, Interval: 500}})
}

// every calls fn every d until ctx ends.
func every(ctx context.Context, d time.Duration, fn func()) {
	tk := time.NewTicker(d)
	defer tk.Stop()
	for {
		fn()
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
		}
	}
}

// counters sums a metric over the first three replicas.
func (f *forgedFleet) counters(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	var sum float64
	for _, k := range f.reps[:3] {
		s, err := k.scrape(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		sum += metric(s, name, labels)
	}
	return sum
}

// reasons sums a counter over the first three replicas by its reason.
func (f *forgedFleet) reasons(t *testing.T, name string) map[string]float64 {
	t.Helper()
	out := map[string]float64{}
	for _, k := range f.reps[:3] {
		s, err := k.scrape(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range s {
			if x.name == name && x.value != 0 {
				out[x.labels["reason"]] += x.value
			}
		}
	}
	return out
}

// speedFactors are each replica's learned speed factors by endpoint.
func (f *forgedFleet) speedFactors(t *testing.T) []map[string]float64 {
	t.Helper()
	var out []map[string]float64
	for _, k := range f.reps[:3] {
		s, err := k.scrape(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]float64{}
		for _, x := range s {
			if x.name == "kvbandit_posterior_speed_factor" {
				m[x.labels["endpoint"]] = x.value
			}
		}
		out = append(out, m)
	}
	return out
}

// learnedStateWithinPeerTTL is the goal "learned state back to normal
// within the peer TTL after it leaves", as far as this branch (h-trust)
// guarantees it: the rogue's outcomes are dropped before they reach the
// policy (checked by the caller from the drop counters), so the endpoint
// it praised (1 us TTFTs) did not become the fast one and the ones it
// slandered (4,000 s) did not become the slow ones. Learnt, those
// outcomes would take the factors to extremes (a 1 us TTFT against
// hundreds of milliseconds); the honest traffic moves them too (timings
// on a loaded machine), hence the 2x margin around the range the
// replicas had before. HOOK for the lead: with h-learn's per-peer undo
// merged (Engine.ForgetPeer), also let a rogue's outcomes through (a peer
// whose Starts the workers vouch for) and assert here that the factors
// return to before within forgedPeerTTL of its last message.
func learnedStateWithinPeerTTL(t *testing.T, before, after []map[string]float64, praised string, slandered []string) {
	t.Helper()
	for i := range before {
		lo, hi := math.Inf(1), 0.0
		for _, f := range before[i] {
			lo, hi = min(lo, f), max(hi, f)
		}
		if a := after[i][praised]; a < lo/2 {
			t.Errorf("replica %d: the praised endpoint %s got fast: speed factor %.3f (the fleet's were %.3f to %.3f)", i, praised, a, lo, hi)
		}
		for _, ep := range slandered {
			if a := after[i][ep]; a > 2*hi {
				t.Errorf("replica %d: the slandered endpoint %s got slow: speed factor %.3f (the fleet's were %.3f to %.3f)", i, ep, a, lo, hi)
			}
		}
	}
}

// TestForgedPeers runs issue 22's forged-peer cases against three
// replicas with NATS credentials enforced. The load cases (forged
// starts, an epoch flood, fake ids) run on replicas with the
// least_loaded policy, whose spread depends on load alone, so that it can
// be compared with the run without the attack to a few points; the
// forged outcomes run on replicas with the kvbandit policy, whose speed
// factors they target (its spread follows timings, which on a loaded
// machine are noise: only the favoured worker is compared there).
// Figures: docs/security.md.
func TestForgedPeers(t *testing.T) {
	t.Run("load", forgedLoadCases)
	t.Run("learning", forgedLearningCases)
}

// baseline runs warm (not measured; 0: none), then the traffic without an
// attack, and checks that the honest replicas were not refuted.
func (f *forgedFleet) baseline(t *testing.T, warm, d time.Duration) *phase {
	t.Helper()
	if warm > 0 {
		f.traffic(t, "warm-up", warm, 99, nil)
	}
	base := f.traffic(t, "baseline", d, 1, nil)
	if base.statuses[http.StatusOK] != base.requests || base.failed != 0 {
		t.Fatalf("the baseline itself failed requests: %v", base)
	}
	f.honest(t, "warm-up and baseline")
	return base
}

// honest checks honest replicas under real load against the real
// workers' counts: nothing refuted, nobody quarantined, nothing refused
// but outcomes no worker count covered (outcome_unvouched), and at
// least 95% of the peers' outcomes held for the workers' counts of
// finished requests learnt.
func (f *forgedFleet) honest(t *testing.T, what string) {
	t.Helper()
	refuted, q := f.counters(t, "kvbandit_sync_refuted_total", nil), f.counters(t, "kvbandit_sync_quarantined_total", nil)
	reasons := f.reasons(t, "kvbandit_sync_rejected_total")
	vouched := f.counters(t, "kvbandit_sync_outcomes_vouched_total", nil)
	unvouched := reasons["outcome_unvouched"]
	other := -unvouched
	for _, n := range reasons {
		other += n
	}
	share := vouched / max(vouched+unvouched, 1)
	t.Logf("%s (%s), honest replicas only: %v refuted, %v quarantined, refused by reason %v; peers' outcomes learnt with the workers' counts: %v of %v (%.1f%%)",
		what, f.policy, refuted, q, reasons, vouched, vouched+unvouched, 100*share)
	if refuted != 0 || q != 0 || other != 0 {
		t.Errorf("%s: honest replicas were refuted (%v), quarantined (%v) or refused (%v)", what, refuted, q, other)
	}
	if vouched == 0 || share < 0.95 {
		t.Errorf("%s: the honest replicas learnt %.1f%% of their peers' outcomes (%v), want at least 95%%", what, 100*share, vouched)
	}
}

// checkPhase checks an attack's phase against the baseline: no 429, no
// failed request, the favoured worker (target, if any) and, with busiest,
// the busiest worker within forgedSpreadTol of the baseline's busiest,
// RSS growth < 50 MiB, < 100 more log lines a minute.
func checkPhase(t *testing.T, p, base *phase, target string, busiest bool) {
	t.Helper()
	if n := p.statuses[http.StatusTooManyRequests]; n > 0 {
		t.Errorf("%s: %d requests answered 429", p.name, n)
	}
	if p.statuses[http.StatusOK] != p.requests-p.failed || p.failed > 0 {
		t.Errorf("%s: requests failed: %v", p.name, p)
	}
	gap := max(p.share(target)-base.busiest(), 0)
	if busiest {
		gap = spreadGap(p, base, target)
	}
	if gap > forgedSpreadTol {
		t.Errorf("%s: the busiest worker (or the one it favours) took %.1f points more than the baseline's busiest, %.0f%% (goal <= %.0f)", p.name, 100*gap, 100*base.busiest(), 100*forgedSpreadTol)
	} else {
		t.Logf("%s: busiest worker %.0f%%, favoured %.0f%%, baseline's busiest %.0f%%: within %.1f points (goal <= %.0f)", p.name,
			100*p.busiest(), 100*p.share(target), 100*base.busiest(), 100*gap, 100*forgedSpreadTol)
	}
	if p.rssGrow >= 50 {
		t.Errorf("%s: a replica's RSS grew %.1f MiB (goal < 50)", p.name, p.rssGrow)
	}
	if rate := float64(p.lines-base.lines) / p.took.Minutes(); rate >= 100 {
		t.Errorf("%s: %.0f more log lines a minute than the baseline (goal < 100)", p.name, rate)
	}
}

// forgedLoadCases: forged starts, a heartbeat flood with a real peer's id
// and alternating epochs, fake ids while a real replica joins.
func forgedLoadCases(t *testing.T) {
	f := startForgedFleet(t, "least_loaded")
	t.Run("unauthenticated client shut out", func(t *testing.T) {
		for name, opts := range map[string][]nats.Option{"no credentials": nil, "wrong password": {nats.UserInfo(syncNATSUser, "guess")}} {
			nc, err := nats.Connect(f.nats.URL(), append(opts, nats.Timeout(5*time.Second), nats.NoReconnect())...)
			if err == nil {
				nc.Close()
				t.Fatalf("%s: connected", name)
			}
			if !errors.Is(err, nats.ErrAuthorization) {
				t.Errorf("%s: %v, want nats.ErrAuthorization", name, err)
			}
		}
	})

	base := f.baseline(t, 0, 8*time.Second)
	t.Run("forged starts", func(t *testing.T) { forgedStarts(t, f, base) })
	t.Run("heartbeat flood with a real peer's id", func(t *testing.T) { epochFlood(t, f, base) })
	t.Run("fake ids while a real replica joins", func(t *testing.T) { fakeIDsWhileJoining(t, f) })
}

// forgedStarts: one forged peer claims 600 decisions of the largest prompt
// a replica accepts on every endpoint but the slowest (issue 22's first
// case).
func forgedStarts(t *testing.T, f *forgedFleet, base *phase) {
	workers := f.addrs
	// One forged peer claims 600 decisions of the largest prompt a
	// replica accepts (--max-body-bytes, 16 MiB: 16,777,216 tokens)
	// on every endpoint but the slowest, with a 5 min TTL, re-sent as
	// its snapshot every second, with heartbeats.
	r := newRogue(t, f.nats)
	var starts []wire.Start
	for e, ep := range workers[:3] {
		for i := range 600 { // 1,800 in all: within the per-peer cap (2 x --max-inflight)
			starts = append(starts, wire.Start{ID: uint64(e*1000 + i + 1), Endpoint: ep, DPRank: -1, BlockSize: 16, ISL: 16 << 20, TTL: 300000})
		}
	}
	var reaction [3]atomic.Int64 // ms from the first forged start to the replica's quarantine
	p := f.traffic(t, "forged starts", 10*time.Second, 2, func(ctx context.Context) {
		t0 := time.Now()
		go every(ctx, 100*time.Millisecond, func() {
			for i, k := range f.reps[:3] {
				if reaction[i].Load() != 0 {
					continue
				}
				if s, err := k.scrape(ctx); err == nil && metric(s, "kvbandit_sync_quarantined_total", nil) > 0 {
					reaction[i].Store(time.Since(t0).Milliseconds())
				}
			}
		})
		every(ctx, 500*time.Millisecond, func() {
			r.heartbeat("rogue-starts", 7)
			r.publish("rogue-starts", 7, &wire.Message{Kind: wire.KindSnapshot, Snapshot: starts})
		})
	})
	t.Logf("forged starts: quarantined on the three replicas %d, %d and %d ms after its first message", reaction[0].Load(), reaction[1].Load(), reaction[2].Load())
	early := 0
	for _, n := range p.early {
		early += n
	}
	t.Logf("forged starts: the unforged worker served %d of the %d requests sent in the first 3 s (baseline share %.0f%%)",
		p.early[workers[3]], early, 100*base.share(workers[3]))
	checkPhase(t, p, base, workers[3], true)
	refuted, quarantined := f.counters(t, "kvbandit_sync_refuted_total", nil), f.counters(t, "kvbandit_sync_quarantined_total", nil)
	capped := f.counters(t, "kvbandit_sync_rejected_total", map[string]string{"reason": "peer_inflight"})
	t.Logf("forged starts: %v refuted, %v quarantines, %v over the per-peer cap (3 replicas)", refuted, quarantined, capped)
	if quarantined != 3 || refuted == 0 {
		t.Errorf("want the forged peer (only) refuted and quarantined on every replica: %v refuted, %v quarantines", refuted, quarantined)
	}
}

// epochFlood: heartbeats with a real replica's id and alternating epochs,
// as fast as the client can (issue 22's third case).
func epochFlood(t *testing.T, f *forgedFleet, base *phase) {
	// As fast as the client can for 10 s: replica-1's id with
	// alternating epochs (each one was a "restart").
	r := newRogue(t, f.nats)
	var sent atomic.Int64
	var flips [2][]byte
	for e := range flips {
		b, err := wire.Append(nil, &wire.Message{Kind: wire.KindHeartbeat, Pool: forgedPool, Replica: "replica-1", Epoch: uint64(e + 1), Seq: 1,
			Heartbeat: wire.Heartbeat{Interval: 250}})
		if err != nil {
			t.Fatal(err)
		}
		flips[e] = b
	}
	t.Logf("epoch flood: %d-byte heartbeats", len(flips[0]))
	p := f.traffic(t, "epoch flood", 10*time.Second, 4, func(ctx context.Context) {
		var wg sync.WaitGroup
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; ctx.Err() == nil; i++ {
					if r.nc.Publish(forgedPrefix+".heartbeat", flips[i%2]) == nil {
						sent.Add(1)
					}
				}
			}()
		}
		wg.Wait()
	})
	checkPhase(t, p, base, "", true)
	conflicts := f.counters(t, "kvbandit_sync_dropped_total", map[string]string{"reason": "epoch_conflict"})
	slow := f.counters(t, "kvbandit_sync_dropped_total", map[string]string{"reason": "slow_consumer"})
	t.Logf("epoch flood: %d heartbeats sent (%.0f/s); dropped as epoch_conflict %v, by NATS as slow_consumer %v (3 replicas)",
		sent.Load(), float64(sent.Load())/p.took.Seconds(), conflicts, slow)
	for _, k := range f.reps[:3] {
		if strings.Count(k.out.String(), "peer replica restarted") > 0 {
			t.Errorf("a forged epoch was taken for replica-1's restart")
		}
	}
	f.waitPeers(t, 10*time.Second, f.reps[:3], 2) // replica-1 is still everyone's peer
	if q := f.counters(t, "kvbandit_sync_quarantined_total", nil); q != 3 {
		t.Errorf("%v quarantines: an honest replica was quarantined (3 are the forged starts' peer's)", q)
	}
}

// fakeIDsWhileJoining: 300 fake ids at 250 messages a second while a real
// replica joins (issue 22's fourth case).
func fakeIDsWhileJoining(t *testing.T, f *forgedFleet) {
	// 300 fake replica ids, one heartbeat each in turn, 250 a second,
	// while replica-3 starts.
	r := newRogue(t, f.nats)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go every(ctx, 4*time.Millisecond, func() {
		n := r.seq.Load()
		r.heartbeat(fmt.Sprintf("fake-%d", n%300), 1)
	})
	// The fake ids fill the 256 peer slots (each is heard every 1.2 s and
	// forgotten after the 1.5 s peer TTL: about 375 are live at once).
	ctx1, cancel1 := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel1()
	if err := poll(ctx1, func() (bool, string) {
		ids, err := peersOf(ctx1, f.reps[0])
		return err == nil && len(ids) >= 256, fmt.Sprintf("replica-0 hears %d peers", len(ids))
	}); err != nil {
		t.Fatalf("the fake ids did not fill the peer slots: %v", err)
	}
	joined := time.Now()
	k := f.addReplica(t, "replica-3")
	ready := time.Since(joined)
	ctx2, cancel2 := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel2()
	err := poll(ctx2, func() (bool, string) {
		for i, old := range f.reps[:3] {
			ids, err := peersOf(ctx2, old)
			if err != nil {
				return false, err.Error()
			}
			if !slices.Contains(ids, "replica-3") {
				return false, fmt.Sprintf("replica-%d hears %d peers, not replica-3", i, len(ids))
			}
		}
		return true, ""
	})
	took := time.Since(joined) - ready
	if err != nil {
		t.Errorf("replica-3 not admitted by every replica within 5 s of its start: %v", err)
	}
	t.Logf("fake ids: with the 256 peer slots full of fake ids, replica-3 ready %v after its start, admitted by all three replicas %v later", ready.Round(10*time.Millisecond), took.Round(10*time.Millisecond))
	cancel()
	k.terminate(t)
	k.waitExit(t, 30*time.Second)
}

// forgedLearningCases: forged outcomes, against the kvbandit policy's
// learned speed factors.
func forgedLearningCases(t *testing.T) {
	f := startForgedFleet(t, "kvbandit")
	workers := f.addrs
	// The bandit learns the workers' speeds first (not measured).
	base := f.baseline(t, 5*time.Second, 8*time.Second)
	t.Run("forged outcomes", func(t *testing.T) {
		// 1 us TTFT on the slowest endpoint, 4,000 s on the others, as
		// successes: for decisions never started, and for decisions
		// started and ended in the same batch (no worker ever ran them:
		// the workers' counts of finished requests do not cover them).
		r := newRogue(t, f.nats)
		before := f.speedFactors(t)
		outcomeReasons := []string{"outcome_unmatched", "outcome_unvouched", "outcome_implausible", "outcome_duplicate", "outcome_mismatch", "outcome_refuted",
			"outcome_pending_full", "outcome_peer_gone", "quarantined"}
		vouched0 := f.counters(t, "kvbandit_sync_outcomes_vouched_total", nil)
		q0 := f.counters(t, "kvbandit_sync_quarantined_total", nil)
		dropped := func() (n float64) {
			for _, r := range outcomeReasons {
				n += f.counters(t, "kvbandit_sync_rejected_total", map[string]string{"reason": r})
			}
			return n
		}
		rejected0 := dropped()
		var sent atomic.Int64
		id := uint64(0)
		p := f.traffic(t, "forged outcomes", 8*time.Second, 3, func(ctx context.Context) {
			every(ctx, 100*time.Millisecond, func() {
				r.heartbeat("rogue-outcomes", 9)
				var items []wire.Item
				for i := range 98 {
					ep, ttft := workers[3], uint32(1) // the slowest, praised
					if i%2 == 1 {
						ep, ttft = workers[i%3], 4000e6
					}
					id++
					o := wire.Outcome{ID: id, Endpoint: ep, DPRank: -1, Kind: 0, Status: 200, TTFTMicros: ttft, LatencyMicros: ttft,
						PromptTokens: 100, CompletionTokens: 20, CachedTokens: -1, BlockSize: 16, ISL: 100}
					if i%7 == 0 {
						items = append(items, wire.StartItem(wire.Start{ID: id, Endpoint: ep, DPRank: -1, BlockSize: 16, ISL: 100, TTL: 60000}), wire.EndItem(id))
					}
					items = append(items, wire.OutcomeItem(o))
				}
				sent.Add(98)
				r.publish("rogue-outcomes", 9, &wire.Message{Kind: wire.KindBatch, Batch: items})
			})
		})
		checkPhase(t, p, base, workers[3], false)
		r.nc.Close() // it leaves
		time.Sleep(forgedPeerTTL + 500*time.Millisecond)
		after := f.speedFactors(t)
		gone := dropped() - rejected0
		reasons := f.reasons(t, "kvbandit_sync_rejected_total")
		// "quarantined" counts the refused Starts of the rogue too.
		t.Logf("forged outcomes: %d sent, %v items dropped over 3 replicas (%.1f%% of 3 x sent; all reasons so far %v); %v peers' outcomes learnt with the workers' counts meanwhile, the honest replicas' own being at most 2 x %d (each request's outcome reaches two peers); %v quarantines; speed factors before %v after %v",
			sent.Load(), gone, 100*gone/float64(3*sent.Load()), reasons, f.counters(t, "kvbandit_sync_outcomes_vouched_total", nil)-vouched0, p.requests,
			f.counters(t, "kvbandit_sync_quarantined_total", nil)-q0, before, after)
		if gone < 0.95*float64(3*sent.Load()) {
			t.Errorf("only %v of %d forged outcomes (x3 replicas) dropped", gone, 3*sent.Load())
		}
		learnedStateWithinPeerTTL(t, before, after, workers[3], workers[:3])
	})
}
