package app

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/extproc/proxy"
)

// startProxyServe runs serve with the standalone proxy on loopback in front
// of one worker and returns the proxy's base URL and serve's result.
func startProxyServe(t *testing.T, ctx context.Context, w *worker.Worker, drain time.Duration) (string, <-chan error) {
	t.Helper()
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	hl := listen()
	ready := make(chan struct{})
	ls := &Listeners{GRPC: listen(), Health: listen(), HTTP: hl, Ready: func(string, string, string) { close(ready) }}
	o := ServeOptions{Endpoints: w.Addr(), Policy: "kv", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second,
		DrainTimeout: drain, StopGrace: 100 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text"}
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)), ls) }()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("serve exited: %v", err)
	}
	return "http://" + hl.Addr().String(), done
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
