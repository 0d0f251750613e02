package proxy_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvbandit/kvbandit/extproc/tracing"
)

const clientTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// TestTracingOffPassesTraceparent: without a tracer the client's
// traceparent and tracestate reach the worker as sent.
func TestTracingOffPassesTraceparent(t *testing.T) {
	f := newFixture(t, options{workers: 1})
	resp, b := f.post(t, "/v1/chat/completions", chatBody("test-model", "hi", ""), "traceparent", clientTraceparent, "tracestate", "vendor=x")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	h := f.workers[0].Requests()[0].Header
	if h.Get("traceparent") != clientTraceparent || h.Get("tracestate") != "vendor=x" {
		t.Errorf("worker got traceparent %q tracestate %q", h.Get("traceparent"), h.Get("tracestate"))
	}
}

// TestTracingProxySpans: the server span continues the client's trace;
// the decision and the upstream call are its children; the worker's
// traceparent names the upstream span; a worker error marks the spans.
func TestTracingProxySpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	f := newFixture(t, options{workers: 2, policy: "round_robin", tracer: tracing.FromProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))})
	resp, b := f.post(t, "/v1/chat/completions", chatBody("test-model", "hi", ""), "traceparent", clientTraceparent, "tracestate", "vendor=x")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	served := resp.Header.Get("x-kvbandit-endpoint")
	spans := waitSpans(t, rec, 3)
	server, decision, up := spans[tracing.SpanProxy], spans[tracing.SpanDecision], spans[tracing.SpanUpstream]
	if server == nil || decision == nil || up == nil {
		t.Fatalf("spans %v", spans)
	}
	if server.Parent().TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || server.Parent().SpanID().String() != "00f067aa0ba902b7" {
		t.Errorf("server span parent %v", server.Parent())
	}
	if server.SpanKind() != trace.SpanKindServer || up.SpanKind() != trace.SpanKindClient {
		t.Errorf("kinds: server %v, upstream %v", server.SpanKind(), up.SpanKind())
	}
	for _, s := range []sdktrace.ReadOnlySpan{decision, up} {
		if s.Parent().SpanID() != server.SpanContext().SpanID() {
			t.Errorf("%s: parent %v, want the server span", s.Name(), s.Parent().SpanID())
		}
	}
	attrs := map[string]string{}
	for _, a := range decision.Attributes() {
		attrs[string(a.Key)] = a.Value.Emit()
	}
	if attrs["kvbandit.endpoint"] != served || attrs["kvbandit.policy"] != "round_robin" || attrs["kvbandit.candidates"] != "2" {
		t.Errorf("decision attributes %v (served %s)", attrs, served)
	}
	h := f.worker(t, served).Requests()[0].Header
	if want := "00-4bf92f3577b34da6a3ce929d0e0e4736-" + up.SpanContext().SpanID().String() + "-01"; h.Get("traceparent") != want {
		t.Errorf("worker traceparent %q, want %q", h.Get("traceparent"), want)
	}
	if h.Get("tracestate") != "vendor=x" {
		t.Errorf("worker tracestate %q", h.Get("tracestate"))
	}

	// A worker error: the upstream span and the server span (502 passed
	// through as the worker's status) are errors.
	rec2 := tracetest.NewSpanRecorder()
	f2 := newFixture(t, options{workers: 1, tracer: tracing.FromProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec2)))})
	f2.workers[0].SetFailStatus(http.StatusServiceUnavailable)
	resp, _ = f2.post(t, "/v1/chat/completions", chatBody("test-model", "hi", ""))
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("status %d", resp.StatusCode)
	}
	spans = waitSpans(t, rec2, 3)
	for _, name := range []string{tracing.SpanProxy, tracing.SpanUpstream} {
		if spans[name].Status().Code != codes.Error {
			t.Errorf("%s: status %v, want error", name, spans[name].Status())
		}
	}
	if spans[tracing.SpanProxy].Parent().IsValid() {
		t.Errorf("no client traceparent: server span has parent %v", spans[tracing.SpanProxy].Parent())
	}
}

// waitSpans waits for n ended spans (the server span ends after the
// handler returns, which may be just after the client has its response).
func waitSpans(t *testing.T, rec *tracetest.SpanRecorder, n int) map[string]sdktrace.ReadOnlySpan {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(rec.Ended()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d spans ended, want %d", len(rec.Ended()), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	out := map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		out[s.Name()] = s
	}
	return out
}

// TestTracingProxyTracestateBounded: with tracing on, the proxy reads the
// client's trace context within the ext_proc path's bounds
// (tracing.MaxTracestateBytes): a valid 8 KiB tracestate is ignored, never
// handed on to the worker, while the traceparent still continues the
// client's trace; one within the bound is passed on.
func TestTracingProxyTracestateBounded(t *testing.T) {
	var big strings.Builder
	for i := range 32 { // W3C's most list members, each value 250 bytes
		if i > 0 {
			big.WriteByte(',')
		}
		fmt.Fprintf(&big, "k%d=%s", i, strings.Repeat("x", 250))
	}
	small := "a=" + strings.Repeat("y", 200) + ",b=" + strings.Repeat("z", 200) + ",c=" + strings.Repeat("w", tracing.MaxTracestateBytes-408)
	for _, c := range []struct {
		name, state, want string
	}{{"8 KiB", big.String(), ""}, {"at the bound", small, small}} {
		t.Run(c.name, func(t *testing.T) {
			rec := tracetest.NewSpanRecorder()
			f := newFixture(t, options{workers: 1, tracer: tracing.FromProvider(sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)))})
			resp, b := f.post(t, "/v1/chat/completions", chatBody("test-model", "hi", ""), "traceparent", clientTraceparent, "tracestate", c.state)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			h := f.workers[0].Requests()[0].Header
			if got := h.Get("tracestate"); got != c.want {
				t.Errorf("worker tracestate of %d bytes, want %d", len(got), len(c.want))
			}
			if !strings.HasPrefix(h.Get("traceparent"), "00-4bf92f3577b34da6a3ce929d0e0e4736-") {
				t.Errorf("worker traceparent %q does not continue the client's trace", h.Get("traceparent"))
			}
			waitSpans(t, rec, 3)
		})
	}
}
