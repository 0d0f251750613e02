package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/tokenizer/tokenizertest"
)

// conversation builds turn n of an agent session: a shared system prompt,
// then the session's growing history.
func conversation(session, turns int) []byte {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	// Agent prompts are long: a system prompt of tool descriptions and
	// house rules (about 600 tokens here) that every session shares.
	system := "You are a careful coding agent working in a large repository. Follow the house style. " +
		strings.Repeat("Tools: read_file(path) returns a file; grep(pattern) searches; run_tests(pkg) runs a package's tests. Always explain a change before making it. ", 20)
	msgs := []msg{{"system", system}}
	for i := range turns {
		msgs = append(msgs, msg{"user", fmt.Sprintf("session %d step %d: please inspect the next file and summarise what it does in detail", session, i)})
		if i < turns-1 {
			msgs = append(msgs, msg{"assistant", fmt.Sprintf("step %d summary: the file defines handlers, tests and a config loader for session %d", i, session)})
		}
	}
	b, _ := json.Marshal(map[string]any{"model": "test-model", "max_tokens": 4, "messages": msgs})
	return b
}

// TestKVPoliciesKeepSessionsTogether: with the KV-aware policies (the
// default kvbandit, and kv), every turn of an agent session goes to the
// worker that served its first turn (its cache holds the growing prefix).
// kvbandit also spreads the sessions, because each announces its remaining
// work (x-prefix-total-requests); kv, with the fleet idle between these
// sequential requests, sends every new session to the worker that already
// caches the shared system prompt (Dynamo's behaviour: cache wins when load
// is equal), which this test records rather than forbids.
func TestKVPoliciesKeepSessionsTogether(t *testing.T) {
	for _, policy := range []string{"kvbandit", "kv"} {
		t.Run(policy, func(t *testing.T) {
			_, addrs := startWorkers(t, 3, worker.Config{})
			k := startKvbandit(t, addrs, "--policy", policy)
			p := startProxy(t, k, envoysim.Config{})
			c := httpClient(t)
			home := map[int]string{}
			used := map[string]bool{}
			for turn := 1; turn <= 5; turn++ {
				for s := range 5 { // 5 sessions: round robin could not pass by accident
					hdr := map[string]string{"x-prefix-id": fmt.Sprintf("session-%d", s), "x-prefix-total-requests": "5"}
					resp := send(t, c, "POST", p.URL()+chatPath, conversation(s, turn), hdr)
					if resp.status != http.StatusOK {
						t.Fatalf("session %d turn %d: %d %s", s, turn, resp.status, resp.body)
					}
					w := resp.worker()
					if turn == 1 {
						home[s] = w
						used[w] = true
					} else if w != home[s] {
						t.Errorf("session %d turn %d went to %s, its first turn to %s", s, turn, w, home[s])
					}
				}
			}
			if policy == "kvbandit" && len(used) < 2 {
				t.Errorf("kvbandit started all 5 sessions on one worker: %v", home)
			}
			k.waitReleased(t)
		})
	}
}

// TestRealTokenizer: with the model's tokenizer (Qwen3's tokenizer.json and
// chat template), requests are routed on real token ids (no fallback to
// the byte estimate), and an agent session still stays on one worker.
func TestRealTokenizer(t *testing.T) {
	tok := filepath.Join(tokenizertest.Require(t, "qwen3/tokenizer.json"), "qwen3")
	_, addrs := startWorkers(t, 3, worker.Config{})
	k := startKvbandit(t, addrs, "--policy", "kvbandit", "--tokenizer", tok)
	p := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)
	var home string
	for turn := 1; turn <= 4; turn++ {
		resp := send(t, c, "POST", p.URL()+chatPath, conversation(7, turn), map[string]string{"x-prefix-id": "tok-session", "x-prefix-total-requests": "4"})
		if resp.status != http.StatusOK {
			t.Fatalf("turn %d: %d %s", turn, resp.status, resp.body)
		}
		if turn == 1 {
			home = resp.worker()
		} else if resp.worker() != home {
			t.Errorf("turn %d went to %s, the session's worker is %s", turn, resp.worker(), home)
		}
	}
	samples, err := k.scrape(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if n := metric(samples, "kvbandit_tokenizer_fallbacks_total", nil); n != 0 {
		t.Errorf("%v requests fell back to the byte estimate", n)
	}
	if n := metric(samples, "kvbandit_tokens_total", map[string]string{"kind": "prompt_routed"}); n < 4*20 {
		t.Errorf("only %v prompt tokens routed", n)
	}
	// Turns 2–4 resend the history: the tokenizer's prefix cache serves it.
	if n := metric(samples, "kvbandit_tokenizer_cache_hits_total", nil); n == 0 {
		t.Error("no tokenizer prefix-cache hits for a growing conversation")
	}
	// ... and the block keys of the history, which the engine uses.
	if n := metric(samples, "kvbandit_tokenizer_cache_block_keys_total", map[string]string{"source": "reused"}); n == 0 {
		t.Error("no block keys reused from the tokenizer's prefix cache")
	}
	if n := metric(samples, "kvbandit_hashed_blocks_total", nil); n != 0 {
		t.Errorf("the engine hashed %v blocks: the tokenizer's keys were not used", n)
	}
	// Qwen3's template has a compiled fast path: none of the 4 renders
	// needed the Jinja engine.
	if f, e := metric(samples, "kvbandit_chat_render_total", map[string]string{"path": "fast"}),
		metric(samples, "kvbandit_chat_render_total", map[string]string{"path": "engine"}); f != 4 || e != 0 {
		t.Errorf("chat renders: %v fast, %v engine; want 4 fast", f, e)
	}
	k.waitReleased(t)
}

// TestLoadScraping: kvbandit scrapes the workers' /metrics (vLLM names) on
// its own, outside the data plane.
func TestLoadScraping(t *testing.T) {
	ws, addrs := startWorkers(t, 2, worker.Config{})
	k := startKvbandit(t, addrs, "--scrape-interval", "100ms")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		samples, err := k.scrape(ctx)
		if err != nil {
			return false, err.Error()
		}
		n := metric(samples, "kvbandit_scrapes_total", map[string]string{"result": "ok"})
		return n >= 4, fmt.Sprintf("%v good scrapes", n)
	}); err != nil {
		t.Fatal(err)
	}
	for _, w := range ws {
		if w.Scrapes() == 0 {
			t.Errorf("worker %s was never scraped", w.Addr())
		}
		if n := len(w.Requests()); n != 0 {
			t.Errorf("scrapes were recorded as routed requests: %d", n)
		}
	}
}
