package app

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/extproc/proxy"
)

// startProxyServe runs serve with the standalone proxy on loopback in front
// of one worker and returns the proxy's base URL and serve's result.
func startProxyServe(t *testing.T, ctx context.Context, w *worker.Worker, drain time.Duration) (string, <-chan error) {
	t.Helper()
	a := startServe(t, ctx, w, func(o *ServeOptions) { o.DrainTimeout = drain })
	return a.proxy, a.done
}

// serveAddrs are the addresses of a serve started by startServe.
type serveAddrs struct {
	proxy   string // base URL of the standalone proxy
	grpc    string // ext_proc
	metrics string // base URL of /metrics
	health  string // gRPC health address
	done    <-chan error
}

// startServe runs serve with the standalone proxy and the metrics server
// on loopback in front of one worker; edit adjusts the options.
func startServe(t *testing.T, ctx context.Context, w *worker.Worker, edit func(*ServeOptions)) serveAddrs {
	t.Helper()
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	hl := listen()
	var a serveAddrs
	ready := make(chan struct{})
	ls := &Listeners{GRPC: listen(), Health: listen(), Metrics: listen(), HTTP: hl, Ready: func(g, h, m string) { a.grpc, a.health, a.metrics = g, h, "http://"+m; close(ready) }}
	o := ServeOptions{Endpoints: w.Addr(), Policy: "kv", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second,
		DrainTimeout: 5 * time.Second, StopGrace: 100 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text"}
	if edit != nil {
		edit(&o)
	}
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)), ls) }()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("serve exited: %v", err)
	}
	a.proxy, a.done = "http://"+hl.Addr().String(), done
	return a
}

// stopServe ends serve and waits for it.
func stopServe(t *testing.T, cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not stop")
	}
}

func startWorker(t *testing.T, cfg worker.Config) *worker.Worker {
	t.Helper()
	w := worker.New(cfg)
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

func streamRequest(t *testing.T, c *http.Client, url string, tokens int) *http.Response {
	t.Helper()
	body := `{"model":"test-model","stream":true,"max_tokens":` + itoa(tokens) + `,"messages":[{"role":"user","content":"hi"}]}`
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get(proxy.HeaderEndpoint) == "" {
		t.Fatalf("status %d, headers %v", resp.StatusCode, resp.Header)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	return resp
}

func itoa(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// TestServeHTTPProxy: --http-addr serves the proxy and /v1/route; at
// shutdown a stream in flight finishes within the drain timeout.
func TestServeHTTPProxy(t *testing.T) {
	w := startWorker(t, worker.Config{TokenDelay: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	url, done := startProxyServe(t, ctx, w, 5*time.Second)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}

	resp, err := c.Post(url+proxy.RoutePath, "application/json", strings.NewReader(`{"model":"test-model","messages":[{"role":"user","content":"hi"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	var rr proxy.RouteResponse
	err = json.NewDecoder(resp.Body).Decode(&rr)
	resp.Body.Close()
	if err != nil || resp.StatusCode != 200 || rr.Endpoint != w.Addr() || rr.Tokens == 0 {
		t.Fatalf("route: %d %+v %v", resp.StatusCode, rr, err)
	}

	stream := streamRequest(t, c, url, 20)
	defer stream.Body.Close()
	cancel() // shutdown begins with the stream in flight
	rest, err := io.ReadAll(stream.Body)
	if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("stream cut during drain: %v, %q", err, rest)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not stop")
	}
}

// TestServeHTTPProxyDrainDeadline: a stream longer than the drain timeout
// is cut at the deadline and serve returns.
func TestServeHTTPProxyDrainDeadline(t *testing.T) {
	w := startWorker(t, worker.Config{TokenDelay: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	url, done := startProxyServe(t, ctx, w, 200*time.Millisecond)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	stream := streamRequest(t, &http.Client{Transport: tr}, url, 1000)
	defer stream.Body.Close()
	start := time.Now()
	cancel()
	_, _ = io.ReadAll(stream.Body)
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not stop")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("shutdown took %v", d)
	}
}

// bufferedGauge reads kvbandit_buffered_body_bytes from /metrics.
func bufferedGauge(t *testing.T, c *http.Client, metricsURL string) float64 {
	t.Helper()
	resp, err := c.Get(metricsURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "kvbandit_buffered_body_bytes "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatal("no kvbandit_buffered_body_bytes in /metrics")
	return 0
}

func waitGauge(t *testing.T, c *http.Client, metricsURL string, what string, ok func(float64) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		v := bufferedGauge(t, c, metricsURL)
		if ok(v) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvbandit_buffered_body_bytes = %v: want %s", v, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// extprocBody opens an ext_proc stream for a chat request and sends n body
// bytes without end of stream; it returns the stream and its cancel.
func extprocBody(t *testing.T, ctx context.Context, addr string, n int) (extprocv3.ExternalProcessor_ProcessClient, context.CancelFunc) {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	sctx, cancel := context.WithCancel(ctx)
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(sctx)
	if err != nil {
		t.Fatal(err)
	}
	hv := func(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{hv(":method", "POST"), hv(":path", "/v1/chat/completions"), hv("content-type", "application/json")}},
	}}}); err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
		Body: bytes.Repeat([]byte(" "), n),
	}}}); err != nil {
		t.Fatal(err)
	}
	return st, cancel
}

// TestServeSharedBufferBudget: the ext_proc server and the standalone proxy
// draw from the one --max-buffered-bytes budget: bytes held by either make
// the other answer 503 server_busy, and the gauge shows their sum.
func TestServeSharedBufferBudget(t *testing.T) {
	const budget = 1 << 20
	w := startWorker(t, worker.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	a := startServe(t, ctx, w, func(o *ServeOptions) {
		o.MaxBodyBytes, o.MaxBufferedBytes, o.DecisionTimeout = budget, budget, 20*time.Second
	})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}

	// 1. A slow proxy client holds 900 KiB; an ext_proc stream's chunk
	// does not fit.
	pc, err := net.Dial("tcp", strings.TrimPrefix(a.proxy, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	if _, err := io.WriteString(pc, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1048576\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	if _, err := pc.Write(bytes.Repeat([]byte(" "), 900<<10)); err != nil {
		t.Fatal(err)
	}
	waitGauge(t, c, a.metrics, "the proxy's 900 KiB", func(v float64) bool { return v == 900<<10 })
	st, stop := extprocBody(t, ctx, a.grpc, 200<<10)
	resp, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if ir := resp.GetImmediateResponse(); ir.GetStatus().GetCode() != 503 || !strings.Contains(string(ir.GetBody()), `"code":"server_busy"`) {
		t.Fatalf("ext_proc stream got %v, want 503 server_busy", resp)
	}
	stop()
	pc.Close()
	waitGauge(t, c, a.metrics, "0 once the proxy client is gone", func(v float64) bool { return v == 0 })

	// 2. An ext_proc stream holds 900 KiB; a proxied request does not fit.
	st, stop = extprocBody(t, ctx, a.grpc, 900<<10)
	defer stop()
	waitGauge(t, c, a.metrics, "the stream's 900 KiB", func(v float64) bool { return v == 900<<10 })
	body := `{"model":"test-model","messages":[{"role":"user","content":"` + strings.Repeat("x", 200<<10) + `"}]}`
	pr, err := c.Post(a.proxy+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(pr.Body)
	pr.Body.Close()
	if pr.StatusCode != 503 || !strings.Contains(string(b), `"code":"server_busy"`) {
		t.Fatalf("proxy got %d %s, want 503 server_busy", pr.StatusCode, b)
	}
	stop()
	waitGauge(t, c, a.metrics, "0 once the stream is gone", func(v float64) bool { return v == 0 })
	stopServe(t, cancel, a.done)
}

// TestServeHTTPProxyHeaderLimit: the proxy port takes request headers up to
// proxy.MaxHeaderBytes (what passes Envoy's default 60 KiB limit passes
// here) and answers 431 beyond.
func TestServeHTTPProxyHeaderLimit(t *testing.T) {
	w := startWorker(t, worker.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	a := startServe(t, ctx, w, nil)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	for _, tc := range []struct {
		size   int
		status int
	}{{50 << 10, 200}, {2 * proxy.MaxHeaderBytes, http.StatusRequestHeaderFieldsTooLarge}} {
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, a.proxy+"/v1/models", nil)
		req.Header.Set("X-Big", strings.Repeat("b", tc.size))
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%d header bytes: status %d, want %d", tc.size, resp.StatusCode, tc.status)
		}
	}
	stopServe(t, cancel, a.done)
}
