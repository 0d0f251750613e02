package extproc_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy/roundrobin"
)

// shimHeaders is the request headers message of NGINX Gateway Fabric's
// endpoint picker shim (cmd/gateway/endpoint_picker.go): the HTTP request's
// headers in Go's canonical case, each in value (not raw_value), no
// pseudo-headers, no protocol_config, end_of_stream false.
func shimHeaders(kv ...string) *extprocv3.ProcessingRequest {
	hs := []*corev3.HeaderValue{{Key: "Content-Type", Value: "application/json"}, {Key: "X-Request-Id", Value: "ngf-1"}}
	for i := 0; i+1 < len(kv); i += 2 {
		hs = append(hs, &corev3.HeaderValue{Key: kv[i], Value: kv[i+1]})
	}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}}}}
}

// requestPicker records each request it picks for.
type requestPicker struct {
	routing.Picker
	got chan routing.Request
}

func (p *requestPicker) Pick(ctx context.Context, req *routing.Request) (*routing.Decision, error) {
	p.got <- *req
	return p.Picker.Pick(ctx, req)
}

// shimExchange sends the shim's sequence (headers, the whole body with end
// of stream, half-close) and returns every reply up to the server's close.
func shimExchange(t *testing.T, client extprocv3.ExternalProcessorClient, body string, kv ...string) []*extprocv3.ProcessingResponse {
	t.Helper()
	s, err := client.Process(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	send(t, s, shimHeaders(kv...))
	send(t, s, reqBody(body, true))
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var out []*extprocv3.ProcessingResponse
	for {
		r, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("recv: %v", err)
		}
		out = append(out, r)
	}
}

// TestPathlessRequestClassifiedByBody: a request without :path is
// classified by x-original-path, then x-forwarded-path, then its body
// ("messages": chat; otherwise completions), as GIE's and llm-d's pickers
// do, so its prompt is read, tokenised and validated. Before, it was of
// kind "other": no tokens, hints in canonical-case headers unread, and
// invalid JSON routed.
func TestPathlessRequestClassifiedByBody(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	e := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: log})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}}}); err != nil {
		t.Fatal(err)
	}
	pk := &requestPicker{Picker: e, got: make(chan routing.Request, 8)}
	srv := extproc.NewServer(extproc.Config{}, extproc.Deps{Picker: pk, Logger: log, Registry: prometheus.NewRegistry()})
	client, stop := startServer(t, srv)
	t.Cleanup(stop)

	const completion = `{"model":"m","prompt":"hello there, a prompt"}`
	for _, tc := range []struct {
		name, body string
		kv         []string
		path       string
	}{
		{"chat body", chat, []string{"X-Prefix-Id", "s1", "X-Prefix-Total-Requests", "4"}, "/v1/chat/completions"},
		{"completion body", completion, nil, "/v1/completions"},
		{"x-original-path", chat, []string{"X-Original-Path", "/v1/chat/completions", "X-Forwarded-Path", "/v1/completions"}, "/v1/chat/completions"},
		{"x-forwarded-path", completion, []string{"X-Forwarded-Path", "/v1/completions"}, "/v1/completions"},
	} {
		out := shimExchange(t, client, tc.body, tc.kv...)
		var req routing.Request
		select {
		case req = <-pk.got:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no pick", tc.name)
		}
		if req.Path != tc.path || req.Model != "m" || req.TokenCount == 0 {
			t.Errorf("%s: picked path %q model %q tokens %d, want %q, m, > 0", tc.name, req.Path, req.Model, req.TokenCount, tc.path)
		}
		if len(tc.kv) > 0 && tc.kv[0] == "X-Prefix-Id" && (req.Hints.PrefixID != "s1" || req.Hints.TotalRequests != 4) {
			t.Errorf("%s: session hints %+v not read from canonical-case headers", tc.name, req.Hints)
		}
		if len(out) == 0 || destination(out[0]) != "10.0.0.1:8000" {
			t.Errorf("%s: not routed: %v", tc.name, out)
		}
	}

	// Invalid JSON is the completion request's 400, as with a :path.
	for _, body := range []string{`{"model":`, `not json`} {
		out := shimExchange(t, client, body)
		if len(out) != 1 || out[0].GetImmediateResponse().GetStatus().GetCode() != http.StatusBadRequest {
			t.Errorf("body %q: want one 400 ImmediateResponse, got %v", body, out)
		}
	}
	select {
	case req := <-pk.got:
		t.Errorf("a rejected body was picked for: %+v", req)
	default:
	}
}

// syncBuffer is a log sink safe for the server's goroutines.
type syncBuffer struct {
	mu chan struct{}
	b  bytes.Buffer
}

func newSyncBuffer() *syncBuffer { return &syncBuffer{mu: make(chan struct{}, 1)} }

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu <- struct{}{}
	defer func() { <-s.mu }()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu <- struct{}{}
	defer func() { <-s.mu }()
	return s.b.String()
}

// TestNoResponsePhaseHoldsLoad: a data plane that half-closes right after
// the request phase and never sends a response phase (NGINX Gateway
// Fabric's shim) gets its decision ended as no_response_phase, not
// cancelled, and only once the predicted duration has passed on the
// server's clock: meanwhile the request still counts as in flight on its
// endpoint. One accurate warning per process, no false "streams response
// bodies" one, no stream error. Before, the decision ended cancelled as the
// stream closed (in-flight 0 while the worker ran).
func TestNoResponsePhaseHoldsLoad(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(1000, 0))
	logs := newSyncBuffer()
	log := slog.New(slog.NewTextHandler(logs, nil))
	done := make(chan routing.Outcome, 4)
	e := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: log, OnDone: func(_ *routing.Decision, o routing.Outcome) { done <- o }})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}}}); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	srv := extproc.NewServer(extproc.Config{ResponseProcessing: true}, extproc.Deps{Picker: e, Logger: log, Registry: reg, Clock: vc})
	client, stop := startServer(t, srv)
	t.Cleanup(stop)

	inflight := func() int64 { return e.Endpoints()[0].InFlight.Load() }
	for range 2 {
		if out := shimExchange(t, client, chat); len(out) == 0 || destination(out[0]) == "" {
			t.Fatalf("not routed: %v", out)
		}
	}
	if err := srv.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	select {
	case o := <-done:
		t.Fatalf("decision ended as the stream closed: %+v", o)
	default:
	}
	if n := inflight(); n != 2 {
		t.Fatalf("in-flight %d after the streams closed, want 2 (held for the predicted duration)", n)
	}
	vc.Step(extproc.NoResponseHold - time.Millisecond)
	if n := inflight(); n != 2 {
		t.Fatalf("in-flight %d before the hold ended, want 2", n)
	}
	vc.Step(extproc.MaxNoResponseHold)
	for range 2 {
		select {
		case o := <-done:
			if o.Kind != routing.OutcomeNoResponsePhase {
				t.Errorf("outcome %v, want no_response_phase", o.Kind)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no outcome after the hold")
		}
	}
	if n := inflight(); n != 0 {
		t.Errorf("in-flight %d after the hold, want 0", n)
	}
	if got := metricValue(t, reg, "kvbandit_decision_outcomes_total", map[string]string{"frontend": "ext_proc", "outcome": "no_response_phase"}); got != 2 {
		t.Errorf("no_response_phase outcomes = %v, want 2", got)
	}
	l := logs.String()
	if n := strings.Count(l, "sends no response phase"); n != 1 {
		t.Errorf("%d no-response-phase warnings, want 1:\n%s", n, l)
	}
	if strings.Contains(l, "streams response bodies") || strings.Contains(l, "closed_early") {
		t.Errorf("false warning:\n%s", l)
	}
}

// TestNoResponsePhaseLateCloseIsCancel: a half-close long after the
// request phase, still before any response, is a client that went away:
// cancelled at once, as before.
func TestNoResponsePhaseLateCloseIsCancel(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(1000, 0))
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, vc)
	s, _ := h.client.Process(t.Context())
	requestPhase(t, s)
	vc.Step(extproc.NoResponseWindow + time.Millisecond)
	_ = s.CloseSend()
	if o := h.outcome(t); o.Kind != routing.OutcomeCancelled {
		t.Fatalf("outcome %+v, want cancelled", o)
	}
	h.noMoreOutcomes(t)
}

// TestResponseProcessingOffNoResponsePhase: with response processing off,
// a data plane that sends no response phase gets no warning about
// streamed response bodies (it sends none) and no closed_early error.
func TestResponseProcessingOffNoResponsePhase(t *testing.T) {
	logs := newSyncBuffer()
	log := slog.New(slog.NewTextHandler(logs, nil))
	e := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: log})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}}}); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	srv := extproc.NewServer(extproc.Config{}, extproc.Deps{Picker: e, Logger: log, Registry: reg})
	client, stop := startServer(t, srv)
	t.Cleanup(stop)
	shimExchange(t, client, chat)
	if err := srv.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	if l := logs.String(); strings.Contains(l, "streams response bodies") {
		t.Errorf("false warning:\n%s", l)
	}
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == "kvbandit_stream_errors_total" {
			for _, m := range mf.GetMetric() {
				if m.GetCounter().GetValue() > 0 {
					t.Errorf("stream error counted: %v", m)
				}
			}
		}
	}
}

// TestNoResponsePhaseNotForEnvoy: a data plane that sends protocol_config
// (Envoy) and half-closes at once after the request phase is a client that
// went away: cancelled at once, no load held.
func TestNoResponsePhaseNotForEnvoy(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(1000, 0))
	h := newHarness(t, extproc.Config{ResponseProcessing: true}, vc)
	s, _ := h.client.Process(t.Context())
	requestPhase(t, s)
	_ = s.CloseSend()
	if o := h.outcome(t); o.Kind != routing.OutcomeCancelled {
		t.Fatalf("outcome %+v, want cancelled", o)
	}
	h.noMoreOutcomes(t)
}
