package proxy_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/pd"
)

// prefillWorker is an httptest prefill worker whose answer the test sets;
// it records the bodies and X-Request-Id headers it receives.
type prefillWorker struct {
	srv    *httptest.Server
	answer http.HandlerFunc
	mu     sync.Mutex
	bodies [][]byte
	ids    []string
}

func newPrefillWorker(t *testing.T, answer http.HandlerFunc) *prefillWorker {
	t.Helper()
	pw := &prefillWorker{answer: answer}
	pw.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		pw.mu.Lock()
		pw.bodies = append(pw.bodies, b)
		pw.ids = append(pw.ids, r.Header.Get("X-Request-Id"))
		pw.mu.Unlock()
		pw.answer(w, r)
	}))
	t.Cleanup(pw.srv.Close)
	return pw
}

func (pw *prefillWorker) addr() string { return strings.TrimPrefix(pw.srv.URL, "http://") }

// vllmPrefillAnswer is what vLLM's NIXL connector answers to a prefill-only
// request (as llm-d-inference-sim v0.10.2 does).
const vllmPrefillAnswer = `{"id":"cmpl-1","choices":[{"index":0,"text":"x","finish_reason":"remote_decode"}],"kv_transfer_params":{"do_remote_decode":false,"do_remote_prefill":true,"remote_block_ids":["B1"],"remote_engine_id":"E1","remote_host":"10.0.0.7","remote_port":5600,"tp_size":1}}`

// pdDirectFixture is a proxy in direct P/D mode over one decode worker
// (e2e/worker) and the prefill worker pw, with threshold 16 tokens.
func pdDirectFixture(t *testing.T, prefill string, cfg proxy.Config) (*fixture, *prometheus.Registry) {
	t.Helper()
	dec, err := pd.New(pd.Config{ThresholdTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	cfg.PDMode = proxy.PDModeDirect
	// Slow tokens: the decode stage lasts long enough to look at the
	// prefill endpoint's load during it (prefillReleasedDuringDecode).
	f := newFixture(t, options{workers: 1, roles: []routing.Role{routing.RoleDecode}, pd: dec, cfg: cfg, reg: reg, wcfg: worker.Config{TokenDelay: 40 * time.Millisecond}})
	eps := []routing.Endpoint{{Key: routing.EndpointKey(f.workers[0].Addr()), Role: routing.RoleDecode}, {Key: routing.EndpointKey(prefill), Role: routing.RolePrefill}}
	if err := f.engine.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return f, reg
}

// prefillReleasedDuringDecode posts body and, once the decode worker has
// the request, checks that only the decode endpoint carries it: the
// prefill endpoint was released after the prefill stage, whether it
// succeeded or failed.
func prefillReleasedDuringDecode(t *testing.T, f *fixture, prefill string, body []byte, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	type result struct {
		resp *http.Response
		b    []byte
	}
	done := make(chan result, 1)
	go func() {
		resp, b := f.post(t, "/v1/chat/completions", body, hdr...)
		done <- result{resp, b}
	}()
	deadline := time.Now().Add(10 * time.Second)
	for len(f.workers[0].Requests()) == 0 && time.Now().Before(deadline) {
		time.Sleep(2 * time.Millisecond)
	}
	for _, st := range f.engine.Endpoints() {
		want := int64(1)
		if string(st.Key) == prefill {
			want = 0
		}
		if n := st.InFlight.Load(); n != want {
			t.Errorf("during the decode stage %s in-flight = %d, want %d", st.Key, n, want)
		}
	}
	r := <-done
	return r.resp, r.b
}

func jsonObject(t *testing.T, b []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("not a JSON object: %v: %s", err, b)
	}
	return m
}

// TestProxyPDDirectTwoStages: in direct mode the proxy sends a long
// prompt to the prefill worker first, with the body pd-sidecar v0.4.0
// sends (stream false, no stream_options, max_tokens and
// max_completion_tokens 1, kv_transfer_params asking for a remote decode),
// then the client's own body to the decode worker with kv_transfer_params
// replaced by the prefill worker's, no x-prefiller-host-port, under one
// fresh X-Request-Id; the stream reaches the client; one outcome, no
// fallback, in-flight back to 0 on both roles.
func TestProxyPDDirectTwoStages(t *testing.T) {
	pw := newPrefillWorker(t, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, vllmPrefillAnswer)
	})
	f, reg := pdDirectFixture(t, pw.addr(), proxy.Config{})
	long := chatBody("test-model", strings.Repeat("route this long prompt please ", 40),
		`,"stream":true,"stream_options":{"include_usage":true},"max_tokens":5,"max_completion_tokens":5,"kv_transfer_params":{"spoofed":true}`)
	resp, b := prefillReleasedDuringDecode(t, f, pw.addr(), long, "X-Request-Id", "client-id", "X-Prefiller-Host-Port", "10.9.9.9:80")
	if resp.StatusCode != http.StatusOK || !bytes.Contains(b, []byte("data: [DONE]")) {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	if len(pw.bodies) != 1 {
		t.Fatalf("prefill worker got %d requests, want 1", len(pw.bodies))
	}
	pre := jsonObject(t, pw.bodies[0])
	for k, want := range map[string]string{"stream": "false", "max_tokens": "1", "max_completion_tokens": "1", "model": `"test-model"`,
		"kv_transfer_params": `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`} {
		if got := string(pre[k]); got != want {
			t.Errorf("prefill body %s = %s, want %s", k, got, want)
		}
	}
	if _, ok := pre["stream_options"]; ok {
		t.Errorf("prefill body kept stream_options")
	}
	reqs := f.workers[0].Requests()
	if len(reqs) != 1 {
		t.Fatalf("decode worker got %d requests", len(reqs))
	}
	dec := jsonObject(t, reqs[0].Body)
	for k, want := range map[string]string{"stream": "true", "max_tokens": "5", "max_completion_tokens": "5", "stream_options": `{"include_usage":true}`,
		"kv_transfer_params": `{"do_remote_decode":false,"do_remote_prefill":true,"remote_block_ids":["B1"],"remote_engine_id":"E1","remote_host":"10.0.0.7","remote_port":5600,"tp_size":1}`} {
		if got := string(dec[k]); got != want {
			t.Errorf("decode body %s = %s, want %s", k, got, want)
		}
	}
	if !bytes.Equal(pre["messages"], dec["messages"]) {
		t.Errorf("messages differ between the stages")
	}
	if h := reqs[0].Header.Get("x-prefiller-host-port"); h != "" {
		t.Errorf("decode worker got x-prefiller-host-port %q in direct mode", h)
	}
	if id := reqs[0].Header.Get("X-Request-Id"); id == "" || id == "client-id" || id != pw.ids[0] {
		t.Errorf("request ids: prefill %q, decode %q (want one fresh id)", pw.ids[0], id)
	}
	if out := f.out.wait(t, 1); out[0].Kind != routing.OutcomeSuccess || out[0].Served != routing.EndpointKey(f.workers[0].Addr()) {
		t.Errorf("outcome %+v", out[0])
	}
	for _, r := range []string{"connect", "status", "timeout"} {
		if v := labelledCounter(t, reg, "kvbandit_proxy_pd_fallbacks_total", "reason", r); v != 0 {
			t.Errorf("fallback %s = %v", r, v)
		}
	}
	f.inflightZero(t)

	// A short prompt stays aggregated: the prefill worker sees nothing.
	resp, _ = f.post(t, "/v1/chat/completions", []byte(`{"model":"test-model","messages":[{"role":"user","content":"hi"}]}`))
	if resp.StatusCode != http.StatusOK || len(pw.bodies) != 1 {
		t.Fatalf("short prompt: %d, prefill requests %d", resp.StatusCode, len(pw.bodies))
	}
	f.out.wait(t, 2)
	f.inflightZero(t)
}

// TestProxyPDDirectFallback: whenever the prefill stage fails (an error
// status, an answer without kv_transfer_params or not JSON, an answer over
// MaxPrefillResponseBytes, no answer within PrefillTimeout, nothing
// listening) the client is still served, aggregated, by the decode worker
// with its own body; the failure is counted by reason, the decision ends
// once and in-flight returns to 0 on both roles.
func TestProxyPDDirectFallback(t *testing.T) {
	cases := []struct {
		name, reason string
		answer       http.HandlerFunc
		cfg          proxy.Config
		dead         bool
	}{
		{name: "status", reason: "status", answer: func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, `{"error":"busy"}`, http.StatusServiceUnavailable)
		}},
		{name: "no params", reason: "no_kv_transfer_params", answer: func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, `{"choices":[],"kv_transfer_params":null}`)
		}},
		{name: "not json", reason: "bad_json", answer: func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, `<html>`)
		}},
		{name: "too large", reason: "too_large", cfg: proxy.Config{MaxPrefillResponseBytes: 1024}, answer: func(w http.ResponseWriter, _ *http.Request) {
			// Chunked (no Content-Length): the bounded read catches it.
			_, _ = io.WriteString(w, `{"pad":"`+strings.Repeat("a", 4096))
			w.(http.Flusher).Flush()
			_, _ = io.WriteString(w, `","kv_transfer_params":{}}`)
		}},
		{name: "timeout", reason: "timeout", cfg: proxy.Config{PrefillTimeout: 200 * time.Millisecond}, answer: func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Second):
			}
		}},
		{name: "refused", reason: "connect", dead: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			addr := closedAddr(t)
			if !c.dead {
				addr = newPrefillWorker(t, c.answer).addr()
			}
			f, reg := pdDirectFixture(t, addr, c.cfg)
			body := chatBody("test-model", strings.Repeat("route this long prompt please ", 40), `,"max_tokens":3`)
			start := time.Now()
			resp, b := prefillReleasedDuringDecode(t, f, addr, body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, b)
			}
			if c.name == "timeout" && time.Since(start) > 5*time.Second {
				t.Errorf("the prefill timeout did not bound the stage: %v", time.Since(start))
			}
			reqs := f.workers[0].Requests()
			if len(reqs) != 1 || !bytes.Equal(reqs[0].Body, body) {
				t.Fatalf("decode worker: %d requests, want the client's body unchanged", len(reqs))
			}
			if v := labelledCounter(t, reg, "kvbandit_proxy_pd_fallbacks_total", "reason", c.reason); v != 1 {
				t.Errorf("fallbacks{reason=%q} = %v, want 1", c.reason, v)
			}
			if out := f.out.wait(t, 1); out[0].Kind != routing.OutcomeSuccess {
				t.Errorf("outcome %+v", out[0])
			}
			f.inflightZero(t)
		})
	}
}

// TestProxyPDDirectClientGone: a client that goes away during the prefill
// stage ends the decision once, as cancelled; the decode worker gets
// nothing and nothing is counted as a fallback.
func TestProxyPDDirectClientGone(t *testing.T) {
	entered := make(chan struct{})
	pw := newPrefillWorker(t, func(_ http.ResponseWriter, r *http.Request) {
		close(entered)
		<-r.Context().Done()
	})
	f, reg := pdDirectFixture(t, pw.addr(), proxy.Config{})
	body := chatBody("test-model", strings.Repeat("route this long prompt please ", 40), "")
	req, err := http.NewRequest(http.MethodPost, f.url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	cancelReq := make(chan struct{})
	req.Cancel = cancelReq //nolint:staticcheck // a plain way to cut one request
	go func() {
		resp, err := f.client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	<-entered
	close(cancelReq)
	if err := <-done; err == nil {
		t.Errorf("request not cut: %v", err)
	}
	if out := f.out.wait(t, 1); out[0].Kind != routing.OutcomeCancelled {
		t.Errorf("outcome %+v, want cancelled", out[0])
	}
	if n := len(f.workers[0].Requests()); n != 0 {
		t.Errorf("decode worker got %d requests", n)
	}
	if v := labelledCounter(t, reg, "kvbandit_proxy_pd_fallbacks_total", "reason", "connect"); v != 0 {
		t.Errorf("fallback counted for a client that went away: %v", v)
	}
	f.inflightZero(t)
}

// TestParsePDMode: the flag's values; anything else is refused.
func TestParsePDMode(t *testing.T) {
	for in, want := range map[string]proxy.PDMode{"": proxy.PDModeSidecar, "sidecar": proxy.PDModeSidecar, "direct": proxy.PDModeDirect} {
		if got, err := proxy.ParsePDMode(in); err != nil || got != want {
			t.Errorf("ParsePDMode(%q) = %q, %v", in, got, err)
		}
	}
	if _, err := proxy.ParsePDMode("Direct"); !errors.Is(err, proxy.ErrPDMode) {
		t.Errorf("ParsePDMode(Direct): %v", err)
	}
}

// TestProxyKVTransferParamsStripped: a client's own kv_transfer_params
// (which would make the decode engine's KV connector pull blocks from a
// host the client names) never reaches a worker of a pool with prefill
// endpoints, whether the request stays aggregated below the threshold
// (sidecar mode) or falls back to aggregated in direct mode; in a pool
// without prefill endpoints it is kept unless the operator's switch says
// otherwise. The rest of the body and its Content-Length follow.
func TestProxyKVTransferParamsStripped(t *testing.T) {
	const evil = `,"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"169.254.169.254","remote_port":5600,"remote_engine_id":"evil","remote_block_ids":[1]}`
	check := func(t *testing.T, w *worker.Worker, sent []byte, wantKept bool) {
		t.Helper()
		reqs := w.Requests()
		if len(reqs) != 1 {
			t.Fatalf("decode worker got %d requests, want 1", len(reqs))
		}
		got := reqs[0]
		_, kept := jsonObject(t, got.Body)["kv_transfer_params"]
		if kept != wantKept {
			t.Errorf("kv_transfer_params forwarded = %v, want %v: %s", kept, wantKept, got.Body)
		}
		want := sent
		if !wantKept {
			want = bytes.Replace(sent, []byte(evil), nil, 1)
		}
		if !bytes.Equal(got.Body, want) || got.ContentLength != int64(len(want)) {
			t.Errorf("decode body (Content-Length %d)\n got %s\nwant %s", got.ContentLength, got.Body, want)
		}
	}
	short := []byte(`{"model":"test-model","messages":[{"role":"user","content":"hi"}]` + evil + `}`)
	long := chatBody("test-model", strings.Repeat("route this long prompt please ", 40), evil)

	t.Run("sidecar below threshold", func(t *testing.T) {
		dec, err := pd.New(pd.Config{ThresholdTokens: 100000})
		if err != nil {
			t.Fatal(err)
		}
		f := newFixture(t, options{workers: 2, roles: []routing.Role{routing.RoleDecode, routing.RolePrefill}, pd: dec})
		if resp, b := f.post(t, "/v1/chat/completions", short); resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		check(t, f.workers[0], short, false)
		f.out.wait(t, 1)
	})
	t.Run("direct fallback", func(t *testing.T) {
		pw := newPrefillWorker(t, func(w http.ResponseWriter, _ *http.Request) {
			http.Error(w, `{"error":"busy"}`, http.StatusServiceUnavailable)
		})
		f, _ := pdDirectFixture(t, pw.addr(), proxy.Config{})
		if resp, b := f.post(t, "/v1/chat/completions", long); resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		check(t, f.workers[0], long, false)
		f.out.wait(t, 1)
	})
	for _, c := range []struct {
		name   string
		always bool
	}{{"no prefill endpoints", false}, {"no prefill endpoints, strip everywhere", true}} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, options{workers: 1, cfg: proxy.Config{StripKVTransferParams: c.always}})
			if resp, b := f.post(t, "/v1/chat/completions", short); resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			check(t, f.workers[0], short, !c.always)
			f.out.wait(t, 1)
		})
	}
}

// TestProxyPDDirectSlowAnswerCharged: a prefill answer is charged to the
// shared buffer budget as its bytes arrive: a prefill worker that sends
// its headers and a few bytes, then stalls, holds those bytes (and the
// request body), not max(1 MiB, --max-body-bytes) ahead of time; once it
// finishes, the two stages complete and everything is released.
func TestProxyPDDirectSlowAnswerCharged(t *testing.T) {
	resume := make(chan struct{})
	const head = `{"id":"cmpl-1","choices":[{"index":0,"text":"x"}],`
	pw := newPrefillWorker(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, head)
		w.(http.Flusher).Flush()
		select {
		case <-resume:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, strings.TrimPrefix(vllmPrefillAnswer, `{"id":"cmpl-1","choices":[{"index":0,"text":"x","finish_reason":"remote_decode"}],`))
	})
	budget := extproc.NewBudget(64 << 20)
	dec, err := pd.New(pd.Config{ThresholdTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	f := newFixture(t, options{workers: 1, roles: []routing.Role{routing.RoleDecode}, pd: dec, reg: reg, budget: budget, cfg: proxy.Config{PDMode: proxy.PDModeDirect}})
	eps := []routing.Endpoint{{Key: routing.EndpointKey(f.workers[0].Addr()), Role: routing.RoleDecode}, {Key: routing.EndpointKey(pw.addr()), Role: routing.RolePrefill}}
	if err := f.engine.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	body := chatBody("test-model", strings.Repeat("route this long prompt please ", 40), "")
	done := make(chan int, 1)
	go func() {
		resp, _ := f.post(t, "/v1/chat/completions", body)
		done <- resp.StatusCode
	}()
	waitFor(t, 5*time.Second, "the prefill worker asked", func() bool {
		pw.mu.Lock()
		defer pw.mu.Unlock()
		return len(pw.bodies) == 1
	})
	time.Sleep(100 * time.Millisecond) // the head of the answer is read
	if u, most := budget.Used(), int64(len(body)+len(head)); u > most {
		t.Errorf("a stalled prefill answer holds %d bytes of the budget, want at most %d (what has arrived)", u, most)
	}
	close(resume)
	if code := <-done; code != http.StatusOK {
		t.Fatalf("status %d", code)
	}
	if v := labelledCounter(t, reg, "kvbandit_proxy_pd_fallbacks_total", "reason", "buffer_budget"); v != 0 {
		t.Errorf("fallbacks{reason=buffer_budget} = %v", v)
	}
	if got := jsonObject(t, f.workers[0].Requests()[0].Body)["kv_transfer_params"]; !bytes.Contains(got, []byte(`"remote_engine_id":"E1"`)) {
		t.Errorf("decode stage kv_transfer_params %s, want the prefill answer's", got)
	}
	f.out.wait(t, 1)
	waitFor(t, 5*time.Second, "the budget released", func() bool { return budget.Used() == 0 })
}
