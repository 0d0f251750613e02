package models

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/tokenizer/tokenizertest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func fixtures(t *testing.T) string {
	t.Helper()
	return tokenizertest.Require(t, "qwen3/tokenizer.json", "qwen3/tokenizer_config.json", "oracle/node_modules/tokenizers")
}

var conversations = []string{
	`{"model":"m","messages":[{"role":"user","content":"Hello! What is KV-cache-aware routing?"}]}`,
	`{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"List three primes."},{"role":"assistant","content":"2, 3, 5"},{"role":"user","content":[{"type":"text","text":"And three more,"},{"type":"text","text":"in Japanese: 日本語で"}]}]}`,
	`{"model":"m","messages":[{"role":"user","content":"emoji 👩‍👩‍👧 and a fake <|im_start|> token"}],"chat_template_kwargs":{"enable_thinking":false}}`,
	`{"model":"m","tools":[{"type":"function","function":{"name":"get_weather","description":"Weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"messages":[{"role":"user","content":"Weather in Paris?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"18C"}]}`,
	// Reasoning closed by </think> with no opening <think> (clients that
	// strip the opening tag, or a model that starts inside its reasoning):
	// the engine used to fail on it and the request fell back to estimated
	// tokens.
	`{"model":"m","messages":[{"role":"user","content":"What is 17 * 23?"},{"role":"assistant","content":"17 * 23 = 17 * 20 + 17 * 3 = 340 + 51.\n</think>\n\n391"},{"role":"user","content":"And 17 * 24?"}]}`,
	`{"model":"m","messages":[{"role":"user","content":"What is 17 * 23?"},{"role":"assistant","content":"340 + 51\n</think>\n\n391"}]}`,
	`{"model":"m","tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"messages":[{"role":"user","content":"Weather in Paris and Rome?"},{"role":"assistant","content":"","reasoning_content":"Both cities, Paris first.","tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"18C"},{"role":"assistant","content":"Now Rome.\n</think>\n\n","tool_calls":[{"id":"c2","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Rome\"}"}}]},{"role":"tool","tool_call_id":"c2","content":"24C"}]}`,
}

// TestEncodeChatMatchesOracle renders each conversation with Python's
// Jinja2 set up as transformers does (tokenizer/chat's oracle) and encodes
// the text with Hugging Face's tokenizers (tokenizer's oracle): the ids must
// equal EncodeChat's, which is what routing hashes.
func TestEncodeChatMatchesOracle(t *testing.T) {
	dir := fixtures(t)
	model := filepath.Join(dir, "qwen3")
	reg := New(Config{Default: model}, nil)
	m, err := reg.For("Qwen/Qwen3-8B")
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		ChatTemplate string `json:"chat_template"`
		BOS          any    `json:"bos_token"`
		EOS          any    `json:"eos_token"`
	}
	raw, _ := os.ReadFile(filepath.Join(model, "tokenizer_config.json"))
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	tokenText := func(v any) string {
		switch x := v.(type) {
		case string:
			return x
		case map[string]any:
			s, _ := x["content"].(string)
			return s
		}
		return ""
	}
	type oracleCase struct {
		Template string          `json:"template"`
		Messages json.RawMessage `json:"messages"`
		AddGen   bool            `json:"add_generation_prompt"`
		BOS      string          `json:"bos_token"`
		EOS      string          `json:"eos_token"`
		Tools    json.RawMessage `json:"tools"`
		Extra    map[string]any  `json:"extra"`
	}
	var cases []oracleCase
	var got [][]uint32
	for _, body := range conversations {
		var req struct {
			Messages json.RawMessage `json:"messages"`
			Tools    json.RawMessage `json:"tools"`
			Kwargs   map[string]any  `json:"chat_template_kwargs"`
		}
		if err := json.Unmarshal([]byte(body), &req); err != nil {
			t.Fatal(err)
		}
		if req.Tools == nil {
			req.Tools = json.RawMessage("null")
		}
		cases = append(cases, oracleCase{cfg.ChatTemplate, req.Messages, true, tokenText(cfg.BOS), tokenText(cfg.EOS), req.Tools, req.Kwargs})
		in, err := ChatInput([]byte(body))
		if err != nil {
			t.Fatal(err)
		}
		ids, err := m.EncodeChat(t.Context(), in)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ids)
	}
	// The request path takes the template's fast path for every
	// conversation without tools (request bodies as ChatInput reads them:
	// content parts, chat_template_kwargs); the two with tools run the engine.
	if st := reg.ChatRenderStats()[model]; st.Fast != 5 || st.Engine != 2 {
		t.Errorf("chat renders by path %+v, want 5 fast and 2 engine", st)
	}
	in, _ := json.Marshal(cases)
	py := exec.CommandContext(t.Context(), "python3", "../chat/testdata/oracle.py")
	py.Stdin = bytes.NewReader(in)
	out, err := py.Output()
	if err != nil {
		t.Fatalf("render oracle: %v", err)
	}
	var rendered []struct {
		Out   string `json:"out"`
		Error string `json:"error"`
	}
	if err := json.Unmarshal(out, &rendered); err != nil {
		t.Fatal(err)
	}
	var texts []string
	for i, r := range rendered {
		if r.Error != "" {
			t.Fatalf("case %d: oracle render error %s", i, r.Error)
		}
		texts = append(texts, r.Out)
	}
	tf := filepath.Join(t.TempDir(), "texts.json")
	b, _ := json.Marshal(texts)
	os.WriteFile(tf, b, 0o644)
	node := exec.CommandContext(t.Context(), "node", "../testdata/oracle.js", filepath.Join(model, "tokenizer.json"), tf)
	node.Env = append(os.Environ(), "NODE_PATH="+filepath.Join(dir, "oracle", "node_modules"))
	out, err = node.Output()
	if err != nil {
		t.Fatalf("tokenizer oracle: %v", err)
	}
	var want [][]uint32
	if err := json.Unmarshal(out, &want); err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if !slices.Equal(got[i], want[i]) {
			t.Errorf("conversation %d: ids differ (got %d ids, want %d)", i, len(got[i]), len(want[i]))
		}
	}
}

func TestRegistryResolution(t *testing.T) {
	dir := fixtures(t)
	reg := New(Config{Models: map[string]string{"qwen": filepath.Join(dir, "qwen3"), "broken": filepath.Join(dir, "does-not-exist")}}, nil)
	if !reg.Enabled() {
		t.Fatal("registry with models reports disabled")
	}
	if _, err := reg.For("unknown"); !errors.Is(err, ErrNoTokenizer) {
		t.Fatalf("unknown model: %v", err)
	}
	a, err := reg.For("qwen")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := reg.For("qwen")
	if a != b {
		t.Fatal("the tokenizer was loaded twice")
	}
	for range 2 {
		if _, err := reg.For("broken"); err == nil {
			t.Fatal("a missing tokenizer loaded")
		}
	}
	ids, err := a.Encode(t.Context(), "hello world")
	if err != nil || len(ids) == 0 {
		t.Fatalf("encode: %v %v", ids, err)
	}
	if New(Config{}, nil).Enabled() {
		t.Fatal("empty registry reports enabled")
	}
}

func TestChatInputRejectsBadRequests(t *testing.T) {
	for _, body := range []string{`{`, `{"messages":3}`, `{"messages":[3]}`} {
		if _, err := ChatInput([]byte(body)); !errors.Is(err, ErrBadChat) {
			t.Errorf("%s: %v", body, err)
		}
	}
}
