package extproc

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
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
	fallback  pathFallback // without :path (dataplane.go)
	kind      openai.Kind
	method    string // :method, at most maxMethodBytes
	requestID string
	tenant    string
	model     string // HeaderModel, read only when the body is unseen
	// hintVals holds the hint headers (hintHeaders order); hintSet says
	// which are present.
	hintVals [len(hintHeaders)]string
	hintSet  uint8
	// session is the session id read from the first configured session
	// header present (Config.SessionHeaders); sessionAt is that header's
	// index + 1 (0: none).
	session   string
	sessionAt int
	spoofed   []string
	subset    *routing.Subset
	// admitted: the request holds one of the server's MaxInflight slots.
	admitted bool
	// traceHdr is the request's trace context (read only when tracing is
	// on); span is the stream's server span (zero when off).
	traceHdr tracing.Carrier
	span     tracing.Span

	body  []byte // request body; aliases the single chunk when possible
	owned bool   // body is our own copy (counted against the budget)
	// bodyRewritten: the body was changed (kv_transfer_params removed);
	// the replies carry it whole and set Content-Length.
	bodyRewritten bool
	held          int64 // bytes held against the server's buffer budget
	started       time.Time
	timer         clock.Timer
	timeout       chan struct{}
	decision      *routing.Decision
	respPhase     bool
	// requestDone is when the request phase ended (noresponse.go).
	requestDone time.Time

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

func headerValue(h *corev3.HeaderValue) string {
	if rv := h.GetRawValue(); len(rv) > 0 {
		return string(rv)
	}
	return h.GetValue()
}

func (p *processor) decided() bool { return p.decision != nil }

// deadline is closed when the decision is overdue. It may also close just
// after a decision; the caller checks decided() under the stream's lock.
func (p *processor) deadline() <-chan struct{} { return p.timeout }
