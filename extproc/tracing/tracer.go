// Package tracing provides kvbandit's OpenTelemetry tracing: a tracer
// provider built from the standard OTEL_* environment variables (OTLP
// export over gRPC or HTTP, off by default), and the few spans the ext_proc
// server and the standalone proxy record: the request's server span
// ("ext_proc stream" or "proxy request", its parent taken from the
// request's W3C traceparent), its "route decision" child with the
// decision's attributes, and the proxy's "upstream request" client span.
// The trace context is passed on to the worker in the traceparent and
// tracestate request headers.
//
// A nil *Tracer is tracing off: every method returns at once, returns zero
// values that do nothing, and allocates nothing, so the request path pays
// one nil check. Nothing here touches OpenTelemetry's globals (no
// otel.SetTracerProvider): the provider is injected where it is used.
package tracing

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of kvbandit's spans.
const ScopeName = "github.com/kvbandit/kvbandit"

// Tracer starts kvbandit's spans. A nil *Tracer is valid: tracing off.
type Tracer struct {
	tracer trace.Tracer
	prop   propagation.TraceContext
	// shutdown flushes and stops the provider New built (nil for
	// FromProvider).
	shutdown func(context.Context) error
}

// New builds the tracer for c: an SDK tracer provider with c's sampler, a
// batch span processor (tuned by the SDK's own OTEL_BSP_* variables) and
// an OTLP exporter for c.Protocol and c.Endpoint (which also reads
// OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT, _COMPRESSION, _CERTIFICATE and
// their _TRACES_ forms itself). The resource carries service.name and
// service.version, then OTEL_RESOURCE_ATTRIBUTES. It returns nil, nil when
// c.Enabled is false. Call Shutdown on exit to flush.
func New(ctx context.Context, c Config, version string) (*Tracer, error) {
	if !c.Enabled {
		return nil, nil
	}
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", c.ServiceName), attribute.String("service.version", version)),
		resource.WithFromEnv())
	if err != nil {
		return nil, fmt.Errorf("%w: OTEL_RESOURCE_ATTRIBUTES: %w", ErrConfig, err)
	}
	if c.ServiceName != DefaultServiceName {
		// OTEL_SERVICE_NAME wins over OTEL_RESOURCE_ATTRIBUTES.
		res, _ = resource.Merge(res, resource.NewSchemaless(attribute.String("service.name", c.ServiceName)))
	}
	var exp sdktrace.SpanExporter
	switch c.Protocol {
	case ProtocolGRPC:
		exp, err = otlptracegrpc.New(ctx, otlptracegrpc.WithEndpointURL(c.Endpoint))
	default:
		exp, err = otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(c.Endpoint))
	}
	if err != nil {
		return nil, fmt.Errorf("tracing: OTLP exporter for %s: %w", c.Endpoint, err)
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithResource(res),
		sdktrace.WithSampler(sampler(c.Sampler, c.Ratio)),
		sdktrace.WithBatcher(exp),
	)
	t := FromProvider(tp)
	t.shutdown = tp.Shutdown
	return t, nil
}

// FromProvider returns a tracer whose spans go to tp (tests use an SDK
// provider with a span recorder). A nil tp gives a nil *Tracer.
func FromProvider(tp trace.TracerProvider) *Tracer {
	if tp == nil {
		return nil
	}
	return &Tracer{tracer: tp.Tracer(ScopeName)}
}

// Shutdown flushes the spans not yet exported and stops the exporter,
// within ctx. It does nothing on a nil Tracer or one from FromProvider.
func (t *Tracer) Shutdown(ctx context.Context) error {
	if t == nil || t.shutdown == nil {
		return nil
	}
	return t.shutdown(ctx)
}

func sampler(name string, ratio float64) sdktrace.Sampler {
	switch name {
	case SamplerAlwaysOn:
		return sdktrace.AlwaysSample()
	case SamplerAlwaysOff:
		return sdktrace.NeverSample()
	case SamplerTraceIDRatio:
		return sdktrace.TraceIDRatioBased(ratio)
	case SamplerParentBasedAlwaysOff:
		return sdktrace.ParentBased(sdktrace.NeverSample())
	case SamplerParentBasedTraceIDRatio:
		return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio))
	}
	return sdktrace.ParentBased(sdktrace.AlwaysSample())
}

// W3C trace context header names (lower case, as Envoy sends them).
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
)

// Bounds on the trace context headers read from a request: a traceparent
// is 55 bytes; W3C asks vendors to pass on at least 512 bytes of
// tracestate. Longer values are ignored (the request starts a new trace).
const (
	MaxTraceparentBytes = 128
	MaxTracestateBytes  = 512
)

// Carrier holds a request's W3C trace context headers (the ext_proc
// processor fills it from the request headers, bounded).
type Carrier struct {
	Traceparent, Tracestate string
}

var _ propagation.TextMapCarrier = (*Carrier)(nil)

// Get implements [propagation.TextMapCarrier].
func (c *Carrier) Get(key string) string {
	switch key {
	case HeaderTraceparent:
		return c.Traceparent
	case HeaderTracestate:
		return c.Tracestate
	}
	return ""
}

// Set implements [propagation.TextMapCarrier].
func (c *Carrier) Set(key, value string) {
	switch key {
	case HeaderTraceparent:
		c.Traceparent = value
	case HeaderTracestate:
		c.Tracestate = value
	}
}

// Keys implements [propagation.TextMapCarrier].
func (c *Carrier) Keys() []string { return []string{HeaderTraceparent, HeaderTracestate} }

// Keep stores a trace context header's value into c when it is within
// its bound (the first of repeated headers counts); other names are
// ignored.
func (c *Carrier) Keep(name, value string) {
	switch {
	case name == HeaderTraceparent && c.Traceparent == "" && len(value) <= MaxTraceparentBytes:
		c.Traceparent = value
	case name == HeaderTracestate && c.Tracestate == "" && len(value) <= MaxTracestateBytes:
		c.Tracestate = value
	}
}

// Span names.
const (
	SpanStream   = "ext_proc stream"
	SpanProxy    = "proxy request"
	SpanDecision = "route decision"
	SpanUpstream = "upstream request"
)

// StartStream starts an ext_proc stream's server span, at start, as a
// child of the trace context in c (a new trace when c has none or an
// invalid one). path (:path; its query is left out) and requestID are the
// request's, already bounded.
func (t *Tracer) StartStream(c *Carrier, start time.Time, path, requestID string) Span {
	if t == nil {
		return Span{}
	}
	ctx := t.prop.Extract(context.Background(), c)
	path, _, _ = strings.Cut(path, "?") // the query may carry secrets
	attrs := []attribute.KeyValue{attribute.String("url.path", path)}
	if requestID != "" {
		attrs = append(attrs, attribute.String("kvbandit.request_id", requestID))
	}
	_, sp := t.tracer.Start(ctx, SpanStream, trace.WithSpanKind(trace.SpanKindServer), trace.WithTimestamp(start), trace.WithAttributes(attrs...))
	return Span{span: sp, t: t}
}

// StartHTTP starts the proxy's server span for r, a child of r's
// traceparent (and tracestate), read within MaxTraceparentBytes and
// MaxTracestateBytes as StartStream's carrier is. It returns w wrapped to record the response status, and r
// with the span in its context; with tracing off it returns w and r as
// they are and a zero Span.
func (t *Tracer) StartHTTP(w http.ResponseWriter, r *http.Request, path string) (http.ResponseWriter, *http.Request, Span) {
	if t == nil {
		return w, r, Span{}
	}
	// The same bounds as the ext_proc path (Carrier.Keep): an oversized
	// traceparent or tracestate is ignored, never handed on to the worker.
	var c Carrier
	for _, name := range [...]string{HeaderTraceparent, HeaderTracestate} {
		for _, v := range r.Header.Values(name) {
			c.Keep(name, v)
		}
	}
	ctx := t.prop.Extract(r.Context(), &c)
	ctx, sp := t.tracer.Start(ctx, SpanProxy, trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(
		attribute.String("http.request.method", truncate(r.Method, maxMethodBytes)), attribute.String("url.path", truncate(path, maxPathBytes))))
	if id := r.Header.Get("X-Request-Id"); id != "" {
		sp.SetAttributes(attribute.String("kvbandit.request_id", truncate(id, 128)))
	}
	rec := &statusRecorder{ResponseWriter: w}
	return rec, r.WithContext(ctx), Span{span: sp, t: t, rec: rec}
}

// Bounds on request strings copied into span attributes (the ext_proc
// processor bounds its own before it starts a span).
const (
	maxPathBytes   = 2048
	maxMethodBytes = 32
)

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// statusRecorder remembers the status a handler answered with; Unwrap lets
// http.ResponseController reach the real writer (Flush, deadlines).
type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }
