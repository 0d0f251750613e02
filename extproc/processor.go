package extproc

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/internal/tracing"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// EPP protocol names.
const (
	// HeaderDestination carries the chosen endpoint to the data plane.
	HeaderDestination = "x-gateway-destination-endpoint"
	// HeaderDPRank carries the chosen data-parallel rank to the worker.
	HeaderDPRank = "x-data-parallel-rank"
	// NamespaceLB is the dynamic metadata namespace of the destination.
	NamespaceLB = "envoy.lb"
	// NamespaceSubset is the metadata namespace of the subset hint.
	NamespaceSubset = "envoy.lb.subset_hint"
	// KeySubset is the subset hint's key in NamespaceSubset.
	KeySubset = "x-gateway-destination-endpoint-subset"
	// KeyServed is the served endpoint's key in NamespaceLB.
	KeyServed = "x-gateway-destination-endpoint-served"
	// HeaderModel carries the request's model in a header (the Gateway API
	// Inference Extension's body-based router writes it). It is read only
	// when the body mode hides the body (NONE, STREAMED).
	HeaderModel = "x-gateway-model-name"
	// HeaderPrefiller names the prefill worker for llm-d's P/D sidecar on
	// the decode worker; only a picker may set it (a client's value would
	// make the sidecar send the prompt to any host:port).
	HeaderPrefiller = "x-prefiller-host-port"
	// destinationPrefix covers every client header that could pose as a
	// data plane or picker header.
	destinationPrefix = "x-gateway-destination-endpoint"
)

// Steering reports whether a request header could steer the data plane or
// a worker's sidecar (x-gateway-destination-endpoint*, the data-parallel
// rank, the prefiller). Only a picker sets these: a client's are removed
// from every request, on the ext_proc path and by the proxy.
func Steering(name string) bool {
	return hasPrefixFold(name, destinationPrefix) || strings.EqualFold(name, HeaderDPRank) || strings.EqualFold(name, HeaderPrefiller)
}

// Bounds on what a stream keeps from its request headers, whatever the
// data plane lets through (Envoy's own default bounds headers to 60 KiB,
// but a gRPC message may carry far more).
const (
	// MaxPathBytes is the longest :path kept (for labels, logs and
	// policies); the request's kind is classified on the whole path first.
	MaxPathBytes = 2048
	// MaxRequestIDBytes is the longest x-request-id kept; longer ones are
	// truncated.
	MaxRequestIDBytes = 128
	// MaxHintHeaderBytes is the longest hint header value (x-prefix-id,
	// x-prefix-total-requests, x-prefix-osl, x-prefix-iat,
	// x-request-priority, the TTFT objective headers,
	// x-gateway-inference-objective) read; a longer one is ignored and counted in
	// kvbandit_hint_problems_total. Other x-prefix-* headers are not read.
	MaxHintHeaderBytes = 1024
	// MaxModelHeaderBytes is the longest HeaderModel value read; a longer
	// one is ignored.
	MaxModelHeaderBytes = 512
	// MaxSpoofedHeaders is how many distinct client headers named
	// x-gateway-destination-endpoint* or x-data-parallel-rank one request
	// may carry; beyond it the request is answered 431, since each of them
	// must be removed and no data plane sends that many.
	MaxSpoofedHeaders = 32
)

// hintHeaders are the request headers package hints reads, in the order
// of processor.hintVals.
var hintHeaders = [...]string{hints.HeaderPrefixID, hints.HeaderTotalRequests, hints.HeaderOSL, hints.HeaderIAT, hints.HeaderPriority, hints.HeaderSLOTTFT, hints.HeaderLLMDSLOTTFT, hints.HeaderInferenceObjective}

// hintIndex returns the index of a hint header name in hintHeaders, or -1.
func hintIndex(name string) int {
	switch name {
	case hints.HeaderPrefixID:
		return 0
	case hints.HeaderTotalRequests:
		return 1
	case hints.HeaderOSL:
		return 2
	case hints.HeaderIAT:
		return 3
	case hints.HeaderPriority:
		return 4
	case hints.HeaderSLOTTFT:
		return 5
	case hints.HeaderLLMDSLOTTFT:
		return 6
	case hints.HeaderInferenceObjective:
		return 7
	}
	return -1
}

// phase is the stream's progress.
type phase uint8

const (
	phaseRequestHeaders phase = iota // waiting for request headers
	phaseRequestBody                 // receiving the request body
	phaseAwaitResponse               // request answered, waiting for the response
	phaseResponseBody                // response headers answered, body streaming
	phaseDone                        // finished
)

// processor holds one stream's protocol state. It is used by the stream's
// loop goroutine only.
type processor struct {
	s *Server
	// pickCtx bounds waiting in the engine's admission queue; its cause says
	// why it ended (decision timeout, shutdown).
	pickCtx context.Context

	phase    phase
	reqMode  filterv3.ProcessingMode_BodySendMode
	respMode filterv3.ProcessingMode_BodySendMode
	// modeKnown is set when the data plane sent protocol_config.
	modeKnown bool
	// reqBodyPassthrough: STREAMED request bodies are acknowledged chunk by
	// chunk (the decision was made at the headers).
	reqBodyPassthrough bool
	// bodyUnseen: the request has a body, but the body mode (NONE,
	// STREAMED) decides it at the headers, without the body.
	bodyUnseen bool

	path      string
	kind      openai.Kind
	method    string // :method, at most maxMethodBytes
	requestID string
	tenant    string
	model     string // HeaderModel, read only when the body is unseen
	// hintVals holds the hint headers (hintHeaders order); hintSet says
	// which are present.
	hintVals [len(hintHeaders)]string
	hintSet  uint8
	spoofed  []string
	subset   *routing.Subset
	// admitted: the request holds one of the server's MaxInflight slots.
	admitted bool
	// traceHdr is the request's trace context (read only when tracing is
	// on); span is the stream's server span (zero when off).
	traceHdr tracing.Carrier
	span     tracing.Span

	body      []byte // request body; aliases the single chunk when possible
	owned     bool   // body is our own copy (counted against the budget)
	held      int64  // bytes held against the server's buffer budget
	started   time.Time
	timer     clock.Timer
	timeout   chan struct{}
	decision  *routing.Decision
	respPhase bool

	// headerTimer bounds stream open → request headers (Server.Process
	// arms it).
	headerTimer clock.Timer
	// idle, when not nil, receives a tick from idleTimer; armed at the
	// decision, it ends a stream silent for StreamIdleTimeout.
	idle      chan struct{}
	idleTimer clock.Timer
	lastMsg   time.Time

	// response state
	status   int
	sse      bool
	json     bool
	served   routing.EndpointKey
	stream   *openai.StreamParser
	respBody []byte
	// respChunk and respOut are reused for every response body reply:
	// the receive loop sends each before it reads the next message.
	respChunk  bodyChunk
	respOut    [1]*extprocv3.ProcessingResponse
	respOver   bool
	ttft       time.Duration
	sawContent bool
	tokensIn   int
	counted    bool
}

func newProcessor(s *Server) *processor {
	return &processor{s: s, timeout: make(chan struct{}), reqMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, respMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
}

// handle dispatches one message to its phase method. It returns the
// replies to send in order, whether the stream is finished, and an error
// that ends the stream (mapped by [Reject]).
func (p *processor) handle(ctx context.Context, m *extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.idleTimer != nil {
		p.lastMsg = p.s.clk.Now()
	}
	if p.phase == phaseRequestHeaders {
		if pc := m.GetProtocolConfig(); pc != nil {
			p.reqMode = pc.GetRequestBodyMode()
			p.respMode = pc.GetResponseBodyMode()
			p.modeKnown = true
		}
	}
	p.readMetadata(m.GetMetadataContext())
	switch r := m.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return p.onRequestHeaders(ctx, r.RequestHeaders)
	case *extprocv3.ProcessingRequest_RequestBody:
		return p.onRequestBody(ctx, r.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return p.onRequestTrailers(ctx)
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return p.onResponseHeaders(r.ResponseHeaders)
	case *extprocv3.ProcessingRequest_ResponseBody:
		return p.onResponseBody(r.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return p.onResponseTrailers()
	}
	// Flow-control or unknown messages need no reply.
	return nil, false, nil
}

func protocolError(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrProtocol, fmt.Sprintf(format, args...))
}

// admit takes one of the server's MaxInflight slots for this request, or
// refuses it: 503 while draining or when every slot is taken. The slot is
// given back in close.
func (p *processor) admit() error {
	select {
	case <-p.s.drain:
		return ErrShuttingDown
	default:
	}
	if n := p.s.inflight.Add(1); n > int64(p.s.cfg.MaxInflight) {
		p.s.inflight.Add(-1)
		return fmt.Errorf("%w: %d in flight", ErrTooManyStreams, p.s.cfg.MaxInflight)
	}
	p.admitted = true
	p.s.metrics.requestsInflight.Inc()
	return nil
}

func (p *processor) onRequestHeaders(ctx context.Context, h *extprocv3.HttpHeaders) ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.phase != phaseRequestHeaders {
		return nil, false, protocolError("request headers in phase %d", p.phase)
	}
	if p.headerTimer != nil {
		p.headerTimer.Stop()
	}
	p.started = p.s.clk.Now()
	p.phase = phaseRequestBody
	err := p.readRequestHeaders(h.GetHeaders())
	p.kind = openai.KindOf(p.path)
	if len(p.path) > MaxPathBytes {
		p.path = strings.Clone(p.path[:MaxPathBytes])
	}
	p.span = p.s.tracer.StartStream(&p.traceHdr, p.started, p.path, p.requestID)
	if err != nil {
		return nil, false, err
	}
	if p.method != "" {
		// A GET on a completion path is 405, not "empty body" (400).
		if err := CheckMethod(p.kind, p.method, p.path); err != nil {
			return nil, false, err
		}
	}
	if err := p.admit(); err != nil {
		return nil, false, err
	}
	p.timer = p.s.clk.AfterFunc(p.s.cfg.DecisionTimeout, func() { close(p.timeout) })

	switch {
	case h.GetEndOfStream(), p.reqMode == filterv3.ProcessingMode_NONE, p.reqMode == filterv3.ProcessingMode_STREAMED:
		// No body to wait for (or none that could still change routing:
		// in STREAMED mode header mutations in body responses are ignored).
		// A body that exists but is not seen first is decided without it.
		if !h.GetEndOfStream() {
			p.bodyUnseen = true
			p.reqBodyPassthrough = p.reqMode == filterv3.ProcessingMode_STREAMED
		}
		if err := p.decide(ctx); err != nil {
			return nil, false, err
		}
		if !p.reqBodyPassthrough {
			p.phase = phaseAwaitResponse
		}
		out := []*extprocv3.ProcessingResponse{p.headersResponse(true)}
		return p.afterRequestPhase(out)
	case p.reqMode == filterv3.ProcessingMode_BUFFERED, p.reqMode == filterv3.ProcessingMode_BUFFERED_PARTIAL:
		// Answer at once (holding it would stall Envoy until its message
		// timeout); the decision goes in the body response.
		return []*extprocv3.ProcessingResponse{p.headersResponse(false)}, false, nil
	}
	// FULL_DUPLEX_STREAMED: hold the headers response until the decision.
	return nil, false, nil
}

func (p *processor) onRequestBody(ctx context.Context, b *extprocv3.HttpBody) ([]*extprocv3.ProcessingResponse, bool, error) {
	switch {
	case p.reqBodyPassthrough:
		if b.GetEndOfStream() {
			p.reqBodyPassthrough = false
			if p.phase == phaseRequestBody {
				p.phase = phaseAwaitResponse
			}
			out := []*extprocv3.ProcessingResponse{bodyAck(true)}
			return p.afterRequestPhase(out)
		}
		return []*extprocv3.ProcessingResponse{bodyAck(true)}, false, nil
	case p.phase == phaseAwaitResponse || p.phase == phaseResponseBody:
		// Data after the first end of stream (Envoy issue 46237): ignore.
		return nil, false, nil
	case p.phase != phaseRequestBody:
		return nil, false, protocolError("request body in phase %d", p.phase)
	}
	if err := p.appendBody(b.GetBody()); err != nil {
		return nil, false, err
	}
	if !b.GetEndOfStream() {
		return nil, false, nil
	}
	return p.requestComplete(ctx, true)
}

func (p *processor) onRequestTrailers(ctx context.Context) ([]*extprocv3.ProcessingResponse, bool, error) {
	trailers := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	if p.phase != phaseRequestBody || p.reqBodyPassthrough {
		if p.phase == phaseRequestHeaders {
			return nil, false, protocolError("request trailers before headers")
		}
		return []*extprocv3.ProcessingResponse{trailers}, false, nil
	}
	// Trailers end a body that had no end_of_stream flag.
	out, _, err := p.requestComplete(ctx, false)
	if err != nil {
		return nil, false, err
	}
	return p.afterRequestPhase(append(out, trailers))
}

// requestComplete routes the buffered request and builds the request-phase
// replies for the stream's mode. eos says whether the body ended with
// end_of_stream (false when trailers ended it).
func (p *processor) requestComplete(ctx context.Context, eos bool) ([]*extprocv3.ProcessingResponse, bool, error) {
	if err := p.decide(ctx); err != nil {
		return nil, false, err
	}
	p.phase = phaseAwaitResponse
	var out []*extprocv3.ProcessingResponse
	if p.reqMode == filterv3.ProcessingMode_BUFFERED || p.reqMode == filterv3.ProcessingMode_BUFFERED_PARTIAL {
		out = []*extprocv3.ProcessingResponse{p.bufferedBodyResponse()}
	} else {
		out = make([]*extprocv3.ProcessingResponse, 0, 2+len(p.body)/BodyChunkBytes)
		out = append(out, p.headersResponse(true))
		out = appendBodyChunks(out, p.body, eos)
	}
	if !eos {
		// Trailers follow: the caller appends the trailers response.
		return out, false, nil
	}
	return p.afterRequestPhase(out)
}

// afterRequestPhase handles response processing being off: the decision
// ends now (abandoned: no outcome will be observed) and the stream closes
// cleanly, which Envoy treats as "continue without the server". The close
// is only safe when the data plane sends no response body to kvbandit
// (response_body_mode NONE): otherwise response chunks already on their way
// would be dropped, so kvbandit keeps echoing them until the response ends
// and warns once.
func (p *processor) afterRequestPhase(out []*extprocv3.ProcessingResponse) ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.s.cfg.ResponseProcessing || p.reqBodyPassthrough {
		return out, false, nil
	}
	p.finish(routing.OutcomeAbandoned)
	if p.modeKnown && p.respMode == filterv3.ProcessingMode_NONE {
		return out, true, nil
	}
	p.phase = phaseAwaitResponse
	p.s.unsafeClose.Do(func() {
		p.s.log.Warn("response processing is off, but the data plane streams response bodies to kvbandit; closing early would drop response bytes, so kvbandit echoes them (set the ext_proc filter's response_header_mode SKIP and response_body_mode NONE to save the work)",
			"response_body_mode", p.respMode.String(), "protocol_config_sent", p.modeKnown)
	})
	return out, false, nil
}

func (p *processor) appendBody(chunk []byte) error {
	if len(chunk) == 0 {
		return nil
	}
	total := int64(len(p.body) + len(chunk))
	if total > p.s.cfg.MaxBodyBytes {
		return fmt.Errorf("%w: more than %d bytes", ErrBodyTooLarge, p.s.cfg.MaxBodyBytes)
	}
	if p.body == nil {
		// Keep a reference to the first chunk: a body that arrives in one
		// message is never copied. gRPC gives each message its own buffer.
		p.body = chunk
		return p.hold(int64(len(chunk)))
	}
	if err := p.hold(int64(len(chunk))); err != nil {
		return err
	}
	if !p.owned {
		grow := make([]byte, len(p.body), max(2*len(p.body), int(total)))
		copy(grow, p.body)
		p.body = grow
		p.owned = true
	}
	p.body = append(p.body, chunk...)
	return nil
}

// hold charges n bytes against the server-wide buffer budget.
func (p *processor) hold(n int64) error {
	if !p.s.budget.Take(n) {
		return ErrBufferBudget
	}
	p.held += n
	return nil
}

// decide parses the request, estimates or computes its tokens and picks.
func (p *processor) decide(ctx context.Context) error {
	m := p.s.metrics
	t0 := p.s.clk.Now()
	req := routing.Request{ID: p.requestID, Path: p.path, Tenant: p.tenant, Arrival: p.started, Subset: p.subset}
	kind := p.kind
	if p.bodyUnseen {
		// Only what the headers carry: hints, the path, and the model when
		// a body-based router put it in a header. No tokens: the engine
		// routes on load and prefix or session affinity.
		kind = openai.KindOther
		req.Model = routing.ModelName(p.model)
	}
	parsed, problems, err := ParseRequest(kind, p.body, p.header, &req)
	if err != nil {
		return err
	}
	if problems.Count > 0 {
		m.hintProblems.Add(float64(problems.Count))
	}
	if r := hints.ApplyObjective(p.header, p.s.objectives, &req.Hints); r != hints.ObjectiveNone {
		m.inferenceObjectives.WithLabelValues(r).Inc()
	}
	t1 := p.s.clk.Now()
	m.phaseParse.Observe(t1.Sub(t0).Seconds())
	if parsed != nil {
		p.tokenize(ctx, parsed, &req)
		t2 := p.s.clk.Now()
		m.phaseTokenize.Observe(t2.Sub(t1).Seconds())
		t1 = t2
	}
	pctx := p.pickCtx
	if pctx == nil {
		pctx = ctx
	}
	d, err := p.s.picker.Pick(pctx, &req)
	t3 := p.s.clk.Now()
	m.phasePick.Observe(t3.Sub(t1).Seconds())
	p.span.Decision(t0, t1, t3, d, err)
	if err != nil {
		return err
	}
	if p.timer != nil {
		p.timer.Stop()
	}
	p.decision = d
	p.tokensIn = req.TokenCount
	m.tokensRouted.Add(float64(req.TokenCount))
	m.phaseTotal.Observe(t3.Sub(p.started).Seconds())
	if p.bodyUnseen {
		p.s.decidedWithoutBody(p.reqMode)
	}
	// What the request phase read from the headers is no longer needed.
	p.hintVals, p.hintSet, p.tenant, p.model = [len(hintHeaders)]string{}, 0, "", ""
	if p.idle != nil {
		p.lastMsg = t3
		p.armIdle(p.s.cfg.StreamIdleTimeout)
	}
	return nil
}

// armIdle schedules the next idle check in d.
func (p *processor) armIdle(d time.Duration) {
	idle := p.idle
	p.idleTimer = p.s.clk.AfterFunc(d, func() {
		select {
		case idle <- struct{}{}:
		default:
		}
	})
}

// idleCheck runs (under the stream's lock) when the idle timer fires. A
// stream that received a message since re-arms for the rest of the
// period; one silent for StreamIdleTimeout ends its decision as abandoned
// and reports the stream settled, to be closed cleanly: Envoy then goes on
// without kvbandit, so a response that is merely slow (a non-streamed
// generation sends nothing until it is complete) still reaches the client,
// only its outcome is lost. Nothing is in flight to be dropped, since
// every message received has been answered.
func (p *processor) idleCheck() (error, bool) {
	if p.phase == phaseDone || !p.decided() {
		return nil, false
	}
	quiet := p.s.clk.Now().Sub(p.lastMsg)
	if rest := p.s.cfg.StreamIdleTimeout - quiet; rest > 0 {
		p.armIdle(rest)
		return nil, false
	}
	p.s.log.Warn("ext_proc stream idle: closing it and releasing its decision", "request_id", p.requestID, "idle", quiet, "phase", int(p.phase))
	p.abort(routing.OutcomeAbandoned, "idle_timeout")
	return nil, true
}

// tokenize fills the request's tokens, falling back to a byte estimate.
func (p *processor) tokenize(ctx context.Context, parsed *openai.Request, req *routing.Request) {
	reason, err := TokenizeRequest(ctx, p.s.tok, p.s.cfg.TokenizerTimeout, parsed, p.body, req)
	if reason == "" {
		return
	}
	if err != nil {
		p.s.log.Debug("tokenizer failed; estimating", "err", err, "model", parsed.Model)
	}
	p.s.metrics.tokenizerFallbacks.WithLabelValues(reason).Inc()
}

// header returns a request header that hint parsing may ask for.
func (p *processor) header(name string) (string, bool) {
	i := hintIndex(name)
	if i < 0 || p.hintSet&(1<<i) == 0 {
		return "", false
	}
	return p.hintVals[i], true
}

func headerValue(h *corev3.HeaderValue) string {
	if rv := h.GetRawValue(); len(rv) > 0 {
		return string(rv)
	}
	return h.GetValue()
}

// maxMethodBytes bounds the :method kept (longer ones are cut, and then
// never equal POST).
const maxMethodBytes = 32

// readRequestHeaders keeps only what routing needs, each bounded: the path
// (bounded by the caller, after classification), the request id, the
// tenant (bounded where prefix state keys it), the model header, the hint
// headers and the names of spoofable headers. Everything else, other
// x-prefix-* headers included, is dropped with the message.
func (p *processor) readRequestHeaders(hm *corev3.HeaderMap) error {
	tenant := p.s.cfg.TenantHeader
	for _, h := range hm.GetHeaders() {
		k := h.GetKey()
		switch {
		case k == ":path":
			p.path = headerValue(h)
		case k == ":method":
			p.method = headerPrefix(h, maxMethodBytes)
		case k == "x-request-id":
			p.requestID = headerPrefix(h, MaxRequestIDBytes)
		case tenant != "" && strings.EqualFold(k, tenant):
			// Bounded at once (a long value becomes its hash), so a
			// stream never holds a client's long header until its
			// decision; the proxy does the same.
			p.tenant = prefixstate.BoundID(headerValue(h))
		case strings.HasPrefix(k, "x-prefix-") || k == hints.HeaderPriority || k == hints.HeaderSLOTTFT || k == hints.HeaderLLMDSLOTTFT || k == hints.HeaderInferenceObjective:
			i := hintIndex(k)
			if i < 0 || p.hintSet&(1<<i) != 0 {
				continue // not a hint, or a repeat: the first one counts
			}
			if headerLen(h) > MaxHintHeaderBytes {
				p.s.metrics.hintProblems.Inc()
				continue
			}
			p.hintVals[i] = headerValue(h)
			p.hintSet |= 1 << i
		case k == HeaderModel:
			if p.model == "" && headerLen(h) <= MaxModelHeaderBytes {
				p.model = strings.TrimSpace(headerValue(h))
			}
		case p.s.tracer != nil && (k == tracing.HeaderTraceparent || k == tracing.HeaderTracestate):
			p.traceHdr.Keep(k, headerPrefix(h, tracing.MaxTracestateBytes+1))
		case Steering(k):
			if slices.Contains(p.spoofed, k) {
				continue
			}
			if len(p.spoofed) == MaxSpoofedHeaders {
				return fmt.Errorf("%w: more than %d", ErrTooManyHeaders, MaxSpoofedHeaders)
			}
			p.spoofed = append(p.spoofed, k)
		}
	}
	return nil
}

// headerLen is the length of a header's value (raw_value, else value).
func headerLen(h *corev3.HeaderValue) int {
	if rv := h.GetRawValue(); len(rv) > 0 {
		return len(rv)
	}
	return len(h.GetValue())
}

// headerPrefix returns at most n bytes of a header's value, copying only
// those.
func headerPrefix(h *corev3.HeaderValue, n int) string {
	if rv := h.GetRawValue(); len(rv) > 0 {
		return string(rv[:min(n, len(rv))])
	}
	v := h.GetValue()
	if len(v) > n {
		return strings.Clone(v[:n])
	}
	return v
}

// hasPrefixFold is strings.HasPrefix ignoring ASCII case, without
// allocating (Envoy lower-cases header names, but not every data plane).
func hasPrefixFold(s, prefix string) bool {
	return len(s) >= len(prefix) && strings.EqualFold(s[:len(prefix)], prefix)
}

// readMetadata picks up the subset hint (request path) and the served
// endpoint (response path) from forwarded dynamic metadata.
func (p *processor) readMetadata(md *corev3.Metadata) {
	fm := md.GetFilterMetadata()
	if len(fm) == 0 {
		return
	}
	if !p.respPhase && p.decision == nil {
		if ns, ok := fm[NamespaceSubset]; ok {
			if v, ok := ns.GetFields()[KeySubset]; ok {
				p.subset = routing.NewSubset(subsetEntries(v))
			}
		}
	}
	if ns, ok := fm[NamespaceLB]; ok {
		if v, ok := ns.GetFields()[KeyServed]; ok {
			if s := strings.TrimSpace(v.GetStringValue()); s != "" {
				// With fallbacks the data plane may report a list; the
				// first entry is the host that served.
				s, _, _ = strings.Cut(s, ",")
				p.served = routing.EndpointKey(strings.TrimSpace(s))
			}
		}
	}
}

// subsetEntries accepts a list value or a comma-separated string.
func subsetEntries(v *structpb.Value) []string {
	switch k := v.GetKind().(type) {
	case *structpb.Value_ListValue:
		out := make([]string, 0, len(k.ListValue.GetValues()))
		for _, e := range k.ListValue.GetValues() {
			if s, ok := e.GetKind().(*structpb.Value_StringValue); ok {
				out = append(out, s.StringValue)
			}
		}
		return out
	case *structpb.Value_StringValue:
		return strings.Split(k.StringValue, ",")
	}
	return []string{}
}

// destination is the value of the destination header and metadata.
func (p *processor) destination() string {
	d := p.decision
	if len(d.Fallbacks) == 0 {
		return string(d.Endpoint)
	}
	var b strings.Builder
	b.WriteString(string(d.Endpoint))
	for _, f := range d.Fallbacks {
		b.WriteByte(',')
		b.WriteString(string(f))
	}
	return b.String()
}

// mutation sets the destination (when decided) and removes every
// client-supplied header that could steer the data plane.
func (p *processor) mutation(hm *extprocv3.HeaderMutation) *extprocv3.HeaderMutation {
	rank := -1
	if p.decision != nil {
		hm.SetHeaders = append(hm.SetHeaders, setHeader(HeaderDestination, p.destination()))
		rank = p.decision.DPRank
		if rank >= 0 {
			hm.SetHeaders = append(hm.SetHeaders, setHeader(HeaderDPRank, strconv.Itoa(rank)))
		}
		if pre := p.decision.Prefill; pre != "" {
			hm.SetHeaders = append(hm.SetHeaders, setHeader(HeaderPrefiller, string(pre)))
		}
		// Tracing on: the worker's parent is the stream's span.
		if tp, ts := p.span.TraceContext(); tp != "" {
			hm.SetHeaders = append(hm.SetHeaders, setHeader(tracing.HeaderTraceparent, tp))
			if ts != "" {
				hm.SetHeaders = append(hm.SetHeaders, setHeader(tracing.HeaderTracestate, ts))
			} else {
				hm.RemoveHeaders = append(hm.RemoveHeaders, tracing.HeaderTracestate)
			}
		}
	}
	for _, k := range p.spoofed {
		lk := strings.ToLower(k)
		if (lk == HeaderDestination && p.decision != nil) || (lk == HeaderDPRank && rank >= 0) || (lk == HeaderPrefiller && p.decision != nil && p.decision.Prefill != "") {
			continue // overwritten above
		}
		hm.RemoveHeaders = append(hm.RemoveHeaders, k)
	}
	return hm
}

func (p *processor) dynamicMetadata() *structpb.Struct {
	m := &lbMetadata{}
	m.destKind.StringValue = p.destination()
	m.dest.Kind = &m.destKind
	m.inner.Fields = map[string]*structpb.Value{HeaderDestination: &m.dest}
	m.lbKind.StructValue = &m.inner
	m.lb.Kind = &m.lbKind
	m.outer.Fields = map[string]*structpb.Value{NamespaceLB: &m.lb}
	return &m.outer
}

// lbMetadata is the decision's dynamic metadata, {NamespaceLB:
// {HeaderDestination: "ip:port"}}, in one allocation besides its maps.
type lbMetadata struct {
	outer, inner structpb.Struct
	lb, dest     structpb.Value
	lbKind       structpb.Value_StructValue
	destKind     structpb.Value_StringValue
}

// headersResponse answers the request headers; with decided set it carries
// the decision.
func (p *processor) headersResponse(decided bool) *extprocv3.ProcessingResponse {
	r := &headersReply{}
	r.mutation.SetHeaders = r.set[:0]
	r.common.HeaderMutation = p.mutation(&r.mutation)
	r.headers.Response = &r.common
	r.oneof.RequestHeaders = &r.headers
	r.resp.Response = &r.oneof
	if decided {
		r.common.ClearRouteCache = true
		r.resp.DynamicMetadata = p.dynamicMetadata()
	}
	return &r.resp
}

// headersReply is a request headers reply and the messages it points to,
// in one allocation, with room for the destination header and one more.
type headersReply struct {
	resp     extprocv3.ProcessingResponse
	oneof    extprocv3.ProcessingResponse_RequestHeaders
	headers  extprocv3.HeadersResponse
	common   extprocv3.CommonResponse
	mutation extprocv3.HeaderMutation
	set      [2]*corev3.HeaderValueOption
}

// bufferedBodyResponse carries the decision in BUFFERED mode, body untouched.
func (p *processor) bufferedBodyResponse() *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{
			Response: &extprocv3.CommonResponse{HeaderMutation: p.mutation(&extprocv3.HeaderMutation{}), ClearRouteCache: true},
		}},
		DynamicMetadata: p.dynamicMetadata(),
	}
}

// appendBodyChunks re-streams body as StreamedBodyResponse chunks of at most
// BodyChunkBytes; the last carries end_of_stream when eos is set. An empty
// body still gets one (empty) chunk.
func appendBodyChunks(out []*extprocv3.ProcessingResponse, body []byte, eos bool) []*extprocv3.ProcessingResponse {
	chunks := make([]bodyChunk, max(1, (len(body)+BodyChunkBytes-1)/BodyChunkBytes))
	for i := range chunks {
		n := min(len(body), BodyChunkBytes)
		out = append(out, chunks[i].set(true, body[:n:n], n == len(body) && eos))
		body = body[n:]
	}
	return out
}

// bodyChunk is a StreamedBodyResponse reply and every message around it,
// laid out together: one allocation instead of seven, and a processor
// reuses one for every response chunk (a reply is encoded by Send before
// the next message is handled).
type bodyChunk struct {
	resp     extprocv3.ProcessingResponse
	req      extprocv3.ProcessingResponse_RequestBody
	res      extprocv3.ProcessingResponse_ResponseBody
	body     extprocv3.BodyResponse
	common   extprocv3.CommonResponse
	mutation extprocv3.BodyMutation
	streamed extprocv3.BodyMutation_StreamedResponse
	chunk    extprocv3.StreamedBodyResponse
}

// set makes c the request (or response) body reply that streams data,
// with end_of_stream eos, and returns it.
func (c *bodyChunk) set(request bool, data []byte, eos bool) *extprocv3.ProcessingResponse {
	c.chunk.Body, c.chunk.EndOfStream = data, eos
	c.streamed.StreamedResponse = &c.chunk
	c.mutation.Mutation = &c.streamed
	c.common.BodyMutation = &c.mutation
	c.body.Response = &c.common
	if request {
		c.req.RequestBody = &c.body
		c.resp.Response = &c.req
	} else {
		c.res.ResponseBody = &c.body
		c.resp.Response = &c.res
	}
	return &c.resp
}

func bodyAck(request bool) *extprocv3.ProcessingResponse {
	if request {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{}}}
}

func (p *processor) onResponseHeaders(h *extprocv3.HttpHeaders) ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.decision == nil || (p.phase != phaseAwaitResponse && !p.reqBodyPassthrough) {
		return nil, false, protocolError("response headers in phase %d", p.phase)
	}
	p.respPhase = true
	p.phase = phaseResponseBody
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch hv.GetKey() {
		case ":status":
			p.status, _ = strconv.Atoi(headerValue(hv))
		case "content-type":
			ct := strings.ToLower(headerValue(hv))
			p.sse = strings.Contains(ct, "text/event-stream")
			p.json = strings.Contains(ct, "json")
		}
	}
	if p.served != "" && p.served != p.decision.Endpoint {
		p.s.metrics.servedMismatch.Inc()
	}
	if p.sse {
		p.stream = openai.NewStreamParser(p.s.cfg.MaxSSEEvent)
	}
	out := []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}}
	if h.GetEndOfStream() || p.respMode == filterv3.ProcessingMode_NONE {
		// No body will come through this stream.
		p.finish(p.statusKind())
		return out, true, nil
	}
	return out, false, nil
}

func (p *processor) onResponseBody(b *extprocv3.HttpBody) ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.phase != phaseResponseBody {
		if p.phase == phaseDone {
			return nil, false, nil
		}
		return nil, false, protocolError("response body in phase %d", p.phase)
	}
	chunk := b.GetBody()
	p.observeResponse(chunk)
	eos := b.GetEndOfStream()
	var out *extprocv3.ProcessingResponse
	if p.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		out = p.respChunk.set(false, chunk, eos)
	} else {
		out = bodyAck(false)
	}
	p.respOut[0] = out
	if eos || p.respMode == filterv3.ProcessingMode_BUFFERED {
		p.finish(p.statusKind())
		return p.respOut[:], true, nil
	}
	return p.respOut[:], false, nil
}

func (p *processor) onResponseTrailers() ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.decision == nil {
		return nil, false, protocolError("response trailers before a decision")
	}
	p.finish(p.statusKind())
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}}, true, nil
}

// observeResponse feeds a response chunk to the TTFT and usage trackers.
func (p *processor) observeResponse(chunk []byte) {
	if len(chunk) == 0 {
		return
	}
	switch {
	case p.stream != nil:
		if p.stream.Feed(chunk) && !p.sawContent {
			p.markFirstContent()
		}
	default:
		if !p.sawContent && p.status >= 200 && p.status < 300 {
			p.markFirstContent()
		}
		if p.json && !p.respOver {
			if len(p.respBody)+len(chunk) > p.s.cfg.MaxSSEEvent {
				p.respOver, p.respBody = true, nil
			} else {
				p.respBody = append(p.respBody, chunk...)
			}
		}
	}
}

func (p *processor) markFirstContent() {
	p.sawContent = true
	p.ttft = p.s.clk.Now().Sub(p.decision.At)
	p.decision.Prefilled()
}

func (p *processor) statusKind() routing.OutcomeKind {
	if p.status >= 200 && p.status < 400 {
		return routing.OutcomeSuccess
	}
	return routing.OutcomeUpstreamError
}

func (p *processor) decided() bool { return p.decision != nil }

// deadline is closed when the decision is overdue. It may also close just
// after a decision; the caller checks decided() under the stream's lock.
func (p *processor) deadline() <-chan struct{} { return p.timeout }

// finish ends the decision with an observed outcome.
func (p *processor) finish(kind routing.OutcomeKind) {
	p.phase = phaseDone
	if p.decision == nil || p.decision.Finished() {
		return
	}
	o := routing.NoUsage(kind)
	o.Served, o.Status = p.served, p.status
	if kind == routing.OutcomeSuccess || kind == routing.OutcomeUpstreamError {
		now := p.s.clk.Now()
		o.Latency = now.Sub(p.decision.At)
		o.TTFT = p.ttft
		var u openai.Usage
		var ok bool
		if p.stream != nil {
			u, ok = p.stream.Usage()
		} else if len(p.respBody) > 0 {
			u, ok = openai.ParseUsage(p.respBody)
		}
		if ok {
			o.PromptTokens, o.CompletionTokens, o.CachedTokens = u.PromptTokens, u.CompletionTokens, u.CachedTokens
		}
	}
	p.end(o)
}

// abort ends the decision without a complete response.
func (p *processor) abort(kind routing.OutcomeKind, reason string) {
	if reason != "" {
		p.s.metrics.streamErrors.WithLabelValues(reason).Inc()
	}
	p.phase = phaseDone
	if p.decision == nil || p.decision.Finished() {
		p.count(p.status)
		return
	}
	o := routing.NoUsage(kind)
	o.Served, o.Status = p.served, p.status
	p.end(o)
}

// finishRejected records a request answered with a local reply.
func (p *processor) finishRejected(err error) {
	status, code := http.StatusInternalServerError, "internal"
	if r := Reject(err); r != nil {
		status, code = r.Status, r.Code
	}
	p.span.Refused(status, code)
	p.phase = phaseDone
	if p.decision != nil && !p.decision.Finished() {
		p.end(routing.NoUsage(routing.OutcomeRejected))
	}
	p.count(status)
}

func (p *processor) end(o routing.Outcome) {
	m := p.s.metrics
	p.decision.Done(o)
	m.req.Outcome(o)
	if o.PromptTokens > 0 {
		m.tokens.WithLabelValues("prompt").Add(float64(o.PromptTokens))
	}
	if o.CompletionTokens > 0 {
		m.tokens.WithLabelValues("completion").Add(float64(o.CompletionTokens))
	}
	if o.CachedTokens > 0 {
		m.tokens.WithLabelValues("cached").Add(float64(o.CachedTokens))
	}
	p.count(o.Status)
}

// count records the request once, by path class and final status.
func (p *processor) count(status int) {
	if p.counted || p.path == "" && status == 0 {
		return
	}
	p.counted = true
	p.s.metrics.req.Request(PathClass(p.kind, p.path), status)
}

// PathClass is the path label of a request: its OpenAI kind, /v1/models,
// or other (decided on the cleaned path, [openai.CleanPath]).
func PathClass(k openai.Kind, path string) string {
	switch k {
	case openai.KindChat:
		return pathChat
	case openai.KindCompletion:
		return pathCompletions
	}
	path, _, _ = strings.Cut(path, "?")
	if clean, err := openai.CleanPath(path); err == nil && clean == "/v1/models" {
		return pathModels
	}
	return PathOther
}

// endOfStream handles Envoy half-closing the stream.
func (p *processor) endOfStream() {
	switch {
	case p.decision == nil:
		p.abort(routing.OutcomeCancelled, "")
	case p.phase == phaseDone:
	default:
		// The data plane closed before the response ended: the client or
		// the upstream went away.
		p.abort(routing.OutcomeCancelled, "closed_early")
	}
}

// close releases the stream's resources; it ends a still-open decision as
// a reset (a safety net: every path above should have ended it).
func (p *processor) close() {
	for _, t := range []clock.Timer{p.timer, p.headerTimer, p.idleTimer} {
		if t != nil {
			t.Stop()
		}
	}
	if p.admitted {
		p.admitted = false
		p.s.inflight.Add(-1)
		p.s.metrics.requestsInflight.Dec()
	}
	if p.held > 0 {
		p.s.budget.Release(p.held)
		p.held = 0
	}
	p.body, p.respBody = nil, nil
	if p.decision != nil && !p.decision.Finished() {
		p.abort(routing.OutcomeReset, "unfinished")
	}
	p.span.End(p.status)
}
