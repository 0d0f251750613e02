package extproc_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy/roundrobin"
)

// prioMap is a fixed set of InferenceObjectives.
type prioMap map[string]int

func (m prioMap) Priority(name string) (int, bool) { p, ok := m[name]; return p, ok }

// hintsPicker records the hints of every request it picks for.
type hintsPicker struct {
	routing.Picker
	got chan routing.Hints
}

func (p *hintsPicker) Pick(ctx context.Context, req *routing.Request) (*routing.Decision, error) {
	p.got <- req.Hints
	return p.Picker.Pick(ctx, req)
}

// TestInferenceObjectivePriority: a request naming an InferenceObjective
// in x-gateway-inference-objective gets its priority unless it gave its
// own; an unknown name keeps the default (no priority), as GIE.
func TestInferenceObjectivePriority(t *testing.T) {
	log := slog.New(slog.DiscardHandler)
	engine := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: log})
	t.Cleanup(engine.Close)
	if err := engine.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}}}); err != nil {
		t.Fatal(err)
	}
	pk := &hintsPicker{Picker: engine, got: make(chan routing.Hints, 1)}
	reg := prometheus.NewRegistry()
	srv := extproc.NewServer(extproc.Config{}, extproc.Deps{Picker: pk, Logger: log, Registry: reg,
		Objectives: prioMap{"gold": 10, "batch": -5, "loud": 5000}})
	client, stop := startServer(t, srv)
	t.Cleanup(stop)

	for _, tc := range []struct {
		name    string
		headers []string // key, value pairs
		prio    int
		has     bool
	}{
		{"found", []string{hints.HeaderInferenceObjective, "gold"}, 10, true},
		{"sheddable", []string{hints.HeaderInferenceObjective, " batch "}, -5, true},
		{"clamped", []string{hints.HeaderInferenceObjective, "loud"}, hints.MaxPriority, true},
		{"own priority wins", []string{hints.HeaderInferenceObjective, "gold", hints.HeaderPriority, "-3"}, -3, true},
		{"unknown", []string{hints.HeaderInferenceObjective, "nope"}, 0, false},
		{"absent", nil, 0, false},
	} {
		s, err := client.Process(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		m := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
		hm := m.GetRequestHeaders().GetHeaders()
		for i := 0; i < len(tc.headers); i += 2 {
			hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: tc.headers[i], RawValue: []byte(tc.headers[i+1])})
		}
		send(t, s, m)
		send(t, s, reqBody(chat, true))
		select {
		case h := <-pk.got:
			if h.Priority != tc.prio || h.HasPriority != tc.has {
				t.Errorf("%s: priority %d (set %v), want %d (%v)", tc.name, h.Priority, h.HasPriority, tc.prio, tc.has)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no pick", tc.name)
		}
		recv(t, s) // headers response
		recv(t, s) // body
		_ = s.CloseSend()
	}
	if got := metricValue(t, reg, "kvbandit_inference_objective_requests_total", map[string]string{"result": "found"}); got != 3 {
		t.Errorf("found = %v, want 3", got)
	}
	if got := metricValue(t, reg, "kvbandit_inference_objective_requests_total", map[string]string{"result": "unknown"}); got != 1 {
		t.Errorf("unknown = %v, want 1", got)
	}
}

var _ extprocv3.ExternalProcessorServer = (*extproc.Server)(nil)
