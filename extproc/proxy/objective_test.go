package proxy_test

import (
	"net/http"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/routing"
)

type prioMap map[string]int

func (m prioMap) Priority(name string) (int, bool) { p, ok := m[name]; return p, ok }

// TestProxyInferenceObjective: the proxy applies an InferenceObjective's
// priority as the ext_proc path does; a client's lower priority is kept.
func TestProxyInferenceObjective(t *testing.T) {
	reg := prometheus.NewRegistry()
	f := newFixture(t, options{workers: 1, objectives: prioMap{"gold": 10, "batch": -5}, reg: reg})
	for _, hdr := range [][]string{
		{hints.HeaderInferenceObjective, "gold"},
		{hints.HeaderInferenceObjective, "batch"},
		{hints.HeaderInferenceObjective, "gold", hints.HeaderPriority, "2"},
		{hints.HeaderInferenceObjective, "nope"},
		nil,
	} {
		resp, b := f.post(t, "/v1/chat/completions", chatBody(f.workers[0].Model(), "hi", ""), hdr...)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%v: %d %s", hdr, resp.StatusCode, b)
		}
	}
	f.out.wait(t, 5)
	f.out.mu.Lock()
	got := append([]routing.Hints(nil), f.out.hints...)
	f.out.mu.Unlock()
	want := []struct {
		prio int
		has  bool
	}{{10, true}, {-5, true}, {2, true}, {0, false}, {0, false}}
	for i, w := range want {
		if got[i].Priority != w.prio || got[i].HasPriority != w.has {
			t.Errorf("request %d: priority %d (%v), want %d (%v)", i, got[i].Priority, got[i].HasPriority, w.prio, w.has)
		}
	}
	const name = "kvbandit_proxy_inference_objective_requests_total"
	for result, want := range map[string]float64{"found": 3, "unknown": 1} {
		if got := counterValue(t, reg, name, result); got != want {
			t.Errorf("%s = %v, want %v", result, got, want)
		}
	}
	f.inflightZero(t)
}

// TestProxyClientPriority (issue 23, item 19): through the proxy too, a
// client's +1000 (header or nvext.agent_hints.priority) no longer
// overrides its InferenceObjective's priority by default, and
// ClientPriority ignore drops client priorities.
func TestProxyClientPriority(t *testing.T) {
	gold := []string{hints.HeaderInferenceObjective, "gold"}
	loud := append([]string{hints.HeaderPriority, "1000"}, gold...)
	type want struct {
		prio int
		has  bool
	}
	for _, tc := range []struct {
		name   string
		pol    hints.PriorityPolicy
		action string
		want   []want // loud header, body +1000 with objective, body +1000 alone, -1 with objective
	}{
		{"default cap", hints.PriorityPolicy{}, "capped", []want{{10, true}, {10, true}, {1000, true}, {-1, true}}},
		{"ignore", hints.PriorityPolicy{Mode: hints.ClientPriorityIgnore}, "ignored", []want{{10, true}, {10, true}, {0, false}, {10, true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			f := newFixture(t, options{workers: 1, objectives: prioMap{"gold": 10}, reg: reg, cfg: proxy.Config{ClientPriority: tc.pol}})
			model := f.workers[0].Model()
			loudBody := []byte(`{"model":"` + model + `","messages":[{"role":"user","content":"hi"}],"nvext":{"agent_hints":{"priority":1000}}}`)
			for _, r := range []struct {
				body []byte
				hdr  []string
			}{
				{chatBody(model, "hi", ""), loud},
				{loudBody, gold},
				{loudBody, nil},
				{chatBody(model, "hi", ""), append([]string{hints.HeaderPriority, "-1"}, gold...)},
			} {
				resp, b := f.post(t, "/v1/chat/completions", r.body, r.hdr...)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("%v: %d %s", r.hdr, resp.StatusCode, b)
				}
			}
			f.out.wait(t, len(tc.want))
			f.out.mu.Lock()
			got := append([]routing.Hints(nil), f.out.hints...)
			f.out.mu.Unlock()
			for i, w := range tc.want {
				if got[i].Priority != w.prio || got[i].HasPriority != w.has {
					t.Errorf("request %d: priority %d (%v), want %d (%v)", i, got[i].Priority, got[i].HasPriority, w.prio, w.has)
				}
			}
			if n := labelledCounter(t, reg, "kvbandit_proxy_client_priorities_total", "action", tc.action); n < 2 {
				t.Errorf("%s = %v, want >= 2", tc.action, n)
			}
			f.inflightZero(t)
		})
	}
}

func counterValue(t *testing.T, reg *prometheus.Registry, name, result string) float64 {
	t.Helper()
	return labelledCounter(t, reg, name, "result", result)
}

// labelledCounter is the value of counter name where label is value (0
// when absent).
func labelledCounter(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}
