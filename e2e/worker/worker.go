// Package worker is a small OpenAI-compatible model server for kvbandit's
// tests: it answers /v1/chat/completions and /v1/completions (JSON, or SSE
// with "stream": true), /v1/models, /health and /metrics (vLLM metric
// names), generates deterministic tokens with an optional per-token delay,
// can inject errors, and records every request it receives so tests can
// check that a body arrived byte for byte and which worker served it. Every
// response carries the worker's own address in the x-worker header. It is
// used only by tests.
package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// HeaderWorker is the response header that names the worker ("ip:port").
const HeaderWorker = "x-worker"

// Config configures a worker.
type Config struct {
	// Model is the served model name (default "test-model"). Requests for
	// another model get vLLM's 404.
	Model string
	// TokenDelay is the time spent on each generated token.
	TokenDelay time.Duration
	// CompletionTokens is how many tokens a request generates when it sets
	// no max_tokens (default 8).
	CompletionTokens int
	// CachedTokens is reported as usage.prompt_tokens_details.cached_tokens
	// (capped at the prompt tokens).
	CachedTokens int
	// FailStatus, when set, makes completion requests fail with this status
	// and an OpenAI error body (see also SetFailStatus).
	FailStatus int
	// Addr is the listen address (default "127.0.0.1:0"); another loopback
	// address (127.0.0.2:8000) gives workers distinct IPs on one port, as
	// pods have.
	Addr string
	// PrefillDelay, when set, makes the worker prefill as an engine does:
	// before its first token a request spends PrefillDelay on each
	// uncached 16-token block of its prompt (text in 64-byte blocks,
	// chained, as a prefix cache holds them), one prefill at a time (a
	// GPU's compute), and its blocks are cached afterwards (up to 1<<16,
	// then the cache starts over). Zero: no prefill time, no cache.
	PrefillDelay time.Duration
}

// Request is what the worker recorded about one request.
type Request struct {
	Seq              int
	Method           string
	Path             string // request URI
	Host             string
	Header           http.Header
	Body             []byte
	ContentLength    int64    // -1 when the body was chunked
	TransferEncoding []string // e.g. ["chunked"]
	Trailer          http.Header
	Received         time.Time
	// Status is the response status, Response the body bytes written;
	// Done says the response was written in full, Canceled that the client
	// went away first.
	Status   int
	Response []byte
	Done     bool
	Canceled bool
}

// Worker is a running fake model server.
type Worker struct {
	cfg        Config
	failStatus atomic.Int64
	running    atomic.Int64
	finished   atomic.Int64 // vllm:request_success_total
	scrapes    atomic.Int64

	mu       sync.Mutex
	started  bool
	ln       net.Listener
	srv      *http.Server
	requests []*Request
	changed  chan struct{}
	wg       sync.WaitGroup

	prefillMu sync.Mutex          // one prefill at a time
	cache     map[uint64]struct{} // prompt blocks cached (PrefillDelay); under prefillMu
}

// New returns a worker; call Start to serve.
func New(cfg Config) *Worker {
	if cfg.Model == "" {
		cfg.Model = "test-model"
	}
	if cfg.CompletionTokens <= 0 {
		cfg.CompletionTokens = 8
	}
	w := &Worker{cfg: cfg, changed: make(chan struct{})}
	w.failStatus.Store(int64(cfg.FailStatus))
	return w
}

// Start listens on Config.Addr (default 127.0.0.1, a random port). ctx is the parent of the
// requests' contexts.
func (w *Worker) Start(ctx context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.started {
		return errors.New("worker: already started")
	}
	addr := w.cfg.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("worker: listen: %w", err)
	}
	w.started = true
	w.ln = ln
	w.srv = &http.Server{
		Handler:           w,
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		_ = w.srv.Serve(ln)
	}()
	return nil
}

// Addr is the worker's "ip:port".
func (w *Worker) Addr() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ln == nil {
		return ""
	}
	return w.ln.Addr().String()
}

// URL is the worker's base URL.
func (w *Worker) URL() string { return "http://" + w.Addr() }

// Model is the served model name.
func (w *Worker) Model() string { return w.cfg.Model }

// Close stops the server and waits for its handlers.
func (w *Worker) Close() error {
	w.mu.Lock()
	srv := w.srv
	w.mu.Unlock()
	if srv == nil {
		return nil
	}
	err := srv.Close()
	w.wg.Wait()
	return err
}

// SetFailStatus makes completion requests fail with code (0: succeed).
func (w *Worker) SetFailStatus(code int) { w.failStatus.Store(int64(code)) }

// Running is the number of completion requests in progress.
func (w *Worker) Running() int { return int(w.running.Load()) }

// Finished is the number of completion requests that generated all their
// tokens (vllm:request_success_total).
func (w *Worker) Finished() int64 { return w.finished.Load() }

// Scrapes counts monitoring requests that did not come through the data
// plane.
func (w *Worker) Scrapes() int64 { return w.scrapes.Load() }

// Requests returns copies of the recorded requests, in arrival order.
func (w *Worker) Requests() []Request {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]Request, len(w.requests))
	for i, r := range w.requests {
		out[i] = *r
		out[i].Header = r.Header.Clone()
		out[i].Trailer = r.Trailer.Clone()
		out[i].Body = slices.Clone(r.Body)
		out[i].Response = slices.Clone(r.Response)
	}
	return out
}

// WaitRequests waits until n requests have finished (Done or Canceled)
// and returns all recorded requests.
func (w *Worker) WaitRequests(ctx context.Context, n int) ([]Request, error) {
	for {
		w.mu.Lock()
		finished := 0
		for _, r := range w.requests {
			if r.Done || r.Canceled {
				finished++
			}
		}
		ch := w.changed
		w.mu.Unlock()
		if finished >= n {
			return w.Requests(), nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return w.Requests(), fmt.Errorf("worker %s: waiting for %d finished requests: %w", w.Addr(), n, ctx.Err())
		}
	}
}

// ClearRequests forgets the recorded requests.
func (w *Worker) ClearRequests() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.requests = nil
}

func (w *Worker) update(f func()) {
	w.mu.Lock()
	defer w.mu.Unlock()
	f()
	close(w.changed)
	w.changed = make(chan struct{})
}

// ServeHTTP records the request, then answers it. Monitoring requests that
// did not come through the data plane (GET /metrics or /health without a
// destination header: kvbandit's load scraper, probes) are answered and
// counted in Scrapes, not recorded.
func (w *Worker) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	if (r.URL.Path == "/metrics" || r.URL.Path == "/health") && r.Header.Get("x-gateway-destination-endpoint") == "" {
		w.scrapes.Add(1)
		sw := &statusWriter{ResponseWriter: rw, status: http.StatusOK}
		sw.Header().Set(HeaderWorker, w.Addr())
		w.route(sw, r, nil)
		return
	}
	body, err := io.ReadAll(r.Body)
	rec := &Request{
		Method:           r.Method,
		Path:             r.RequestURI,
		Host:             r.Host,
		Header:           r.Header.Clone(),
		Body:             body,
		ContentLength:    r.ContentLength,
		TransferEncoding: slices.Clone(r.TransferEncoding),
		Trailer:          r.Trailer.Clone(),
		Received:         time.Now(),
	}
	w.update(func() {
		rec.Seq = len(w.requests) + 1
		w.requests = append(w.requests, rec)
	})
	sw := &statusWriter{ResponseWriter: rw, status: http.StatusOK}
	sw.Header().Set(HeaderWorker, w.Addr())
	if err != nil {
		w.update(func() { rec.Canceled = true })
		return
	}
	w.route(sw, r, body)
	canceled := r.Context().Err() != nil
	w.update(func() {
		rec.Status = sw.status
		rec.Response = sw.body
		rec.Canceled = canceled
		rec.Done = !canceled
	})
}

type statusWriter struct {
	http.ResponseWriter
	status int
	body   []byte
}

func (s *statusWriter) Write(b []byte) (int, error) {
	n, err := s.ResponseWriter.Write(b)
	s.body = append(s.body, b[:n]...)
	return n, err
}

func (s *statusWriter) WriteHeader(code int) {
	s.status = code
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (w *Worker) route(rw *statusWriter, r *http.Request, body []byte) {
	switch r.URL.Path {
	case "/health":
		rw.WriteHeader(http.StatusOK)
	case "/metrics":
		rw.Header().Set("Content-Type", "text/plain; version=0.0.4")
		fmt.Fprintf(rw, "# HELP vllm:num_requests_running Number of requests currently running on GPU.\n"+
			"# TYPE vllm:num_requests_running gauge\n"+
			"vllm:num_requests_running{model_name=%q} %d\n"+
			"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"+
			"# TYPE vllm:num_requests_waiting gauge\n"+
			"vllm:num_requests_waiting{model_name=%q} 0\n"+
			"# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"+
			"# TYPE vllm:kv_cache_usage_perc gauge\n"+
			"vllm:kv_cache_usage_perc{model_name=%q} 0\n"+
			"# HELP vllm:request_success_total Count of successfully processed requests.\n"+
			"# TYPE vllm:request_success_total counter\n"+
			"vllm:request_success_total{finished_reason=\"stop\",model_name=%q} %d\n",
			w.cfg.Model, w.running.Load(), w.cfg.Model, w.cfg.Model, w.cfg.Model, w.finished.Load())
	case "/v1/models":
		writeJSON(rw, http.StatusOK, map[string]any{
			"object": "list",
			"data": []any{map[string]any{
				"id": w.cfg.Model, "object": "model", "created": 1700000000, "owned_by": "kvbandit-e2e", "root": w.cfg.Model,
			}},
		})
	case "/v1/chat/completions":
		w.complete(rw, r, body, true)
	case "/v1/completions":
		w.complete(rw, r, body, false)
	default:
		writeError(rw, http.StatusNotFound, "NotFoundError", "Not Found")
	}
}

// completionRequest is the part of an OpenAI request the worker reads.
type completionRequest struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	MaxTokens           int             `json:"max_tokens"`
	MaxCompletionTokens int             `json:"max_completion_tokens"`
	Messages            json.RawMessage `json:"messages"`
	Prompt              json.RawMessage `json:"prompt"`
}

func (w *Worker) complete(rw *statusWriter, r *http.Request, body []byte, chat bool) {
	if r.Method != http.MethodPost {
		writeError(rw, http.StatusMethodNotAllowed, "BadRequestError", "method not allowed")
		return
	}
	w.running.Add(1)
	defer w.running.Add(-1)
	if code := int(w.failStatus.Load()); code != 0 {
		writeError(rw, code, "InternalServerError", fmt.Sprintf("injected failure (status %d)", code))
		return
	}
	var req completionRequest
	if err := json.Unmarshal(body, &req); err != nil {
		writeError(rw, http.StatusBadRequest, "BadRequestError", "invalid JSON: "+err.Error())
		return
	}
	if req.Model != w.cfg.Model {
		writeError(rw, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", req.Model))
		return
	}
	n := w.cfg.CompletionTokens
	if req.MaxCompletionTokens > 0 {
		n = req.MaxCompletionTokens
	} else if req.MaxTokens > 0 {
		n = req.MaxTokens
	}
	n = min(n, 4096)
	promptText := string(req.Messages) + string(req.Prompt)
	promptTokens := max(1, (len(promptText)+3)/4)
	usage := map[string]any{
		"prompt_tokens":     promptTokens,
		"completion_tokens": n,
		"total_tokens":      promptTokens + n,
		"prompt_tokens_details": map[string]any{
			"cached_tokens": min(w.cfg.CachedTokens, promptTokens),
		},
	}
	id := fmt.Sprintf("cmpl-%s-%d", strings.ReplaceAll(w.Addr(), ":", "-"), time.Now().UnixNano())
	created := time.Now().Unix()
	object := "text_completion"
	if chat {
		object = "chat.completion"
	}
	ctx := r.Context()
	if !w.prefill(ctx, promptText) {
		return
	}

	if !req.Stream {
		for range n {
			if !sleep(ctx, w.cfg.TokenDelay) {
				return
			}
		}
		w.finished.Add(1) // as vLLM: when the engine finishes, before the response is out
		text := Text(n)
		choice := map[string]any{"index": 0, "finish_reason": "stop", "text": text}
		if chat {
			choice = map[string]any{"index": 0, "finish_reason": "stop",
				"message": map[string]any{"role": "assistant", "content": text}}
		}
		writeJSON(rw, http.StatusOK, map[string]any{
			"id": id, "object": object, "created": created, "model": w.cfg.Model,
			"choices": []any{choice}, "usage": usage,
		})
		return
	}
	w.stream(ctx, rw, &req, completion{id: id, created: created, chat: chat, tokens: n, usage: usage})
}

// completion is what one answer of complete says, whichever way it is sent.
type completion struct {
	id      string
	created int64
	chat    bool
	tokens  int
	usage   map[string]any
}

// stream sends the answer as server-sent events, a token every
// Config.TokenDelay, as vLLM streams chat or completion chunks.
func (w *Worker) stream(ctx context.Context, rw *statusWriter, req *completionRequest, c completion) {
	id, created, chat, n, usage := c.id, c.created, c.chat, c.tokens, c.usage
	chunkObject := "text_completion"
	if chat {
		chunkObject = "chat.completion.chunk"
	}
	rw.Header().Set("Content-Type", "text/event-stream")
	rw.Header().Set("Cache-Control", "no-cache")
	rw.WriteHeader(http.StatusOK)
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		if _, err := fmt.Fprintf(rw, "data: %s\n\n", b); err != nil {
			return false
		}
		rw.Flush()
		return true
	}
	chunk := func(choice map[string]any) map[string]any {
		return map[string]any{"id": id, "object": chunkObject, "created": created, "model": w.cfg.Model,
			"choices": []any{choice}}
	}
	if chat && !send(chunk(map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}, "finish_reason": nil})) {
		return
	}
	for i := range n {
		if !sleep(ctx, w.cfg.TokenDelay) {
			return
		}
		var choice map[string]any
		if chat {
			choice = map[string]any{"index": 0, "delta": map[string]any{"content": Token(i)}, "finish_reason": nil}
		} else {
			choice = map[string]any{"index": 0, "text": Token(i), "finish_reason": nil}
		}
		if !send(chunk(choice)) {
			return
		}
	}
	w.finished.Add(1)
	final := map[string]any{"index": 0, "text": "", "finish_reason": "stop"}
	if chat {
		final = map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "stop"}
	}
	if !send(chunk(final)) {
		return
	}
	if req.StreamOptions != nil && req.StreamOptions.IncludeUsage {
		if !send(map[string]any{"id": id, "object": chunkObject, "created": created, "model": w.cfg.Model,
			"choices": []any{}, "usage": usage}) {
			return
		}
	}
	if _, err := io.WriteString(rw, "data: [DONE]\n\n"); err == nil {
		rw.Flush()
	}
}

// Token is the i-th generated token's text.
func Token(i int) string { return fmt.Sprintf("tok%d ", i) }

// Text is the text of n generated tokens.
func Text(n int) string {
	var b strings.Builder
	for i := range n {
		b.WriteString(Token(i))
	}
	return b.String()
}

// prefillBlock is the fake prefix cache's block of prompt text: 64 bytes,
// about 16 tokens at the worker's 4 bytes a token.
const prefillBlock = 64

// prefill spends Config.PrefillDelay on each block of text not cached,
// one request at a time, and caches the blocks. It reports false when ctx
// ended first.
func (w *Worker) prefill(ctx context.Context, text string) bool {
	if w.cfg.PrefillDelay <= 0 {
		return true
	}
	w.prefillMu.Lock()
	defer w.prefillMu.Unlock()
	if w.cache == nil || len(w.cache) > 1<<16 {
		w.cache = map[uint64]struct{}{}
	}
	var h uint64 = 14695981039346656037 // FNV-1a, chained over the blocks
	uncached := 0
	for i := 0; i < len(text); i += prefillBlock {
		for _, c := range []byte(text[i:min(i+prefillBlock, len(text))]) {
			h = (h ^ uint64(c)) * 1099511628211
		}
		if _, ok := w.cache[h]; !ok {
			uncached++
			w.cache[h] = struct{}{}
		}
	}
	return sleep(ctx, time.Duration(uncached)*w.cfg.PrefillDelay)
}

func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func writeJSON(rw http.ResponseWriter, code int, v any) {
	b, _ := json.Marshal(v)
	rw.Header().Set("Content-Type", "application/json")
	rw.WriteHeader(code)
	_, _ = rw.Write(b)
}

// writeError writes vLLM's OpenAI-style error body.
func writeError(rw http.ResponseWriter, code int, typ, msg string) {
	writeJSON(rw, code, map[string]any{
		"error": map[string]any{"message": msg, "type": typ, "param": nil, "code": code},
	})
}
