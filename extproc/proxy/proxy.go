package proxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
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
// *engine.Engine implements it.
type Engine interface {
	routing.Picker
	routing.Scorer
}

var _ Engine = (*engine.Engine)(nil)

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
	// StripKVTransferParams removes a client's kv_transfer_params from
	// request bodies in every pool; in pools with prefill endpoints it is
	// always removed (extproc.StripsKVTransfer).
	StripKVTransferParams bool
	// SessionHeaders name the request headers that carry the session id
	// (the prefix id hint), the first present winning, as
	// extproc.Config.SessionHeaders (empty: x-prefix-id).
	SessionHeaders []string
	// ClientPriority is the operator's rule for client priorities against
	// InferenceObjectives, as extproc.Config.ClientPriority.
	ClientPriority hints.PriorityPolicy
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
	// (x-gateway-inference-objective); nil when objectives are not
	// discovered (see hints.ResolvePriority).
	Objectives hints.Priorities
	// Fleet lists the endpoints whose models GET /v1/models lists; nil:
	// Engine, when it is a Fleet (*engine.Engine is), else /v1/models is
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
