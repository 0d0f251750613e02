package extproc_test

import (
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
)

// stepUntil advances vc by step every millisecond of real time until stop
// is closed, so that timers armed at any moment eventually fire.
func stepUntil(vc *clock.Virtual, step time.Duration, stop <-chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				vc.Step(step)
			}
		}
	}()
	return &wg
}

// parallel runs f(0..n-1) on a few goroutines and fails on the first error.
func parallel(t *testing.T, n int, f func(i int) error) {
	t.Helper()
	const workers = 8
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += workers {
				if err := f(i); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		t.Fatal(err)
	}
}

// eventually waits (up to 60 s: the machine may be busy) until cond holds.
func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal(msg)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestEmptyStreamsHoldNoSlots: streams that open and never send request
// headers neither take --max-inflight slots from real requests nor live
// forever: 2,000 of them (twice the default limit) are open while a real
// request is routed, then the header timeout closes every one with
// DEADLINE_EXCEEDED and the goroutines go away.
func TestEmptyStreamsHoldNoSlots(t *testing.T) {
	const empty = 2000
	vc := clock.NewVirtual(time.Unix(0, 0))
	h := newHarness(t, extproc.Config{ResponseProcessing: true, StreamHeaderTimeout: 2 * time.Second}, vc)
	baseline := runtime.NumGoroutine()

	streams := make([]extprocv3.ExternalProcessor_ProcessClient, empty)
	parallel(t, empty, func(i int) error {
		var err error
		streams[i], err = h.client.Process(t.Context())
		return err
	})
	eventually(t, func() bool { return h.srv.Streams() == empty }, "the server never saw every empty stream")
	if got := h.srv.InFlight(); got != 0 {
		t.Fatalf("streams without request headers hold %d in-flight slots", got)
	}

	s, err := h.client.Process(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	requestPhase(t, s) // fails with the 503 too_many_requests_in_flight reply if the idle streams hold slots

	stop := make(chan struct{})
	stepping := stepUntil(vc, time.Second, stop)
	parallel(t, empty, func(i int) error {
		if _, err := streams[i].Recv(); status.Code(err) != codes.DeadlineExceeded {
			return fmt.Errorf("empty stream %d: got %v, want DEADLINE_EXCEEDED", i, err)
		}
		return nil
	})
	// Stop the clock before the routed request's engine-side stale sweep
	// (5 virtual minutes) could end its decision.
	close(stop)
	stepping.Wait()
	eventually(t, func() bool { return h.srv.Streams() == 1 }, "more than the routed stream still open")

	// The routed request is untouched by the header timeout.
	send(t, s, respHeaders("200"))
	recv(t, s)
	send(t, s, respBody(sseContent+sseUsage, true))
	recv(t, s)
	if o := h.outcome(t); o.Kind != routing.OutcomeSuccess {
		t.Fatalf("outcome %+v", o)
	}
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("routed stream: %v", err)
	}
	if got := metricValue(t, h.reg, "kvbandit_extproc_stream_errors_total", map[string]string{"reason": "header_timeout"}); got != empty {
		t.Fatalf("header_timeout stream errors = %v, want %d", got, empty)
	}
	eventually(t, func() bool { return h.srv.Streams() == 0 && runtime.NumGoroutine() <= baseline+10 }, "streams or goroutines left over")
	if got := metricValue(t, h.reg, "kvbandit_extproc_streams_inflight", nil); got != 0 {
		t.Fatalf("streams gauge %v after every stream ended", got)
	}
	if got := metricValue(t, h.reg, "kvbandit_extproc_requests_inflight", nil); got != 0 {
		t.Fatalf("requests gauge %v after every stream ended", got)
	}
}

// TestMaxInflightCountsAtHeaders: the limit applies to requests (streams
// that sent their headers), and its 503 answers the request headers.
func TestMaxInflightCountsAtHeaders(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true, MaxInflight: 1}, nil)
	quiet, _ := h.client.Process(t.Context()) // opens, sends nothing
	waitStreams(t, h.srv, 1)
	s1, _ := h.client.Process(t.Context())
	send(t, s1, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	waitInFlight(t, h.srv, 1)
	s2, _ := h.client.Process(t.Context())
	send(t, s2, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
	r := recv(t, s2)
	if c := r.GetImmediateResponse().GetStatus().GetCode(); c != 503 || !strings.Contains(string(r.GetImmediateResponse().GetBody()), "too_many_requests_in_flight") {
		t.Fatalf("want 503 too_many_requests_in_flight, got %v", r)
	}
	if got := metricValue(t, h.reg, "kvbandit_requests_total", map[string]string{"frontend": "ext_proc", "path": "chat_completions", "code_class": "5xx"}); got != 1 {
		t.Fatalf("the refusal is not counted as a chat request: %v", got)
	}
	// The slot comes back when the request ends.
	send(t, s1, reqBody(chat, true))
	recv(t, s1)
	recv(t, s1)
	send(t, s1, respHeaders("200"))
	recv(t, s1)
	send(t, s1, respBody(sseContent, true))
	recv(t, s1)
	h.outcome(t)
	waitInFlight(t, h.srv, 0)
	s3, _ := h.client.Process(t.Context())
	requestPhase(t, s3)
	s3.CloseSend()
	quiet.CloseSend()
	if _, err := quiet.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("quiet stream: %v", err)
	}
}

// TestStreamIdleTimeout: a decided stream is never cut while messages keep
// coming, however long the response takes, and one silent for
// StreamIdleTimeout is closed cleanly (gRPC OK: Envoy carries on without
// kvbandit) with its decision released as abandoned.
func TestStreamIdleTimeout(t *testing.T) {
	// Shorter than the engine's stale-decision sweep (5 minutes), which
	// would release the decision first.
	const idle = time.Minute
	vc := clock.NewVirtual(time.Unix(0, 0))
	h := newHarness(t, extproc.Config{ResponseProcessing: true, StreamIdleTimeout: idle, StreamHeaderTimeout: time.Hour, DecisionTimeout: time.Hour}, vc)
	s, _ := h.client.Process(t.Context())
	requestPhase(t, s)
	send(t, s, respHeaders("200"))
	recv(t, s)
	// 90 s of response with a chunk every 45 s: never idle.
	for range 2 {
		vc.Step(45 * time.Second)
		time.Sleep(20 * time.Millisecond) // let a wrong cut surface
		send(t, s, respBody(sseContent, false))
		if got := recv(t, s).GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody(); string(got) != sseContent {
			t.Fatalf("chunk not echoed: %q", got)
		}
	}
	last := vc.Now()
	// Then silence.
	stop := make(chan struct{})
	stepping := stepUntil(vc, time.Second, stop)
	defer func() { close(stop); stepping.Wait() }()
	done := make(chan error, 1)
	go func() { _, err := s.Recv(); done <- err }()
	select {
	case err := <-done:
		if !errors.Is(err, io.EOF) {
			t.Fatalf("idle stream ended with %v, want a clean close", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a silent decided stream was never closed")
	}
	if quiet := vc.Now().Sub(last); quiet < idle {
		t.Fatalf("closed after %v of silence, want at least %v", quiet, idle)
	}
	if o := h.outcome(t); o.Kind != routing.OutcomeAbandoned || o.Status != 200 {
		t.Fatalf("outcome %+v", o)
	}
	h.noMoreOutcomes(t)
	if got := metricValue(t, h.reg, "kvbandit_extproc_stream_errors_total", map[string]string{"reason": "idle_timeout"}); got != 1 {
		t.Fatalf("idle_timeout stream errors = %v", got)
	}
}

// TestStreamIdleTimeoutAwaitingResponse: the wait between the decision and
// the response headers is bounded too.
func TestStreamIdleTimeoutAwaitingResponse(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(0, 0))
	h := newHarness(t, extproc.Config{ResponseProcessing: true, StreamIdleTimeout: time.Minute, StreamHeaderTimeout: time.Hour, DecisionTimeout: time.Hour}, vc)
	s, _ := h.client.Process(t.Context())
	requestPhase(t, s)
	stop := make(chan struct{})
	stepping := stepUntil(vc, time.Second, stop)
	defer func() { close(stop); stepping.Wait() }()
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("want a clean close, got %v", err)
	}
	if o := h.outcome(t); o.Kind != routing.OutcomeAbandoned {
		t.Fatalf("outcome %+v", o)
	}
}

// TestBodyModesDecideAtHeaders: with request_body_mode NONE or STREAMED a
// chat request is routed at its headers (there is no later point where
// the destination could still be set), counted by reason; a model named by
// x-gateway-model-name narrows the candidates.
func TestBodyModesDecideAtHeaders(t *testing.T) {
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_NONE, filterv3.ProcessingMode_STREAMED} {
		t.Run(mode.String(), func(t *testing.T) {
			h := newHarness(t, extproc.Config{ResponseProcessing: true}, nil)
			if err := h.engine.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000", Models: []routing.ModelName{"a"}}, {Key: "10.0.0.2:8000", Models: []routing.ModelName{"b"}}}}); err != nil {
				t.Fatal(err)
			}
			for i := range 4 {
				s, _ := h.client.Process(t.Context())
				m := reqHeaders("/v1/chat/completions", false, mode)
				m.GetRequestHeaders().GetHeaders().Headers = append(m.GetRequestHeaders().GetHeaders().GetHeaders(), &corev3.HeaderValue{Key: extproc.HeaderModel, RawValue: []byte("b")})
				send(t, s, m)
				r := recv(t, s)
				if r.GetImmediateResponse() != nil {
					t.Fatalf("request %d refused: %v", i, r)
				}
				if got := destination(r); got != "10.0.0.2:8000" {
					t.Fatalf("request %d routed to %q, want the endpoint serving model b", i, got)
				}
				if mode == filterv3.ProcessingMode_STREAMED {
					send(t, s, reqBody(chat, true))
					if recv(t, s).GetRequestBody() == nil {
						t.Fatal("STREAMED body chunk not acknowledged")
					}
				}
				send(t, s, respHeaders("200"))
				recv(t, s)
				send(t, s, respBody(sseContent, true))
				recv(t, s)
				if o := h.outcome(t); o.Kind != routing.OutcomeSuccess {
					t.Fatalf("outcome %+v", o)
				}
			}
			reason := map[filterv3.ProcessingMode_BodySendMode]string{filterv3.ProcessingMode_NONE: "request_body_mode_none", filterv3.ProcessingMode_STREAMED: "request_body_mode_streamed"}[mode]
			if got := metricValue(t, h.reg, "kvbandit_decisions_without_body_total", map[string]string{"reason": reason}); got != 4 {
				t.Fatalf("decisions without body = %v, want 4", got)
			}
		})
	}
}

func destination(r *extprocv3.ProcessingResponse) string {
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == extproc.HeaderDestination {
			return string(h.GetHeader().GetRawValue())
		}
	}
	return ""
}

// TestTooManySpoofableHeaders: every client header that could pose as a
// destination must be removed, so a request carrying more distinct ones
// than any data plane sends is refused (431) instead of being remembered.
func TestTooManySpoofableHeaders(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, nil)
	s, _ := h.client.Process(t.Context())
	m := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	hm := m.GetRequestHeaders().GetHeaders()
	for i := range extproc.MaxSpoofedHeaders + 1 {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: fmt.Sprintf("%s-%d", extproc.HeaderDestination, i), RawValue: []byte("10.9.9.9:80")})
	}
	send(t, s, m)
	r := recv(t, s)
	if c := r.GetImmediateResponse().GetStatus().GetCode(); c != 431 || !strings.Contains(string(r.GetImmediateResponse().GetBody()), "request_headers_too_large") {
		t.Fatalf("want 431 request_headers_too_large, got %v", r)
	}
	waitInFlight(t, h.srv, 0)
}

// TestOversizedHintHeaderIgnored: a hint header value beyond
// MaxHintHeaderBytes is ignored and counted as a hint problem; the request
// is routed.
func TestOversizedHintHeaderIgnored(t *testing.T) {
	h := newHarness(t, extproc.Config{ResponseProcessing: false}, nil)
	s, _ := h.client.Process(t.Context())
	m := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
	m.ProtocolConfig.ResponseBodyMode = filterv3.ProcessingMode_NONE
	hm := m.GetRequestHeaders().GetHeaders()
	hm.Headers = append(hm.Headers,
		&corev3.HeaderValue{Key: "x-prefix-id", RawValue: []byte(strings.Repeat("p", extproc.MaxHintHeaderBytes+1))},
		&corev3.HeaderValue{Key: "x-prefix-unknown", RawValue: []byte("whatever")},
	)
	send(t, s, m)
	send(t, s, reqBody(chat, true))
	if destination(recv(t, s)) == "" {
		t.Fatal("not routed")
	}
	recv(t, s)
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("want a clean close, got %v", err)
	}
	h.outcome(t)
	if got := metricValue(t, h.reg, "kvbandit_hint_problems_total", nil); got != 1 {
		t.Fatalf("hint problems = %v, want 1", got)
	}
}
