package extproc

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
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
	p.resolvePath(!h.GetEndOfStream())
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

// maxMethodBytes bounds the :method kept (longer ones are cut, and then
// never equal POST).
const maxMethodBytes = 32

// readRequestHeaders keeps only what routing needs, each bounded: the path
// (bounded by the caller, after classification; without :path, the
// fallback path headers, see resolvePath), the request id, the
// tenant (bounded where prefix state keys it), the model header, the hint
// headers and the names of spoofable headers. Everything else, other
// x-prefix-* headers included, is dropped with the message.
func (p *processor) readRequestHeaders(hm *corev3.HeaderMap) error {
	tenant := p.s.cfg.TenantHeader
	for _, h := range hm.GetHeaders() {
		k := lowerName(h.GetKey())
		switch {
		case k == ":path":
			p.path = headerValue(h)
		case k == HeaderOriginalPath && p.fallback.original == "":
			p.fallback.original = headerPrefix(h, MaxPathBytes+1)
		case k == HeaderForwardedPath && p.fallback.forwarded == "":
			p.fallback.forwarded = headerPrefix(h, MaxPathBytes+1)
		case k == ":method":
			p.method = headerPrefix(h, maxMethodBytes)
		case k == "x-request-id":
			p.requestID = headerPrefix(h, MaxRequestIDBytes)
		case tenant != "" && strings.EqualFold(k, tenant):
			// Bounded at once (a long value becomes its hash), so a
			// stream never holds a client's long header until its
			// decision; the proxy does the same.
			p.tenant = prefixstate.BoundID(headerValue(h))
		case p.sessionHeader(k, h):
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

// sessionHeader keeps h's value as the session id when k is a configured
// session header (Config.SessionHeaders) listed before the one kept so
// far, and reports whether k is one. A value over MaxHintHeaderBytes is
// ignored and counted as a hint problem.
func (p *processor) sessionHeader(k string, h *corev3.HeaderValue) bool {
	i := slices.IndexFunc(p.s.cfg.SessionHeaders, func(n string) bool { return strings.EqualFold(n, k) })
	if i < 0 {
		return false
	}
	if p.sessionAt != 0 && p.sessionAt <= i+1 {
		return true // a later name, or a repeat: the first one counts
	}
	if headerLen(h) > MaxHintHeaderBytes {
		p.s.metrics.hintProblems.Inc()
		return true
	}
	p.session, p.sessionAt = headerValue(h), i+1
	return true
}

// header returns a request header that hint parsing may ask for; the
// prefix id comes from the configured session headers.
func (p *processor) header(name string) (string, bool) {
	if name == hints.HeaderPrefixID {
		return p.session, p.sessionAt != 0
	}
	i := hintIndex(name)
	if i < 0 || p.hintSet&(1<<i) == 0 {
		return "", false
	}
	return p.hintVals[i], true
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
