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
// (65,536 blocks stored per worker, far beyond this test; the
// cache is that large so that the probes' prompts are not evicted). With it, the
// restarted replica takes a peer's state over NATS.

const (
	warmWorkers = 4
	// probeTokens is the cached prompt each probe extends (see
	// TestWarmStartAfterRestart).
	probeTokens = 16384
)

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
	f := &warmFleet{nats: startSyncNATS(t), c: httpClient(t)}
	var recs []map[string]any
	for range warmWorkers {
		sw, err := simworker.New(simworker.Config{Addr: freeAddr(t), KVEventsAddr: "tcp://127.0.0.1:0", SpeedUp: 20,
			Worker: simmodel.WorkerConfig{BlockSize: 16, KVBlocks: 65536}})
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
		"snapshot_interval_ms": replicasSnapshot.Milliseconds(),
		"nats":                 map[string]any{"user": syncNATSUser, "password": syncNATSPassword}}}
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
	// Every replica is connected to every worker's PUB before the first
	// request, so that all see each worker's stream from its message 0.
	for i := range f.reps {
		f.waitConnected(t, i)
	}
	time.Sleep(time.Second) // the SUBSCRIBE reaches the PUB after the handshake
	return f
}

// waitConnected waits until replica i has a ZMTP connection to every
// worker's KV-event publisher.
func (f *warmFleet) waitConnected(t *testing.T, i int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	err := poll(ctx, func() (bool, string) {
		ss, err := f.reps[i].scrape(ctx)
		if err != nil {
			return false, err.Error()
		}
		n := 0
		for _, a := range f.addrs {
			if metric(ss, "kvbandit_kv_events_connections", map[string]string{"endpoint": a}) >= 1 {
				n++
			}
		}
		return n == warmWorkers, fmt.Sprintf("replica %d connected to %d of %d workers", i, n, warmWorkers)
	})
	if err != nil {
		t.Fatal(err)
	}
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
// alive (alive(i)), 3 at a time, until stop; it counts failures, except
// those of a request under way while a replica was taken down (down: a
// counter the test moves before and after it stops a replica).
type load struct {
	sent, failed atomic.Int64
	stop         chan struct{}
	once         sync.Once
	wg           sync.WaitGroup
}

func (f *warmFleet) startLoad(t *testing.T, alive func(int) bool, down *atomic.Int64) *load {
	l := &load{stop: make(chan struct{})}
	var next atomic.Uint32
	for w := range 3 {
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
				gen := down.Load()
				if !alive(r) {
					continue
				}
				status, _, _, err := f.post(t.Context(), f.proxies[r]+"/v1/completions", tokenBody(seqIDs(1000+next.Add(1), 128), 8))
				l.sent.Add(1)
				if (err != nil || status != http.StatusOK) && down.Load() == gen {
					l.failed.Add(1)
				}
			}
		}()
	}
	return l
}

func (l *load) end() {
	l.once.Do(func() { close(l.stop) })
	l.wg.Wait()
}

// TestWarmStartAfterRestart: the goal. Under load, replica 1 is
// stopped and started again; within 2 s of its start (its exec) it trusts
// every worker's KV view (kvbandit_kv_events_trusted 1 on all four), and,
// once the load's requests are done, its /v1/route answers on a fixed set
// of probes match its two peers' (under load an answer also weighs the
// queue ahead at the instant each replica is asked). The probes are
// decided by cache overlap, not by a random draw: each extends a
// 16,384-token prompt (1,024 blocks) that only one worker caches. The
// latency model prices a prompt by its uncached tokens in steps of the
// workers' 8,192-token batch: the caching worker's 32 uncached tokens are
// one step, the others' 16,416 three steps and two batches' worth, about
// 8 times as long with the fit these workers teach (some 38 ms a batch,
// 15 ms a step), far more than a speed factor's Thompson draw (σ ≤ 0.15)
// can outweigh. (A 1,024-token prompt is not enough: its 64 blocks are an
// eighth of a batch, within one step, and the draws decide.) The answer
// must name that worker with those 1,024 blocks cached, which a replica
// that does not see them (an empty or untrusted view) cannot give. The control: the same restart with
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
	// A first request straight to each worker: its first KV-event
	// message (0) reaches all three replicas.
	for i, w := range f.workers {
		if status, _, body, err := f.post(ctx, "http://"+w.Addr()+"/v1/completions", tokenBody(seqIDs(uint32(500+i), 64), 2)); err != nil || status != http.StatusOK {
			t.Fatalf("primer %d: %d %v %s", i, status, err, body)
		}
	}
	var probes []probe
	for i := range 8 {
		ids := seqIDs(uint32(10+i), probeTokens)
		status, served, body, err := f.post(ctx, f.proxies[0]+"/v1/completions", tokenBody(ids, 4))
		if err != nil || status != http.StatusOK {
			t.Fatalf("seed %d: %d %v %s", i, status, err, body)
		}
		probes = append(probes, probe{tokenBody(append(ids, seqIDs(uint32(90+i), 32)...), 4), served})
	}
	for i := range f.reps {
		f.waitTrusted(t, i, 15*time.Second)
	}
	// Every replica's index holds the seeds (their workers' events).
	var lastBody []byte
	route := func(ctx context.Context, url string, p probe) (string, error) {
		status, _, body, err := f.post(ctx, url+"/v1/route", p.body)
		lastBody = body
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
	wantAnswer := func(p probe) string { return fmt.Sprintf("%s/%d", p.worker, probeTokens/16) }
	agree := func(ctx context.Context, reps []int) (bool, string) {
		for pi, p := range probes {
			for _, r := range reps {
				got, err := route(ctx, f.proxies[r], p)
				if err != nil {
					return false, err.Error()
				}
				if got != wantAnswer(p) {
					return false, fmt.Sprintf("probe %d: replica %d answers %s, the worker that caches it is %s (%s)", pi, r, got, wantAnswer(p), lastBody)
				}
			}
		}
		return true, ""
	}
	pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	var why string
	if err := poll(pctx, func() (bool, string) {
		ok, w := agree(pctx, []int{0, 1, 2})
		if pctx.Err() == nil {
			why = w
		}
		return ok, w
	}); err != nil {
		cancel()
		t.Fatalf("before the restart: %s", why)
	}
	cancel()

	var down atomic.Int32
	var changes atomic.Int64 // moved around every stop and start
	setDown := func(i int32) { changes.Add(1); down.Store(i); changes.Add(1) }
	down.Store(-1)
	l := f.startLoad(t, func(i int) bool { return int(down.Load()) != i }, &changes)
	defer l.end()
	time.Sleep(time.Second) // the load runs; the workers publish

	// Stop replica 1 and start it again, under load.
	setDown(1)
	f.reps[1].terminate(t)
	f.reps[1].waitExit(t, 30*time.Second)
	// Watch the restarted replica's metrics from its exec on: the
	// harness's readiness wait (gRPC health, whose client backs off a
	// second after a refused connection) says when the harness saw it
	// ready, not when it was. The last --metrics-addr wins.
	metricsAddr := freeAddr(t)
	watch := &kvb{metricsAddr: metricsAddr}
	trustedAt := make(chan time.Duration, 1)
	start := time.Now()
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		_ = poll(wctx, func() (bool, string) {
			n, err := f.trusted(wctx, watch)
			return err == nil && n == warmWorkers, ""
		})
		trustedAt <- time.Since(start)
	}()
	f.reps[1], f.proxies[1] = f.startReplica(t, 1, "--metrics-addr", metricsAddr)
	f.reps[1].metricsAddr = metricsAddr
	setDown(-1)
	ready := time.Since(start)
	trustedAfter := <-trustedAt
	if n, err := f.trusted(ctx, f.reps[1]); err != nil || n != warmWorkers {
		t.Fatalf("the restarted replica trusts %d of %d workers (%v)\n%s", n, warmWorkers, err, f.reps[1].out)
	}
	ss, err := f.reps[1].scrape(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("restarted replica: every worker trusted %v after its exec (the harness saw it ready after %v); its warm start took %.0f ms",
		trustedAfter.Round(time.Millisecond), ready.Round(time.Millisecond), 1000*metric(ss, "kvbandit_sync_warm_start_seconds", nil))
	if trustedAfter > 2*time.Second {
		t.Errorf("every worker trusted %v after the restart, goal 2 s", trustedAfter)
	}
	var st struct {
		WarmStart struct {
			State         string            `json:"state"`
			Peer          string            `json:"peer"`
			Endpoints     map[string]string `json:"endpoints"`
			Bytes         int               `json:"bytes"`
			Blocks        int               `json:"blocks"`
			FetchSeconds  float64           `json:"fetch_seconds"`
			ResumeSeconds float64           `json:"resume_seconds"`
		} `json:"warm_start"`
	}
	if err := f.reps[1].getJSON(ctx, "/debug/replicas", &st); err != nil {
		t.Fatal(err)
	}
	if st.WarmStart.State != "done" || st.WarmStart.Peer == "" || len(st.WarmStart.Endpoints) != warmWorkers {
		t.Errorf("/debug/replicas warm_start: %+v", st.WarmStart)
	}
	t.Logf("warm start: %d bytes, %d blocks from %s; fetch %.0f ms, import and resume %.0f ms", st.WarmStart.Bytes, st.WarmStart.Blocks,
		st.WarmStart.Peer, 1000*st.WarmStart.FetchSeconds, 1000*st.WarmStart.ResumeSeconds)
	// The probes, once the load's requests are done: under load a
	// probe's answer weighs its cached prefill against the queue ahead at
	// that instant, which each replica reads a few milliseconds apart.
	l.end()
	t.Logf("load: %d requests, %d failed", l.sent.Load(), l.failed.Load())
	if n := l.failed.Load(); n > 0 {
		t.Errorf("%d of %d load requests failed", n, l.sent.Load())
	}
	for _, k := range f.reps {
		k.waitReleased(t)
	}
	if ok, why := agree(ctx, []int{1, 0, 2}); !ok {
		t.Errorf("after the restart: %s", why)
	}

	// The control: a restart without the warm start, under load again,
	// stays untrusted (it has seen the workers' messages: a late start).
	l2 := f.startLoad(t, func(i int) bool { return int(down.Load()) != i }, &changes)
	defer l2.end()
	setDown(2)
	f.reps[2].terminate(t)
	f.reps[2].waitExit(t, 30*time.Second)
	f.reps[2], f.proxies[2] = f.startReplica(t, 2, "--sync-warm-start=false")
	setDown(-1)
	time.Sleep(2 * time.Second)
	ss, err = f.reps[2].scrape(ctx)
	if err != nil {
		t.Fatal(err)
	}
	resyncs := metric(ss, "kvbandit_kv_events_total", map[string]string{"kind": "resyncs"})
	if n, err := f.trusted(ctx, f.reps[2]); err != nil || n != 0 || resyncs == 0 {
		t.Errorf("without the warm start the restarted replica trusts %d workers (%v) after %v resyncs, want 0 after a late start: the test could not tell", n, err, resyncs)
	}
}
