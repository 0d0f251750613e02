package proxy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/routing"
)

// startModelWorker starts a simulated worker serving model.
func startModelWorker(t *testing.T, model string) *worker.Worker {
	t.Helper()
	w := worker.New(worker.Config{Model: model})
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Close() })
	return w
}

// closedAddr returns a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

func (f *fixture) get(t *testing.T, method, path string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), method, f.url+path, nil)
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

func modelsRequests(w *worker.Worker) int {
	n := 0
	for _, r := range w.Requests() {
		if r.Path == proxy.ModelsPath {
			n++
		}
	}
	return n
}

// TestProxyModelsFleet: GET /v1/models is answered by the proxy with the
// union of the models every worker reports and every endpoint declares
// (an unreachable worker's declared models included), deduplicated by id
// and sorted; worker answers are cached; /v1/models/{id} answers one entry
// or 404; other methods get 405 with Allow: GET, HEAD; no decision is made.
func TestProxyModelsFleet(t *testing.T) {
	f := newFixture(t, options{})
	a, b, c := startModelWorker(t, "model-a"), startModelWorker(t, "shared"), startModelWorker(t, "shared")
	dead := closedAddr(t)
	set := routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{
		{Key: routing.EndpointKey(a.Addr()), Models: []routing.ModelName{"model-a"}},
		{Key: routing.EndpointKey(b.Addr())},
		{Key: routing.EndpointKey(c.Addr())},
		{Key: routing.EndpointKey(dead), Models: []routing.ModelName{"declared-only"}, Adapters: []routing.ModelName{"lora-x"}},
	}}
	if err := f.engine.Update(set); err != nil {
		t.Fatal(err)
	}
	resp, body := f.get(t, http.MethodGet, "/v1/models")
	var list proxy.ModelList
	if resp.StatusCode != 200 || json.Unmarshal(body, &list) != nil || list.Object != "list" || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		t.Fatalf("GET /v1/models: %d %s", resp.StatusCode, body)
	}
	want := []proxy.Model{
		{ID: "declared-only", Object: "model", OwnedBy: "kvbandit"},
		{ID: "lora-x", Object: "model", OwnedBy: "kvbandit"},
		{ID: "model-a", Object: "model", Created: 1700000000, OwnedBy: "kvbandit-e2e"},
		{ID: "shared", Object: "model", Created: 1700000000, OwnedBy: "kvbandit-e2e"},
	}
	if fmt.Sprint(list.Data) != fmt.Sprint(want) {
		t.Errorf("models\n got %+v\nwant %+v", list.Data, want)
	}
	if resp.Header.Get(proxy.HeaderEndpoint) != "" {
		t.Errorf("answered by a worker: %v", resp.Header)
	}

	// Within the cache TTL the workers are not asked again; a cleaned
	// path (/v1//models) is the same listing.
	if resp, b2 := f.get(t, http.MethodGet, "/v1//models?limit=1"); resp.StatusCode != 200 || string(b2) != string(body) {
		t.Errorf("second GET: %d %s", resp.StatusCode, b2)
	}
	for _, w := range []*worker.Worker{a, b, c} {
		if n := modelsRequests(w); n != 1 {
			t.Errorf("worker %s asked %d times, want 1", w.Addr(), n)
		}
	}

	if resp, b := f.get(t, http.MethodHead, "/v1/models"); resp.StatusCode != 200 || len(b) != 0 {
		t.Errorf("HEAD: %d %q", resp.StatusCode, b)
	}
	resp, body = f.get(t, http.MethodGet, "/v1/models/model-a")
	var one proxy.Model
	if resp.StatusCode != 200 || json.Unmarshal(body, &one) != nil || one != want[2] {
		t.Errorf("GET /v1/models/model-a: %d %s", resp.StatusCode, body)
	}
	resp, body = f.get(t, http.MethodGet, "/v1/models/nope")
	if resp.StatusCode != 404 || errorCode(t, resp, body) != "model_not_found" {
		t.Errorf("GET /v1/models/nope: %d %s", resp.StatusCode, body)
	}
	resp, body = f.get(t, http.MethodPost, "/v1/models")
	if resp.StatusCode != 405 || errorCode(t, resp, body) != "method_not_allowed" || resp.Header.Get("Allow") != "GET, HEAD" {
		t.Errorf("POST /v1/models: %d %s %v", resp.StatusCode, body, resp.Header)
	}
	if got, d := f.out.snapshot(); len(got) != 0 || d != 0 {
		t.Errorf("listing made %d decisions, %d outcomes", d, len(got))
	}
}

// TestProxyModelsHostileWorkers: a worker that hangs, answers too much,
// answers garbage or an error status, or lists too many or oversized ids
// cannot stall or blow up the listing: the answer comes within the
// per-worker timeout and holds only the usable entries, at most
// MaxModelsPerWorker from one worker.
func TestProxyModelsHostileWorkers(t *testing.T) {
	hang := make(chan struct{})
	serve := func(h http.HandlerFunc) string {
		s := httptest.NewServer(h)
		t.Cleanup(s.Close)
		return strings.TrimPrefix(s.URL, "http://")
	}
	many := func(w http.ResponseWriter, _ *http.Request) {
		var sb strings.Builder
		sb.WriteString(`{"object":"list","data":[`)
		for i := range proxy.MaxModelsPerWorker + 100 {
			if i > 0 {
				sb.WriteByte(',')
			}
			fmt.Fprintf(&sb, `{"id":"m%05d","created":"not a number","owned_by":7}`, i)
		}
		sb.WriteString(`,{"id":"late"}]}`)
		io.WriteString(w, sb.String())
	}
	addrs := []string{
		serve(func(w http.ResponseWriter, r *http.Request) { // hangs past the timeout
			select {
			case <-r.Context().Done():
			case <-hang:
			}
		}),
		serve(func(w http.ResponseWriter, _ *http.Request) { // 2 MiB
			io.WriteString(w, `{"object":"list","data":[{"id":"big","pad":"`+strings.Repeat("x", 2<<20)+`"}]}`)
		}),
		serve(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, `{"data":[{"id":"broken"`) }),
		serve(func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(500)
			io.WriteString(w, `{"data":[{"id":"from-error"}]}`)
		}),
		serve(func(w http.ResponseWriter, _ *http.Request) {
			io.WriteString(w, `{"data":[{"id":"`+strings.Repeat("L", proxy.MaxModelIDBytes+1)+`"},{"id":42},{"id":""},{"no":"id"},"str",{"id":"ok-model","created":5,"owned_by":"me"}]}`)
		}),
		serve(many),
	}
	defer close(hang)
	f := newFixture(t, options{cfg: proxy.Config{ModelsTimeout: 300 * time.Millisecond}})
	var eps []routing.Endpoint
	for _, a := range addrs {
		eps = append(eps, routing.Endpoint{Key: routing.EndpointKey(a)})
	}
	if err := f.engine.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	resp, body := f.get(t, http.MethodGet, "/v1/models")
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("listing took %v with a hanging worker (timeout 300ms)", took)
	}
	var list proxy.ModelList
	if resp.StatusCode != 200 || json.Unmarshal(body, &list) != nil {
		t.Fatalf("%d %.200s", resp.StatusCode, body)
	}
	if len(list.Data) != proxy.MaxModelsPerWorker+1 {
		t.Fatalf("%d models, want %d (the capped list and ok-model)", len(list.Data), proxy.MaxModelsPerWorker+1)
	}
	for _, m := range list.Data {
		switch {
		case m.ID == "ok-model":
			if m.Created != 5 || m.OwnedBy != "me" {
				t.Errorf("ok-model: %+v", m)
			}
		case strings.HasPrefix(m.ID, "m"):
			if m.Created != 0 || m.OwnedBy != "kvbandit" || m.Object != "model" {
				t.Errorf("ill-typed fields kept: %+v", m)
			}
		default:
			t.Errorf("unexpected model %.40q", m.ID)
		}
	}
}

// TestSharedRequestMetrics: the ext_proc server and the proxy on one
// registry record their requests in the same kvbandit_requests_total,
// kvbandit_decision_outcomes_total, kvbandit_ttft_seconds and
// kvbandit_request_duration_seconds, told apart by the frontend label; a
// proxied request is counted with frontend="proxy" only.
func TestSharedRequestMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	f := newFixture(t, options{workers: 1, reg: reg})
	_ = extproc.NewServer(extproc.Config{}, extproc.Deps{Picker: f.engine, Registry: reg}) // second on the registry: shares the series
	resp, b := f.post(t, "/v1/chat/completions", []byte(`{"model":"test-model","messages":[{"role":"user","content":"hi"}]}`))
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	f.out.wait(t, 1)
	if resp, _ := f.get(t, http.MethodGet, "/v1/completions"); resp.StatusCode != 405 {
		t.Fatalf("GET /v1/completions: %d", resp.StatusCode)
	}
	got := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, lp := range m.GetLabel() {
				labels = append(labels, lp.GetName()+"="+lp.GetValue())
			}
			v := m.GetCounter().GetValue()
			if h := m.GetHistogram(); h != nil {
				v = float64(h.GetSampleCount())
			}
			got[mf.GetName()+"{"+strings.Join(labels, ",")+"}"] = v
		}
	}
	for name, want := range map[string]float64{
		"kvbandit_requests_total{code_class=2xx,frontend=proxy,path=chat_completions}":    1,
		"kvbandit_requests_total{code_class=4xx,frontend=proxy,path=completions}":         1,
		"kvbandit_requests_total{code_class=2xx,frontend=ext_proc,path=chat_completions}": 0,
		"kvbandit_decision_outcomes_total{frontend=proxy,outcome=success}":                1,
		"kvbandit_ttft_seconds{frontend=proxy}":                                           1,
		"kvbandit_request_duration_seconds{frontend=proxy}":                               1,
	} {
		if v, ok := got[name]; !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", name, v, ok, want)
		}
	}
	for name := range got {
		if strings.HasPrefix(name, "kvbandit_proxy_requests_total") || strings.HasPrefix(name, "kvbandit_proxy_ttft") {
			t.Errorf("old proxy-only series %s still exported", name)
		}
	}
}

// TestProxyModelsDeepAnswer: a worker's valid JSON answer nested far
// deeper than openai.MaxDepth is refused by the non-recursive depth check
// before gjson reads it (gjson's own validator recurses once per level):
// it counts as a bad answer, and the worker's last good list stays.
func TestProxyModelsDeepAnswer(t *testing.T) {
	const levels = 200_000
	deep := `{"object":"list","data":[{"id":"deep","x":` + strings.Repeat("[", levels) + strings.Repeat("]", levels) + `}]}`
	var calls atomic.Int64
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if calls.Add(1) == 1 {
			io.WriteString(w, `{"object":"list","data":[{"id":"good","created":3,"owned_by":"w"}]}`)
			return
		}
		io.WriteString(w, deep)
	}))
	t.Cleanup(s.Close)
	f := newFixture(t, options{
		cfg:       proxy.Config{ModelsCacheTTL: time.Nanosecond},
		endpoints: []routing.Endpoint{{Key: routing.EndpointKey(strings.TrimPrefix(s.URL, "http://"))}},
	})
	want := `{"object":"list","data":[{"id":"good","object":"model","created":3,"owned_by":"w"}]}`
	for i := range 3 {
		resp, body := f.get(t, http.MethodGet, "/v1/models")
		if resp.StatusCode != 200 || string(body) != want {
			t.Errorf("listing %d: %d %.200s\nwant %s", i, resp.StatusCode, body, want)
		}
	}
	if n := calls.Load(); n < 3 {
		t.Errorf("worker asked %d times, want 3 (TTL 1ns)", n)
	}
}

// TestProxyModelsEmpty: with no model known the listing is an empty
// array, "data":[], never null (OpenAI clients iterate over it).
func TestProxyModelsEmpty(t *testing.T) {
	f := newFixture(t, options{})
	resp, body := f.get(t, http.MethodGet, "/v1/models")
	if want := `{"object":"list","data":[]}`; resp.StatusCode != 200 || string(body) != want {
		t.Errorf("GET /v1/models with no endpoints: %d %s, want 200 %s", resp.StatusCode, body, want)
	}
}
