package e2e

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
)

// TestObjectivesEndToEnd: TTFT objectives and priorities through ext_proc
// (envoysim) and through the standalone proxy. A sheddable request that no
// worker is predicted to serve within its objective gets 429 overloaded
// with an OpenAI-style body, an invalid x-slo-ttft-ms gets 400, a request
// whose objective is met is served and counted in
// kvbandit_objective_total.
func TestObjectivesEndToEnd(t *testing.T) {
	_, addrs := startWorkers(t, 2, worker.Config{TokenDelay: time.Millisecond})
	k, base := startProxyKvbandit(t, addrs, "--policy", "kvbandit")
	px := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)
	body := chatRequest(400, "")
	nvShed := chatRequest(400, `"nvext":{"agent_hints":{"ttft_slo_ms":1,"priority":-1}},`)

	wantError := func(r response, status int, code string) {
		t.Helper()
		var e openAIError
		if r.status != status || json.Unmarshal(r.body, &e) != nil || e.Error.Code != code || e.Error.Message == "" || r.worker() != "" {
			t.Fatalf("status %d body %s; want %d %s from kvbandit", r.status, r.body, status, code)
		}
	}
	for _, url := range []string{px.URL() + chatPath, base + chatPath} {
		// Sheddable, and 1 ms is below any prediction: shed at decision
		// time (header form, then nvext form).
		wantError(send(t, c, "POST", url, body, map[string]string{"x-slo-ttft-ms": "1", "x-request-priority": "-1"}), http.StatusTooManyRequests, "overloaded")
		wantError(send(t, c, "POST", url, nvShed, nil), http.StatusTooManyRequests, "overloaded")
		// Not sheddable: routed anyway (the objective will be missed).
		if r := send(t, c, "POST", url, body, map[string]string{"x-slo-ttft-ms": "1"}); r.status != http.StatusOK || r.worker() == "" {
			t.Fatalf("non-sheddable: %d %s", r.status, r.body)
		}
		// A bad objective is the client's error.
		wantError(send(t, c, "POST", url, body, map[string]string{"x-slo-ttft-ms": "soon"}), http.StatusBadRequest, "invalid_field")
		wantError(send(t, c, "POST", url, body, map[string]string{"x-slo-ttft-ms": "600001"}), http.StatusBadRequest, "invalid_field")
		// Ten minutes is met by any healthy worker.
		if r := send(t, c, "POST", url, body, map[string]string{"x-slo-ttft-ms": "600000", "x-request-priority": "-1"}); r.status != http.StatusOK || r.worker() == "" {
			t.Fatalf("met: %d %s", r.status, r.body)
		}
	}
	k.waitMetric(t, "kvbandit_objective_total", map[string]string{"result": "shed"}, 4)
	k.waitMetric(t, "kvbandit_objective_total", map[string]string{"result": "met"}, 2)
	k.waitMetric(t, "kvbandit_objective_total", map[string]string{"result": "missed"}, 2)
}
