package tracing_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/routing"
)

func env(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestFromEnv(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		want tracing.Config
	}{
		{"nothing set: off", nil, tracing.Config{Protocol: "http/protobuf", Endpoint: "http://localhost:4318/v1/traces", Sampler: "parentbased_always_on", Ratio: 1, ServiceName: "kvbandit"}},
		{"exporter otlp: defaults", map[string]string{"OTEL_TRACES_EXPORTER": "otlp"},
			tracing.Config{Enabled: true, Protocol: "http/protobuf", Endpoint: "http://localhost:4318/v1/traces", Sampler: "parentbased_always_on", Ratio: 1, ServiceName: "kvbandit"}},
		{"generic endpoint turns it on, /v1/traces appended", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/base/"},
			tracing.Config{Enabled: true, Protocol: "http/protobuf", Endpoint: "http://collector:4318/base/v1/traces", Sampler: "parentbased_always_on", Ratio: 1, ServiceName: "kvbandit"}},
		{"traces endpoint used as is, over the generic one", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://b:2/x"},
			tracing.Config{Enabled: true, Protocol: "http/protobuf", Endpoint: "https://b:2/x", Sampler: "parentbased_always_on", Ratio: 1, ServiceName: "kvbandit"}},
		{"grpc, traces protocol over generic", map[string]string{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
			tracing.Config{Enabled: true, Protocol: "grpc", Endpoint: "http://localhost:4317", Sampler: "parentbased_always_on", Ratio: 1, ServiceName: "kvbandit"}},
		{"sampler, ratio, service", map[string]string{"OTEL_TRACES_EXPORTER": "OTLP", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25", "OTEL_SERVICE_NAME": "router-a"},
			tracing.Config{Enabled: true, Protocol: "http/protobuf", Endpoint: "http://localhost:4318/v1/traces", Sampler: "parentbased_traceidratio", Ratio: 0.25, ServiceName: "router-a"}},
		{"none wins over an endpoint", map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1"},
			tracing.Config{Protocol: "http/protobuf", Endpoint: "http://a:1/v1/traces", Sampler: "parentbased_always_on", Ratio: 1, ServiceName: "kvbandit"}},
		{"SDK disabled", map[string]string{"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "otlp"},
			tracing.Config{Protocol: "http/protobuf", Endpoint: "http://localhost:4318/v1/traces", Sampler: "parentbased_always_on", Ratio: 1, ServiceName: "kvbandit"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tracing.FromEnv(env(tc.env))
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestFromEnvErrors(t *testing.T) {
	for _, tc := range []struct {
		env     map[string]string
		varName string // the error must name it
	}{
		{map[string]string{"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"},
		{map[string]string{"OTEL_SDK_DISABLED": "yes"}, "OTEL_SDK_DISABLED"},
		{map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_PROTOCOL"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "OTEL_EXPORTER_OTLP_ENDPOINT"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector"}, "OTEL_EXPORTER_OTLP_ENDPOINT"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:99999"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://user:pw@collector:4318"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://" + strings.Repeat("a", 5000)}, "OTEL_EXPORTER_OTLP_ENDPOINT"},
		{map[string]string{"OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"},
		{map[string]string{"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"},
		{map[string]string{"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "NaN"}, "OTEL_TRACES_SAMPLER_ARG"},
		{map[string]string{"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"},
		// A bad value is an error even when tracing is off.
		{map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_SAMPLER": "sometimes"}, "OTEL_TRACES_SAMPLER"},
	} {
		_, err := tracing.FromEnv(env(tc.env))
		if !errors.Is(err, tracing.ErrConfig) || !strings.Contains(err.Error(), tc.varName) {
			t.Errorf("%v: error %v, want one wrapping ErrConfig that names %s", tc.env, err, tc.varName)
		}
	}
}

// TestOffAllocatesNothing: with tracing off (a nil *Tracer) the hooks on
// the request path allocate nothing and change nothing.
func TestOffAllocatesNothing(t *testing.T) {
	var tr *tracing.Tracer
	c := &tracing.Carrier{Traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	d := &routing.Decision{Policy: "p", Endpoint: "10.0.0.1:1"}
	now := time.Now()
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
	r.Header.Set("traceparent", c.Traceparent)
	w := httptest.NewRecorder()
	n := testing.AllocsPerRun(100, func() {
		s := tr.StartStream(c, now, "/v1/chat/completions", "id")
		s.Decision(now, now, now, d, nil)
		if tp, ts := s.TraceContext(); tp != "" || ts != "" {
			t.Fatal("trace context with tracing off")
		}
		s.Refused(503, "x")
		s.End(200)
		w2, r2, s2 := tr.StartHTTP(w, r, "/v1/chat/completions")
		if w2 != w || r2 != r || s2.On() {
			t.Fatal("StartHTTP changed the request with tracing off")
		}
		s2.StartUpstream(r, "10.0.0.1:1").End(200, routing.OutcomeSuccess)
	})
	if n != 0 {
		t.Errorf("%v allocations per request with tracing off, want 0", n)
	}
	if got := r.Header.Get("traceparent"); got != c.Traceparent {
		t.Errorf("traceparent changed to %q", got)
	}
}

func TestCarrierKeepBounds(t *testing.T) {
	var c tracing.Carrier
	c.Keep("traceparent", strings.Repeat("a", tracing.MaxTraceparentBytes+1))
	c.Keep("tracestate", "a=1")
	c.Keep("tracestate", "b=2") // a repeat: the first counts
	c.Keep("x-other", "zzz")
	if c.Traceparent != "" || c.Tracestate != "a=1" {
		t.Errorf("carrier %+v", c)
	}
}

// TestNewExportsAndFlushes: New's OTLP/HTTP exporter sends the spans to
// the configured endpoint, with the service name, when Shutdown flushes
// them (the batch delay is far longer than the test).
func TestNewExportsAndFlushes(t *testing.T) {
	var mu sync.Mutex
	var got []*coltracepb.ExportTraceServiceRequest
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if r.URL.Path != "/v1/traces" || proto.Unmarshal(b, &req) != nil {
			http.Error(w, "bad", http.StatusBadRequest)
			return
		}
		mu.Lock()
		got = append(got, &req)
		mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		_, _ = w.Write(out)
	}))
	defer srv.Close()
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
	c, err := tracing.FromEnv(env(map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": srv.URL, "OTEL_SERVICE_NAME": "svc-x"}))
	if err != nil {
		t.Fatal(err)
	}
	tr, err := tracing.New(t.Context(), c, "v1.2.3")
	if err != nil {
		t.Fatal(err)
	}
	s := tr.StartStream(&tracing.Carrier{}, time.Now(), "/v1/chat/completions", "")
	s.End(200)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := tr.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 1 || len(got[0].GetResourceSpans()) != 1 {
		t.Fatalf("exports: %v", got)
	}
	rs := got[0].GetResourceSpans()[0]
	attrs := map[string]string{}
	for _, kv := range rs.GetResource().GetAttributes() {
		attrs[kv.GetKey()] = kv.GetValue().GetStringValue()
	}
	if attrs["service.name"] != "svc-x" || attrs["service.version"] != "v1.2.3" {
		t.Errorf("resource %v", attrs)
	}
	sp := rs.GetScopeSpans()[0].GetSpans()[0]
	if sp.GetName() != tracing.SpanStream || trace.SpanID(sp.GetSpanId()).IsValid() == false {
		t.Errorf("span %v", sp)
	}
}

// TestNilTracerShutdown: Shutdown of tracing off is a no-op.
func TestNilTracerShutdown(t *testing.T) {
	var tr *tracing.Tracer
	if err := tr.Shutdown(t.Context()); err != nil {
		t.Fatal(err)
	}
	if tr, err := tracing.New(t.Context(), tracing.Config{}, "v"); tr != nil || err != nil {
		t.Fatalf("New(disabled) = %v, %v; want nil, nil", tr, err)
	}
}
