package extproc_test

import (
	"errors"
	"io"
	"log/slog"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy/roundrobin"
)

const (
	clientTrace  = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientParent = "00f067aa0ba902b7"
)

// traceExchange runs one FULL_DUPLEX_STREAMED request with the client's
// traceparent and tracestate (the subset hint, when not empty, restricts
// the pick) through a server with tracer (nil: off), the response
// included. It returns the request-phase header mutation, or the
// immediate response when the request was refused.
func traceExchange(t *testing.T, tracer *tracing.Tracer, subset string) (*extprocv3.HeaderMutation, *extprocv3.ImmediateResponse) {
	t.Helper()
	e := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: slog.New(slog.DiscardHandler)})
	defer e.Close()
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}, {Key: "10.0.0.2:8000"}}}); err != nil {
		t.Fatal(err)
	}
	srv := extproc.NewServer(extproc.Config{ResponseProcessing: true}, extproc.Deps{Picker: e, Logger: slog.New(slog.DiscardHandler), Registry: prometheus.NewRegistry(), Tracer: tracer})
	client, stop := startServer(t, srv)
	defer stop()
	s, err := client.Process(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	h := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	h.GetRequestHeaders().GetHeaders().Headers = append(h.GetRequestHeaders().GetHeaders().GetHeaders(),
		&corev3.HeaderValue{Key: "traceparent", RawValue: []byte("00-" + clientTrace + "-" + clientParent + "-01")},
		&corev3.HeaderValue{Key: "tracestate", RawValue: []byte("vendor=x")},
		&corev3.HeaderValue{Key: "x-request-id", RawValue: []byte("req-1")})
	if subset != "" {
		h.MetadataContext = subsetMetadata(subset)
	}
	send(t, s, h)
	send(t, s, reqBody(chat, true))
	r := recv(t, s)
	if ir := r.GetImmediateResponse(); ir != nil {
		waitClosed(t, s)
		return nil, ir
	}
	hm := r.GetRequestHeaders().GetResponse().GetHeaderMutation()
	recv(t, s) // the echoed body
	send(t, s, respHeaders("200"))
	recv(t, s)
	send(t, s, respBody(sseContent+sseUsage, true))
	recv(t, s)
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, s)
	return hm, nil
}

// waitClosed waits for the server to end the stream: its spans have ended
// by then (the processor closes before Process returns).
func waitClosed(t *testing.T, s extprocv3.ExternalProcessor_ProcessClient) {
	t.Helper()
	if m, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the exchange: %v, %v; want EOF", m, err)
	}
}

func subsetMetadata(v string) *corev3.Metadata {
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		extproc.NamespaceSubset: {Fields: map[string]*structpb.Value{extproc.KeySubset: structpb.NewStringValue(v)}},
	}}
}

func recordingTracer() (*tracing.Tracer, *tracetest.SpanRecorder) {
	rec := tracetest.NewSpanRecorder()
	return tracing.FromProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))), rec
}

func setHeaderValue(hm *extprocv3.HeaderMutation, key string) (string, bool) {
	for _, h := range hm.GetSetHeaders() {
		if h.GetHeader().GetKey() == key {
			return string(h.GetHeader().GetRawValue()), true
		}
	}
	return "", false
}

// TestTracingOffLeavesTraceHeaders: without a tracer the client's
// traceparent and tracestate reach the worker untouched (no mutation).
func TestTracingOffLeavesTraceHeaders(t *testing.T) {
	hm, _ := traceExchange(t, nil, "")
	for _, k := range []string{"traceparent", "tracestate"} {
		if v, ok := setHeaderValue(hm, k); ok {
			t.Errorf("tracing off: %s set to %q", k, v)
		}
	}
	if len(hm.GetRemoveHeaders()) != 0 {
		t.Errorf("tracing off: headers removed: %q", hm.GetRemoveHeaders())
	}
}

// TestTracingStreamAndDecisionSpans: the stream span continues the
// client's trace, the decision span is its child with the decision's
// attributes, and the worker's traceparent names the stream span.
func TestTracingStreamAndDecisionSpans(t *testing.T) {
	tracer, rec := recordingTracer()
	hm, _ := traceExchange(t, tracer, "")
	spans := rec.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans ended, want 2", len(spans))
	}
	byName := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range spans {
		byName[s.Name()] = s
	}
	stream, decision := byName[tracing.SpanStream], byName[tracing.SpanDecision]
	if stream == nil || decision == nil {
		t.Fatalf("spans: %v", byName)
	}
	if got := stream.SpanContext().TraceID().String(); got != clientTrace {
		t.Errorf("stream trace %s, want the client's %s", got, clientTrace)
	}
	if got := stream.Parent().SpanID().String(); got != clientParent || !stream.Parent().IsRemote() {
		t.Errorf("stream parent %s (remote %v), want the client's %s", got, stream.Parent().IsRemote(), clientParent)
	}
	if decision.Parent().SpanID() != stream.SpanContext().SpanID() {
		t.Errorf("decision parent %s, want the stream span %s", decision.Parent().SpanID(), stream.SpanContext().SpanID())
	}
	attrs := map[string]string{}
	for _, a := range append(stream.Attributes(), decision.Attributes()...) {
		attrs[string(a.Key)] = a.Value.Emit()
	}
	dest, _ := setHeaderValue(hm, extproc.HeaderDestination)
	for k, want := range map[string]string{
		"kvbandit.policy": "round_robin", "kvbandit.endpoint": dest, "kvbandit.candidates": "2",
		"kvbandit.predicted_cache_hit": "false", "kvbandit.overlap_blocks": "0",
		"http.response.status_code": "200", "url.path": "/v1/chat/completions", "kvbandit.request_id": "req-1",
	} {
		if attrs[k] != want {
			t.Errorf("attribute %s = %q, want %q", k, attrs[k], want)
		}
	}
	if _, ok := attrs["kvbandit.queue_wait_ms"]; !ok {
		t.Error("no kvbandit.queue_wait_ms")
	}
	tp, _ := setHeaderValue(hm, "traceparent")
	if want := "00-" + clientTrace + "-" + stream.SpanContext().SpanID().String() + "-01"; tp != want {
		t.Errorf("traceparent to the worker %q, want %q", tp, want)
	}
	if ts, _ := setHeaderValue(hm, "tracestate"); ts != "vendor=x" {
		t.Errorf("tracestate to the worker %q, want vendor=x", ts)
	}
}

// TestTracingRefusal: a refused request (empty subset: 503) ends both
// spans with an error status and the refusal's code (error.type).
func TestTracingRefusal(t *testing.T) {
	tracer, rec := recordingTracer()
	_, ir := traceExchange(t, tracer, "10.9.9.9:1")
	if ir == nil || ir.GetStatus().GetCode() != 503 {
		t.Fatalf("immediate response %v, want 503", ir)
	}
	// The stream span ends when the stream closes, after the reply.
	spans := rec.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans ended, want 2", len(spans))
	}
	for _, s := range spans {
		if s.Status().Code != codes.Error {
			t.Errorf("%s: status %v, want error", s.Name(), s.Status())
		}
		if s.Name() == tracing.SpanStream {
			code := ""
			for _, a := range s.Attributes() {
				if a.Key == "error.type" {
					code = a.Value.Emit()
				}
			}
			if code != "subset_empty" {
				t.Errorf("stream span: error.type %q, want subset_empty", code)
			}
		}
	}
}

// BenchmarkExtProcExchangeTracing is BenchmarkExtProcExchange's 4 KiB
// kvbandit exchange with tracing on and every request sampled (spans are
// recorded, then dropped: no exporter), for the cost of tracing on; with
// tracing off the exchange is BenchmarkExtProcExchange itself.
//
//	go test -run '^$' -bench 'ExtProcExchange(Tracing)?/body=4KB/server=kvbandit' -benchmem -count 6 ./extproc/
func BenchmarkExtProcExchangeTracing(b *testing.B) {
	body := chatBody(4 << 10)
	b.Run("body=4KB/server=kvbandit", func(b *testing.B) {
		e := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: slog.New(slog.DiscardHandler)})
		defer e.Close()
		if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}, {Key: "10.0.0.2:8000"}}}); err != nil {
			b.Fatal(err)
		}
		tracer := tracing.FromProvider(sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample())))
		srv := extproc.NewServer(extproc.Config{ResponseProcessing: true}, extproc.Deps{Picker: e, Logger: slog.New(slog.DiscardHandler), Tracer: tracer})
		client, stop := startServer(b, srv)
		defer stop()
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			if err := exchange(b.Context(), client, body); err != nil {
				b.Fatal(err)
			}
		}
	})
}
