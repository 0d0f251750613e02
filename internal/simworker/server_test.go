package simworker

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing/kvevents"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/scrape"
	"github.com/kvbandit/kvbandit/routing/sim"
)

func start(t *testing.T, cfg Config) *Server {
	t.Helper()
	if cfg.SpeedUp == 0 {
		cfg.SpeedUp = 10
	}
	if cfg.Worker.BlockSize == 0 {
		cfg.Worker.BlockSize = 16
	}
	if cfg.Worker.KVBlocks == 0 {
		cfg.Worker.KVBlocks = 1024
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func post(t *testing.T, s *Server, path, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+s.Addr()+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

type completion struct {
	Object  string `json:"object"`
	Choices []struct {
		Text    string `json:"text"`
		Message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *usage `json:"usage"`
}

// longPrompt is about 100 pseudo-tokens, shared by tests that need full
// blocks.
var longPrompt = strings.Repeat("You are a careful assistant. ", 14)

func chatBody(model, prompt string, extra string) string {
	b, _ := json.Marshal(prompt)
	return fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%s},{"role":"user","content":"hi"}]%s}`, model, b, extra)
}

func promptTokens(t *testing.T, kind openai.Kind, body string) []uint32 {
	t.Helper()
	r, err := openai.Parse(kind, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return extproc.EstimateTokens(r)
}

func TestChatNonStream(t *testing.T) {
	t.Parallel()
	s := start(t, Config{})
	body := chatBody(DefaultModel, longPrompt, `,"max_tokens":5`)
	resp := post(t, s, "/v1/chat/completions", body)
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
	var c completion
	if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
		t.Fatal(err)
	}
	if c.Object != "chat.completion" || len(c.Choices) != 1 || c.Choices[0].Message.Role != "assistant" {
		t.Fatalf("response %+v", c)
	}
	if n := len(strings.Fields(c.Choices[0].Message.Content)); n != 5 {
		t.Errorf("content %q has %d words, want 5", c.Choices[0].Message.Content, n)
	}
	want := len(promptTokens(t, openai.KindChat, body))
	if u := c.Usage; u == nil || u.PromptTokens != want || u.CompletionTokens != 5 || u.TotalTokens != want+5 || u.PromptTokensDetails.CachedTokens != 0 {
		t.Fatalf("usage %+v, want %d prompt tokens, 5 completion, 0 cached", c.Usage, want)
	}
	if fr := c.Choices[0].FinishReason; fr == nil || *fr != "length" {
		t.Errorf("finish_reason %v, want length", fr)
	}
}

// sse reads the data payloads of an SSE body up to [DONE].
func sse(t *testing.T, r io.Reader) (chunks []completion, done bool) {
	t.Helper()
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			return chunks, true
		}
		var c completion
		if err := json.Unmarshal([]byte(line), &c); err != nil {
			t.Fatalf("chunk %q: %v", line, err)
		}
		chunks = append(chunks, c)
	}
	return chunks, false
}

func TestStreamWithUsage(t *testing.T) {
	t.Parallel()
	s := start(t, Config{})
	for _, tc := range []struct {
		path, body string
		kind       openai.Kind
	}{
		{"/v1/chat/completions", chatBody(DefaultModel, "hello", `,"max_completion_tokens":7,"stream":true,"stream_options":{"include_usage":true}`), openai.KindChat},
		{"/v1/completions", `{"model":"sim-model","prompt":"Once upon a time","max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}`, openai.KindCompletion},
		{"/v1/completions", `{"model":"sim-model","prompt":[1,2,3,4,5,6],"max_tokens":7,"stream":true,"stream_options":{"include_usage":true}}`, openai.KindCompletion},
	} {
		resp := post(t, s, tc.path, tc.body)
		if ct := resp.Header.Get("Content-Type"); resp.StatusCode != 200 || ct != "text/event-stream" {
			t.Fatalf("%s: status %d, content type %q", tc.path, resp.StatusCode, ct)
		}
		chunks, done := sse(t, resp.Body)
		if !done {
			t.Fatalf("%s: no [DONE]", tc.path)
		}
		var text strings.Builder
		var u *usage
		finished := 0
		for _, c := range chunks {
			if c.Usage != nil {
				u = c.Usage
				if len(c.Choices) != 0 {
					t.Errorf("usage chunk with choices: %+v", c)
				}
			}
			for _, ch := range c.Choices {
				text.WriteString(ch.Text + ch.Delta.Content)
				if ch.FinishReason != nil {
					finished++
				}
			}
		}
		if n := len(strings.Fields(text.String())); n != 7 || finished != 1 {
			t.Errorf("%s: %d words (%q), %d finish chunks; want 7 and 1", tc.path, n, text.String(), finished)
		}
		want := len(promptTokens(t, tc.kind, tc.body))
		if u == nil || u.PromptTokens != want || u.CompletionTokens != 7 {
			t.Errorf("%s: usage %+v, want %d prompt and 7 completion tokens", tc.path, u, want)
		}
	}
}

func TestRepeatedPromptIsCached(t *testing.T) {
	t.Parallel()
	s := start(t, Config{})
	body := chatBody(DefaultModel, longPrompt, `,"max_tokens":2`)
	var cached []int
	for range 2 {
		var c completion
		if err := json.NewDecoder(post(t, s, "/v1/chat/completions", body).Body).Decode(&c); err != nil {
			t.Fatal(err)
		}
		cached = append(cached, c.Usage.PromptTokensDetails.CachedTokens)
	}
	n := len(promptTokens(t, openai.KindChat, body))
	if want := (n - 1) / 16 * 16; cached[0] != 0 || cached[1] != want {
		t.Fatalf("cached tokens %v, want [0 %d]", cached, want)
	}
}

func TestErrors(t *testing.T) {
	t.Parallel()
	s := start(t, Config{Worker: sim.WorkerConfig{KVBlocks: 4, BlockSize: 16}})
	for _, tc := range []struct {
		body string
		want int
	}{
		{`{`, 400},
		{`{"messages":[]}`, 400},
		{chatBody("other-model", "x", ""), 404},
		{chatBody(DefaultModel, "x", `,"max_tokens":1000`), 400}, // more than the KV cache
	} {
		if resp := post(t, s, "/v1/chat/completions", tc.body); resp.StatusCode != tc.want {
			t.Errorf("%s: status %d, want %d", tc.body, resp.StatusCode, tc.want)
		}
	}
	if _, err := New(Config{SpeedUp: -1}); err == nil {
		t.Error("negative speed-up accepted")
	}
}

func get(t *testing.T, s *Server, path string) []byte {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+s.Addr()+path, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %s", path, resp.StatusCode, b)
	}
	return b
}

func TestMetricsAndModels(t *testing.T) {
	t.Parallel()
	s := start(t, Config{SpeedUp: 1, Worker: sim.WorkerConfig{KVBlocks: 512, BlockSize: 32}})
	get(t, s, "/health")
	var models struct {
		Data []struct{ ID string } `json:"data"`
	}
	if err := json.Unmarshal(get(t, s, "/v1/models"), &models); err != nil || len(models.Data) != 1 || models.Data[0].ID != DefaultModel {
		t.Fatalf("models %s (%v)", get(t, s, "/v1/models"), err)
	}
	// A long streamed request is running while we scrape.
	resp := post(t, s, "/v1/chat/completions", chatBody(DefaultModel, longPrompt, `,"max_tokens":2000,"stream":true`))
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil { // the first token
		t.Fatal(err)
	}
	sample, err := scrape.Parse(bytes.NewReader(get(t, s, "/metrics")), 0)
	if err != nil {
		t.Fatal(err)
	}
	if sample.BlockSize != 32 || sample.NumGPUBlocks != 512 {
		t.Errorf("cache config: block size %d, blocks %d; want 32, 512", sample.BlockSize, sample.NumGPUBlocks)
	}
	if l := sample.Load(); !l.Known || l.Running != 1 || l.Waiting != 0 || l.KVUsage <= 0 {
		t.Errorf("load %+v, want one running request and some KV usage", l)
	}
	text := string(get(t, s, "/metrics"))
	for _, name := range []string{"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"} {
		if !strings.Contains(text, name+"{") {
			t.Errorf("metrics lack %s", name)
		}
	}
}

// The worker's KV events, received by kvbandit's subscriber and applied
// to a real index, match the block keys kvbandit computes for the prompt.
func TestKVEventsMatchRouterKeys(t *testing.T) {
	t.Parallel()
	s := start(t, Config{KVEventsAddr: "tcp://127.0.0.1:0"})
	ix, err := kvindex.New(kvindex.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	wid := ix.Worker(s.Addr(), 0)
	var mu sync.Mutex
	var applyErrs []error
	sub, err := kvevents.Subscribe(t.Context(), kvevents.Config{Endpoint: s.Addr(), Address: s.KVEventsAddr()}, kvevents.Deps{
		Apply: func(ep string, rank int, ev kvindex.Event) error {
			err := ix.Apply(wid, ev)
			if err != nil {
				mu.Lock()
				applyErrs = append(applyErrs, err)
				mu.Unlock()
			}
			return err
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	// PUB/SUB drops what is sent before the subscription arrives: send
	// distinct warm-up prompts until one gets through.
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; sub.Stats().Messages == 0; i++ {
		if time.Now().After(deadline) {
			t.Fatal("no KV events received")
		}
		post(t, s, "/v1/completions", fmt.Sprintf(`{"model":"sim-model","prompt":"warm-up %d %s","max_tokens":1}`, i, longPrompt))
		time.Sleep(20 * time.Millisecond)
	}
	body := chatBody(DefaultModel, "A different system prompt. "+longPrompt, `,"max_tokens":1`)
	post(t, s, "/v1/chat/completions", body)
	tokens := promptTokens(t, openai.KindChat, body)
	keys := kvindex.AppendBlockKeys(nil, tokens, 16, kvindex.BaseSeed)
	if len(keys) < 3 {
		t.Fatalf("prompt has only %d blocks", len(keys))
	}
	deadline = time.Now().Add(5 * time.Second)
	for {
		ms := ix.Overlaps(16, keys, nil)
		if len(ms) == 1 && ms[0].Worker == wid && ms[0].Blocks == len(keys) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("overlaps %+v, want worker %d with all %d blocks; stats %+v", ms, wid, len(keys), sub.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
	st := sub.Stats()
	mu.Lock()
	defer mu.Unlock()
	if st.Malformed != 0 || len(applyErrs) != 0 {
		t.Fatalf("malformed %d, apply errors %v", st.Malformed, applyErrs)
	}
}

// Requests over the batch capacity wait, as in the model, and Close ends
// everything (goleak checks the goroutines).
func TestQueueingAndClose(t *testing.T) {
	t.Parallel()
	s := start(t, Config{SpeedUp: 1, Worker: sim.WorkerConfig{MaxNumSeqs: 1}})
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://"+s.Addr()+"/v1/completions",
				strings.NewReader(fmt.Sprintf(`{"model":"sim-model","prompt":"p%d","max_tokens":10000,"stream":true}`, i)))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		sample, err := scrape.Parse(bytes.NewReader(get(t, s, "/metrics")), 0)
		if err != nil {
			t.Fatal(err)
		}
		if sample.Running == 1 && sample.Waiting == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("load %+v, want 1 running and 2 waiting", sample.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	s.Close()
	wg.Wait()
}

// With KVEventsDial the worker connects to a bound subscriber (the
// endpoint record's kv_events_bind) and connects again when the subscriber
// goes away and comes back on the same address.
func TestKVEventsDial(t *testing.T) {
	t.Parallel()
	subscribe := func(addr string) *kvevents.Sub {
		t.Helper()
		sub, err := kvevents.Subscribe(t.Context(), kvevents.Config{Endpoint: "w", Address: addr, Bind: true}, kvevents.Deps{
			Apply: func(string, int, kvindex.Event) error { return nil },
		})
		if err != nil {
			t.Fatal(err)
		}
		return sub
	}
	sub := subscribe("tcp://127.0.0.1:0")
	addr := "tcp://" + sub.Addr().String()
	s := start(t, Config{KVEventsAddr: addr, KVEventsDial: true})
	if got := s.KVEventsAddr(); got != addr {
		t.Fatalf("KVEventsAddr() = %q, want %q", got, addr)
	}
	// PUB/SUB drops what is sent before the connection and the
	// subscription: send distinct prompts until one gets through.
	receive := func(sub *kvevents.Sub, round int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for i := 0; sub.Stats().Messages == 0; i++ {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: no KV events received on the bound subscriber", round)
			}
			post(t, s, "/v1/completions", fmt.Sprintf(`{"model":"sim-model","prompt":"round %d prompt %d %s","max_tokens":1}`, round, i, longPrompt))
			time.Sleep(20 * time.Millisecond)
		}
	}
	receive(sub, 1)
	sub.Close()
	sub = subscribe(addr) // the same address again: the worker redials it
	defer sub.Close()
	receive(sub, 2)
}
