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

// priorityCase is one request of a priority test: its headers and body,
// and the priority the picker must see.
type priorityCase struct {
	name    string
	headers []string // key, value pairs
	body    string   // "": chat
	prio    int
	has     bool
}

// runPriorityCases sends each case over its own stream to a server made
// with cfg and the objectives, and checks the hints the picker saw.
func runPriorityCases(t *testing.T, cfg extproc.Config, objectives hints.Priorities, cases []priorityCase) *prometheus.Registry {
	t.Helper()
	log := slog.New(slog.DiscardHandler)
	engine := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: log})
	t.Cleanup(engine.Close)
	if err := engine.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}}}); err != nil {
		t.Fatal(err)
	}
	pk := &hintsPicker{Picker: engine, got: make(chan routing.Hints, 1)}
	reg := prometheus.NewRegistry()
	srv := extproc.NewServer(cfg, extproc.Deps{Picker: pk, Logger: log, Registry: reg, Objectives: objectives})
	client, stop := startServer(t, srv)
	t.Cleanup(stop)
	for _, tc := range cases {
		s, err := client.Process(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		m := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
		hm := m.GetRequestHeaders().GetHeaders()
		for i := 0; i < len(tc.headers); i += 2 {
			hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: tc.headers[i], RawValue: []byte(tc.headers[i+1])})
		}
		body := tc.body
		if body == "" {
			body = chat
		}
		send(t, s, m)
		send(t, s, reqBody(body, true))
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
	return reg
}

// TestInferenceObjectivePriority: a request naming an InferenceObjective
// in x-gateway-inference-objective gets its priority unless it gave a lower
// one of its own; an unknown name keeps the default (no priority), as GIE.
func TestInferenceObjectivePriority(t *testing.T) {
	reg := runPriorityCases(t, extproc.Config{}, prioMap{"gold": 10, "batch": -5, "loud": 5000}, []priorityCase{
		{"found", []string{hints.HeaderInferenceObjective, "gold"}, "", 10, true},
		{"sheddable", []string{hints.HeaderInferenceObjective, " batch "}, "", -5, true},
		{"clamped", []string{hints.HeaderInferenceObjective, "loud"}, "", hints.MaxPriority, true},
		{"own lower priority wins", []string{hints.HeaderInferenceObjective, "gold", hints.HeaderPriority, "-3"}, "", -3, true},
		{"unknown", []string{hints.HeaderInferenceObjective, "nope"}, "", 0, false},
		{"absent", nil, "", 0, false},
	})
	if got := metricValue(t, reg, "kvbandit_inference_objective_requests_total", map[string]string{"result": "found"}); got != 4 {
		t.Errorf("found = %v, want 4", got)
	}
	if got := metricValue(t, reg, "kvbandit_inference_objective_requests_total", map[string]string{"result": "unknown"}); got != 1 {
		t.Errorf("unknown = %v, want 1", got)
	}
}

// chatPriority is chat with nvext.agent_hints.priority 1000.
const chatPriority = `{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}],"nvext":{"agent_hints":{"priority":1000}}}`

// TestClientPriorityPolicy (issue 23, item 19): by default a client's
// +1000 (x-request-priority or nvext.agent_hints.priority) no longer
// overrides its InferenceObjective's priority; --client-priority ignore
// drops client priorities, allow restores the old precedence, and a
// ceiling bounds clients without an objective.
func TestClientPriorityPolicy(t *testing.T) {
	objectives := prioMap{"gold": 10}
	gold := []string{hints.HeaderInferenceObjective, "gold"}
	loud := append([]string{hints.HeaderPriority, "1000"}, gold...)
	t.Run("default cap", func(t *testing.T) {
		reg := runPriorityCases(t, extproc.Config{}, objectives, []priorityCase{
			{"header +1000", loud, "", 10, true},
			{"body +1000", gold, chatPriority, 10, true},
			{"lower kept", []string{hints.HeaderPriority, "-1", hints.HeaderInferenceObjective, "gold"}, "", -1, true},
			{"no objective", []string{hints.HeaderPriority, "1000"}, "", 1000, true},
			{"body, no objective", nil, chatPriority, 1000, true},
		})
		if got := metricValue(t, reg, "kvbandit_client_priorities_total", map[string]string{"action": "capped"}); got != 2 {
			t.Errorf("capped = %v, want 2", got)
		}
	})
	t.Run("cap 0", func(t *testing.T) {
		cfg := extproc.Config{ClientPriority: hints.PriorityPolicy{Mode: hints.ClientPriorityCap, Max: 0, HasMax: true}}
		runPriorityCases(t, cfg, objectives, []priorityCase{
			{"no objective", []string{hints.HeaderPriority, "1000"}, "", 0, true},
			{"objective", loud, "", 10, true},
		})
	})
	t.Run("ignore", func(t *testing.T) {
		cfg := extproc.Config{ClientPriority: hints.PriorityPolicy{Mode: hints.ClientPriorityIgnore}}
		reg := runPriorityCases(t, cfg, objectives, []priorityCase{
			{"header +1000", loud, "", 10, true},
			{"body +1000", gold, chatPriority, 10, true},
			{"lower dropped", []string{hints.HeaderPriority, "-1", hints.HeaderInferenceObjective, "gold"}, "", 10, true},
			{"no objective", []string{hints.HeaderPriority, "1000"}, "", 0, false},
			{"body, no objective", nil, chatPriority, 0, false},
		})
		if got := metricValue(t, reg, "kvbandit_client_priorities_total", map[string]string{"action": "ignored"}); got != 5 {
			t.Errorf("ignored = %v, want 5", got)
		}
	})
	t.Run("allow", func(t *testing.T) {
		cfg := extproc.Config{ClientPriority: hints.PriorityPolicy{Mode: hints.ClientPriorityAllow}}
		runPriorityCases(t, cfg, objectives, []priorityCase{
			{"header +1000", loud, "", 1000, true},
			{"objective alone", gold, "", 10, true},
		})
	})
}

var _ extprocv3.ExternalProcessorServer = (*extproc.Server)(nil)
