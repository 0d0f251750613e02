package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/internal/tracing"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// HeaderEndpoint is the response header naming the endpoint ("ip:port")
// that served the request (the proxy's counterpart of Envoy's
// x-gateway-destination-endpoint-served).
const HeaderEndpoint = "x-kvbandit-endpoint"

// RoutePath answers which endpoint a request would go to, without routing
// it.
const RoutePath = "/v1/route"

// Engine is what the proxy needs from the routing engine: committed picks
// for proxied requests and side-effect-free scoring for /v1/route.
// *routing.Engine implements it.
type Engine interface {
	routing.Picker
	routing.Scorer
}

var _ Engine = (*routing.Engine)(nil)

// Limits on the proxy's HTTP exchanges.
const (
	// MaxHeaderBytes is the request header limit the proxy's http.Server
	// should use (serve sets it; net/http answers 431 beyond). It is a
	// little above Envoy's default request header limit (60 KiB), so a
	// client that works through Envoy works through the proxy.
	MaxHeaderBytes = 64 << 10
	// MaxResponseHeaderBytes bounds a worker's response headers
	// ([NewTransport]); beyond it the request fails as upstream_unavailable.
	MaxResponseHeaderBytes = 64 << 10
	// initialBodyBuffer is the largest buffer allocated for a request body
	// before its bytes arrive: the buffer grows with the bytes received,
	// never with the Content-Length a client declares.
	initialBodyBuffer = 16 << 10
)

// Config holds the proxy's limits. Zero fields take the ext_proc defaults.
type Config struct {
	// MaxBodyBytes is the largest request body accepted (413 beyond).
	MaxBodyBytes int64
	// MaxInflight is the number of requests handled at once (503
	// too_many_requests_in_flight beyond, before any body is read). It is
	// the proxy's own count, with the same limit as the ext_proc server's
	// (--max-inflight).
	MaxInflight int
	// MaxBufferedBytes sizes the proxy's private buffer budget when
	// Deps.Budget is nil (0: max(4 x MaxBodyBytes, 256 MiB), as the ext_proc
	// server's).
	MaxBufferedBytes int64
	// DecisionTimeout bounds request headers → decision, the body read
	// included (503 decision_timeout beyond), as --decision-timeout does on
	// the ext_proc path; it never applies to the response.
	DecisionTimeout time.Duration
	// TenantHeader names the request header that carries the tenant.
	TenantHeader string
	// MaxSSEEvent bounds one buffered SSE event (and a JSON response kept
	// for its usage).
	MaxSSEEvent int
	// TokenizerTimeout bounds one request's tokenization.
	TokenizerTimeout time.Duration
	// ModelsCacheTTL and ModelsTimeout tune the /v1/models listing: how
	// long a worker's answer is reused (0: DefaultModelsCacheTTL) and how
	// long one worker is waited for (0: DefaultModelsTimeout).
	ModelsCacheTTL, ModelsTimeout time.Duration
	// PDMode says who runs a disaggregated request's prefill stage: the
	// decode worker's sidecar ("" or PDModeSidecar) or the proxy
	// (PDModeDirect).
	PDMode PDMode
	// PrefillTimeout bounds the direct mode's prefill stage (0:
	// DefaultPrefillTimeout); MaxPrefillResponseBytes bounds the prefill
	// worker's answer (0: the larger of 1 MiB and MaxBodyBytes). Beyond
	// either the request is served aggregated.
	PrefillTimeout          time.Duration
	MaxPrefillResponseBytes int64
}

func (c *Config) defaults() {
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = extproc.DefaultMaxBodyBytes
	}
	if c.MaxInflight <= 0 {
		c.MaxInflight = extproc.DefaultMaxInflight
	}
	if c.MaxBufferedBytes <= 0 {
		c.MaxBufferedBytes = extproc.DefaultMaxBufferedBytes(c.MaxBodyBytes)
	}
	if c.DecisionTimeout <= 0 {
		c.DecisionTimeout = extproc.DefaultDecisionTimeout
	}
	if c.MaxSSEEvent <= 0 {
		c.MaxSSEEvent = extproc.DefaultMaxSSEEvent
	}
	if c.TokenizerTimeout <= 0 {
		c.TokenizerTimeout = extproc.DefaultTokenizerTimeout
	}
	if c.PDMode == "" {
		c.PDMode = PDModeSidecar
	}
	if c.PrefillTimeout <= 0 {
		c.PrefillTimeout = DefaultPrefillTimeout
	}
	if c.MaxPrefillResponseBytes <= 0 {
		c.MaxPrefillResponseBytes = max(minPrefillResponseBytes, c.MaxBodyBytes)
	}
}

// Deps are the proxy's injected dependencies; nil fields get defaults
// except Engine, which is required.
type Deps struct {
	Engine    Engine
	Tokenizer extproc.Tokenizer
	Logger    *slog.Logger
	// Registry receives the proxy's metrics (a private registry when nil).
	Registry prometheus.Registerer
	// Clock must be the engine's clock: TTFT and latency are measured
	// from Decision.At.
	Clock clock.Clock
	// Transport carries requests to the workers; nil: [NewTransport].
	Transport http.RoundTripper
	// Budget bounds the request body bytes held at once; serve shares one
	// with the ext_proc server. nil: a private one of
	// Config.MaxBufferedBytes.
	Budget *extproc.Budget
	// Objectives gives the priority of a request's InferenceObjective
	// (x-gateway-inference-objective) when the request gave none; nil when
	// objectives are not discovered (see hints.ApplyObjective).
	Objectives hints.Priorities
	// Fleet lists the endpoints whose models GET /v1/models lists; nil:
	// Engine, when it is a Fleet (*routing.Engine is), else /v1/models is
	// forwarded like any other path.
	Fleet Fleet
	// Tracer records each proxied request's spans and hands the trace
	// context to the worker (traceparent); nil: tracing off, headers
	// passed through untouched.
	Tracer *tracing.Tracer
}

// NewTransport returns the transport the proxy uses by default: keep-alive
// connections to every worker, no proxy from the environment, and no
// transparent compression (Accept-Encoding and Content-Encoding pass through
// untouched), and worker response headers bounded by
// [MaxResponseHeaderBytes].
func NewTransport() *http.Transport {
	return &http.Transport{
		MaxResponseHeaderBytes: MaxResponseHeaderBytes,
		DialContext:            (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:           4096,
		MaxIdleConnsPerHost:    512,
		IdleConnTimeout:        90 * time.Second,
		ExpectContinueTimeout:  time.Second,
		DisableCompression:     true,
		WriteBufferSize:        64 << 10,
		ReadBufferSize:         64 << 10,
	}
}

// Errors the proxy answers itself, beyond those [extproc.Reject] maps.
var (
	// ErrUpstreamUnavailable: the chosen worker could not be reached (503).
	ErrUpstreamUnavailable = errors.New("upstream unavailable")
	// ErrNotFound: the cleaned path is outside /v1/ (404).
	ErrNotFound = errors.New("not found")
	// ErrMethodNotAllowed: the path does not take the method (405):
	// /v1/route and the completion paths take POST only, /v1/models GET
	// and HEAD. It is [extproc.ErrMethodNotAllowed].
	ErrMethodNotAllowed = extproc.ErrMethodNotAllowed
	// errStopped is the cause of requests cut by Stop.
	errStopped = fmt.Errorf("%w: proxy stopped", extproc.ErrShuttingDown)
)

// reject turns a proxy-only error into its rejection; everything else goes
// through extproc.Reject, the one mapping of routing and request errors.
func reject(err error) *extproc.Rejection {
	switch {
	case errors.Is(err, ErrUpstreamUnavailable):
		return &extproc.Rejection{Status: http.StatusServiceUnavailable, Type: "service_unavailable", Code: "upstream_unavailable", Err: err}
	case errors.Is(err, ErrNotFound):
		return &extproc.Rejection{Status: http.StatusNotFound, Type: "invalid_request_error", Code: "not_found", Err: err}
	case errors.Is(err, openai.ErrInvalidPath):
		return &extproc.Rejection{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "invalid_path", Err: err}
	}
	if r := extproc.Reject(err); r != nil {
		return r
	}
	return &extproc.Rejection{Status: http.StatusInternalServerError, Type: "internal_error", Code: "internal", Err: err}
}

// Proxy is the standalone OpenAI-compatible reverse proxy. Make it with New.
type Proxy struct {
	cfg     Config
	engine  Engine
	tok     extproc.Tokenizer
	log     *slog.Logger
	clk     clock.Clock
	rt      http.RoundTripper
	ownRT   *http.Transport
	metrics *metrics
	bufs    sync.Pool
	budget  *extproc.Budget
	// objectives is Deps.Objectives (nil: none).
	objectives hints.Priorities
	// modelList answers /v1/models (nil: no fleet, forwarded).
	modelList *modelLister
	tracer    *tracing.Tracer

	inflight atomic.Int64
	wg       sync.WaitGroup
	stopCtx  context.Context
	stop     context.CancelCauseFunc
}

var _ http.Handler = (*Proxy)(nil)

// New returns a proxy. deps.Engine must be set.
func New(cfg Config, deps Deps) *Proxy {
	cfg.defaults()
	p := &Proxy{cfg: cfg, engine: deps.Engine, tok: deps.Tokenizer, log: deps.Logger, clk: clock.Or(deps.Clock), rt: deps.Transport, budget: deps.Budget, objectives: deps.Objectives, tracer: deps.Tracer}
	if p.budget == nil {
		p.budget = extproc.NewBudget(cfg.MaxBufferedBytes)
	}
	if p.log == nil {
		p.log = slog.Default()
	}
	if p.rt == nil {
		p.ownRT = NewTransport()
		p.rt = p.ownRT
	}
	p.bufs.New = func() any { b := make([]byte, 32<<10); return &b }
	p.stopCtx, p.stop = context.WithCancelCause(context.Background())
	p.metrics = newMetrics(deps.Registry, func() float64 { return float64(p.inflight.Load()) })
	fleet := deps.Fleet
	if fleet == nil {
		fleet, _ = deps.Engine.(Fleet)
	}
	if fleet != nil {
		p.modelList = newModelLister(fleet, p.rt, p.log, p.clk, cfg.ModelsCacheTTL, cfg.ModelsTimeout)
	}
	return p
}

// InFlight is the number of requests being handled (those refused for
// being over Config.MaxInflight included, while they are answered).
func (p *Proxy) InFlight() int64 { return p.inflight.Load() }

// Stop cuts every request still in flight (their decisions end as
// abandoned) and closes the idle connections of the proxy's own transport.
// Requests that arrive afterwards are cut at once.
func (p *Proxy) Stop() {
	p.stop(errStopped)
	p.CloseIdleConnections()
}

// CloseIdleConnections closes the idle keep-alive connections to workers
// (of the proxy's own transport).
func (p *Proxy) CloseIdleConnections() {
	if p.ownRT != nil {
		p.ownRT.CloseIdleConnections()
	}
}

// Wait blocks until every handler has returned or ctx is done.
func (p *Proxy) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() { p.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// CleanPath is the proxy's path rule for a request's escaped path (no
// query): [openai.CleanPath] decodes and cleans it, refusing encoded
// slashes, backslashes, percent signs and dot segments (an error wrapping
// [openai.ErrInvalidPath]: 400 invalid_path), and the result must lie under
// /v1/ ([ErrNotFound]: 404 not_found). It returns the decoded clean path,
// which the proxy classifies, routes and forwards to the worker (escaped
// again), never the raw one.
func CleanPath(escaped string) (string, error) {
	clean, err := openai.CleanPath(escaped)
	if err != nil {
		return "", err
	}
	if !strings.HasPrefix(clean, "/v1/") {
		return "", fmt.Errorf("%w: %q", ErrNotFound, truncate(clean))
	}
	return clean, nil
}

// truncate bounds a client-supplied string quoted in an error message.
func truncate(s string) string {
	const limit = 256
	if len(s) > limit {
		return s[:limit] + "..."
	}
	return s
}

// ServeHTTP implements [http.Handler].
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.wg.Add(1)
	defer p.wg.Done()
	n := p.inflight.Add(1)
	defer p.inflight.Add(-1)
	clean, err := CleanPath(r.URL.EscapedPath())
	if err != nil {
		closeUnread(w, r)
		p.fail(w, extproc.PathOther, err)
		return
	}
	kind := openai.KindOf(clean)
	class := extproc.PathClass(kind, clean)
	if clean == RoutePath {
		class = pathRoute
	}
	// Admission before any body byte is read.
	if n > int64(p.cfg.MaxInflight) {
		closeUnread(w, r)
		p.fail(w, class, fmt.Errorf("%w: %d requests in flight", extproc.ErrTooManyStreams, p.cfg.MaxInflight))
		return
	}
	if clean == RoutePath {
		p.route(w, r)
		return
	}
	if p.modelList != nil && (clean == ModelsPath || strings.HasPrefix(clean, ModelsPath+"/")) {
		p.models(w, r, clean, class)
		return
	}
	if err := extproc.CheckMethod(kind, r.Method, clean); err != nil {
		closeUnread(w, r)
		p.fail(w, class, err)
		return
	}
	p.forward(w, r, clean, kind, class)
}

// closeUnread makes net/http close an HTTP/1 connection soon after the
// reply instead of draining the request body the proxy did not read for as
// long as the client likes (net/http reads up to 256 KiB of it, with no
// deadline of its own, before it lets go of the connection):
// "Connection: close", and a read deadline refuseLinger from now. The
// reply is written before net/http drains, so the deadline never holds a
// refusal back; it only bounds how long the connection stays. Draining
// that long (rather than closing at once) lets a client that is still
// sending its body finish and read the refusal: closing with unread bytes
// makes the kernel reset the connection, and a client then sees "connection
// reset" instead of the 503. A client that sends slowly, or never, holds
// the connection for refuseLinger at most. HTTP/2 needs neither (the server
// resets the stream; there "Connection: close" would end every stream of
// the connection).
func closeUnread(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 && r.ContentLength != 0 {
		w.Header().Set("Connection", "close")
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(refuseLinger))
	}
}

// refuseLinger bounds the drain of a refused request's unread body (Go's
// own server waits as long before it closes a connection it gave up
// draining).
const refuseLinger = 500 * time.Millisecond

// fail answers err as an OpenAI-style error and counts the request.
func (p *Proxy) fail(w http.ResponseWriter, path string, err error) {
	p.metrics.request(path, p.reply(w, err))
}

// reply answers err as an OpenAI-style error and returns the status.
func (p *Proxy) reply(w http.ResponseWriter, err error) int {
	rej := reject(err)
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set(extproc.HeaderError, rej.Code)
	if rej.Status == http.StatusMethodNotAllowed {
		h.Set("Allow", extproc.Allow(err))
	}
	w.WriteHeader(rej.Status)
	_, _ = w.Write(rej.Body())
	return rej.Status
}

// reqBody is a request body read by the proxy, its bytes charged to the
// buffer budget until release.
type reqBody struct {
	mu       sync.Mutex
	b        []byte
	held     int64
	budget   *extproc.Budget
	released bool
}

// bytes returns the body (nil after release).
func (rb *reqBody) bytes() []byte {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return rb.b
}

// open returns a reader for the worker; it is the upstream request's
// GetBody, so the transport can replay the body on a fresh connection
// until release.
func (rb *reqBody) open() (io.ReadCloser, error) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if rb.released {
		return nil, errBodyReleased
	}
	u := &upstreamBody{}
	u.r.Reset(rb.b)
	return u, nil
}

// release gives the bytes back to the budget and forgets them: the body is
// no longer needed once the worker has answered (or could not be reached).
// It is idempotent.
func (rb *reqBody) release() {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	rb.budget.Release(rb.held)
	rb.held, rb.b, rb.released = 0, nil, true
}

// replace swaps the body for b (the direct P/D mode's decode stage body),
// charging b to the budget; false, body unchanged, when the budget has no
// room for it.
func (rb *reqBody) replace(b []byte) bool {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if rb.released || !rb.budget.Take(int64(len(b))) {
		return false
	}
	rb.budget.Release(rb.held)
	rb.b, rb.held = b, int64(len(b))
	return true
}

var errBodyReleased = errors.New("proxy: request body already released")

// upstreamBody is the request body as sent to a worker. It forgets the
// bytes once the transport closes it (after writing them), so a long
// response does not keep the request body alive through resp.Request.
type upstreamBody struct {
	mu sync.Mutex
	r  bytes.Reader
}

func (u *upstreamBody) Read(b []byte) (int, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.r.Read(b)
}

// Close implements io.Closer.
func (u *upstreamBody) Close() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.r.Reset(nil)
	return nil
}

// readBody reads the request body, bounded by MaxBodyBytes, the buffer
// budget and the deadline (the decision deadline: headers → decision).
// The buffer grows with the bytes received, never with a declared
// Content-Length, and each chunk is charged to the budget as it arrives.
// The read deadline is cleared once the body has been read in full, so the
// response (a long SSE stream) is never cut; on an error it stays, which
// bounds net/http's draining of what is left of the body.
func (p *Proxy) readBody(w http.ResponseWriter, r *http.Request, deadline time.Time) (*reqBody, error) {
	rb := &reqBody{budget: p.budget}
	limit := p.cfg.MaxBodyBytes
	if r.ContentLength > limit {
		return nil, fmt.Errorf("%w: more than %d bytes", extproc.ErrBodyTooLarge, limit)
	}
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return rb, nil
	}
	rc := http.NewResponseController(w)
	// ErrNotSupported only for a ResponseWriter that is not net/http's
	// (serve always uses net/http's server).
	deadlineSet := rc.SetReadDeadline(deadline) == nil
	fail := func(err error) (*reqBody, error) {
		rb.release()
		return nil, err
	}
	size := int64(initialBodyBuffer)
	if r.ContentLength > 0 {
		size = min(r.ContentLength+1, size) // +1: EOF without growing
	}
	buf := make([]byte, 0, min(size, limit+1))
	for {
		if len(buf) == cap(buf) {
			grown := make([]byte, len(buf), min(2*int64(cap(buf)), limit+1))
			copy(grown, buf)
			buf = grown
		}
		n, err := r.Body.Read(buf[len(buf):cap(buf)])
		if n > 0 {
			if !p.budget.Take(int64(n)) {
				return fail(fmt.Errorf("%w: request body of %s", extproc.ErrBufferBudget, r.URL.Path))
			}
			rb.held += int64(n)
			buf = buf[:len(buf)+n]
			if int64(len(buf)) > limit {
				return fail(fmt.Errorf("%w: more than %d bytes", extproc.ErrBodyTooLarge, limit))
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			var ne net.Error
			if errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
				return fail(fmt.Errorf("%w: request body not received within %v (%d bytes arrived)", extproc.ErrDecisionTimeout, p.cfg.DecisionTimeout, len(buf)))
			}
			var mbe *http.MaxBytesError
			if errors.As(err, &mbe) {
				return fail(fmt.Errorf("%w: more than %d bytes", extproc.ErrBodyTooLarge, limit))
			}
			return fail(&extproc.Rejection{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "body_read_error", Err: err})
		}
	}
	if deadlineSet {
		_ = rc.SetReadDeadline(time.Time{})
	}
	rb.b = buf
	return rb, nil
}

// build parses, reads hints and tokenizes: the routing.Request for body.
func (p *Proxy) build(ctx context.Context, r *http.Request, target string, kind openai.Kind, body []byte) (routing.Request, error) {
	req := routing.Request{ID: r.Header.Get("X-Request-Id"), Path: target, Arrival: p.clk.Now()}
	if p.cfg.TenantHeader != "" {
		// Bounded as the ext_proc side does (prefixstate.BoundID).
		req.Tenant = prefixstate.BoundID(r.Header.Get(p.cfg.TenantHeader))
	}
	header := func(name string) (string, bool) {
		v := r.Header.Values(name)
		if len(v) == 0 {
			return "", false
		}
		return v[0], true
	}
	parsed, problems, err := extproc.ParseRequest(kind, body, header, &req)
	if err != nil {
		return req, err
	}
	if problems.Count > 0 {
		p.metrics.hintProblems.Add(float64(problems.Count))
	}
	if r := hints.ApplyObjective(header, p.objectives, &req.Hints); r != hints.ObjectiveNone {
		p.metrics.inferenceObjectives.WithLabelValues(r).Inc()
	}
	if parsed != nil {
		reason, terr := extproc.TokenizeRequest(ctx, p.tok, p.cfg.TokenizerTimeout, parsed, body, &req)
		if reason != "" {
			if terr != nil {
				p.log.Debug("tokenizer failed; estimating", "err", terr, "model", parsed.Model)
			}
			p.metrics.tokenizerFallbacks.WithLabelValues(reason).Inc()
		}
	}
	return req, nil
}

// forward routes and proxies one request whose cleaned path is clean.
func (p *Proxy) forward(w http.ResponseWriter, r *http.Request, clean string, kind openai.Kind, path string) {
	// The decision deadline runs from the request headers, as on the
	// ext_proc path: it covers the body read and the pick.
	deadline := time.Now().Add(p.cfg.DecisionTimeout)
	w, r, span := p.tracer.StartHTTP(w, r, clean)
	defer span.End(0)
	if p.stopCtx.Err() != nil {
		p.fail(w, path, errStopped)
		return
	}
	// ctx ends when the client goes away or Stop cuts the request.
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	unhook := context.AfterFunc(p.stopCtx, func() { cancel(context.Cause(p.stopCtx)) })
	defer unhook()

	body, err := p.readBody(w, r, deadline)
	if err != nil {
		closeUnread(w, r)
		p.fail(w, path, err)
		return
	}
	defer body.release()
	target := (&url.URL{Path: clean, RawQuery: r.URL.RawQuery}).RequestURI()
	req, err := p.build(ctx, r, target, kind, body.bytes())
	if err != nil {
		p.fail(w, path, err)
		return
	}
	pctx, cancelPick := context.WithDeadlineCause(ctx, deadline, extproc.ErrDecisionTimeout)
	pickStart := p.clk.Now()
	d, err := p.engine.Pick(pctx, &req)
	cancelPick()
	span.Decision(req.Arrival, pickStart, p.clk.Now(), d, err)
	if err != nil {
		if ctx.Err() != nil {
			if p.stopCtx.Err() == nil {
				p.metrics.request(path, 0) // the client went away while queued
				return
			}
			err = errStopped
		}
		p.fail(w, path, err)
		return
	}
	p.metrics.tokensRouted.Add(float64(req.TokenCount))
	x := &exchange{p: p, d: d, ctx: ctx, span: span}
	defer func() { p.metrics.request(path, x.reply) }()
	defer x.recoverEnd()
	x.run(w, r, target, body)
}

// exchange is one proxied request after its decision: it owns the
// decision until it ends it, exactly once.
type exchange struct {
	p   *Proxy
	d   *routing.Decision
	ctx context.Context
	// reply is the status the client got (0: none, the client went away).
	reply int
	// span is the request's server span, up the worker call's (zero when
	// tracing is off).
	span tracing.Span
	up   tracing.Upstream

	status     int
	sse        bool
	json       bool
	stream     *openai.StreamParser
	respBody   []byte
	respOver   bool
	ttft       time.Duration
	sawContent bool
	ended      bool
}

// recoverEnd is the safety net: a panic (http.ErrAbortHandler included)
// still ends the decision, as a reset, and is re-raised.
func (x *exchange) recoverEnd() {
	if x.ended {
		return
	}
	v := recover()
	x.end(routing.OutcomeReset)
	if v != nil {
		panic(v)
	}
}

// run sends the request to the chosen worker (target is the cleaned path
// and the query) and streams the response back.
func (x *exchange) run(w http.ResponseWriter, r *http.Request, target string, body *reqBody) {
	up, ok := x.upstreamRequest(w, r, target, body)
	if !ok {
		return
	}
	resp, ok := x.roundTrip(w, up, body)
	if !ok {
		return
	}
	defer resp.Body.Close()
	rc := x.writeHeader(w, resp)
	bp := x.p.bufs.Get().(*[]byte)
	defer x.p.bufs.Put(bp)
	if !x.copyBody(w, rc, resp.Body, *bp) {
		return
	}
	x.finishResponse(w, resp)
}

// upstreamRequest builds the worker's request: the client's headers
// (outboundHeader), the decision's destination, data-parallel rank and,
// for a disaggregated request, its prefill stage (run here in the direct
// P/D mode, named for the sidecar otherwise), and the body. false: the
// decision has ended and the client been answered.
func (x *exchange) upstreamRequest(w http.ResponseWriter, r *http.Request, target string, body *reqBody) (*http.Request, bool) {
	p, d := x.p, x.d
	ep := string(d.Endpoint)
	up, err := http.NewRequestWithContext(x.ctx, r.Method, "http://"+ep+target, http.NoBody)
	if err != nil {
		body.release()
		x.end(routing.OutcomeRejected)
		x.reply = p.reply(w, err)
		return nil, false
	}
	up.Header = outboundHeader(r)
	up.Header.Set(extproc.HeaderDestination, ep)
	if d.DPRank >= 0 {
		up.Header.Set(extproc.HeaderDPRank, strconv.Itoa(d.DPRank))
	}
	switch {
	case d.Prefill == "":
	case p.cfg.PDMode == PDModeDirect:
		// Disaggregated, no sidecar: the proxy runs the prefill stage
		// and rewrites the body for the decode stage.
		if !x.direct(r, target, body, up) {
			body.release()
			x.endCut(w)
			return nil, false
		}
	default:
		// Disaggregated: the decode worker's P/D sidecar runs the
		// prefill stage on this endpoint.
		up.Header.Set(extproc.HeaderPrefiller, string(d.Prefill))
	}
	if b := body.bytes(); len(b) > 0 {
		up.Body, _ = body.open()
		up.GetBody, up.ContentLength = body.open, int64(len(b))
	}
	return up, true
}

// roundTrip sends up to the worker and releases the request body. false:
// the worker could not be reached (or the request was cut); the decision
// has ended and the client been answered if it is still there.
func (x *exchange) roundTrip(w http.ResponseWriter, up *http.Request, body *reqBody) (*http.Response, bool) {
	p := x.p
	ep := string(x.d.Endpoint)
	x.up = x.span.StartUpstream(up, ep)
	resp, err := p.rt.RoundTrip(up)
	// The worker has answered or cannot be reached: the body is no longer
	// needed (the transport replays it, through GetBody, only inside
	// RoundTrip).
	body.release()
	if err != nil {
		if x.ctx.Err() != nil {
			x.endCut(w)
			return nil, false
		}
		p.metrics.upstreamErrors.WithLabelValues("connect").Inc()
		x.end(routing.OutcomeUpstreamError) // status 0: no response
		p.log.Debug("upstream unreachable", "endpoint", ep, "err", err)
		x.reply = p.reply(w, fmt.Errorf("%w: %s: %w", ErrUpstreamUnavailable, ep, err))
		return nil, false
	}
	return resp, true
}

// endCut ends the decision of a request whose context ended before the
// worker answered; a request Stop cut (abandoned) is answered with the
// cause, a client that went away (cancelled) is not.
func (x *exchange) endCut(w http.ResponseWriter) {
	x.end(x.cancelKind())
	if x.cancelKind() == routing.OutcomeAbandoned {
		x.reply = x.p.reply(w, context.Cause(x.ctx))
	}
}

// writeHeader notes the worker's status and content type (for the outcome
// and the TTFT and usage trackers) and sends the client the worker's
// response headers, flushed at once for SSE.
func (x *exchange) writeHeader(w http.ResponseWriter, resp *http.Response) *http.ResponseController {
	x.status = resp.StatusCode
	ct := strings.ToLower(resp.Header.Get("Content-Type"))
	x.sse = strings.Contains(ct, "text/event-stream")
	x.json = strings.Contains(ct, "json")
	if x.sse {
		x.stream = openai.NewStreamParser(x.p.cfg.MaxSSEEvent)
	}

	h := w.Header()
	copyHeader(h, resp.Header)
	h.Set(HeaderEndpoint, string(x.d.Endpoint))
	for k := range resp.Trailer {
		h.Add("Trailer", k)
	}
	w.WriteHeader(resp.StatusCode)
	x.reply = resp.StatusCode
	rc := http.NewResponseController(w)
	if x.sse {
		_ = rc.Flush() // headers out now: an SSE client sees the stream open
	}
	return rc
}

// copyBody streams the worker's body to the client through buf, writing
// and flushing every chunk as it is read. false: the client went away or
// the request was cut, and the decision has ended. A worker body that
// breaks off ends the decision and panics with http.ErrAbortHandler, so
// that the client sees the truncation.
func (x *exchange) copyBody(w http.ResponseWriter, rc *http.ResponseController, src io.Reader, buf []byte) bool {
	p := x.p
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			x.observe(buf[:n])
			if _, werr := w.Write(buf[:n]); werr != nil {
				x.end(x.cancelKind())
				return false
			}
			if ferr := rc.Flush(); ferr != nil {
				x.end(x.cancelKind())
				return false
			}
		}
		if rerr == io.EOF {
			return true
		}
		if rerr != nil {
			if x.ctx.Err() != nil {
				x.end(x.cancelKind())
				return false
			}
			// The worker broke off: end the decision, then abort the
			// client's connection so the truncation is visible.
			p.metrics.upstreamErrors.WithLabelValues("body").Inc()
			p.log.Debug("upstream body broke off", "endpoint", string(x.d.Endpoint), "err", rerr)
			x.end(routing.OutcomeUpstreamError)
			panic(http.ErrAbortHandler)
		}
	}
}

// finishResponse sends the worker's trailers and ends the decision by the
// worker's status.
func (x *exchange) finishResponse(w http.ResponseWriter, resp *http.Response) {
	for k, vv := range resp.Trailer {
		w.Header()[http.TrailerPrefix+k] = vv
	}
	if x.status >= 200 && x.status < 400 {
		x.end(routing.OutcomeSuccess)
	} else {
		x.p.metrics.upstreamErrors.WithLabelValues("status").Inc()
		x.end(routing.OutcomeUpstreamError)
	}
}

// cancelKind says how a request whose context ended is charged: abandoned
// when Stop cut it, cancelled when the client went away.
func (x *exchange) cancelKind() routing.OutcomeKind {
	if errors.Is(context.Cause(x.ctx), errStopped) || x.p.stopCtx.Err() != nil {
		return routing.OutcomeAbandoned
	}
	return routing.OutcomeCancelled
}

// observe feeds a response chunk to the TTFT and usage trackers (as the
// ext_proc processor does).
func (x *exchange) observe(chunk []byte) {
	switch {
	case x.stream != nil:
		if x.stream.Feed(chunk) && !x.sawContent {
			x.markFirstContent()
		}
	default:
		if !x.sawContent && x.status >= 200 && x.status < 300 {
			x.markFirstContent()
		}
		if x.json && !x.respOver {
			if len(x.respBody)+len(chunk) > x.p.cfg.MaxSSEEvent {
				x.respOver, x.respBody = true, nil
			} else {
				x.respBody = append(x.respBody, chunk...)
			}
		}
	}
}

func (x *exchange) markFirstContent() {
	x.sawContent = true
	x.ttft = x.p.clk.Now().Sub(x.d.At)
	x.d.Prefilled()
}

// end reports the outcome; only the first call counts.
func (x *exchange) end(kind routing.OutcomeKind) {
	if x.ended {
		return
	}
	x.ended = true
	o := routing.NoUsage(kind)
	o.Status = x.status
	if x.status != 0 {
		o.Served = x.d.Endpoint
	}
	if kind == routing.OutcomeSuccess || kind == routing.OutcomeUpstreamError {
		o.Latency = x.p.clk.Now().Sub(x.d.At)
		o.TTFT = x.ttft
		var u openai.Usage
		var ok bool
		if x.stream != nil {
			u, ok = x.stream.Usage()
		} else if len(x.respBody) > 0 {
			u, ok = openai.ParseUsage(x.respBody)
		}
		if ok {
			o.PromptTokens, o.CompletionTokens, o.CachedTokens = u.PromptTokens, u.CompletionTokens, u.CachedTokens
		}
	}
	x.d.Done(o)
	x.up.End(x.status, kind)
	x.respBody = nil
	x.p.metrics.req.Outcome(o)
}

// hopHeaders are removed in both directions (RFC 9110 section 7.6.1, and
// the ones net/http/httputil.ReverseProxy removes).
var hopHeaders = [...]string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// hop reports whether k is a hop-by-hop header, either by name or because
// the Connection header lists it.
func hop(k string, connection []string) bool {
	for _, h := range hopHeaders {
		if strings.EqualFold(k, h) {
			return true
		}
	}
	for _, v := range connection {
		for f := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(f), k) {
				return true
			}
		}
	}
	return false
}

// outboundHeader copies the client's request headers for the worker
// without hop-by-hop headers and without headers that could pose as the
// gateway's (extproc.Steering: x-gateway-destination-endpoint*,
// x-data-parallel-rank, x-prefiller-host-port) or as
// kvbandit's own; it appends the client to X-Forwarded-For and keeps
// "TE: trailers" (gRPC-style clients need it end to end).
func outboundHeader(r *http.Request) http.Header {
	conn := r.Header.Values("Connection")
	out := make(http.Header, len(r.Header)+3)
	for k, vv := range r.Header {
		lk := strings.ToLower(k)
		if hop(k, conn) || extproc.Steering(k) || strings.HasPrefix(lk, "x-kvbandit-") {
			continue
		}
		out[k] = vv
	}
	for _, te := range r.Header.Values("Te") {
		if strings.Contains(strings.ToLower(te), "trailers") {
			out.Set("Te", "trailers")
		}
	}
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		if prior := out.Values("X-Forwarded-For"); len(prior) > 0 {
			ip = strings.Join(prior, ", ") + ", " + ip
		}
		out.Set("X-Forwarded-For", ip)
	}
	return out
}

// copyHeader copies the worker's response headers without hop-by-hop ones.
func copyHeader(dst, src http.Header) {
	conn := src.Values("Connection")
	for k, vv := range src {
		if hop(k, conn) || strings.HasPrefix(strings.ToLower(k), "x-kvbandit-") {
			continue
		}
		dst[k] = vv
	}
}
