package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
)

// These tests run the real `kvbandit serve` binary behind envoysim (FULL_DUPLEX_STREAMED
// both ways unless a test says otherwise) in front of real HTTP workers.

const chatPath = "/v1/chat/completions"

func TestRoundRobinAlternates(t *testing.T) {
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs, "--policy", "round_robin")
	p := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)

	var served []string
	for i := range 6 {
		resp := send(t, c, "POST", p.URL()+chatPath, chatRequest(300+i, ""), nil)
		if resp.status != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.status, resp.body)
		}
		served = append(served, resp.worker())
	}
	for i := 1; i < len(served); i++ {
		if served[i] == served[i-1] {
			t.Fatalf("round robin did not alternate: %v", served)
		}
	}
	for _, w := range ws {
		if n := len(w.Requests()); n != 3 {
			t.Errorf("worker %s got %d requests, want 3", w.Addr(), n)
		}
	}
	xs, err := p.WaitExchanges(t.Context(), 6)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range xs {
		if x.Fallback || x.Destination != x.Upstream || x.Upstream == "" {
			t.Errorf("exchange %d: destination %q upstream %q fallback %v", x.ID, x.Destination, x.Upstream, x.Fallback)
		}
	}
	k.waitReleased(t)
	k.waitMetric(t, "kvbandit_requests_total", map[string]string{"frontend": "ext_proc", "path": "chat_completions", "code_class": "2xx"}, 6)
}

func TestPolicies(t *testing.T) {
	t.Run("random spreads", func(t *testing.T) {
		ws, addrs := startWorkers(t, 2, worker.Config{})
		k := startKvbandit(t, addrs, "--policy", "random")
		p := startProxy(t, k, envoysim.Config{})
		c := httpClient(t)
		for i := range 24 {
			if resp := send(t, c, "POST", p.URL()+chatPath, chatRequest(300, ""), nil); resp.status != 200 {
				t.Fatalf("request %d: %d", i, resp.status)
			}
		}
		for _, w := range ws {
			if len(w.Requests()) == 0 {
				t.Errorf("random never picked %s in 24 requests", w.Addr())
			}
		}
		k.waitReleased(t)
	})

	t.Run("least_loaded avoids the busy endpoint", func(t *testing.T) {
		ws, addrs := startWorkers(t, 2, worker.Config{TokenDelay: 20 * time.Millisecond})
		k := startKvbandit(t, addrs, "--policy", "least_loaded")
		p := startProxy(t, k, envoysim.Config{})
		c := httpClient(t)

		// A long generation keeps one endpoint busy...
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		busy, rd := openStream(t, ctx, c, p.URL()+chatPath, streamRequest(2000))
		defer busy.Body.Close()
		if _, err := rd.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
		busyAddr := busy.Header.Get(worker.HeaderWorker)
		// ...so every other request goes to the idle one.
		for i := range 3 {
			resp := send(t, c, "POST", p.URL()+chatPath, chatRequest(300, `"max_tokens":2,`), nil)
			if resp.status != 200 || resp.worker() == busyAddr {
				t.Errorf("request %d: %d served by %q while %s is busy", i, resp.status, resp.worker(), busyAddr)
			}
		}
		cancel()
		busy.Body.Close()
		waitWorkerRequests(t, byAddr(t, ws, busyAddr), 1)
		k.waitReleased(t)
	})
}

func TestRequestBodyByteForByte(t *testing.T) {
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{ChunkSizes: []int{1021, 16381, 65537, 3}})
	c := httpClient(t)
	for _, size := range []int{4 << 10, 256 << 10, 3 << 20} {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			body := chatRequest(size, `"max_tokens":3,`)
			resp := send(t, c, "POST", p.URL()+chatPath, body, nil)
			if resp.status != 200 {
				t.Fatalf("status %d: %s", resp.status, resp.body)
			}
			w := byAddr(t, ws, resp.worker())
			reqs := w.Requests()
			got := reqs[len(reqs)-1]
			if !bytes.Equal(got.Body, body) {
				t.Errorf("the worker got %d bytes, not the %d sent (first difference at %d)", len(got.Body), len(body), firstDiff(got.Body, body))
			}
			if !strings.Contains(string(resp.body), worker.Text(3)) {
				t.Errorf("response %s", resp.body)
			}
		})
	}
	k.waitReleased(t)
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func streamRequest(maxTokens int) []byte {
	return []byte(fmt.Sprintf(`{"model":"test-model","stream":true,"stream_options":{"include_usage":true},"max_tokens":%d,`+
		`"messages":[{"role":"user","content":"tell me a story"}]}`, maxTokens))
}

// openStream sends a streaming request and returns the response with a
// reader on its body.
func openStream(t *testing.T, ctx context.Context, c *http.Client, url string, body []byte) (*http.Response, *bufio.Reader) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, "POST", url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	return resp, bufio.NewReader(resp.Body)
}

func waitWorkerRequests(t *testing.T, w *worker.Worker, n int) []worker.Request {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	reqs, err := w.WaitRequests(ctx, n)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

func TestSSEResponseByteForByte(t *testing.T) {
	ws, addrs := startWorkers(t, 1, worker.Config{TokenDelay: 5 * time.Millisecond, CachedTokens: 2})
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)

	resp, rd := openStream(t, t.Context(), c, p.URL()+chatPath, streamRequest(40))
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Errorf("content type %q", ct)
	}
	first, err := rd.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	if ws[0].Running() != 1 {
		t.Error("the first event reached the client only after the generation ended: not streamed")
	}
	rest, err := io.ReadAll(rd)
	if err != nil {
		t.Fatal(err)
	}
	got := append([]byte(first), rest...)
	reqs := waitWorkerRequests(t, ws[0], 1)
	if !bytes.Equal(got, reqs[0].Response) {
		t.Errorf("the client got %d bytes, the worker sent %d (first difference at %d)", len(got), len(reqs[0].Response), firstDiff(got, reqs[0].Response))
	}
	if !bytes.HasSuffix(got, []byte("data: [DONE]\n\n")) {
		t.Errorf("stream does not end with [DONE]")
	}
	k.waitReleased(t)
	// The response went through kvbandit: it read the usage chunk.
	k.waitMetric(t, "kvbandit_tokens_total", map[string]string{"kind": "completion"}, 40)
}

func TestSpoofedDestinationIsOverwritten(t *testing.T) {
	// envoysim runs without envoy/sidecar.yaml's header filters (which
	// strip these headers before ext_proc and at the route), so this checks
	// kvbandit's own overwrite/removal.
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)
	spoof := map[string]string{
		"x-gateway-destination-endpoint":        "10.1.2.3:80",
		"X-Gateway-Destination-Endpoint-Served": addrs[1],
		"x-gateway-destination-endpoint-subset": addrs[1],
		"X-Prefiller-Host-Port":                 "10.9.9.9:80",
	}
	for i := range 4 {
		for _, r := range []response{
			send(t, c, "POST", p.URL()+chatPath, chatRequest(300, ""), spoof),
			send(t, c, "GET", p.URL()+"/v1/models", nil, spoof),
		} {
			if r.status != 200 {
				t.Errorf("request %d: %d %s", i, r.status, r.body)
			}
		}
	}
	for _, w := range ws {
		reqs := w.Requests()
		if len(reqs) != 4 {
			t.Errorf("worker %s got %d requests, want 4 (the client's destination header must not route)", w.Addr(), len(reqs))
		}
		for _, r := range reqs {
			if got := r.Header.Values("x-gateway-destination-endpoint"); !slices.Equal(got, []string{w.Addr()}) {
				t.Errorf("%s %s: the worker saw x-gateway-destination-endpoint %q, want only %q", r.Method, r.Path, got, w.Addr())
			}
			for _, h := range []string{"x-gateway-destination-endpoint-served", "x-gateway-destination-endpoint-subset", "x-prefiller-host-port"} {
				if got := r.Header.Values(h); len(got) != 0 {
					t.Errorf("%s %s: the client's %s reached the worker: %q", r.Method, r.Path, h, got)
				}
			}
		}
	}
	xs, err := p.WaitExchanges(t.Context(), 8)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range xs {
		if x.Fallback || x.Destination != x.Upstream {
			t.Errorf("exchange %d (%s %s): destination %q upstream %q fallback %v", x.ID, x.Method, x.Path, x.Destination, x.Upstream, x.Fallback)
		}
	}
	k.waitReleased(t)
}

func TestSubsetHint(t *testing.T) {
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs)
	c := httpClient(t)
	w1, w2 := addrs[0], addrs[1]
	_, otherPort, _ := strings.Cut(freeAddr(t), ":")

	for _, tc := range []struct {
		name string
		hint func() *structpb.Value
		want []string // workers allowed; nil: 503
	}{
		{"list", func() *structpb.Value { return envoysim.SubsetList(w2) }, []string{w2}},
		{"comma string", func() *structpb.Value { return envoysim.SubsetString(w1) }, []string{w1}},
		{"comma string with spaces", func() *structpb.Value { return envoysim.SubsetString(" " + w2 + " , 10.9.9.9:1") }, []string{w2}},
		{"both", func() *structpb.Value { return envoysim.SubsetString(w1 + "," + w2) }, []string{w1, w2}},
		{"ip without port matches every port", func() *structpb.Value { return envoysim.SubsetList("127.0.0.1") }, []string{w1, w2}},
		{"exact ip:port", func() *structpb.Value { return envoysim.SubsetList("127.0.0.1:" + otherPort) }, nil},
		{"empty list", func() *structpb.Value { return envoysim.SubsetList() }, nil},
		{"empty string", func() *structpb.Value { return envoysim.SubsetString("") }, nil},
		{"unknown endpoint", func() *structpb.Value { return envoysim.SubsetList("10.9.9.9:1") }, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, w := range ws {
				w.ClearRequests()
			}
			p := startProxy(t, k, envoysim.Config{SubsetHint: tc.hint()})
			seen := map[string]bool{}
			for i := range 4 {
				resp := send(t, c, "POST", p.URL()+chatPath, chatRequest(300, ""), nil)
				if tc.want == nil {
					expectError(t, resp, http.StatusServiceUnavailable)
					continue
				}
				if resp.status != 200 || !slices.Contains(tc.want, resp.worker()) {
					t.Errorf("request %d: %d served by %q, want one of %v", i, resp.status, resp.worker(), tc.want)
				}
				seen[resp.worker()] = true
			}
			if tc.want == nil {
				for _, w := range ws {
					if n := len(w.Requests()); n != 0 {
						t.Errorf("worker %s contacted %d times", w.Addr(), n)
					}
				}
			} else if len(seen) != len(tc.want) {
				t.Errorf("served by %v, want all of %v", seen, tc.want)
			}
			k.waitReleased(t)
		})
	}
}

// expectError checks a kvbandit rejection: status, JSON error body, no
// worker involved.
func expectError(t *testing.T, resp response, status int) openAIError {
	t.Helper()
	var e openAIError
	if resp.status != status {
		t.Errorf("status %d, want %d (body %s)", resp.status, status, resp.body)
	}
	if ct := resp.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("content type %q, want application/json", ct)
	}
	if err := json.Unmarshal(resp.body, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" || e.Error.Code == "" {
		t.Errorf("error body %s: %v", resp.body, err)
	}
	if resp.worker() != "" {
		t.Errorf("a worker (%s) answered", resp.worker())
	}
	return e
}

func TestBufferedMode(t *testing.T) {
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{RequestBodyMode: envoysim.Buffered, BufferLimit: 4 << 20, ChunkSizes: []int{4099}})
	c := httpClient(t)
	var served []string
	for i := range 4 {
		body := chatRequest(256<<10+i, `"max_tokens":2,`)
		resp := send(t, c, "POST", p.URL()+chatPath, body, nil)
		if resp.status != 200 {
			t.Fatalf("status %d %s", resp.status, resp.body)
		}
		served = append(served, resp.worker())
		reqs := byAddr(t, ws, resp.worker()).Requests()
		got := reqs[len(reqs)-1]
		if !bytes.Equal(got.Body, body) || got.ContentLength != int64(len(body)) {
			t.Errorf("request %d: worker got %d bytes (content length %d), want %d", i, len(got.Body), got.ContentLength, len(body))
		}
	}
	if served[0] == served[1] || served[1] == served[2] || served[2] == served[3] {
		t.Errorf("round robin in BUFFERED mode: %v", served)
	}
	xs, err := p.WaitExchanges(t.Context(), 4)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"> request_headers", "< request_headers", "> request_body eos", "< request_body"}
	for _, x := range xs {
		if flow := x.Flow(); len(flow) < 4 || !slices.Equal(flow[:4], want) {
			t.Errorf("exchange %d flow %v", x.ID, flow)
		}
		if x.Fallback || x.Destination != x.Upstream {
			t.Errorf("exchange %d: destination %q upstream %q", x.ID, x.Destination, x.Upstream)
		}
	}
	if resp := send(t, c, "GET", p.URL()+"/v1/models", nil, nil); resp.status != 200 || resp.worker() == "" {
		t.Errorf("GET in BUFFERED mode: %d served by %q", resp.status, resp.worker())
	}
	k.waitReleased(t)
}

func TestModelsGetIsRouted(t *testing.T) {
	_, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{})
	resp := send(t, httpClient(t), "GET", p.URL()+"/v1/models", nil, nil)
	if resp.status != 200 || !bytes.Contains(resp.body, []byte(`"test-model"`)) {
		t.Fatalf("%d %s", resp.status, resp.body)
	}
	x, err := p.WaitExchanges(t.Context(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if x[0].Fallback || x[0].Upstream != resp.worker() || x[0].Destination != resp.worker() {
		t.Errorf("destination %q upstream %q fallback %v, served by %q", x[0].Destination, x[0].Upstream, x[0].Fallback, resp.worker())
	}
	if !x[0].Sent()[0].GetRequestHeaders().GetEndOfStream() {
		t.Error("GET sent without end_of_stream")
	}
	k.waitReleased(t)
	k.waitMetric(t, "kvbandit_requests_total", map[string]string{"frontend": "ext_proc", "path": "models", "code_class": "2xx"}, 1)
}

func TestRejections(t *testing.T) {
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs, "--max-body-bytes", "65536")
	p := startProxy(t, k, envoysim.Config{ChunkSizes: []int{8191}})
	c := httpClient(t)
	for _, tc := range []struct {
		name   string
		body   []byte
		status int
	}{
		{"invalid JSON", []byte(`{"model":"test-model","messages":[`), 400},
		{"missing model", []byte(`{"messages":[{"role":"user","content":"hi"}]}`), 400},
		{"body over --max-body-bytes", chatRequest(100<<10, ""), 413},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := send(t, c, "POST", p.URL()+chatPath, tc.body, nil)
			e := expectError(t, resp, tc.status)
			t.Logf("%d %+v", resp.status, e.Error)
		})
	}
	for _, w := range ws {
		if n := len(w.Requests()); n != 0 {
			t.Errorf("worker %s contacted %d times", w.Addr(), n)
		}
	}
	k.waitReleased(t)
	k.waitMetric(t, "kvbandit_requests_total", map[string]string{"frontend": "ext_proc", "path": "chat_completions", "code_class": "4xx"}, 3)
}

func TestUnknownModel(t *testing.T) {
	t.Run("bare endpoints serve every model", func(t *testing.T) {
		_, addrs := startWorkers(t, 1, worker.Config{})
		k := startKvbandit(t, addrs)
		p := startProxy(t, k, envoysim.Config{})
		resp := send(t, httpClient(t), "POST", p.URL()+chatPath, []byte(`{"model":"other-model","messages":[]}`), nil)
		// Routed: the worker itself answers that it does not know the model.
		if resp.status != 404 || resp.worker() != addrs[0] {
			t.Errorf("%d from %q: %s", resp.status, resp.worker(), resp.body)
		}
		k.waitReleased(t)
	})
	t.Run("declared models", func(t *testing.T) {
		ws, addrs := startWorkers(t, 2, worker.Config{})
		cfg := filepath.Join(t.TempDir(), "kvbandit.yaml")
		yaml := "endpoints:\n"
		for _, a := range addrs {
			yaml += fmt.Sprintf("  - address: %q\n    models: [test-model]\n", a)
		}
		if err := os.WriteFile(cfg, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		k := startKvbandit(t, nil, "--config", cfg)
		k.endpoints = addrs
		p := startProxy(t, k, envoysim.Config{})
		c := httpClient(t)
		e := expectError(t, send(t, c, "POST", p.URL()+chatPath, []byte(`{"model":"other-model","messages":[]}`), nil), 404)
		if e.Error.Code != "model_not_found" {
			t.Errorf("code %q, want model_not_found", e.Error.Code)
		}
		if resp := send(t, c, "POST", p.URL()+chatPath, chatRequest(300, ""), nil); resp.status != 200 {
			t.Errorf("declared model: %d %s", resp.status, resp.body)
		}
		n := 0
		for _, w := range ws {
			n += len(w.Requests())
		}
		if n != 1 {
			t.Errorf("workers contacted %d times, want 1", n)
		}
		k.waitReleased(t)
	})
}

func TestTooManyStreams(t *testing.T) {
	ws, addrs := startWorkers(t, 1, worker.Config{TokenDelay: 20 * time.Millisecond})
	k := startKvbandit(t, addrs, "--max-inflight", "1")
	p := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	resp, rd := openStream(t, ctx, c, p.URL()+chatPath, streamRequest(2000))
	defer resp.Body.Close()
	if _, err := rd.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	// The first stream holds the only slot.
	e := expectError(t, send(t, c, "POST", p.URL()+chatPath, chatRequest(300, ""), nil), 503)
	t.Logf("%+v", e.Error)
	cancel()
	resp.Body.Close()
	waitWorkerRequests(t, ws[0], 1)
	k.waitReleased(t)
	// The slot is free again.
	ctx2, cancel2 := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel2()
	err := poll(ctx2, func() (bool, string) {
		r := send(t, c, "POST", p.URL()+chatPath, chatRequest(300, `"max_tokens":1,`), nil)
		return r.status == 200, fmt.Sprintf("after the stream ended: %d %s", r.status, r.body)
	})
	if err != nil {
		t.Error(err)
	}
	k.waitReleased(t)
}

func TestDecisionTimeout(t *testing.T) {
	ws, addrs := startWorkers(t, 1, worker.Config{})
	k := startKvbandit(t, addrs, "--decision-timeout", "300ms")
	p := startProxy(t, k, envoysim.Config{})
	pr, pw := io.Pipe()
	defer pw.Close()
	req, err := http.NewRequestWithContext(t.Context(), "POST", p.URL()+chatPath, pr)
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = -1
	go func() {
		// Half a body, then nothing until the test ends.
		_, _ = pw.Write([]byte(`{"model":"test-model","messages":[{"role":"user","content":"`))
	}()
	resp, err := httpClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	pw.CloseWithError(io.ErrUnexpectedEOF)
	e := expectError(t, response{resp.StatusCode, resp.Header, b}, 503)
	if e.Error.Code != "decision_timeout" {
		t.Errorf("code %q, want decision_timeout", e.Error.Code)
	}
	if n := len(ws[0].Requests()); n != 0 {
		t.Errorf("worker contacted %d times", n)
	}
	k.waitReleased(t)
}

func TestUpstreamError(t *testing.T) {
	ws, addrs := startWorkers(t, 2, worker.Config{})
	ws[0].SetFailStatus(500)
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)
	failed := 0
	for range 4 {
		resp := send(t, c, "POST", p.URL()+chatPath, chatRequest(300, ""), nil)
		switch resp.worker() {
		case addrs[0]:
			failed++
			if resp.status != 500 || !bytes.Contains(resp.body, []byte("injected failure")) {
				t.Errorf("failing worker: %d %s", resp.status, resp.body)
			}
		case addrs[1]:
			if resp.status != 200 {
				t.Errorf("healthy worker: %d %s", resp.status, resp.body)
			}
		default:
			t.Errorf("served by %q: %d %s", resp.worker(), resp.status, resp.body)
		}
	}
	if failed != 2 {
		t.Errorf("%d requests hit the failing worker, want 2", failed)
	}
	k.waitReleased(t)
	k.waitMetric(t, "kvbandit_requests_total", map[string]string{"frontend": "ext_proc", "path": "chat_completions", "code_class": "5xx"}, 2)
}

func TestClientCancelMidStream(t *testing.T) {
	ws, addrs := startWorkers(t, 1, worker.Config{TokenDelay: 20 * time.Millisecond})
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	resp, rd := openStream(t, ctx, httpClient(t), p.URL()+chatPath, streamRequest(2000))
	defer resp.Body.Close()
	for range 3 {
		if _, err := rd.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	resp.Body.Close()
	reqs := waitWorkerRequests(t, ws[0], 1)
	if !reqs[0].Canceled {
		t.Error("the worker's request was not canceled")
	}
	xs, err := p.WaitExchanges(t.Context(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if !xs[0].ClientCanceled {
		t.Errorf("exchange: %v", xs[0].Notes)
	}
	// The decision ends although the response never finished.
	k.waitReleased(t)
}

func TestResponseProcessingOff(t *testing.T) {
	for _, tc := range []struct {
		name     string
		response envoysim.BodyMode // what the data plane is configured for
	}{
		{"data plane streams the response", envoysim.FullDuplexStreamed},
		{"data plane skips the response", envoysim.None},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ws, addrs := startWorkers(t, 2, worker.Config{TokenDelay: time.Millisecond})
			k := startKvbandit(t, addrs, "--response-processing=false")
			p := startProxy(t, k, envoysim.Config{ResponseBodyMode: tc.response})
			c := httpClient(t)
			var served []string
			for i := range 4 {
				resp := send(t, c, "POST", p.URL()+chatPath, streamRequest(10), nil)
				if resp.status != 200 {
					t.Fatalf("%d %s", resp.status, resp.body)
				}
				served = append(served, resp.worker())
				reqs := waitWorkerRequests(t, byAddr(t, ws, resp.worker()), 1)
				if want := reqs[len(reqs)-1].Response; !bytes.Equal(resp.body, want) {
					xs, _ := p.WaitExchanges(t.Context(), i+1)
					t.Errorf("request %d: the client got %d bytes, the worker sent %d; %d response bytes went to kvbandit "+
						"before its clean close arrived and were dropped (flow %v)",
						i, len(resp.body), len(want), unechoed(xs[i]), xs[i].Flow())
				}
			}
			if served[0] == served[1] || served[1] == served[2] {
				t.Errorf("round robin: %v", served)
			}
			xs, err := p.WaitExchanges(t.Context(), 4)
			if err != nil {
				t.Fatal(err)
			}
			for _, x := range xs {
				sentResponse := false
				for _, m := range x.Sent() {
					if m.GetResponseHeaders() != nil || m.GetResponseBody() != nil {
						sentResponse = true
					}
				}
				switch {
				case tc.response == envoysim.None && sentResponse:
					t.Errorf("exchange %d: response sent to kvbandit although the data plane skips it: %v", x.ID, x.Flow())
				case tc.response == envoysim.None && x.ServerClosed != nil && x.ServerClosed.Code() != codes.OK:
					// Either side may close first here (nothing more
					// will flow), but never with an error.
					t.Errorf("exchange %d: the stream ended with %v", x.ID, x.ServerClosed)
				case tc.response == envoysim.FullDuplexStreamed && !slices.Contains(x.Flow(), "< response_body streamed eos"):
					// Closing early would drop the chunks in flight, so
					// kvbandit echoes the response to its end instead.
					t.Errorf("exchange %d: kvbandit did not echo the response to its end: %v", x.ID, x.Flow())
				}
			}
			k.waitReleased(t)
		})
	}
}

func TestServedEndpointDiffers(t *testing.T) {
	// kvbandit knows two workers, the data plane's cluster only the first:
	// decisions for the second fall back, and the served endpoint tells.
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{Hosts: addrs[:1]})
	c := httpClient(t)
	for range 4 {
		if resp := send(t, c, "POST", p.URL()+chatPath, chatRequest(300, ""), nil); resp.status != 200 || resp.worker() != addrs[0] {
			t.Fatalf("%d served by %q", resp.status, resp.worker())
		}
	}
	xs, err := p.WaitExchanges(t.Context(), 4)
	if err != nil {
		t.Fatal(err)
	}
	fallbacks := 0
	for _, x := range xs {
		if x.Fallback {
			fallbacks++
			if x.Destination != addrs[1] {
				t.Errorf("fallback from %q", x.Destination)
			}
		}
	}
	if fallbacks != 2 || len(ws[1].Requests()) != 0 {
		t.Errorf("%d fallbacks, %d requests on the worker outside the cluster", fallbacks, len(ws[1].Requests()))
	}
	k.waitReleased(t)
	k.waitMetric(t, "kvbandit_served_mismatch_total", nil, 2)
}

func TestShutdownDuringStream(t *testing.T) {
	ws, addrs := startWorkers(t, 1, worker.Config{TokenDelay: time.Millisecond})
	// --stop-grace far above the generation's length: on a loaded machine
	// 3,000 tokens took over the default 5 s, and the cut at the grace
	// deadline (by design) failed the test.
	k := startKvbandit(t, addrs, "--drain-timeout", "300ms", "--stop-grace", "2m")
	p := startProxy(t, k, envoysim.Config{})
	resp, rd := openStream(t, t.Context(), httpClient(t), p.URL()+chatPath, streamRequest(3000))
	defer resp.Body.Close()
	first, err := rd.ReadString('\n')
	if err != nil {
		t.Fatal(err)
	}
	// SIGTERM while tokens are flowing: the drain deadline passes before
	// the generation ends, yet the client must still get the whole
	// stream, byte for byte.
	k.terminate(t)
	rest, err := io.ReadAll(rd)
	if err != nil {
		t.Fatalf("reading the stream after SIGTERM: %v", err)
	}
	got := append([]byte(first), rest...)
	reqs := waitWorkerRequests(t, ws[0], 1)
	xs, err := p.WaitExchanges(t.Context(), 1)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, reqs[0].Response) {
		t.Errorf("the client got %d bytes, the worker sent %d (first difference at %d): kvbandit ended the stream (%v) "+
			"while %d response bytes it had not echoed were on their way to it, and Envoy drops those",
			len(got), len(reqs[0].Response), firstDiff(got, reqs[0].Response), xs[0].ServerClosed, unechoed(xs[0]))
	}
	k.waitExit(t, 30*time.Second)
}

func TestRequestTrailers(t *testing.T) {
	// A chunked body followed by trailers: Envoy sends the last body chunk
	// without end_of_stream, then request_trailers.
	ws, addrs := startWorkers(t, 1, worker.Config{})
	k := startKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{ChunkSizes: []int{100}})
	body := chatRequest(1000, `"max_tokens":2,`)
	req, err := http.NewRequestWithContext(t.Context(), "POST", p.URL()+chatPath, io.MultiReader(bytes.NewReader(body)))
	if err != nil {
		t.Fatal(err)
	}
	req.ContentLength = -1
	req.Trailer = http.Header{"X-Checksum": {"abc123"}}
	resp, err := httpClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	reqs := waitWorkerRequests(t, ws[0], 1)
	if !bytes.Equal(reqs[0].Body, body) || reqs[0].Trailer.Get("X-Checksum") != "abc123" {
		t.Errorf("the worker got %d bytes (want %d) and trailers %v", len(reqs[0].Body), len(body), reqs[0].Trailer)
	}
	xs, err := p.WaitExchanges(t.Context(), 1)
	if err != nil {
		t.Fatal(err)
	}
	flow := xs[0].Flow()
	if !slices.Contains(flow, "> request_trailers") || !slices.Contains(flow, "< request_trailers") || slices.Contains(flow, "> request_body eos") {
		t.Errorf("flow %v", flow)
	}
	k.waitReleased(t)
}
