package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
)

// simModel is the model the llm-d-inference-sim workers serve.
const simModel = "fake/tiny-model"

// sim is one llm-d-inference-sim process.
type sim struct {
	addr string // 127.0.0.1:port (it binds every interface of the namespace)
	zmq  string // the kvbandit SUB socket it dials
	proc
}

// proc is a third-party server process of the suite (a sim, a sidecar).
type proc struct {
	cmd    *exec.Cmd
	out    *syncBuffer
	exited chan struct{}
}

// startProc runs bin with args and POD_IP=127.0.0.1 (the sims and llm-d's
// sidecar read it), stops it at the end of the test (SIGTERM, SIGKILL
// after 5 s) and logs its output if the test failed, and waits until c
// gets 200 from healthURL.
func startProc(t *testing.T, name, bin string, args []string, c *http.Client, healthURL string) proc {
	t.Helper()
	p := proc{cmd: exec.Command(bin, args...), out: &syncBuffer{}, exited: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), "POD_IP=127.0.0.1")
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.exited:
		case <-time.After(5 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.exited
		}
		if t.Failed() {
			t.Logf("%s output:\n%s", name, p.out)
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		select {
		case <-p.exited:
			return false, "exited"
		default:
		}
		resp, err := c.Get(healthURL)
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return resp.StatusCode == 200, resp.Status
	}); err != nil {
		t.Fatalf("%s not healthy: %v\n%s", name, err, p.out)
	}
	return p
}

// startSim runs an llm-d-inference-sim on addr whose KV events go to zmq,
// and waits for its /health. The sim binds every interface: the suite runs
// in a private network namespace (TestMain).
func startSim(t *testing.T, addr, zmq string, extra ...string) *sim {
	t.Helper()
	_, port, _ := net.SplitHostPort(addr)
	args := append([]string{"--model", simModel, "--force-dummy-tokenizer", "--port", port, "--mode", "echo",
		"--time-to-first-token", "10ms", "--inter-token-latency", "2ms", "--max-num-seqs", "8",
		"--enable-kvcache", "--kv-cache-size", "1024", "--block-size", "16", "--event-batch-size", "1",
		"--zmq-endpoint", zmq}, extra...)
	s := runSim(t, addr, args)
	s.zmq = zmq
	return s
}

// runSim runs an llm-d-inference-sim with args (which must include --port
// for addr) and waits for its /health.
func runSim(t *testing.T, addr string, args []string) *sim {
	t.Helper()
	return &sim{addr: addr, proc: startProc(t, "sim "+addr, simBin, args, &http.Client{Timeout: time.Second}, "http://"+addr+"/health")}
}

// tokenPrompt is a /v1/completions body whose prompt is token ids: the
// sims take pre-tokenized prompts verbatim (their dummy tokenizer would hash
// words into ids kvbandit cannot know), and kvbandit hashes the same ids, so
// both sides see the same blocks.
func tokenPrompt(ids []uint32) []byte {
	b, _ := json.Marshal(map[string]any{"model": simModel, "prompt": ids, "max_tokens": 2, "stream": false})
	return b
}

func ids(seed uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed*100000 + uint32(i) + 1
	}
	return out
}

// writeEndpoints writes an endpoints file (discovery.File) atomically.
func writeEndpoints(t *testing.T, path string, recs []map[string]any) {
	t.Helper()
	b, err := json.Marshal(map[string]any{"endpoints": recs})
	if err != nil {
		t.Fatal(err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func simRecord(s *sim) map[string]any {
	return map[string]any{"address": s.addr, "engine": "vllm", "models": []string{simModel}, "block_size": 16,
		"kv_events": s.zmq, "kv_events_bind": true, "kv_events_first_seq": 1}
}

// TestSimWorkersEventsSteerRouting runs two llm-d-inference-sim workers
// behind kvbandit (kv policy, endpoints from a file): requests reach them,
// their /metrics are scraped, their KV events make the index event-fed, and
// a request sharing a prefix that was sent to one sim directly (so only its
// KV events can tell kvbandit where those blocks are) is routed there.
func TestSimWorkersEventsSteerRouting(t *testing.T) {
	var sims []*sim
	var recs []map[string]any
	for range 2 {
		s := &sim{addr: freeAddr(t), zmq: "tcp://" + freeAddr(t)}
		sims = append(sims, s)
		recs = append(recs, simRecord(s))
	}
	path := filepath.Join(t.TempDir(), "endpoints.json")
	writeEndpoints(t, path, recs)
	k := startKvbandit(t, nil, "--endpoints-file", path, "--policy", "kv", "--scrape-interval", "200ms")
	k.endpoints = []string{sims[0].addr, sims[1].addr}
	// kvbandit binds the SUB sockets; the sims dial them.
	for i, s := range sims {
		sims[i] = startSim(t, s.addr, s.zmq)
	}
	// kvbandit started first and its scrapes of the sims failed until they
	// were up: an endpoint is ejected after 3 failed scrapes until a good
	// one. Wait until kvbandit has scraped both sims, or the first requests
	// can only go to the one it has (the product is right to do so).
	k.waitScraped(t, k.endpoints)
	px := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)

	// Through kvbandit: both sims answer. The prompts share nothing, so
	// their costs tie; the kv policy gives a tie to the endpoint with the
	// smaller indexed tree, so the second request goes to the sim the first
	// did not use.
	served := map[string]int{}
	for i := range 4 {
		r := send(t, c, "POST", px.URL()+"/v1/completions", tokenPrompt(ids(uint32(100+i), 40)), nil)
		if r.status != 200 {
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
	}
	xs, err := px.WaitExchanges(t.Context(), 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range xs {
		if x.Fallback || x.Upstream != x.Destination {
			t.Fatalf("exchange %d: destination %q upstream %q fallback %v", x.ID, x.Destination, x.Upstream, x.Fallback)
		}
		served[x.Upstream]++
	}
	if len(served) != 2 {
		t.Fatalf("requests went to %v, want both sims", served)
	}

	// The sims' events arrive and are trusted (first sequence 1); their
	// metrics are scraped.
	for _, s := range sims {
		k.waitMetric(t, "kvbandit_kv_events_trusted", map[string]string{"endpoint": s.addr}, 1)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		ss, err := k.scrape(ctx)
		if err != nil {
			return false, err.Error()
		}
		ok := metric(ss, "kvbandit_scrapes_total", map[string]string{"result": "ok"})
		var blocks []float64
		for _, s := range sims {
			blocks = append(blocks, metric(ss, "kvbandit_kv_events_total", map[string]string{"endpoint": s.addr, "kind": "blocks"}))
		}
		return ok >= 2 && blocks[0] > 0 && blocks[1] > 0, fmt.Sprintf("scrapes ok %v, event blocks %v", ok, blocks)
	}); err != nil {
		t.Fatal(err)
	}

	// Warm a long prefix on each sim directly, bypassing kvbandit.
	prefixes := [][]uint32{ids(7, 96), ids(8, 96)} // 6 blocks of 16 each
	for i, s := range sims {
		r := send(t, c, "POST", "http://"+s.addr+"/v1/completions", tokenPrompt(prefixes[i]), nil)
		if r.status != 200 {
			t.Fatalf("direct request to sim %d: %d %s", i, r.status, r.body)
		}
	}
	// Wait for their events: the index must hold them as event entries.
	if err := poll(ctx, func() (bool, string) {
		ss, err := k.scrape(ctx)
		if err != nil {
			return false, err.Error()
		}
		var blocks []float64
		for _, s := range sims {
			blocks = append(blocks, metric(ss, "kvbandit_kv_events_total", map[string]string{"endpoint": s.addr, "kind": "blocks"}))
		}
		// 4 requests of 40 tokens (2 blocks each) + 6 blocks per prefix.
		entries := metric(ss, "kvbandit_index_entries", map[string]string{"mode": "event"})
		return blocks[0]+blocks[1] >= 4*2+12 && entries >= 4*2+12, fmt.Sprintf("event blocks %v, event entries %v", blocks, entries)
	}); err != nil {
		t.Fatal(err)
	}
	// Follow-ups sharing each prefix land on the sim that holds it, several
	// times each (the kv policy would otherwise spread them by load).
	n := len(px.Exchanges())
	for round := range 3 {
		for i := range sims {
			p := append(append([]uint32(nil), prefixes[i]...), ids(uint32(900+10*round+i), 20)...)
			r := send(t, c, "POST", px.URL()+"/v1/completions", tokenPrompt(p), nil)
			if r.status != 200 {
				t.Fatalf("follow-up: %d %s", r.status, r.body)
			}
			n++
			xs, err := px.WaitExchanges(t.Context(), n)
			if err != nil {
				t.Fatal(err)
			}
			if got := xs[n-1].Upstream; got != sims[i].addr {
				if resp, err := http.Get("http://" + k.metricsAddr + "/metrics"); err == nil {
					var b strings.Builder
					io.Copy(&b, resp.Body)
					resp.Body.Close()
					for _, l := range strings.Split(b.String(), "\n") {
						if strings.Contains(l, "kv_events") || strings.Contains(l, "index") {
							t.Log(l)
						}
					}
				}
				t.Fatalf("round %d: prefix cached on sim %d (%s) by events, request went to %s\n%s", round, i, sims[i].addr, got, k.out)
			}
		}
	}
	t.Logf("requests through kvbandit per sim before the follow-ups: %v", served)
}

// waitScraped waits until kvbandit has every endpoint of addrs in its set,
// not ejected, with no failed scrape since its last good one (a healthy
// worker then needs 3 failed scrapes in a row to be ejected again).
func (k *kvb) waitScraped(t *testing.T, addrs []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	err := poll(ctx, func() (bool, string) {
		req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+k.metricsAddr+"/debug/endpoints", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		var body struct {
			Endpoints []struct {
				Address string `json:"address"`
				Health  struct {
					Ejected        bool  `json:"ejected"`
					ScrapeFailures int64 `json:"scrape_failures"`
				} `json:"health"`
			} `json:"endpoints"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			return false, err.Error()
		}
		ok := 0
		var state []string
		for _, e := range body.Endpoints {
			state = append(state, fmt.Sprintf("%s ejected=%v scrape_failures=%d", e.Address, e.Health.Ejected, e.Health.ScrapeFailures))
			if slices.Contains(addrs, e.Address) && !e.Health.Ejected && e.Health.ScrapeFailures == 0 {
				ok++
			}
		}
		return ok == len(addrs), "endpoints not scraped yet: " + strings.Join(state, "; ")
	})
	if err != nil {
		t.Fatal(err)
	}
}
