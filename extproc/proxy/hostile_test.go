package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/routing"
)

// rawConn is a client connection that writes bytes exactly as given.
type rawConn struct {
	net.Conn
	r *bufio.Reader
}

func dialRaw(t testing.TB, baseURL string) *rawConn {
	t.Helper()
	u, err := url.Parse(baseURL)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &rawConn{Conn: c, r: bufio.NewReader(c)}
}

// send writes a request head with the given target and extra header lines.
func (c *rawConn) send(t testing.TB, method, target string, header ...string) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: kvbandit.test\r\n", method, target)
	for _, h := range header {
		b.WriteString(h + "\r\n")
	}
	b.WriteString("\r\n")
	if _, err := c.Write([]byte(b.String())); err != nil {
		t.Fatal(err)
	}
}

// response reads one response, waiting at most d.
func (c *rawConn) response(d time.Duration) (*http.Response, []byte, error) {
	_ = c.SetReadDeadline(time.Now().Add(d))
	resp, err := http.ReadResponse(c.r, nil)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, b, err
}

// errorCode checks an OpenAI-style error reply and returns its code.
func errorCode(t testing.TB, resp *http.Response, body []byte) string {
	t.Helper()
	var e struct {
		Error struct{ Message, Type, Code string }
	}
	if err := json.Unmarshal(body, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
		t.Errorf("not an OpenAI error body (%v): %s", err, body)
	}
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") || resp.Header.Get(extproc.HeaderError) != e.Error.Code {
		t.Errorf("headers %v for code %q", resp.Header, e.Error.Code)
	}
	return e.Error.Code
}

// waitFor polls cond for up to d.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after %v: %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func heapInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// TestProxyDeclaredLengthFlood: connections that declare a 16 MiB body and
// send one byte cost what they sent, not what they promised, and are
// answered 503 decision_timeout once the decision deadline passes.
func TestProxyDeclaredLengthFlood(t *testing.T) {
	const (
		conns = 60
		// Long enough for all 60 connections to be waiting at once on a
		// loaded 2-core machine under -race, when the heap is measured.
		timeout = 2 * time.Second
		bound   = 32 << 20 // the unfixed proxy held 60 x 16 MiB here
	)
	f := newFixture(t, options{workers: 1, cfg: proxy.Config{DecisionTimeout: timeout}})
	before := heapInUse()
	cs := make([]*rawConn, conns)
	sent := make([]time.Time, conns)
	for i := range cs {
		cs[i] = dialRaw(t, f.url)
		cs[i].send(t, "POST", "/v1/chat/completions", "Content-Type: application/json", "Content-Length: 16777216")
		if _, err := cs[i].Write([]byte("{")); err != nil {
			t.Fatal(err)
		}
		sent[i] = time.Now()
	}
	waitFor(t, 5*time.Second, "every connection in the proxy", func() bool { return f.proxy.InFlight() == conns })
	after := heapInUse()
	growth := int64(after) - int64(before)
	t.Logf("heap growth with %d connections waiting: %.1f MiB", conns, float64(growth)/(1<<20))
	if growth > bound {
		t.Errorf("heap grew by %d MiB with %d connections waiting, bound %d MiB", growth>>20, conns, bound>>20)
	}

	var wg sync.WaitGroup
	errs := make(chan error, conns)
	for i, c := range cs {
		wg.Go(func() {
			resp, body, err := c.response(timeout + 3*time.Second)
			if err != nil {
				errs <- fmt.Errorf("conn %d: no answer: %w", i, err)
				return
			}
			took := time.Since(sent[i])
			var e struct{ Error struct{ Code string } }
			_ = json.Unmarshal(body, &e)
			switch {
			case resp.StatusCode != http.StatusServiceUnavailable || e.Error.Code != "decision_timeout":
				errs <- fmt.Errorf("conn %d: %d %s", i, resp.StatusCode, body)
			case took > timeout+2*time.Second:
				errs <- fmt.Errorf("conn %d answered after %v (timeout %v)", i, took, timeout)
			}
			// The connection is closed after the answer: the rest of the
			// body will never be read.
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			if n, err := c.r.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
				errs <- fmt.Errorf("conn %d still open after the answer: %d, %v", i, n, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	waitFor(t, 2*time.Second, "in-flight back to 0", func() bool { return f.proxy.InFlight() == 0 })
	if got, d := f.out.snapshot(); len(got) != 0 || d != 0 {
		t.Errorf("%d decisions, %d outcomes for bodies that never arrived", d, len(got))
	}
}

// TestProxySlowBodyCut: a body trickling at one byte per 100 ms is cut at
// the decision deadline with 503 decision_timeout and the JSON error.
func TestProxySlowBodyCut(t *testing.T) {
	const timeout = 300 * time.Millisecond
	f := newFixture(t, options{workers: 1, cfg: proxy.Config{DecisionTimeout: timeout}})
	body := chatBody("test-model", "slow", "")
	c := dialRaw(t, f.url)
	start := time.Now()
	c.send(t, "POST", "/v1/chat/completions", "Content-Type: application/json", fmt.Sprintf("Content-Length: %d", len(body)))
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	trickled := make(chan struct{})
	go func() {
		defer close(trickled)
		for _, b := range body {
			select {
			case <-ctx.Done():
				return
			case <-time.After(100 * time.Millisecond):
			}
			if _, err := c.Write([]byte{b}); err != nil {
				return
			}
		}
	}()
	resp, b, err := c.response(5 * time.Second)
	took := time.Since(start)
	cancel()
	<-trickled
	if err != nil {
		t.Fatalf("no answer after %v: %v", took, err)
	}
	if resp.StatusCode != http.StatusServiceUnavailable || errorCode(t, resp, b) != "decision_timeout" {
		t.Fatalf("got %d %s, want 503 decision_timeout", resp.StatusCode, b)
	}
	if took < timeout || took > timeout+1500*time.Millisecond {
		t.Errorf("answered after %v, timeout %v", took, timeout)
	}
	if n := len(f.workers[0].Requests()); n != 0 {
		t.Errorf("worker got %d requests", n)
	}
	waitFor(t, 2*time.Second, "in-flight back to 0", func() bool { return f.proxy.InFlight() == 0 })
}

// TestProxyDeadlineDoesNotCutResponse: the body read deadline is cleared
// once the body is in: a stream much longer than the decision timeout runs
// to its end, and the keep-alive connection serves the next request.
func TestProxyDeadlineDoesNotCutResponse(t *testing.T) {
	f := newFixture(t, options{workers: 1, cfg: proxy.Config{DecisionTimeout: 200 * time.Millisecond}, wcfg: worker.Config{TokenDelay: 50 * time.Millisecond}})
	for range 2 {
		resp, b := f.post(t, "/v1/chat/completions", chatBody("test-model", "stream", `,"stream":true,"max_tokens":20`))
		if resp.StatusCode != 200 || !strings.HasSuffix(string(b), "data: [DONE]\n\n") {
			t.Fatalf("%d %q", resp.StatusCode, b)
		}
	}
	for _, o := range f.out.wait(t, 2) {
		if o.Kind != routing.OutcomeSuccess {
			t.Errorf("outcome %+v", o)
		}
	}
}

// TestProxyMaxInflight: with MaxInflight 2 and two requests held at the
// worker, a third (declaring a body it never sends) is refused at once.
func TestProxyMaxInflight(t *testing.T) {
	f := newFixture(t, options{workers: 1, cfg: proxy.Config{MaxInflight: 2, DecisionTimeout: 10 * time.Second}, wcfg: worker.Config{TokenDelay: 50 * time.Millisecond}})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var held []*http.Response
	for range 2 {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.url+"/v1/chat/completions",
			bytes.NewReader(chatBody("test-model", "hold", `,"stream":true,"max_tokens":1000`)))
		resp, err := f.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
			t.Fatal(err)
		}
		held = append(held, resp)
	}
	c := dialRaw(t, f.url)
	start := time.Now()
	c.send(t, "POST", "/v1/chat/completions", "Content-Type: application/json", "Content-Length: 1000")
	resp, b, err := c.response(5 * time.Second)
	if err != nil {
		t.Fatalf("third request: %v", err)
	}
	if resp.StatusCode != http.StatusServiceUnavailable || errorCode(t, resp, b) != "too_many_requests_in_flight" {
		t.Fatalf("third request: %d %s", resp.StatusCode, b)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("refused after %v", took)
	}
	// The unread body is not drained: the connection is closed.
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if n, err := c.r.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
		t.Errorf("connection still open after the refusal: %d, %v", n, err)
	}
	cancel()
	for _, r := range held {
		_, _ = io.Copy(io.Discard, r.Body)
	}
	waitFor(t, 5*time.Second, "in-flight back to 0", func() bool { return f.proxy.InFlight() == 0 })
	f.out.wait(t, 2)
	f.inflightZero(t)
	// Capacity is back.
	if resp, b := f.post(t, "/v1/chat/completions", chatBody("test-model", "again", "")); resp.StatusCode != 200 {
		t.Fatalf("after the held requests ended: %d %s", resp.StatusCode, b)
	}
}

// TestProxyBufferBudget: bytes are charged to the budget as they arrive and
// given back when the request ends; a request that does not fit is
// answered 503 server_busy.
func TestProxyBufferBudget(t *testing.T) {
	budget := extproc.NewBudget(64 << 10)
	f := newFixture(t, options{workers: 1, budget: budget, cfg: proxy.Config{DecisionTimeout: 10 * time.Second}})
	// A slow client holds 60 KiB of a 100 KiB body.
	c := dialRaw(t, f.url)
	c.send(t, "POST", "/v1/chat/completions", "Content-Type: application/json", "Content-Length: 102400")
	if _, err := c.Write(bytes.Repeat([]byte(" "), 60<<10)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "60 KiB charged", func() bool { return budget.Used() == 60<<10 })

	resp, b := f.post(t, "/v1/chat/completions", chatBody("test-model", strings.Repeat("x", 8<<10), ""))
	if resp.StatusCode != http.StatusServiceUnavailable || errorCode(t, resp, b) != "server_busy" {
		t.Fatalf("got %d %s, want 503 server_busy", resp.StatusCode, b)
	}
	if u := budget.Used(); u != 60<<10 {
		t.Errorf("budget holds %d bytes after the refusal, want %d", u, 60<<10)
	}
	c.Close()
	waitFor(t, 5*time.Second, "the slow client's bytes released", func() bool { return budget.Used() == 0 })
	resp, b = f.post(t, "/v1/chat/completions", chatBody("test-model", strings.Repeat("x", 8<<10), ""))
	if resp.StatusCode != 200 {
		t.Fatalf("after release: %d %s", resp.StatusCode, b)
	}
	if u := budget.Used(); u != 0 {
		t.Errorf("budget holds %d bytes after the request ended", u)
	}
	f.out.wait(t, 1)
}

// TestProxyRefusalReachesASendingClient: a request refused part-way
// through its body (here: the buffer budget) is answered, and the
// connection then ends with a close, not a reset: closing with unread bytes
// makes the kernel reset the connection, and a client still writing its
// body (Go's client, seen once in CI) reports "write: connection reset by
// peer" instead of the 503. The proxy drains for a bounded time first.
func TestProxyRefusalReachesASendingClient(t *testing.T) {
	budget := extproc.NewBudget(64 << 10)
	f := newFixture(t, options{workers: 1, budget: budget, cfg: proxy.Config{DecisionTimeout: 10 * time.Second}})
	for i := range 5 {
		c := dialRaw(t, f.url)
		const size = 200 << 10
		c.send(t, "POST", "/v1/chat/completions", "Content-Type: application/json", fmt.Sprintf("Content-Length: %d", size))
		// The whole body, written at once; the write may fail once the
		// proxy has closed, but the answer must be there to read.
		_, _ = c.Write(bytes.Repeat([]byte(" "), size))
		resp, b, err := c.response(5 * time.Second)
		if err != nil {
			t.Fatalf("request %d: no answer: %v", i, err)
		}
		if resp.StatusCode != http.StatusServiceUnavailable || errorCode(t, resp, b) != "server_busy" {
			t.Fatalf("request %d: got %d %s, want 503 server_busy", i, resp.StatusCode, b)
		}
		// The proxy ends the connection with a close, not a reset.
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		if n, err := c.r.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
			t.Fatalf("request %d: after the refusal: %d, %v, want a clean close (EOF)", i, n, err)
		}
		c.Close()
	}
	waitFor(t, 5*time.Second, "budget back to 0", func() bool { return budget.Used() == 0 })
}

// TestProxyHostilePaths: paths are decoded once, refused when they hide
// separators or dot segments, cleaned, and must stay under /v1/; the worker
// only ever sees the cleaned path.
func TestProxyHostilePaths(t *testing.T) {
	f := newFixture(t, options{workers: 1})
	cases := []struct {
		target string
		status int
		code   string // error code, or "" when forwarded
		want   string // the path the worker must see when forwarded
	}{
		{"/v1/../../etc/passwd", 404, "not_found", ""},
		{"/v1/%2e%2e/metrics", 400, "invalid_path", ""},
		{"/v1/..%2fmetrics", 400, "invalid_path", ""},
		{"/v1/./../x", 404, "not_found", ""},
		{"//v1/..", 404, "not_found", ""},
		{"/v1/chat/completions/../../metrics", 0, "", "/v1/metrics"},
		{"/v1/models%2F..%2F..%2Fmetrics", 400, "invalid_path", ""},
		{"/v1/..%5Cmetrics", 400, "invalid_path", ""},
		{"/v1/..\\metrics", 400, "invalid_path", ""},
		{"/v1/%252e%252e/metrics", 400, "invalid_path", ""},
		{"/v1/.%2E/.%2e/metrics", 400, "invalid_path", ""},
		{"/v1/%00", 400, "invalid_path", ""},
		{"/v1", 404, "not_found", ""},
		{"/v1/..", 404, "not_found", ""},
		{"/v1//files", 0, "", "/v1/files"},
		{"/v1/x/../files?limit=2", 0, "", "/v1/files?limit=2"},
		{"/v1/files/a%20b", 0, "", "/v1/files/a%20b"},
	}
	for _, c := range cases {
		t.Run(c.target, func(t *testing.T) {
			f.workers[0].ClearRequests()
			rc := dialRaw(t, f.url)
			rc.send(t, "GET", c.target)
			resp, b, err := rc.response(5 * time.Second)
			if err != nil {
				t.Fatal(err)
			}
			reqs := f.workers[0].Requests()
			if c.code != "" {
				if resp.StatusCode != c.status || errorCode(t, resp, b) != c.code {
					t.Errorf("got %d %s, want %d %s", resp.StatusCode, b, c.status, c.code)
				}
				if len(reqs) != 0 {
					t.Errorf("the worker saw %q", reqs[0].Path)
				}
				return
			}
			if c.status != 0 && resp.StatusCode != c.status {
				t.Errorf("status %d %s, want %d", resp.StatusCode, b, c.status)
			}
			if resp.Header.Get(proxy.HeaderEndpoint) == "" || len(reqs) != 1 || reqs[0].Path != c.want {
				t.Errorf("worker requests %+v, want one for %q", reqs, c.want)
			}
		})
	}
	// Classification uses the cleaned path too: this is a chat request.
	f.workers[0].ClearRequests()
	// "messages" of the wrong type is the chat parser's 400; any other
	// path only reads "model".
	resp, b := f.post(t, "/v1/models/../chat/%63ompletions", []byte(`{"model":"test-model","messages":"x"}`))
	if resp.StatusCode != 400 || errorCode(t, resp, b) != "invalid_field" {
		t.Errorf("chat through a dotted path: %d %s, want the chat parser's 400 invalid_field", resp.StatusCode, b)
	}
	resp, b = f.post(t, "/v1/chat/completions/../models", []byte(`{"model":"test-model","messages":"x"}`))
	if reqs := f.workers[0].Requests(); resp.StatusCode == 400 || len(reqs) != 1 || reqs[0].Path != "/v1/chat/models" {
		t.Errorf("/v1/chat/completions/../models: %d %s, worker saw %+v", resp.StatusCode, b, reqs)
	}
}

// TestProxyWorkerHeaderLimit: a worker's response headers are bounded; an
// oversized set is answered 503 upstream_unavailable.
func TestProxyWorkerHeaderLimit(t *testing.T) {
	huge := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("X-Huge", strings.Repeat("h", 2*proxy.MaxResponseHeaderBytes))
		w.WriteHeader(http.StatusOK)
	}))
	defer huge.Close()
	f := newFixture(t, options{endpoints: []routing.Endpoint{{Key: routing.EndpointKey(strings.TrimPrefix(huge.URL, "http://"))}}})
	resp, b := f.post(t, "/v1/chat/completions", chatBody("m", "hi", ""))
	if resp.StatusCode != http.StatusServiceUnavailable || errorCode(t, resp, b) != "upstream_unavailable" {
		t.Fatalf("got %d (%d header bytes) %.200s", resp.StatusCode, len(resp.Header.Get("X-Huge")), b)
	}
	if o := f.out.wait(t, 1)[0]; o.Kind != routing.OutcomeUpstreamError {
		t.Errorf("outcome %+v", o)
	}
}

// FuzzPath: proxy.CleanPath either refuses a path (invalid_path or
// not_found) or returns a clean path under /v1/ which, escaped for the
// worker and decoded there, is the same path. Seeds: testdata/fuzz/FuzzPath.
func FuzzPath(f *testing.F) {
	f.Fuzz(func(t *testing.T, in string) {
		out, err := proxy.CleanPath(in)
		if err != nil {
			if out != "" || !errors.Is(err, openai.ErrInvalidPath) && !errors.Is(err, proxy.ErrNotFound) {
				t.Fatalf("CleanPath(%q) = %q, %v", in, out, err)
			}
			return
		}
		if !strings.HasPrefix(out, "/v1/") || strings.Contains(out, "//") || strings.ContainsAny(out, "\\%") {
			t.Fatalf("CleanPath(%q) = %q", in, out)
		}
		for seg := range strings.SplitSeq(out, "/") {
			if seg == "." || seg == ".." {
				t.Fatalf("CleanPath(%q) = %q has a dot segment", in, out)
			}
		}
		// What the worker receives: the escaped form, decoded once.
		sent := (&url.URL{Path: out}).RequestURI()
		u, err := url.ParseRequestURI(sent)
		if err != nil {
			t.Fatalf("CleanPath(%q) = %q sent as %q: %v", in, out, sent, err)
		}
		if u.Path != out {
			t.Fatalf("CleanPath(%q) = %q sent as %q, the worker reads %q", in, out, sent, u.Path)
		}
		if again, err := proxy.CleanPath(sent); err != nil || again != out {
			t.Fatalf("CleanPath(%q) = %q sent as %q cleans to %q, %v", in, out, sent, again, err)
		}
	})
}

// TestProxyRefusalDoesNotWaitForBody: a request refused before its body is
// read (bad path, outside /v1/, wrong method, declared length over the
// limit) is answered at once although the body never comes, and its
// connection is closed rather than drained.
func TestProxyRefusalDoesNotWaitForBody(t *testing.T) {
	f := newFixture(t, options{workers: 1, cfg: proxy.Config{MaxBodyBytes: 1 << 20, DecisionTimeout: 30 * time.Second}})
	cases := []struct {
		method, target, length string
		status                 int
	}{
		{"POST", "/v1/%2e%2e/chat/completions", "1000", 400},
		{"POST", "/admin", "1000", 404},
		{"GET", proxy.RoutePath, "1000", 405},
		{"POST", "/v1/chat/completions", "2097152", 413},
	}
	for _, c := range cases {
		t.Run(c.method+" "+c.target, func(t *testing.T) {
			rc := dialRaw(t, f.url)
			start := time.Now()
			rc.send(t, c.method, c.target, "Content-Type: application/json", "Content-Length: "+c.length)
			resp, b, err := rc.response(5 * time.Second)
			if err != nil {
				t.Fatalf("no answer after %v: %v", time.Since(start), err)
			}
			if resp.StatusCode != c.status || !resp.Close {
				t.Errorf("got %d (close %v) %s, want %d and close", resp.StatusCode, resp.Close, b, c.status)
			}
			if took := time.Since(start); took > time.Second {
				t.Errorf("answered after %v", took)
			}
			_ = rc.SetReadDeadline(time.Now().Add(2 * time.Second))
			if n, err := rc.r.Read(make([]byte, 1)); n != 0 || !errors.Is(err, io.EOF) {
				t.Errorf("connection still open: %d, %v", n, err)
			}
		})
	}
	waitFor(t, 2*time.Second, "in-flight back to 0", func() bool { return f.proxy.InFlight() == 0 })
}
