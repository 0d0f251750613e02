package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
)

// envOtelcol names the OpenTelemetry Collector binary (tools/otelcol),
// built outside the network namespace.
const envOtelcol = "KVBANDIT_E2E_OTELCOL"

func init() {
	extraSetup = append(extraSetup, func(root, _ string) ([]string, error) {
		cmd := exec.Command("bash", filepath.Join(root, "tools", "build.sh"), "otelcol")
		cmd.Stderr = os.Stderr
		out, err := cmd.Output()
		if err != nil {
			return nil, fmt.Errorf("tools/build.sh otelcol: %w", err)
		}
		return []string{envOtelcol + "=" + strings.TrimSpace(string(out))}, nil
	})
}

// spanSink is an OTLP/HTTP traces endpoint in the test process: the
// collector's otlphttp exporter forwards what it received to it, and it
// decodes the protobuf requests.
type spanSink struct {
	mu    sync.Mutex
	spans []sunkSpan
}

// sunkSpan is a received span with its resource's service.name.
type sunkSpan struct {
	service string
	span    *tracepb.Span
}

func (s *spanSink) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/v1/traces" {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 16<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var req coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(body, &req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	for _, rs := range req.GetResourceSpans() {
		svc := attrString(rs.GetResource().GetAttributes(), "service.name")
		for _, ss := range rs.GetScopeSpans() {
			for _, sp := range ss.GetSpans() {
				s.spans = append(s.spans, sunkSpan{svc, sp})
			}
		}
	}
	s.mu.Unlock()
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// trace returns the spans received for the trace id (hex).
func (s *spanSink) trace(id string) []sunkSpan {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []sunkSpan
	for _, sp := range s.spans {
		if hex.EncodeToString(sp.span.GetTraceId()) == id {
			out = append(out, sp)
		}
	}
	return out
}

func attrString(kvs []*commonpb.KeyValue, key string) string {
	for _, kv := range kvs {
		if kv.GetKey() == key {
			return kv.GetValue().GetStringValue()
		}
	}
	return ""
}

func attr(kvs []*commonpb.KeyValue, key string) (*commonpb.AnyValue, bool) {
	for _, kv := range kvs {
		if kv.GetKey() == key {
			return kv.GetValue(), true
		}
	}
	return nil, false
}

// startCollector runs the collector with an OTLP receiver (gRPC and HTTP)
// on loopback that forwards traces, over OTLP/HTTP, to sinkURL. It returns
// the receiver's gRPC and HTTP addresses.
func startCollector(t *testing.T, sinkURL string) (grpcAddr, httpAddr string) {
	t.Helper()
	bin := os.Getenv(envOtelcol)
	if bin == "" {
		t.Fatal(envOtelcol + " is not set (TestMain builds tools/otelcol)")
	}
	grpcAddr, httpAddr = freeAddr(t), freeAddr(t)
	cfg := fmt.Sprintf(`receivers:
  otlp:
    protocols:
      grpc:
        endpoint: %s
      http:
        endpoint: %s
exporters:
  otlphttp:
    endpoint: %s
    compression: none
    sending_queue:
      enabled: false
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [otlphttp]
`, grpcAddr, httpAddr, sinkURL)
	path := filepath.Join(t.TempDir(), "otelcol.yaml")
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	out := &syncBuffer{}
	cmd := exec.Command(bin, "--config", path)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
			t.Error("the collector did not stop on SIGTERM")
		}
		if t.Failed() {
			t.Logf("collector output:\n%s", out.String())
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		select {
		case <-exited:
			return false, "the collector exited:\n" + out.String()
		default:
		}
		for _, a := range []string{grpcAddr, httpAddr} {
			c, err := net.DialTimeout("tcp", a, time.Second)
			if err != nil {
				return false, "receiver not listening: " + err.Error()
			}
			c.Close()
		}
		return true, ""
	}); err != nil {
		t.Fatal(err)
	}
	return grpcAddr, httpAddr
}

// TestTracingThroughCollector: kvbandit serve with tracing configured by
// OTEL_* variables exports to a real OpenTelemetry Collector (over
// OTLP/HTTP, then over OTLP/gRPC); the collector forwards the spans to the
// test, which checks, for a request through the Envoy-faithful client and
// one through the standalone proxy, each with a client traceparent: the
// spans are in the client's trace, children of the client's span; the
// route decision is a child of the server span with the decision's
// attributes; and the worker received a traceparent naming kvbandit's
// span (the stream span for ext_proc, the upstream span for the proxy).
func TestTracingThroughCollector(t *testing.T) {
	sink := &spanSink{}
	srv := httptest.NewServer(sink)
	t.Cleanup(srv.Close)
	grpcAddr, httpAddr := startCollector(t, srv.URL)

	for _, tc := range []struct{ protocol, endpoint string }{
		{"http/protobuf", "http://" + httpAddr},
		{"grpc", "http://" + grpcAddr},
	} {
		t.Run("protocol="+strings.ReplaceAll(tc.protocol, "/", "_"), func(t *testing.T) {
			t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", tc.endpoint)
			t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", tc.protocol)
			t.Setenv("OTEL_SERVICE_NAME", "kvbandit-e2e")
			t.Setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
			t.Setenv("OTEL_TRACES_SAMPLER_ARG", "0") // only the client's sampled traces
			t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
			testTracing(t, sink)
		})
	}
}

func testTracing(t *testing.T, sink *spanSink) {
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k, proxyURL := startProxyKvbandit(t, addrs)
	p := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)

	// Through the ext_proc server, then the standalone proxy; then an
	// unsampled client trace: kvbandit passes the context on, exports
	// nothing.
	extTrace, extParent, extWorker := tracedRequest(t, c, p.URL(), "01", "vendor=x")
	pxTrace, pxParent, pxWorker := tracedRequest(t, c, proxyURL, "01", "")
	offTrace, offParent, _ := tracedRequest(t, c, proxyURL, "00", "")

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	var ext, px []sunkSpan
	if err := poll(ctx, func() (bool, string) {
		ext, px = sink.trace(extTrace), sink.trace(pxTrace)
		return len(ext) >= 2 && len(px) >= 3, fmt.Sprintf("spans received: ext_proc trace %d (want 2), proxy trace %d (want 3)", len(ext), len(px))
	}); err != nil {
		t.Fatal(err)
	}

	// ext_proc: stream span, child of the client's span; decision under it.
	stream := only(t, ext, "ext_proc stream")
	checkSpan(t, stream, tracepb.Span_SPAN_KIND_SERVER, extParent)
	if v, _ := attr(stream.span.GetAttributes(), "http.response.status_code"); v.GetIntValue() != 200 {
		t.Errorf("ext_proc stream span: http.response.status_code = %v, want 200", v)
	}
	if s := stream.span.GetTraceState(); s != "vendor=x" {
		t.Errorf("ext_proc stream span: trace state %q, want the client's vendor=x", s)
	}
	checkDecision(t, only(t, ext, "route decision"), stream, extWorker)
	wantWorkerParent(t, ws, extWorker, extTrace, hex.EncodeToString(stream.span.GetSpanId()), "vendor=x")

	// Proxy: server span, decision and upstream client span under it.
	server := only(t, px, "proxy request")
	checkSpan(t, server, tracepb.Span_SPAN_KIND_SERVER, pxParent)
	checkDecision(t, only(t, px, "route decision"), server, pxWorker)
	up := only(t, px, "upstream request")
	checkSpan(t, up, tracepb.Span_SPAN_KIND_CLIENT, hex.EncodeToString(server.span.GetSpanId()))
	if v, _ := attr(up.span.GetAttributes(), "server.address"); v.GetStringValue() != pxWorker {
		t.Errorf("upstream span: server.address = %v, want %s", v, pxWorker)
	}
	wantWorkerParent(t, ws, pxWorker, pxTrace, hex.EncodeToString(up.span.GetSpanId()), "")

	// The unsampled trace reached the worker (same trace, flags 00), and
	// nothing of it was exported (the batch delay is 100 ms; the sampled
	// proxy trace sent before it has arrived).
	time.Sleep(500 * time.Millisecond)
	if n := len(sink.trace(offTrace)); n != 0 {
		t.Errorf("unsampled trace: %d spans exported, want 0", n)
	}
	found := false
	for _, w := range ws {
		for _, rq := range w.Requests() {
			if tp := rq.Header.Get("traceparent"); strings.HasPrefix(tp, "00-"+offTrace+"-") {
				found = true
				if !strings.HasSuffix(tp, "-00") || strings.Contains(tp, offParent) {
					t.Errorf("unsampled request: worker got traceparent %q, want kvbandit's span of trace %s, flags 00", tp, offTrace)
				}
			}
		}
	}
	if !found {
		t.Errorf("unsampled request: no worker got a traceparent of trace %s", offTrace)
	}
}

// tracedRequest sends a chat completion to base with a new client trace
// context (traceparent flags, and tracestate when not ""); it returns the
// trace id, the client's span id and the worker that served.
func tracedRequest(t *testing.T, c *http.Client, base, flags, state string) (trace, parent, served string) {
	t.Helper()
	trace, parent = randomHex(t, 16), randomHex(t, 8)
	hdr := map[string]string{"traceparent": "00-" + trace + "-" + parent + "-" + flags}
	if state != "" {
		hdr["tracestate"] = state
	}
	r := send(t, c, http.MethodPost, base+"/v1/chat/completions", chatRequest(300, ""), hdr)
	if r.status != http.StatusOK {
		t.Fatalf("request to %s: %d %s", base, r.status, r.body)
	}
	return trace, parent, r.worker()
}

func randomHex(t *testing.T, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	b[0] |= 1 // never all zeros (an invalid id)
	return hex.EncodeToString(b)
}

// only returns the one span named name.
func only(t *testing.T, spans []sunkSpan, name string) sunkSpan {
	t.Helper()
	var out []sunkSpan
	var names []string
	for _, s := range spans {
		names = append(names, s.span.GetName())
		if s.span.GetName() == name {
			out = append(out, s)
		}
	}
	if len(out) != 1 {
		t.Fatalf("%d spans named %q, want 1 (spans: %q)", len(out), name, names)
	}
	return out[0]
}

func checkSpan(t *testing.T, s sunkSpan, kind tracepb.Span_SpanKind, parent string) {
	t.Helper()
	if s.service != "kvbandit-e2e" {
		t.Errorf("%s: service.name %q, want kvbandit-e2e (OTEL_SERVICE_NAME)", s.span.GetName(), s.service)
	}
	if s.span.GetKind() != kind {
		t.Errorf("%s: kind %v, want %v", s.span.GetName(), s.span.GetKind(), kind)
	}
	if got := hex.EncodeToString(s.span.GetParentSpanId()); got != parent {
		t.Errorf("%s: parent span %s, want %s", s.span.GetName(), got, parent)
	}
}

// checkDecision checks a route decision span: child of server, internal,
// the decision's attributes, endpoint = the worker that served.
func checkDecision(t *testing.T, d, server sunkSpan, served string) {
	t.Helper()
	checkSpan(t, d, tracepb.Span_SPAN_KIND_INTERNAL, hex.EncodeToString(server.span.GetSpanId()))
	a := d.span.GetAttributes()
	if v, _ := attr(a, "kvbandit.policy"); v.GetStringValue() != "round_robin" {
		t.Errorf("decision: kvbandit.policy = %v, want round_robin", v)
	}
	if v, _ := attr(a, "kvbandit.endpoint"); v.GetStringValue() != served || served == "" {
		t.Errorf("decision: kvbandit.endpoint = %v, want the worker that served, %q", v, served)
	}
	if v, _ := attr(a, "kvbandit.candidates"); v.GetIntValue() != 2 {
		t.Errorf("decision: kvbandit.candidates = %v, want 2", v)
	}
	if v, ok := attr(a, "kvbandit.queue_wait_ms"); !ok || v.GetDoubleValue() < 0 {
		t.Errorf("decision: kvbandit.queue_wait_ms = %v, want >= 0", v)
	}
	for _, key := range []string{"kvbandit.predicted_cache_hit", "kvbandit.overlap_blocks", "kvbandit.decision_id"} {
		if _, ok := attr(a, key); !ok {
			t.Errorf("decision: no %s attribute", key)
		}
	}
	if d.span.GetStartTimeUnixNano() < server.span.GetStartTimeUnixNano() || d.span.GetEndTimeUnixNano() > server.span.GetEndTimeUnixNano() {
		t.Errorf("decision span [%d, %d] not within its server span [%d, %d]", d.span.GetStartTimeUnixNano(), d.span.GetEndTimeUnixNano(), server.span.GetStartTimeUnixNano(), server.span.GetEndTimeUnixNano())
	}
}

// wantWorkerParent checks that the worker at addr received the request of
// trace with traceparent 00-trace-span-01 (and tracestate, when not "").
func wantWorkerParent(t *testing.T, ws []*worker.Worker, addr, trace, span, state string) {
	t.Helper()
	want := "00-" + trace + "-" + span + "-01"
	var got []string
	for _, rq := range byAddr(t, ws, addr).Requests() {
		tp := rq.Header.Get("traceparent")
		got = append(got, tp)
		if tp == want {
			if state != "" && rq.Header.Get("tracestate") != state {
				t.Errorf("worker %s: tracestate %q, want %q", addr, rq.Header.Get("tracestate"), state)
			}
			return
		}
	}
	t.Errorf("worker %s: traceparents %q, want %q", addr, got, want)
}
