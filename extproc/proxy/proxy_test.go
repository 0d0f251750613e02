package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// outcomes records every Decision.Done the engine sees.
type outcomes struct {
	mu        sync.Mutex
	done      []routing.Outcome
	endpoints []routing.EndpointKey
	decisions int
	hints     []routing.Hints // of every decided request
}

func (o *outcomes) onDone(d *routing.Decision, out routing.Outcome) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.done = append(o.done, out)
	o.endpoints = append(o.endpoints, d.Endpoint)
}

func (o *outcomes) onDecision(r *routing.Request, _ *routing.Decision) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.decisions++
	o.hints = append(o.hints, r.Hints)
}

func (o *outcomes) snapshot() ([]routing.Outcome, int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]routing.Outcome(nil), o.done...), o.decisions
}

// wait waits for n outcomes, then checks for a short while that no more
// arrive (Done must run exactly once per decision).
func (o *outcomes) wait(t *testing.T, n int) []routing.Outcome {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got, _ := o.snapshot()
		if len(got) >= n {
			time.Sleep(50 * time.Millisecond)
			got, _ = o.snapshot()
			if len(got) != n {
				t.Fatalf("%d outcomes, want exactly %d: %+v", len(got), n, got)
			}
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d outcomes after 5s, want %d: %+v", len(got), n, got)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

type fixture struct {
	engine  *engine.Engine
	proxy   *proxy.Proxy
	url     string
	client  *http.Client
	out     *outcomes
	workers []*worker.Worker
}

type options struct {
	policy  string
	workers int
	wcfg    worker.Config
	cfg     proxy.Config
	// endpoints, when set, replaces the workers' addresses.
	endpoints []routing.Endpoint
	models    bool // declare the workers' model on their endpoints
	budget    *extproc.Budget
	// objectives is the InferenceObjective lookup (nil: none).
	objectives hints.Priorities
	reg        *prometheus.Registry
	tracer     *tracing.Tracer
	// roles are the workers' roles, in order; pd turns P/D on with this
	// threshold.
	roles []routing.Role
	pd    *pd.Decider
}

func newFixture(t testing.TB, o options) *fixture {
	t.Helper()
	if o.policy == "" {
		o.policy = "kv"
	}
	f := &fixture{out: &outcomes{}}
	var eps []routing.Endpoint
	for range o.workers {
		w := worker.New(o.wcfg)
		if err := w.Start(context.Background()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { w.Close() })
		f.workers = append(f.workers, w)
		ep := routing.Endpoint{Key: routing.EndpointKey(w.Addr())}
		if o.models {
			ep.Models = []routing.ModelName{routing.ModelName(w.Model())}
		}
		if i := len(eps); i < len(o.roles) {
			ep.Role = o.roles[i]
		}
		eps = append(eps, ep)
	}
	if o.endpoints != nil {
		eps = o.endpoints
	}
	rnd := routing.NewRand(7)
	pol, err := policy.Builtin().New(o.policy, policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := pol.(interface{ Close() error }); ok {
		t.Cleanup(func() { c.Close() })
	}
	rdeps := engine.Deps{Logger: slog.New(slog.DiscardHandler), Rand: rnd, OnDone: f.out.onDone, OnDecision: f.out.onDecision}
	if o.pd != nil {
		rdeps.PD = o.pd
	}
	f.engine = engine.Must(pol, engine.Options{}, rdeps)
	t.Cleanup(f.engine.Close)
	if len(eps) > 0 {
		if err := f.engine.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
			t.Fatal(err)
		}
	}
	deps := proxy.Deps{Engine: f.engine, Budget: o.budget, Objectives: o.objectives, Tracer: o.tracer}
	if o.reg != nil {
		deps.Registry = o.reg
	}
	f.proxy = proxy.New(o.cfg, deps)
	srv := httptest.NewServer(f.proxy)
	f.url = srv.URL
	tr := &http.Transport{DisableCompression: true}
	f.client = &http.Client{Transport: tr}
	t.Cleanup(func() {
		tr.CloseIdleConnections()
		srv.Close()
		f.proxy.Stop()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := f.proxy.Wait(ctx); err != nil {
			t.Errorf("proxy handlers still running: %v", err)
		}
	})
	return f
}

func (f *fixture) worker(t testing.TB, addr string) *worker.Worker {
	t.Helper()
	for _, w := range f.workers {
		if w.Addr() == addr {
			return w
		}
	}
	t.Fatalf("no worker %q", addr)
	return nil
}

func (f *fixture) post(t testing.TB, path string, body []byte, hdr ...string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), http.MethodPost, f.url+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
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

// inflightZero checks that no decision is left open in the engine.
func (f *fixture) inflightZero(t *testing.T) {
	t.Helper()
	for _, st := range f.engine.Endpoints() {
		if n := st.InFlight.Load(); n != 0 {
			t.Errorf("%s in-flight = %d, want 0", st.Key, n)
		}
	}
}

func chatBody(model, content string, extra string) []byte {
	return fmt.Appendf(nil, `{"model":%q,"messages":[{"role":"system","content":"You are a helpful assistant that answers questions about the routing of language model requests."},{"role":"user","content":%q}]%s}`, model, content, extra)
}

func TestProxyChatNonStreaming(t *testing.T) {
	f := newFixture(t, options{workers: 2, wcfg: worker.Config{CachedTokens: 3, CompletionTokens: 5}})
	body := chatBody("test-model", "hello there", "")
	resp, b := f.post(t, "/v1/chat/completions", body)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	ep := resp.Header.Get(proxy.HeaderEndpoint)
	if ep == "" || ep != resp.Header.Get(worker.HeaderWorker) {
		t.Fatalf("%s = %q, worker header %q", proxy.HeaderEndpoint, ep, resp.Header.Get(worker.HeaderWorker))
	}
	var got struct {
		Choices []struct {
			Message struct{ Content string }
		}
	}
	if err := json.Unmarshal(b, &got); err != nil || len(got.Choices) != 1 || got.Choices[0].Message.Content != worker.Text(5) {
		t.Fatalf("body %s (err %v)", b, err)
	}
	reqs := f.worker(t, ep).Requests()
	if len(reqs) != 1 || !bytes.Equal(reqs[0].Body, body) {
		t.Fatalf("worker got %d requests, body equal: %v", len(reqs), len(reqs) == 1 && bytes.Equal(reqs[0].Body, body))
	}
	if h := reqs[0].Header.Get("x-gateway-destination-endpoint"); h != ep {
		t.Errorf("worker saw destination %q, want %q", h, ep)
	}
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeSuccess || o.Status != 200 || string(o.Served) != ep {
		t.Errorf("outcome %+v", o)
	}
	if o.PromptTokens <= 0 || o.CompletionTokens != 5 || o.CachedTokens != 3 || o.TTFT <= 0 || o.Latency < o.TTFT {
		t.Errorf("outcome usage/timing %+v", o)
	}
	f.inflightZero(t)
}

func TestProxyChatStreaming(t *testing.T) {
	const n = 6
	f := newFixture(t, options{workers: 2, wcfg: worker.Config{CachedTokens: 2, TokenDelay: 40 * time.Millisecond}})
	body := chatBody("test-model", "stream please", fmt.Sprintf(`,"stream":true,"stream_options":{"include_usage":true},"max_tokens":%d`, n))
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, f.url+"/v1/chat/completions", bytes.NewReader(body))
	start := time.Now()
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, content-type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	sc := bufio.NewScanner(resp.Body)
	var content strings.Builder
	var firstContent time.Duration
	var usage bool
	done := false
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			break
		}
		var ch struct {
			Choices []struct{ Delta struct{ Content string } }
			Usage   *struct {
				CompletionTokens int `json:"completion_tokens"`
			}
		}
		if err := json.Unmarshal([]byte(line), &ch); err != nil {
			t.Fatal(err)
		}
		for _, c := range ch.Choices {
			if c.Delta.Content != "" && firstContent == 0 {
				firstContent = time.Since(start)
			}
			content.WriteString(c.Delta.Content)
		}
		if ch.Usage != nil && ch.Usage.CompletionTokens == n {
			usage = true
		}
	}
	total := time.Since(start)
	if !done || !usage || content.String() != worker.Text(n) {
		t.Fatalf("done %v usage %v content %q", done, usage, content.String())
	}
	// Unbuffered: the first token arrives long before the last.
	if firstContent > total-3*40*time.Millisecond {
		t.Errorf("first content after %v of %v: the stream was buffered", firstContent, total)
	}
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeSuccess || o.Status != 200 || o.CompletionTokens != n || o.CachedTokens != 2 || o.PromptTokens <= 0 {
		t.Errorf("outcome %+v", o)
	}
	if o.TTFT <= 0 || o.TTFT >= o.Latency {
		t.Errorf("ttft %v latency %v", o.TTFT, o.Latency)
	}
	f.inflightZero(t)
}

func TestProxyCompletionsAndModels(t *testing.T) {
	f := newFixture(t, options{workers: 1, wcfg: worker.Config{CompletionTokens: 3}})
	resp, b := f.post(t, "/v1/completions", []byte(`{"model":"test-model","prompt":"Once upon a time"}`))
	if resp.StatusCode != 200 || !strings.Contains(string(b), worker.Text(3)) {
		t.Fatalf("completions: %d %s", resp.StatusCode, b)
	}
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeSuccess || o.CompletionTokens != 3 {
		t.Errorf("outcome %+v", o)
	}
	// Other /v1/ paths pass through (routed by load only).
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, f.url+"/v1/embeddings", nil)
	mr, err := f.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	mb, _ := io.ReadAll(mr.Body)
	mr.Body.Close()
	if mr.StatusCode != 404 || mr.Header.Get(proxy.HeaderEndpoint) != f.workers[0].Addr() {
		t.Fatalf("embeddings: %d %s %v", mr.StatusCode, mb, mr.Header)
	}
	f.out.wait(t, 2)
	f.inflightZero(t)
}

// TestProxyHintsAffinity: sessions announced with x-prefix-* headers or
// nvext.agent_hints stay on one worker while load spreads sessions.
func TestProxyHintsAffinity(t *testing.T) {
	f := newFixture(t, options{policy: "kvbandit", workers: 4})
	type session struct {
		id   string
		body func(turn int) ([]byte, []string)
	}
	var sessions []session
	for s := range 4 {
		id := fmt.Sprintf("sess-%d", s)
		history := func(turn int) string {
			var b strings.Builder
			for i := range turn + 1 {
				fmt.Fprintf(&b, "session %s turn %d: tell me more about topic %d and its history. ", id, i, s*100+i)
			}
			return b.String()
		}
		if s%2 == 0 {
			sessions = append(sessions, session{id, func(turn int) ([]byte, []string) {
				return chatBody("test-model", history(turn), ""), []string{"x-prefix-id", id, "x-prefix-total-requests", "6", "x-prefix-iat", "LOW"}
			}})
		} else {
			sessions = append(sessions, session{id, func(turn int) ([]byte, []string) {
				return chatBody("test-model", history(turn), fmt.Sprintf(`,"nvext":{"agent_hints":{"prefix_id":%q,"total_requests":6,"iat":50}}`, id)), nil
			}})
		}
	}
	where := map[string]map[string]int{}
	for turn := range 6 {
		for _, s := range sessions {
			body, hdr := s.body(turn)
			resp, b := f.post(t, "/v1/chat/completions", body, hdr...)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			if where[s.id] == nil {
				where[s.id] = map[string]int{}
			}
			where[s.id][resp.Header.Get(proxy.HeaderEndpoint)]++
		}
	}
	for id, m := range where {
		if len(m) != 1 {
			t.Errorf("session %s spread over %v", id, m)
		}
	}
	f.out.wait(t, 24)
	f.inflightZero(t)
}

func TestProxyRouteHasNoSideEffects(t *testing.T) {
	f := newFixture(t, options{workers: 3})
	prompt := strings.Repeat("a shared system prompt about routing and caches. ", 20)
	warm := chatBody("test-model", prompt, "")
	resp, _ := f.post(t, "/v1/chat/completions", warm)
	warmed := resp.Header.Get(proxy.HeaderEndpoint)
	f.out.wait(t, 1)
	// The approximate index is fed off the request path: wait for it.
	time.Sleep(50 * time.Millisecond)

	type counts map[routing.EndpointKey][2]int64
	state := func() counts {
		c := counts{}
		for _, st := range f.engine.Endpoints() {
			c[st.Key] = [2]int64{st.InFlight.Load(), st.Decisions.Load()}
		}
		return c
	}
	before := state()
	_, decisions := f.out.snapshot()
	var first proxy.RouteResponse
	for i := range 5 {
		resp, b := f.post(t, proxy.RoutePath, warm)
		if resp.StatusCode != 200 {
			t.Fatalf("route: %d %s", resp.StatusCode, b)
		}
		var got proxy.RouteResponse
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			first = got
			continue
		}
		if fmt.Sprint(got) != fmt.Sprint(first) {
			t.Fatalf("route answer changed:\n%+v\n%+v", first, got)
		}
	}
	if first.Endpoint != warmed || first.OverlapBlocks == 0 || first.Tokens == 0 || len(first.Scores) != 3 || first.Policy != "kv" || first.DPRank != -1 {
		t.Fatalf("route = %+v, want endpoint %s with overlap", first, warmed)
	}
	// The answer says how to read its scores: kv's are costs.
	if first.ScoreOrder != proxy.ScoreLowerIsBetter {
		t.Errorf("score_order = %q, want %q", first.ScoreOrder, proxy.ScoreLowerIsBetter)
	}
	for k, v := range first.Scores {
		if v < first.Scores[first.Endpoint] {
			t.Errorf("%s scores %v, below the chosen %s's %v, with lower is better", k, v, first.Endpoint, first.Scores[first.Endpoint])
		}
	}
	var raw map[string]any
	_, b := f.post(t, proxy.RoutePath, []byte(`{"model":"test-model","prompt":"hi"}`))
	if err := json.Unmarshal(b, &raw); err != nil || raw["endpoint"] == nil || raw["scores"] == nil || raw["tokens"] == nil || raw["overlap_blocks"] == nil {
		t.Fatalf("completion route: %s", b)
	}
	if after := state(); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("engine counters moved: %v -> %v", before, after)
	}
	if _, d := f.out.snapshot(); d != decisions {
		t.Errorf("decisions %d -> %d", decisions, d)
	}
	for _, w := range f.workers {
		if n := len(w.Requests()); w.Addr() != warmed && n != 0 || w.Addr() == warmed && n != 1 {
			t.Errorf("worker %s got %d requests", w.Addr(), n)
		}
	}
}

// TestProxyRouteScoreOrder: policies whose scores rank highest first say
// so; policies without scores say nothing.
func TestProxyRouteScoreOrder(t *testing.T) {
	for policy, want := range map[string]string{"least_loaded": proxy.ScoreHigherIsBetter, "round_robin": ""} {
		f := newFixture(t, options{workers: 2, policy: policy})
		resp, b := f.post(t, proxy.RoutePath, chatBody("test-model", "hi", ""))
		var got proxy.RouteResponse
		if resp.StatusCode != 200 || json.Unmarshal(b, &got) != nil {
			t.Fatalf("%s: route: %d %s", policy, resp.StatusCode, b)
		}
		if got.ScoreOrder != want {
			t.Errorf("%s: score_order = %q, want %q (%s)", policy, got.ScoreOrder, want, b)
		}
	}
}

func TestProxyErrors(t *testing.T) {
	f := newFixture(t, options{workers: 1, models: true, cfg: proxy.Config{MaxBodyBytes: 1024}})
	empty := newFixture(t, options{})
	cases := []struct {
		name   string
		f      *fixture
		method string
		path   string
		body   string
		status int
		code   string
	}{
		{"bad json", f, "POST", "/v1/chat/completions", `{"model":`, 400, "invalid_json"},
		{"missing model", f, "POST", "/v1/chat/completions", `{"messages":[]}`, 400, "missing_model"},
		{"unknown model", f, "POST", "/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, 404, "model_not_found"},
		{"too large", f, "POST", "/v1/chat/completions", `{"model":"test-model","prompt":"` + strings.Repeat("x", 2000) + `"}`, 413, "body_too_large"},
		{"no endpoints", empty, "POST", "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"x"}]}`, 503, "no_endpoint"},
		{"route bad json", f, "POST", proxy.RoutePath, `nope`, 400, "invalid_json"},
		{"route unknown model", f, "POST", proxy.RoutePath, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, 404, "model_not_found"},
		{"route no endpoints", empty, "POST", proxy.RoutePath, `{"model":"m","messages":[{"role":"user","content":"x"}]}`, 503, "no_endpoint"},
		{"route GET", f, "GET", proxy.RoutePath, ``, 405, "method_not_allowed"},
		{"chat GET", f, "GET", "/v1/chat/completions", ``, 405, "method_not_allowed"},
		{"completions PUT", f, "PUT", "/v1/completions", `{"model":"test-model","prompt":"x"}`, 405, "method_not_allowed"},
		{"outside /v1/", f, "GET", "/admin", ``, 404, "not_found"},
	}
	for _, c := range cases {
		for _, chunked := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/chunked=%v", c.name, chunked), func(t *testing.T) {
				var body io.Reader = strings.NewReader(c.body)
				if chunked {
					body = io.MultiReader(body) // unknown length: sent chunked
				}
				req, _ := http.NewRequestWithContext(t.Context(), c.method, c.f.url+c.path, body)
				resp, err := c.f.client.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				var e struct {
					Error struct{ Message, Type, Code string }
				}
				if resp.StatusCode != c.status || json.Unmarshal(b, &e) != nil || e.Error.Code != c.code || e.Error.Message == "" || e.Error.Type == "" {
					t.Fatalf("got %d %s, want %d %s", resp.StatusCode, b, c.status, c.code)
				}
				if resp.Header.Get("x-kvbandit-error") != c.code || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
					t.Errorf("headers %v", resp.Header)
				}
				if c.status == 405 && resp.Header.Get("Allow") != "POST" {
					t.Errorf("Allow %q, want POST", resp.Header.Get("Allow"))
				}
			})
		}
	}
	if got, d := f.out.snapshot(); len(got) != 0 || d != 0 {
		t.Errorf("rejected requests made %d decisions, %d outcomes", d, len(got))
	}
	if n := len(f.workers[0].Requests()); n != 0 {
		t.Errorf("worker got %d requests", n)
	}
}

func TestProxyClientCancelMidStream(t *testing.T) {
	f := newFixture(t, options{workers: 1, wcfg: worker.Config{TokenDelay: 50 * time.Millisecond}})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	body := chatBody("test-model", "long answer", `,"stream":true,"max_tokens":200`)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.url+"/v1/chat/completions", bytes.NewReader(body))
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(resp.Body)
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(line, "tok1 ") {
			break
		}
	}
	cancel()
	resp.Body.Close()
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeCancelled || o.Status != 200 {
		t.Errorf("outcome %+v, want cancelled", o)
	}
	if _, err := f.workers[0].WaitRequests(t.Context(), 1); err != nil {
		t.Fatal(err)
	}
	if rq := f.workers[0].Requests(); !rq[0].Canceled {
		t.Errorf("the worker's request was not cancelled")
	}
	f.inflightZero(t)
}

func TestProxyUpstreamDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	f := newFixture(t, options{endpoints: []routing.Endpoint{{Key: routing.EndpointKey(dead)}}})
	resp, b := f.post(t, "/v1/chat/completions", chatBody("m", "hi", ""))
	var e struct{ Error struct{ Code string } }
	if resp.StatusCode != 503 || json.Unmarshal(b, &e) != nil || e.Error.Code != "upstream_unavailable" {
		t.Fatalf("got %d %s", resp.StatusCode, b)
	}
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeUpstreamError || o.Status != 0 {
		t.Errorf("outcome %+v", o)
	}
	f.inflightZero(t)
}

func TestProxyUpstreamErrorStatus(t *testing.T) {
	f := newFixture(t, options{workers: 1, wcfg: worker.Config{FailStatus: 500}})
	resp, b := f.post(t, "/v1/chat/completions", chatBody("test-model", "hi", ""))
	if resp.StatusCode != 500 || !strings.Contains(string(b), "injected failure") || resp.Header.Get(proxy.HeaderEndpoint) == "" {
		t.Fatalf("got %d %s", resp.StatusCode, b)
	}
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeUpstreamError || o.Status != 500 || o.TTFT != 0 {
		t.Errorf("outcome %+v", o)
	}
	f.inflightZero(t)
}

// TestProxyStopAbandons: Stop cuts a stream in flight; its decision ends
// as abandoned.
func TestProxyStopAbandons(t *testing.T) {
	f := newFixture(t, options{workers: 1, wcfg: worker.Config{TokenDelay: 50 * time.Millisecond}})
	body := chatBody("test-model", "long answer", `,"stream":true,"max_tokens":200`)
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, f.url+"/v1/chat/completions", bytes.NewReader(body))
	resp, err := f.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	f.proxy.Stop()
	_, _ = io.Copy(io.Discard, resp.Body)
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeAbandoned {
		t.Errorf("outcome %+v, want abandoned", o)
	}
	f.inflightZero(t)
}

// TestProxySpoofedHeaders: client headers posing as the gateway's are
// dropped; hop-by-hop headers are not forwarded.
func TestProxySpoofedHeaders(t *testing.T) {
	f := newFixture(t, options{workers: 2})
	other := f.workers[0].Addr()
	resp, _ := f.post(t, "/v1/chat/completions", chatBody("test-model", "hi", ""),
		"x-gateway-destination-endpoint", other, "x-gateway-destination-endpoint-served", other,
		"x-data-parallel-rank", "3", "X-Prefiller-Host-Port", "10.9.9.9:80", "Connection", "x-drop-me", "x-drop-me", "1", "x-keep", "yes")
	ep := resp.Header.Get(proxy.HeaderEndpoint)
	rq := f.worker(t, ep).Requests()[0]
	if rq.Header.Get("x-gateway-destination-endpoint") != ep || rq.Header.Get("x-gateway-destination-endpoint-served") != "" ||
		rq.Header.Get("x-data-parallel-rank") != "" || rq.Header.Get("x-prefiller-host-port") != "" || rq.Header.Get("x-drop-me") != "" || rq.Header.Get("x-keep") != "yes" {
		t.Errorf("worker headers %v", rq.Header)
	}
	if rq.Header.Get("X-Forwarded-For") != "127.0.0.1" {
		t.Errorf("X-Forwarded-For %q", rq.Header.Get("X-Forwarded-For"))
	}
	f.out.wait(t, 1)
}

// TestProxyPrefillerHeader: in a P/D pool the proxy sends a long prompt to
// the decode worker with x-prefiller-host-port naming the prefill worker
// (for the decode worker's P/D sidecar; the proxy runs no prefill stage
// itself), replacing a client's copy; /v1/route shows the same choice;
// both workers' in-flight counts return to 0.
func TestProxyPrefillerHeader(t *testing.T) {
	dec, err := pd.New(pd.Config{ThresholdTokens: 16})
	if err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, options{workers: 2, roles: []routing.Role{routing.RoleDecode, routing.RolePrefill}, pd: dec})
	decode, prefill := f.workers[0].Addr(), f.workers[1].Addr()
	long := chatBody("test-model", strings.Repeat("route this long prompt please ", 40), "")
	resp, b := f.post(t, proxy.RoutePath, long)
	var rr proxy.RouteResponse
	if err := json.Unmarshal(b, &rr); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("route: %d %s", resp.StatusCode, b)
	}
	if rr.Endpoint != decode || rr.Prefill != prefill || rr.PD != "disaggregated" {
		t.Fatalf("route: %+v", rr)
	}
	resp, _ = f.post(t, "/v1/chat/completions", long, "X-Prefiller-Host-Port", "10.9.9.9:80")
	if resp.StatusCode != http.StatusOK || resp.Header.Get(proxy.HeaderEndpoint) != decode {
		t.Fatalf("status %d on %q", resp.StatusCode, resp.Header.Get(proxy.HeaderEndpoint))
	}
	if got := f.worker(t, decode).Requests()[0].Header.Values("x-prefiller-host-port"); len(got) != 1 || got[0] != prefill {
		t.Errorf("decode worker got x-prefiller-host-port %q, want %q", got, prefill)
	}
	if n := len(f.worker(t, prefill).Requests()); n != 0 {
		t.Errorf("the prefill worker got %d requests from the proxy", n)
	}
	// A short prompt stays aggregated: no header at all.
	resp, _ = f.post(t, "/v1/chat/completions", []byte(`{"model":"test-model","prompt":"hi"}`), "X-Prefiller-Host-Port", "10.9.9.9:80")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("short: %d", resp.StatusCode)
	}
	if rq := f.worker(t, decode).Requests(); len(rq) != 2 || rq[1].Header.Get("x-prefiller-host-port") != "" {
		t.Errorf("short prompt: %d requests, header %q", len(rq), rq[len(rq)-1].Header.Get("x-prefiller-host-port"))
	}
	f.out.wait(t, 2)
	f.inflightZero(t)
}
