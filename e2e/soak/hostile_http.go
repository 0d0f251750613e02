package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"time"
)

// rawAnswer is what a raw HTTP/1.1 exchange got back.
type rawAnswer struct {
	status   int
	header   http.Header
	body     []byte
	after    time.Duration // from the first byte sent to the status line
	writeErr error
}

// rawHTTP sends an HTTP/1.1 request by hand on a new connection to addr:
// head is the request line and headers (without the blank line), and
// writeBody writes the body however slowly it likes (it must stop when
// ctx ends). The response is read concurrently, so an answer that comes
// before the body is complete is seen. The connection is closed on
// return.
func rawHTTP(ctx context.Context, addr, head string, writeBody func(ctx context.Context, c net.Conn) error) (rawAnswer, error) {
	var a rawAnswer
	c, err := dialTCP(ctx, addr, 5*time.Second)
	if err != nil {
		return a, err
	}
	defer c.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	start := time.Now()

	type readResult struct {
		status int
		header http.Header
		body   []byte
		err    error
		at     time.Duration
	}
	readDone := make(chan readResult, 1)
	sentAll := make(chan struct{})
	go func() {
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			readDone <- readResult{err: err}
			return
		}
		at := time.Since(start)
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
		resp.Body.Close()
		readDone <- readResult{status: resp.StatusCode, header: resp.Header, body: b, at: at}
	}()
	go func() {
		if _, err := io.WriteString(c, head+"\r\n\r\n"); err != nil {
			a.writeErr = err
		} else if writeBody != nil {
			a.writeErr = writeBody(ctx, c)
		}
		close(sentAll)
	}()
	r := <-readDone
	cancel() // stops a body writer still sending
	<-sentAll
	if r.err != nil {
		return a, r.err
	}
	a.status, a.header, a.body, a.after = r.status, r.header, r.body, r.at
	return a, nil
}

// sleepCtx waits d unless ctx ends first (false).
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func postHead(path, host string, contentLength int64, extra ...string) string {
	h := []string{"POST " + path + " HTTP/1.1", "Host: " + host, "Content-Type: application/json"}
	if contentLength >= 0 {
		h = append(h, fmt.Sprintf("Content-Length: %d", contentLength))
	}
	return strings.Join(append(h, extra...), "\r\n")
}

// hugeContentLength declares a big body (within or beyond the limit) and
// sends one byte: the server must answer (413 at once beyond the limit, a
// timeout within it) rather than wait or allocate what was promised.
func (e *env) hugeContentLength(addr string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		declared := []int64{e.maxBody - 1, e.maxBody / 2, 4 * e.maxBody, 1 << 40}[rng.IntN(4)]
		a, err := rawHTTP(ctx, addr, postHead("/v1/chat/completions", addr, declared), func(ctx context.Context, c net.Conn) error {
			if _, err := c.Write([]byte("{")); err != nil {
				return err
			}
			<-ctx.Done() // the rest never comes
			return nil
		})
		if err != nil {
			if ctx.Err() != nil {
				return failf("declared %s, sent 1 byte: no answer within the request timeout", sizeText(declared))
			}
			return failf("declared %s: %s", sizeText(declared), errText(err))
		}
		switch a.status {
		case http.StatusRequestEntityTooLarge, http.StatusRequestTimeout, http.StatusServiceUnavailable, http.StatusBadRequest:
			return ok()
		}
		return failf("declared %s, sent 1 byte: status %d: %s", sizeText(declared), a.status, errorCode(a.body))
	}
}

func sizeText(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%d GiB", n>>30)
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d B", n)
}

// slowBody sends a valid body a few bytes at a time, much slower than the
// decision timeout: the server must give up on it (408/503) before it is
// complete.
func (e *env) slowBody(addr string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		body := chatRequest(model, e.chatMessages(rng), false, 8, nil)
		step := 8 + rng.IntN(24)
		pause := time.Duration(300+rng.IntN(700)) * time.Millisecond
		a, err := rawHTTP(ctx, addr, postHead("/v1/chat/completions", addr, int64(len(body))), func(ctx context.Context, c net.Conn) error {
			for off := 0; off < len(body); off += step {
				if _, err := c.Write(body[off:min(off+step, len(body))]); err != nil {
					return err
				}
				if !sleepCtx(ctx, pause) {
					return nil
				}
			}
			return nil
		})
		if err != nil {
			if ctx.Err() != nil {
				return failf("slow body: no answer within the request timeout")
			}
			return failf("slow body: %s", errText(err))
		}
		switch a.status {
		case http.StatusRequestTimeout, http.StatusServiceUnavailable:
			return ok()
		}
		return failf("slow body: status %d (%s), not a timeout answer", a.status, errorCode(a.body))
	}
}

// traversalPaths try to leave /v1/ for the workers' or kvbandit's own
// pages.
var traversalPaths = []string{
	"/v1/../metrics", "/v1/%2e%2e/metrics", "/v1/%2E%2E/metrics", "/v1/..%2fmetrics", "/v1/..%2Fmetrics",
	"/v1/chat/completions/../../metrics", "/v1/models/%2e%2e/%2e%2e/metrics", "/v1//../metrics",
	"/v1/./../debug/endpoints", "/v1/%2e%2e/debug/endpoints", "/v1/../health", "/%2e%2e/v1/models",
	"/v1/%252e%252e/metrics", "/v1/.%2e/metrics", "/v1/models/..", "/v1/..;/metrics",
}

// pageMarkers betray a page outside the OpenAI API.
var pageMarkers = []string{"vllm:", "# HELP", "# TYPE", "go_goroutines", `"discovery"`, "kvbandit_"}

func (e *env) traversal(addr string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		path := traversalPaths[rng.IntN(len(traversalPaths))]
		var head string
		var body []byte
		if rng.IntN(2) == 0 {
			head = "GET " + path + " HTTP/1.1\r\nHost: " + addr
		} else {
			body = chatRequest(model, e.chatMessages(rng), false, 4, nil)
			head = postHead(path, addr, int64(len(body)))
		}
		a, err := rawHTTP(ctx, addr, head, func(_ context.Context, c net.Conn) error {
			_, err := c.Write(body)
			return err
		})
		if err != nil {
			return failf("%s: %s", path, errText(err))
		}
		for _, m := range pageMarkers {
			if bytes.Contains(a.body, []byte(m)) {
				return failf("%s escaped /v1/: status %d, the body holds %q", path, a.status, m)
			}
		}
		if a.status >= 500 && a.status != http.StatusServiceUnavailable {
			return failf("%s: status %d: %s", path, a.status, errorCode(a.body))
		}
		return ok()
	}
}

// spoofHeaders pose as the data plane's and the picker's own headers.
func (e *env) spoofHeaders(rng *rand.Rand) map[string]string {
	target := []string{e.metricsAddr, "10.1.2.3:8000", "127.0.0.1:1", e.grpcAddr, "[::1]:9", "not-an-address"}[rng.IntN(6)]
	return map[string]string{
		"x-gateway-destination-endpoint":        target,
		"x-gateway-destination-endpoint-served": target,
		"x-gateway-destination-endpoint-subset": target,
		"x-data-parallel-rank":                  fmt.Sprint(rng.IntN(64)),
		"x-prefiller-host-port":                 target,
		headerEndpoint:                          target,
		tenantHeader:                            "tenant-0",
	}
}

// spoof sends a normal request with spoofed routing headers: it must be
// routed to a worker of kvbandit's choosing as usual.
func (e *env) spoof(base string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		r, err := e.post(ctx, base, "/v1/chat/completions", chatRequest(model, e.chatMessages(rng), false, 8, nil), e.spoofHeaders(rng))
		res := expect200(r, err, false)
		if res.kind == resultOK && base == e.proxyURL {
			if ep := r.header.Get(headerEndpoint); !e.isWorker(ep) {
				return failf("spoofed destination honoured: served by %q", ep)
			}
		}
		return res
	}
}

// hugeHeader sends one header of 256 KiB to 4 MiB: the server must refuse
// it (431) or close the connection, not buffer it.
func (e *env) hugeHeader(addr string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		n := (256 << 10) << rng.IntN(5)
		head := postHead("/v1/chat/completions", addr, 2) + "\r\nX-Big: " + strings.Repeat("a", n)
		a, err := rawHTTP(ctx, addr, head, func(_ context.Context, c net.Conn) error {
			_, err := c.Write([]byte("{}"))
			return err
		})
		if err != nil {
			if ctx.Err() != nil {
				return failf("%s header: no answer within the request timeout", sizeText(int64(n)))
			}
			return ok() // the connection was closed on us: refused
		}
		if a.status >= 500 && a.status != http.StatusServiceUnavailable {
			return failf("%s header: status %d: %s", sizeText(int64(n)), a.status, errorCode(a.body))
		}
		return ok()
	}
}

// manyHeaders sends a normal request with 1,000 to 16,000 small headers.
func (e *env) manyHeaders(base string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		n := 1000 << rng.IntN(5)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions",
			bytes.NewReader(chatRequest(model, e.chatMessages(rng), false, 8, nil)))
		if err != nil {
			return failf("%v", err)
		}
		req.Header.Set("content-type", "application/json")
		for i := range n {
			req.Header[fmt.Sprintf("X-H-%d", i)] = []string{fmt.Sprintf("v%d", rng.Uint32())}
		}
		resp, err := e.http.Do(req)
		if err != nil {
			if ctx.Err() != nil {
				return failf("%d headers: no answer within the request timeout", n)
			}
			return ok() // refused by closing the connection
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, maxReply))
		if resp.StatusCode >= 500 && resp.StatusCode != http.StatusServiceUnavailable {
			return failf("%d headers: status %d: %s", n, resp.StatusCode, errorCode(b))
		}
		return ok()
	}
}
