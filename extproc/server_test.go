package extproc_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy/roundrobin"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// harness is an extproc server on loopback gRPC with a real engine whose
// outcomes are recorded.
type harness struct {
	srv    *extproc.Server
	engine *engine.Engine
	client extprocv3.ExternalProcessorClient
	reg    *prometheus.Registry
	stop   func()

	mu       sync.Mutex
	outcomes []routing.Outcome
	doneC    chan routing.Outcome
}

func newHarness(t *testing.T, cfg extproc.Config, clk clock.Clock, dial ...grpc.DialOption) *harness {
	t.Helper()
	h := &harness{reg: prometheus.NewRegistry(), doneC: make(chan routing.Outcome, 16)}
	log := slog.New(slog.DiscardHandler)
	h.engine = engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: log, Clock: clk, OnDone: func(_ *routing.Decision, o routing.Outcome) {
		h.mu.Lock()
		h.outcomes = append(h.outcomes, o)
		h.mu.Unlock()
		h.doneC <- o
	}})
	t.Cleanup(h.engine.Close)
	if err := h.engine.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}, {Key: "10.0.0.2:8000"}}}); err != nil {
		t.Fatal(err)
	}
	h.srv = extproc.NewServer(cfg, extproc.Deps{Picker: h.engine, Logger: log, Registry: h.reg, Clock: clk})
	h.client, h.stop = startServer(t, h.srv, dial...)
	t.Cleanup(func() {
		h.stop()
		for _, st := range h.engine.Endpoints() {
			if n := st.InFlight.Load(); n != 0 {
				t.Errorf("%s: in-flight %d at the end of the test", st.Key, n)
			}
		}
	})
	return h
}

// outcome waits for the next Done.
func (h *harness) outcome(t *testing.T) routing.Outcome {
	t.Helper()
	select {
	case o := <-h.doneC:
		return o
	case <-time.After(10 * time.Second):
		t.Fatal("no outcome within 10s")
	}
	return routing.Outcome{}
}

func (h *harness) noMoreOutcomes(t *testing.T) {
	t.Helper()
	time.Sleep(20 * time.Millisecond) // let a wrong second Done surface
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.outcomes) != 1 {
		t.Fatalf("Done called %d times, want exactly 1: %+v", len(h.outcomes), h.outcomes)
	}
}

func reqHeaders(path string, eos bool, mode filterv3.ProcessingMode_BodySendMode) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{EndOfStream: eos, Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
			{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte(path)},
		}}}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: mode, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}
}

func reqBody(b string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: eos}}}
}

func respHeaders(code string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":status", Value: code}, // older data planes fill value, not raw_value
		{Key: "content-type", RawValue: []byte("text/event-stream")},
	}}}}}
}

func respBody(b string, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: []byte(b), EndOfStream: eos}}}
}

const chat = `{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}]}`
const sseContent = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n"
const sseUsage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n"

// requestPhase runs headers + body and reads the decision and the echoed body.
func requestPhase(t *testing.T, s extprocv3.ExternalProcessor_ProcessClient) string {
	t.Helper()
	send(t, s, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	send(t, s, reqBody(chat[:10], false))
	send(t, s, reqBody(chat[10:], true))
	r := recv(t, s)
	dest := ""
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == extproc.HeaderDestination {
			dest = string(h.GetHeader().GetRawValue())
		}
	}
	if dest == "" {
		t.Fatalf("no destination in %v", r)
	}
	if got := r.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue().GetFields()[extproc.HeaderDestination].GetStringValue(); got != dest {
		t.Fatalf("metadata destination %q != header %q", got, dest)
	}
	b := recv(t, s).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if string(b.GetBody()) != chat || !b.GetEndOfStream() {
		t.Fatalf("echoed body %q eos=%v", b.GetBody(), b.GetEndOfStream())
	}
	return dest
}

func send(t *testing.T, s extprocv3.ExternalProcessor_ProcessClient, m *extprocv3.ProcessingRequest) {
	t.Helper()
	if err := s.Send(m); err != nil {
		t.Fatalf("send: %v", err)
	}
}

func recv(t *testing.T, s extprocv3.ExternalProcessor_ProcessClient) *extprocv3.ProcessingResponse {
	t.Helper()
	r, err := s.Recv()
	if err != nil {
		t.Fatalf("recv: %v", err)
	}
	return r
}

// tickClock advances 1 ms on every Now, so durations are positive and
// deterministic.
type tickClock struct {
	clock.Real
	mu  sync.Mutex
	now time.Time
}

func (c *tickClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(time.Millisecond)
	return c.now
}

func TestOutcomeSuccessWithUsageAndTTFT(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, &tickClock{now: time.Unix(0, 0)})
	s, _ := h.client.Process(t.Context())
	dest := requestPhase(t, s)
	send(t, s, respHeaders("200"))
	recv(t, s)
	send(t, s, respBody(sseContent[:17], false))
	if got := recv(t, s).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody(); string(got) != sseContent[:17] {
		t.Fatalf("response chunk not echoed verbatim: %q", got)
	}
	send(t, s, respBody(sseContent[17:]+sseUsage, true))
	last := recv(t, s).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
	if !last.GetEndOfStream() {
		t.Fatal("last chunk lost end_of_stream")
	}
	o := h.outcome(t)
	if o.Kind != routing.OutcomeSuccess || o.Status != 200 || o.TTFT <= 0 || o.Latency < o.TTFT {
		t.Fatalf("outcome %+v", o)
	}
	if o.PromptTokens != 7 || o.CompletionTokens != 1 || o.CachedTokens != 4 {
		t.Fatalf("usage %+v", o)
	}
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("stream not closed cleanly after the response: %v", err)
	}
	h.noMoreOutcomes(t)
	if got := metricValue(t, h.reg, "kvbandit_requests_total", map[string]string{"frontend": "ext_proc", "path": "chat_completions", "code_class": "2xx"}); got != 1 {
		t.Fatalf("requests_total 2xx = %v", got)
	}
	_ = dest
}

func TestOutcomeUpstreamError(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, nil)
	s, _ := h.client.Process(t.Context())
	requestPhase(t, s)
	send(t, s, respHeaders("503"))
	recv(t, s)
	send(t, s, respBody(`{"error":{}}`, true))
	recv(t, s)
	if o := h.outcome(t); o.Kind != routing.OutcomeUpstreamError || o.Status != 503 {
		t.Fatalf("outcome %+v", o)
	}
	h.noMoreOutcomes(t)
}

func TestOutcomeClientCancel(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, nil)
	ctx, cancel := context.WithCancel(t.Context())
	s, _ := h.client.Process(ctx)
	requestPhase(t, s)
	send(t, s, respHeaders("200"))
	recv(t, s)
	cancel() // Envoy resets the stream when the client goes away
	if o := h.outcome(t); o.Kind != routing.OutcomeCancelled && o.Kind != routing.OutcomeReset {
		t.Fatalf("outcome %+v", o)
	}
	h.noMoreOutcomes(t)
}

func TestOutcomeHalfCloseMidResponse(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, nil)
	s, _ := h.client.Process(t.Context())
	requestPhase(t, s)
	send(t, s, respHeaders("200"))
	recv(t, s)
	s.CloseSend()
	if o := h.outcome(t); o.Kind != routing.OutcomeCancelled {
		t.Fatalf("outcome %+v", o)
	}
	h.noMoreOutcomes(t)
}

func TestResponseProcessingOffClosesAfterRequest(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: false}, nil)
	s, _ := h.client.Process(t.Context())
	hdrs := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	hdrs.ProtocolConfig.ResponseBodyMode = filterv3.ProcessingMode_NONE
	send(t, s, hdrs)
	send(t, s, reqBody(chat, true))
	recv(t, s)
	recv(t, s)
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("want a clean close, got %v", err)
	}
	if o := h.outcome(t); o.Kind != routing.OutcomeAbandoned {
		t.Fatalf("outcome %+v", o)
	}
	h.noMoreOutcomes(t)
}

// TestResponseProcessingOffKeepsStreamedResponses: with response processing
// off but the data plane streaming the response body to kvbandit anyway,
// closing early would drop response chunks in flight, so kvbandit echoes the
// response to its end; the decision still ended at pick time.
func TestResponseProcessingOffKeepsStreamedResponses(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: false}, nil)
	s, _ := h.client.Process(t.Context())
	requestPhase(t, s)
	if o := h.outcome(t); o.Kind != routing.OutcomeAbandoned {
		t.Fatalf("outcome %+v", o)
	}
	send(t, s, respHeaders("200"))
	recv(t, s)
	send(t, s, respBody(sseContent, true))
	if got := recv(t, s).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody(); string(got) != sseContent {
		t.Fatalf("response chunk not echoed: %q", got)
	}
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("want a clean close after the response, got %v", err)
	}
	h.noMoreOutcomes(t)
}

func TestDrainLetsDecidedStreamsFinish(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, nil)
	s, _ := h.client.Process(t.Context())
	requestPhase(t, s)
	send(t, s, respHeaders("200"))
	recv(t, s)
	send(t, s, respBody(sseContent, false))
	if got := recv(t, s).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody(); string(got) != sseContent {
		t.Fatal("chunk not echoed")
	}
	h.srv.Drain()
	// Still echoing after the drain: the response runs to its end.
	send(t, s, respBody(sseUsage, true))
	if got := recv(t, s).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody(); string(got) != sseUsage {
		t.Fatal("chunk after drain not echoed")
	}
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("want a clean close, got %v", err)
	}
	if o := h.outcome(t); o.Kind != routing.OutcomeSuccess {
		t.Fatalf("outcome %+v", o)
	}
	h.noMoreOutcomes(t)
}

func TestHardStopAbandons(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, nil)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	s, _ := h.client.Process(ctx)
	requestPhase(t, s)
	h.srv.Drain()
	h.srv.Stopping()
	cancel() // what the gRPC server's Stop does to the stream context
	if o := h.outcome(t); o.Kind != routing.OutcomeAbandoned {
		t.Fatalf("outcome %+v", o)
	}
	h.noMoreOutcomes(t)
}

func TestDrainRejectsRequestPhase(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, nil)
	s, _ := h.client.Process(t.Context())
	send(t, s, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	send(t, s, reqBody(chat[:5], false))
	waitStreams(t, h.srv, 1)
	h.srv.Drain()
	r := recv(t, s)
	if c := r.GetImmediateResponse().GetStatus().GetCode(); c != 503 || !strings.Contains(string(r.GetImmediateResponse().GetBody()), "shutting_down") {
		t.Fatalf("want 503 shutting_down, got %v", r)
	}
	// New streams after drain are refused too.
	s2, _ := h.client.Process(t.Context())
	send(t, s2, reqHeaders("/v1/models", true, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	if c := recv(t, s2).GetImmediateResponse().GetStatus().GetCode(); c != 503 {
		t.Fatalf("new stream during drain: %v", c)
	}
}

func waitStreams(t *testing.T, s *extproc.Server, n int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.Streams() < n {
		if time.Now().After(deadline) {
			t.Fatalf("streams = %d, want %d", s.Streams(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func waitInFlight(t *testing.T, s *extproc.Server, n int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for s.InFlight() != n {
		if time.Now().After(deadline) {
			t.Fatalf("in flight = %d, want %d", s.InFlight(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestDecisionTimeout(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(0, 0))
	h := newHarness(t, extproc.Config{ResponseProcessing: true, DecisionTimeout: 5 * time.Second, StreamHeaderTimeout: time.Hour}, vc)
	s, _ := h.client.Process(t.Context())
	send(t, s, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	send(t, s, reqBody(chat[:5], false))
	// Wait until the server armed its deadline (the header timer, due in
	// an hour, is gone once the headers arrived), then move time past it.
	deadline := time.Now().Add(5 * time.Second)
	for {
		if at, ok := vc.NextAt(); ok && at.Equal(time.Unix(5, 0)) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no deadline armed")
		}
		time.Sleep(time.Millisecond)
	}
	vc.Step(4 * time.Second)
	vc.Step(2 * time.Second)
	r := recv(t, s)
	if c := r.GetImmediateResponse().GetStatus().GetCode(); c != 503 || !strings.Contains(string(r.GetImmediateResponse().GetBody()), "decision_timeout") {
		t.Fatalf("want 503 decision_timeout, got %v", r)
	}
}

func TestMaxInflightRejectsBeforeBuffering(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true, MaxInflight: 1}, nil)
	s1, _ := h.client.Process(t.Context())
	send(t, s1, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	waitInFlight(t, h.srv, 1)
	s2, _ := h.client.Process(t.Context())
	send(t, s2, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	r := recv(t, s2)
	if c := r.GetImmediateResponse().GetStatus().GetCode(); c != 503 || !strings.Contains(string(r.GetImmediateResponse().GetBody()), "too_many_requests_in_flight") {
		t.Fatalf("want 503, got %v", r)
	}
	s1.CloseSend()
	if _, err := s1.Recv(); !errors.Is(err, io.EOF) && status.Code(err) != codes.OK {
		t.Fatalf("s1: %v", err)
	}
}

func TestBufferBudget(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true, MaxBodyBytes: 100, MaxBufferedBytes: 150}, nil)
	s1, _ := h.client.Process(t.Context())
	send(t, s1, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	send(t, s1, reqBody(strings.Repeat("x", 90), false))
	waitStreams(t, h.srv, 1)
	time.Sleep(20 * time.Millisecond) // let s1's chunk be buffered
	s2, _ := h.client.Process(t.Context())
	send(t, s2, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	send(t, s2, reqBody(strings.Repeat("y", 90), false))
	if c := recv(t, s2).GetImmediateResponse().GetStatus().GetCode(); c != 503 {
		t.Fatalf("over the global budget: got %v", c)
	}
	s1.CloseSend()
	s1.Recv()
}

// metricValue returns the value of the first counter or gauge series of
// name whose labels include labels.
func metricValue(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if want, ok := labels[lp.GetName()]; ok && want != lp.GetValue() {
					continue next
				}
			}
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no series %s%v", name, labels)
	return 0
}

// TestDataParallelRankHeader: an endpoint with several data-parallel ranks
// gets the chosen rank in x-data-parallel-rank, and a client's own value
// of that header is replaced.
func TestDataParallelRankHeader(t *testing.T) {
	e := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: slog.New(slog.DiscardHandler)})
	defer e.Close()
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000", DataParallelSize: 2}}}); err != nil {
		t.Fatal(err)
	}
	srv := extproc.NewServer(extproc.Config{ResponseProcessing: false}, extproc.Deps{Picker: e, Logger: slog.New(slog.DiscardHandler), Registry: prometheus.NewRegistry()})
	client, stop := startServer(t, srv)
	defer stop()
	ranks := map[string]bool{}
	for range 4 {
		s, _ := client.Process(t.Context())
		h := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
		h.GetRequestHeaders().GetHeaders().Headers = append(h.GetRequestHeaders().GetHeaders().GetHeaders(), &corev3.HeaderValue{Key: "x-data-parallel-rank", RawValue: []byte("9")})
		h.ProtocolConfig.ResponseBodyMode = filterv3.ProcessingMode_NONE
		send(t, s, h)
		send(t, s, reqBody(chat, true))
		r := recv(t, s)
		for _, hv := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if hv.GetHeader().GetKey() == extproc.HeaderDPRank {
				ranks[string(hv.GetHeader().GetRawValue())] = true
			}
		}
		recv(t, s)
		s.CloseSend()
	}
	if len(ranks) != 2 || !ranks["0"] || !ranks["1"] {
		t.Fatalf("ranks sent: %v", ranks)
	}
}
