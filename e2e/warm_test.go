package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/internal/simworker"
	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
	simmodel "github.com/kvbandit/kvbandit/routing/sim"
)

// The warm start (issue 22): three real `kvbandit serve` replicas on one
// real nats-server in front of four simulated vLLM workers that publish
// KV events (internal/simworker: a bound PUB socket each, vLLM's wire
// format, sequence numbers from 0). Every replica subscribes to every
// worker before the first request, so all three trust every worker's
// view. Under load, one replica is stopped and started again: it
// subscribes after the workers started, which without the warm start
// leaves every view untrusted until each worker's cache has turned over
// (4,096 blocks stored per worker, far beyond this test). With it, the
// restarted replica takes a peer's state over NATS.

const warmWorkers = 4

// warmFleet is the suite's deployment.
type warmFleet struct {
	nats    *natsenv.Server
	workers []*simworker.Server
	addrs   []string
	cfg     string
	reps    []*kvb
	proxies []string // each replica's --http-addr, as a base URL
	c       *http.Client
}

func startWarmFleet(t *testing.T) *warmFleet {
	t.Helper()
	f := &warmFleet{nats: natsenv.Start(t, natsenv.Options{}), c: httpClient(t)}
	var recs []map[string]any
	for range warmWorkers {
		sw, err := simworker.New(simworker.Config{Addr: freeAddr(t), KVEventsAddr: "tcp://127.0.0.1:0", SpeedUp: 20,
			Worker: simmodel.WorkerConfig{BlockSize: 16, KVBlocks: 4096}})
		if err != nil {
			t.Fatal(err)
		}
		if err := sw.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sw.Close() })
		f.workers = append(f.workers, sw)
		f.addrs = append(f.addrs, sw.Addr())
		recs = append(recs, map[string]any{"address": sw.Addr(), "engine": "vllm", "models": []string{simworker.DefaultModel},
			"block_size": 16, "kv_events": sw.KVEventsAddr()})
	}
	cfg := map[string]any{"endpoints": recs, "sync": map[string]any{
		"heartbeat_interval_ms": replicasHeartbeat.Milliseconds(), "peer_ttl_ms": replicasPeerTTL.Milliseconds(),
		"snapshot_interval_ms": replicasSnapshot.Milliseconds()}}
	b, err := json.Marshal(cfg) // JSON is YAML
	if err != nil {
		t.Fatal(err)
	}
	f.cfg = filepath.Join(t.TempDir(), "kvbandit.yaml")
	if err := os.WriteFile(f.cfg, b, 0o600); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		k, url := f.startReplica(t, i)
		f.reps, f.proxies = append(f.reps, k), append(f.proxies, url)
	}
	for i := range f.reps {
		f.waitTrusted(t, i, 15*time.Second)
	}
	return f
}

// startReplica starts replica i (its id replica-i), with extra flags.
func (f *warmFleet) startReplica(t *testing.T, i int, extra ...string) (*kvb, string) {
	t.Helper()
	httpAddr := freeAddr(t)
	args := append([]string{"--policy", "kvbandit", "--config", f.cfg, "--sync-nats", f.nats.URL(),
		"--replica-id", fmt.Sprintf("replica-%d", i), "--http-addr", httpAddr, "--scrape-interval", "200ms"}, extra...)
	return startKvbandit(t, nil, args...), "http://" + httpAddr
}

// trusted reports how many workers replica k trusts.
func (f *warmFleet) trusted(ctx context.Context, k *kvb) (int, error) {
	ss, err := k.scrape(ctx)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, a := range f.addrs {
		if metric(ss, "kvbandit_kv_events_trusted", map[string]string{"endpoint": a}) == 1 {
			n++
		}
	}
	return n, nil
}

// waitTrusted waits until replica i trusts every worker, or fails.
func (f *warmFleet) waitTrusted(t *testing.T, i int, within time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), within)
	defer cancel()
	err := poll(ctx, func() (bool, string) {
		n, err := f.trusted(ctx, f.reps[i])
		if err != nil {
			return false, err.Error()
		}
		return n == warmWorkers, fmt.Sprintf("replica %d trusts %d of %d workers", i, n, warmWorkers)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// tokenBody is a completion whose prompt is token ids (the workers take
// them as they are and kvbandit hashes the same ids).
func tokenBody(ids []uint32, maxTokens int) []byte {
	b, _ := json.Marshal(map[string]any{"model": simworker.DefaultModel, "prompt": ids, "max_tokens": maxTokens})
	return b
}

func seqIDs(seed uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed*100_000 + uint32(i) + 1
	}
	return out
}

// post sends body to url and returns the status and the endpoint that
// served it (or would: /v1/route).
func (f *warmFleet) post(ctx context.Context, url string, body []byte) (int, string, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, "POST", url, strings.NewReader(string(body)))
	if err != nil {
		return 0, "", nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := f.c.Do(req)
	if err != nil {
		return 0, "", nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("x-kvbandit-endpoint"), b, nil
}

// load sends requests with prompts of their own through the replicas
// alive (alive(i)), 4 at a time, until stop; it counts failures.
type load struct {
	sent, failed atomic.Int64
	stop         chan struct{}
	wg           sync.WaitGroup
}

func (f *warmFleet) startLoad(t *testing.T, alive func(int) bool) *load {
	l := &load{stop: make(chan struct{})}
	var next atomic.Uint32
	for w := range 4 {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			for i := w; ; i++ {
				select {
				case <-l.stop:
					return
				default:
				}
				r := i % len(f.proxies)
				if !alive(r) {
					continue
				}
				status, _, _, err := f.post(t.Context(), f.proxies[r]+"/v1/completions", tokenBody(seqIDs(1000+next.Add(1), 256), 8))
				l.sent.Add(1)
				if err != nil || status != http.StatusOK {
					l.failed.Add(1)
				}
			}
		}()
	}
	return l
}

func (l *load) end() { close(l.stop); l.wg.Wait() }

// TestWarmStartAfterRestart: the goal. Under load, replica 1 is
// stopped and started again; within 2 s of its start it trusts every
// worker's KV view (kvbandit_kv_events_trusted 1 on all four), and its
// /v1/route answers on a fixed set of probes match its two peers'. The
// probes are decided by cache overlap, not by a random draw: each
// extends a 1,024-token prompt (64 blocks) that only one worker caches,
// which costs the others 64 blocks of prefill and ρ = 8 times that in
// recompute, far more than the load's few hundred queued tokens or a
// speed factor's Thompson draw (σ 0.15) can outweigh; a replica that does
// not see the cached blocks (an empty or untrusted view) answers from
// load and draws alone. The control: the same restart with
// --sync-warm-start=false leaves the views untrusted for as long as it is
// watched (2 s).
func TestWarmStartAfterRestart(t *testing.T) {
	f := startWarmFleet(t)
	ctx := t.Context()
	// Seed prompts, one per worker as kvbandit places them, through
	// replica 0; the probes extend them.
	type probe struct {
		body   []byte
		worker string
	}
	var probes []probe
	for i := range 8 {
		ids := seqIDs(uint32(10+i), 1024)
		status, served, body, err := f.post(ctx, f.proxies[0]+"/v1/completions", tokenBody(ids, 4))
		if err != nil || status != http.StatusOK {
			t.Fatalf("seed %d: %d %v %s", i, status, err, body)
		}
		probes = append(probes, probe{tokenBody(append(ids, seqIDs(uint32(90+i), 32)...), 4), served})
	}
	// Every replica's index holds the seeds (their workers' events).
	route := func(ctx context.Context, url string, p probe) (string, error) {
		status, _, body, err := f.post(ctx, url+"/v1/route", p.body)
		if err != nil {
			return "", err
		}
		if status != http.StatusOK {
			return "", fmt.Errorf("/v1/route: %d %s", status, body)
		}
		var r struct {
			Endpoint string `json:"endpoint"`
			Overlap  int    `json:"overlap_blocks"`
		}
		if err := json.Unmarshal(body, &r); err != nil {
			return "", err
		}
		return fmt.Sprintf("%s/%d", r.Endpoint, r.Overlap), nil
	}
	wantAnswer := func(p probe) string { return p.worker + "/64" }
	agree := func(ctx context.Context, reps []int) (bool, string) {
		for pi, p := range probes {
			for _, r := range reps {
				got, err := route(ctx, f.proxies[r], p)
				if err != nil {
					return false, err.Error()
				}
				if got != wantAnswer(p) {
					return false, fmt.Sprintf("probe %d: replica %d answers %s, the worker that caches it is %s", pi, r, got, wantAnswer(p))
				}
			}
		}
		return true, ""
	}
	pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	if err := poll(pctx, func() (bool, string) { return agree(pctx, []int{0, 1, 2}) }); err != nil {
		cancel()
		t.Fatalf("before the restart: %v", err)
	}
	cancel()

	var down atomic.Int32
	down.Store(-1)
	l := f.startLoad(t, func(i int) bool { return int(down.Load()) != i })
	defer l.end()
	time.Sleep(time.Second) // the load runs; the workers publish

	// Stop replica 1 and start it again, under load.
	down.Store(1)
	f.reps[1].terminate(t)
	f.reps[1].waitExit(t, 30*time.Second)
	start := time.Now()
	f.reps[1], f.proxies[1] = f.startReplica(t, 1)
	down.Store(-1)
	ready := time.Since(start)
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := poll(tctx, func() (bool, string) {
		n, err := f.trusted(tctx, f.reps[1])
		if err != nil {
			return false, err.Error()
		}
		return n == warmWorkers, fmt.Sprintf("%d of %d trusted", n, warmWorkers)
	}); err != nil {
		t.Fatalf("the restarted replica: %v\n%s", err, f.reps[1].out)
	}
	trustedAfter := time.Since(start)
	t.Logf("restarted replica: ready %v after its start, every worker trusted %v after it", ready.Round(time.Millisecond), trustedAfter.Round(time.Millisecond))
	if trustedAfter > 2*time.Second {
		t.Errorf("every worker trusted %v after the restart, goal 2 s", trustedAfter)
	}
	if ok, why := agree(ctx, []int{1, 0, 2}); !ok {
		t.Errorf("after the restart, under load: %s", why)
	}
	var st struct {
		WarmStart struct {
			State     string            `json:"state"`
			Peer      string            `json:"peer"`
			Endpoints map[string]string `json:"endpoints"`
		} `json:"warm_start"`
	}
	if err := f.reps[1].getJSON(ctx, "/debug/replicas", &st); err != nil {
		t.Fatal(err)
	}
	if st.WarmStart.State != "done" || st.WarmStart.Peer == "" || len(st.WarmStart.Endpoints) != warmWorkers {
		t.Errorf("/debug/replicas warm_start: %+v", st.WarmStart)
	}
	if n := l.failed.Load(); n > 0 {
		t.Errorf("%d of %d load requests failed", n, l.sent.Load())
	}

	// The control: a restart without the warm start stays untrusted.
	down.Store(2)
	f.reps[2].terminate(t)
	f.reps[2].waitExit(t, 30*time.Second)
	f.reps[2], f.proxies[2] = f.startReplica(t, 2, "--sync-warm-start=false")
	down.Store(-1)
	time.Sleep(2 * time.Second)
	if n, err := f.trusted(ctx, f.reps[2]); err != nil || n != 0 {
		t.Errorf("without the warm start the restarted replica trusts %d workers (%v), want 0: the test could not tell", n, err)
	}
	l.end()
	l.stop = make(chan struct{}) // the deferred end is a no-op now
	t.Logf("load: %d requests, %d failed", l.sent.Load(), l.failed.Load())
}
