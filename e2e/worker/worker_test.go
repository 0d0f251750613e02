package worker_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/e2e/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func start(t *testing.T, cfg worker.Config) (*worker.Worker, *http.Client) {
	t.Helper()
	w := worker.New(cfg)
	if err := w.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return w, &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

func post(t *testing.T, c *http.Client, url, body string) (*http.Response, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), "POST", url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
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

func TestChatJSON(t *testing.T) {
	w, c := start(t, worker.Config{Model: "m1", CachedTokens: 3})
	body := `{"model":"m1","messages":[{"role":"user","content":"hello there"}],"max_tokens":4}`
	resp, b := post(t, c, w.URL()+"/v1/chat/completions", body)
	if resp.StatusCode != 200 || resp.Header.Get(worker.HeaderWorker) != w.Addr() {
		t.Fatalf("status %d worker %q: %s", resp.StatusCode, resp.Header.Get(worker.HeaderWorker), b)
	}
	var out struct {
		Object  string `json:"object"`
		Model   string `json:"model"`
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens    int `json:"completion_tokens"`
			PromptTokensDetails struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	if out.Object != "chat.completion" || out.Model != "m1" || out.Choices[0].Message.Content != worker.Text(4) ||
		out.Usage.CompletionTokens != 4 || out.Usage.PromptTokensDetails.CachedTokens != 3 {
		t.Errorf("response %s", b)
	}
	reqs := w.Requests()
	if len(reqs) != 1 || string(reqs[0].Body) != body || reqs[0].Path != "/v1/chat/completions" || !reqs[0].Done || reqs[0].Status != 200 {
		t.Errorf("recorded %+v", reqs)
	}
}

func TestStreamingWithUsage(t *testing.T) {
	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		t.Run(path, func(t *testing.T) {
			w, c := start(t, worker.Config{TokenDelay: time.Millisecond})
			body := `{"model":"test-model","prompt":"x","messages":[{"role":"user","content":"x"}],"stream":true,"stream_options":{"include_usage":true},"max_tokens":5}`
			resp, b := post(t, c, w.URL()+path, body)
			if resp.Header.Get("Content-Type") != "text/event-stream" {
				t.Errorf("content type %q", resp.Header.Get("Content-Type"))
			}
			var events []string
			sc := bufio.NewScanner(bytes.NewReader(b))
			for sc.Scan() {
				if line, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
					events = append(events, line)
				}
			}
			if len(events) < 3 || events[len(events)-1] != "[DONE]" {
				t.Fatalf("events %q", events)
			}
			var usage struct {
				Choices []any `json:"choices"`
				Usage   struct {
					CompletionTokens    int `json:"completion_tokens"`
					PromptTokensDetails *struct {
						CachedTokens int `json:"cached_tokens"`
					} `json:"prompt_tokens_details"`
				} `json:"usage"`
			}
			if err := json.Unmarshal([]byte(events[len(events)-2]), &usage); err != nil {
				t.Fatal(err)
			}
			if len(usage.Choices) != 0 || usage.Usage.CompletionTokens != 5 || usage.Usage.PromptTokensDetails == nil {
				t.Errorf("usage chunk %s", events[len(events)-2])
			}
			var text strings.Builder
			for _, e := range events[:len(events)-2] {
				var ch struct {
					Choices []struct {
						Text  string `json:"text"`
						Delta struct {
							Content string `json:"content"`
						} `json:"delta"`
					} `json:"choices"`
				}
				if err := json.Unmarshal([]byte(e), &ch); err != nil {
					t.Fatal(err)
				}
				text.WriteString(ch.Choices[0].Text + ch.Choices[0].Delta.Content)
			}
			if text.String() != worker.Text(5) {
				t.Errorf("streamed text %q", text.String())
			}
		})
	}
}

func TestErrorsAndEndpoints(t *testing.T) {
	w, c := start(t, worker.Config{})
	if resp, b := post(t, c, w.URL()+"/v1/completions", `{"model":`); resp.StatusCode != 400 || !bytes.Contains(b, []byte(`"error"`)) {
		t.Errorf("invalid JSON: %d %s", resp.StatusCode, b)
	}
	if resp, _ := post(t, c, w.URL()+"/v1/completions", `{"model":"other","prompt":"x"}`); resp.StatusCode != 404 {
		t.Errorf("unknown model: %d", resp.StatusCode)
	}
	w.SetFailStatus(503)
	if resp, b := post(t, c, w.URL()+"/v1/completions", `{"model":"test-model","prompt":"x"}`); resp.StatusCode != 503 || !bytes.Contains(b, []byte("injected")) {
		t.Errorf("injected failure: %d %s", resp.StatusCode, b)
	}
	w.SetFailStatus(0)

	get := func(path string) (int, string) {
		req, _ := http.NewRequestWithContext(t.Context(), "GET", w.URL()+path, nil)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, b := get("/v1/models"); code != 200 || !strings.Contains(b, `"id":"test-model"`) {
		t.Errorf("models: %d %s", code, b)
	}
	if code, _ := get("/health"); code != 200 {
		t.Errorf("health: %d", code)
	}
	if code, b := get("/metrics"); code != 200 || !strings.Contains(b, `vllm:num_requests_running{model_name="test-model"} 0`) ||
		!strings.Contains(b, "vllm:num_requests_waiting") || !strings.Contains(b, `vllm:request_success_total{finished_reason="stop",model_name="test-model"} 0`) {
		t.Errorf("metrics: %d %s", code, b)
	}
	// A request that generates its tokens is counted as finished; failed
	// ones were not.
	if resp, _ := post(t, c, w.URL()+"/v1/completions", `{"model":"test-model","prompt":"x"}`); resp.StatusCode != 200 {
		t.Errorf("completion: %d", resp.StatusCode)
	}
	if code, b := get("/metrics"); code != 200 || !strings.Contains(b, `vllm:request_success_total{finished_reason="stop",model_name="test-model"} 1`) || w.Finished() != 1 {
		t.Errorf("metrics after one completion: %d %s", code, b)
	}
	// /health and /metrics asked directly (no destination header) are
	// monitoring, counted apart from routed requests.
	if n := len(w.Requests()); n != 5 {
		t.Errorf("%d requests recorded, want 5", n)
	}
	if n := w.Scrapes(); n != 3 {
		t.Errorf("%d monitoring requests counted, want 3", n)
	}
}

func TestCancelIsRecorded(t *testing.T) {
	w, c := start(t, worker.Config{TokenDelay: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", w.URL()+"/v1/completions",
		strings.NewReader(`{"model":"test-model","prompt":"x","stream":true,"max_tokens":1000}`))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	if w.Running() != 1 {
		t.Errorf("running %d", w.Running())
	}
	cancel()
	resp.Body.Close()
	reqs, err := w.WaitRequests(t.Context(), 1)
	if err != nil || !reqs[0].Canceled || reqs[0].Done {
		t.Errorf("%v %+v", err, reqs)
	}
}

// TestPrefillDelay: a prompt's blocks cost PrefillDelay each the first
// time; the same prompt again finds them cached, and a longer one pays for
// its new blocks only.
func TestPrefillDelay(t *testing.T) {
	const delay = 20 * time.Millisecond
	w, c := start(t, worker.Config{PrefillDelay: delay})
	prompt := strings.Repeat("0123456789abcdef", 4*30) // 30 blocks of 64 bytes
	body := func(p string) string {
		return `{"model":"test-model","prompt":"` + p + `","max_tokens":1}`
	}
	took := func(p string) time.Duration {
		t0 := time.Now()
		if resp, b := post(t, c, w.URL()+"/v1/completions", body(p)); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		return time.Since(t0)
	}
	cold := took(prompt)
	if cold < 30*delay {
		t.Fatalf("cold prompt of 30 blocks took %v, want >= %v", cold, 30*delay)
	}
	if warm := took(prompt); warm >= cold/2 {
		t.Errorf("the same prompt again took %v, cold %v: its blocks were not cached", warm, cold)
	}
	if longer := took(prompt + strings.Repeat("x", 64*10)); longer < 10*delay || longer >= cold {
		t.Errorf("10 new blocks took %v, want >= %v and under the cold %v", longer, 10*delay, cold)
	}
}
