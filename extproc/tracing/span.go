package tracing

import (
	"context"
	"net/http"
	"strconv"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvbandit/kvbandit/routing"
)

// Decision attribute keys (see docs/tracing.md).
const (
	AttrPolicy            = "kvbandit.policy"
	AttrEndpoint          = "kvbandit.endpoint"
	AttrDecisionID        = "kvbandit.decision_id"
	AttrDPRank            = "kvbandit.dp_rank"
	AttrCandidates        = "kvbandit.candidates"
	AttrPredictedCacheHit = "kvbandit.predicted_cache_hit"
	AttrOverlapBlocks     = "kvbandit.overlap_blocks"
	AttrOverlapCPUBlocks  = "kvbandit.overlap_cpu_blocks"
	AttrOverlapDiskBlocks = "kvbandit.overlap_disk_blocks"
	AttrQueueWaitMS       = "kvbandit.queue_wait_ms"
	AttrPredictedTTFTMS   = "kvbandit.predicted_ttft_ms"
	AttrTTFTObjectiveMS   = "kvbandit.ttft_objective_ms"
	AttrSticky            = "kvbandit.sticky"
	AttrStatusCode        = "http.response.status_code"
	AttrErrorType         = "error.type"
	AttrOutcome           = "kvbandit.outcome"
)

// maxStatusMessage bounds an error message copied into a span status (it
// may quote a client's model name).
const maxStatusMessage = 512

// Span is a request's server span ("ext_proc stream" or "proxy request").
// The zero Span (tracing off) does nothing. A Span is used by one
// goroutine at a time, like the request it belongs to.
type Span struct {
	span trace.Span
	t    *Tracer
	rec  *statusRecorder // proxy spans: the status the client got
}

// On reports whether the span exists (tracing on).
func (s Span) On() bool { return s.span != nil }

// Decision records the request's "route decision" child span, from start
// (before parsing) to end (after the pick), with the decision's
// attributes; pickStart is when the pick began, so the time from it to the
// decision (d.At) is the admission queue wait. A non-nil err (the request
// was refused) sets the span's status to error.
func (s Span) Decision(start, pickStart, end time.Time, d *routing.Decision, err error) {
	if s.span == nil || !s.span.IsRecording() {
		return
	}
	ctx := trace.ContextWithSpan(context.Background(), s.span)
	_, sp := s.t.tracer.Start(ctx, SpanDecision, trace.WithTimestamp(start))
	if d != nil {
		hit := d.Overlap+d.OverlapCPU+d.OverlapDisk > 0
		attrs := make([]attribute.KeyValue, 0, 14)
		attrs = append(attrs,
			attribute.String(AttrPolicy, d.Policy),
			attribute.String(AttrEndpoint, string(d.Endpoint)),
			attribute.String(AttrDecisionID, d.ID),
			attribute.Int(AttrCandidates, d.Candidates),
			attribute.Bool(AttrPredictedCacheHit, hit),
			attribute.Int(AttrOverlapBlocks, d.Overlap),
			attribute.Float64(AttrQueueWaitMS, ms(max(d.At.Sub(pickStart), 0))),
			attribute.Bool(AttrSticky, d.Sticky),
		)
		if d.DPRank >= 0 {
			attrs = append(attrs, attribute.Int(AttrDPRank, d.DPRank))
		}
		if d.OverlapCPU > 0 {
			attrs = append(attrs, attribute.Int(AttrOverlapCPUBlocks, d.OverlapCPU))
		}
		if d.OverlapDisk > 0 {
			attrs = append(attrs, attribute.Int(AttrOverlapDiskBlocks, d.OverlapDisk))
		}
		if d.Predicted.TTFT > 0 {
			attrs = append(attrs, attribute.Float64(AttrPredictedTTFTMS, ms(d.Predicted.TTFT)))
		}
		if d.Objective > 0 {
			attrs = append(attrs, attribute.Float64(AttrTTFTObjectiveMS, ms(d.Objective)))
		}
		sp.SetAttributes(attrs...)
	}
	if err != nil {
		setError(sp, err)
	}
	sp.End(trace.WithTimestamp(end))
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func setError(sp trace.Span, err error) {
	msg := err.Error()
	if len(msg) > maxStatusMessage {
		msg = msg[:maxStatusMessage]
	}
	sp.SetStatus(codes.Error, msg)
}

// TraceContext returns the traceparent (and tracestate, possibly empty)
// that hands the span's context on to the worker; both are empty with
// tracing off.
func (s Span) TraceContext() (traceparent, tracestate string) {
	if s.span == nil {
		return "", ""
	}
	var c Carrier
	s.t.prop.Inject(trace.ContextWithSpan(context.Background(), s.span), &c)
	return c.Traceparent, c.Tracestate
}

// Refused records that the request was answered locally with status
// (code is the OpenAI error code, such as "no_endpoint"); a 5xx status
// marks the span as an error, as for any server span.
func (s Span) Refused(status int, code string) {
	if s.span == nil {
		return
	}
	s.span.SetAttributes(attribute.Int(AttrStatusCode, status), attribute.String(AttrErrorType, code))
	if status >= 500 {
		s.span.SetStatus(codes.Error, code)
	}
}

// End ends the span. status is the worker's response status (0: none
// seen); a proxy span uses the status its client got instead. A 5xx
// status marks the span as an error.
func (s Span) End(status int) {
	if s.span == nil {
		return
	}
	if s.rec != nil {
		status = s.rec.status
	}
	if status > 0 {
		s.span.SetAttributes(attribute.Int(AttrStatusCode, status))
		if status >= 500 {
			s.span.SetStatus(codes.Error, strconv.Itoa(status))
		}
	}
	s.span.End()
}

// Upstream is the proxy's client span for the call to the worker; the zero
// Upstream does nothing.
type Upstream struct {
	span trace.Span
}

// StartUpstream starts the client span for req (the proxied request to the
// worker), a child of s, and sets req's traceparent and tracestate headers
// to it, replacing the client's. With tracing off it does nothing and the
// client's headers pass through untouched.
func (s Span) StartUpstream(req *http.Request, endpoint string) Upstream {
	if s.span == nil {
		return Upstream{}
	}
	ctx, sp := s.t.tracer.Start(trace.ContextWithSpan(req.Context(), s.span), SpanUpstream,
		trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(
			attribute.String("http.request.method", truncate(req.Method, maxMethodBytes)),
			attribute.String("server.address", endpoint),
			attribute.String("url.path", truncate(req.URL.Path, maxPathBytes))))
	req.Header.Del(HeaderTracestate)
	s.t.prop.Inject(ctx, propagation.HeaderCarrier(req.Header))
	return Upstream{span: sp}
}

// End ends the upstream span with the worker's status (0: no response)
// and the exchange's outcome; an upstream error or a reset marks it as an
// error.
func (u Upstream) End(status int, kind routing.OutcomeKind) {
	if u.span == nil {
		return
	}
	if status > 0 {
		u.span.SetAttributes(attribute.Int(AttrStatusCode, status))
	}
	u.span.SetAttributes(attribute.String(AttrOutcome, kind.String()))
	if kind == routing.OutcomeUpstreamError || kind == routing.OutcomeReset {
		u.span.SetStatus(codes.Error, kind.String())
	}
	u.span.End()
}
