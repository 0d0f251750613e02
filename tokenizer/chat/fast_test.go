package chat_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/tokenizer/chat"
)

// TestFastPathOracle renders every case of the oracle corpus (and each with
// add_generation_prompt flipped) three ways: fast path, engine, Python's
// Jinja2. Where the fast path accepts a case, its output must equal both;
// where the template raises, the fast path must have declined.
func TestFastPathOracle(t *testing.T) {
	// The fast path each test model must get: a fixture whose template
	// changed (new SHA-256) would silently fall back to the engine.
	wantFastPath := map[string]string{"qwen3": "qwen3", "llama3.1": "llama3", "mistral": "mistral-instruct", "kimi-k2": ""}
	cases := loadCases(t)
	for _, c := range loadCases(t) {
		c.Name += "/flipped-gen"
		c.AddGenerationPrompt = !c.AddGenerationPrompt
		cases = append(cases, c)
	}
	for _, m := range models(t) {
		t.Run(m.name, func(t *testing.T) {
			tmpl, err := chat.Compile(m.src)
			if err != nil {
				t.Fatal(err)
			}
			want, ok := wantFastPath[m.name]
			if !ok || tmpl.FastPath() != want {
				t.Fatalf("fast path %q, want %q", tmpl.FastPath(), want)
			}
			if want == "" {
				return
			}
			oracle := runOracle(t, oracleRequests(m, cases))
			accepted := 0
			for i, c := range cases {
				in := c.input(t, m.sp)
				fast, ok := chat.RenderFast(tmpl, in)
				if !ok {
					continue
				}
				accepted++
				eng, err := chat.RenderEngine(t.Context(), tmpl, in)
				switch {
				case err != nil:
					t.Errorf("%s: fast path accepted what the engine rejects (%v)", c.Name, err)
				case fast != eng:
					t.Errorf("%s: fast path differs from the engine\nfast   %q\nengine %q", c.Name, fast, eng)
				case oracle[i].Out == nil:
					t.Errorf("%s: fast path accepted what Jinja2 rejects (%s)", c.Name, oracle[i].Error)
				case fast != *oracle[i].Out:
					t.Errorf("%s: fast path differs from Jinja2\nfast   %q\njinja2 %q", c.Name, fast, *oracle[i].Out)
				}
				if got, err := tmpl.Render(t.Context(), in); err != nil || got != fast {
					t.Errorf("%s: Render = %q, %v; the fast path gave %q", c.Name, got, err, fast)
				}
			}
			t.Logf("%s: fast path took %d/%d cases, each equal to the engine and to Jinja2", m.name, accepted, len(cases))
			// The corpus is mostly plain conversations; a fast path that
			// declines them all would make this test vacuous.
			if accepted < len(cases)/3 {
				t.Errorf("fast path took only %d of %d cases", accepted, len(cases))
			}
		})
	}
}

// TestFastPathDeclines: inputs a fast path does not model go to the engine,
// so Render gives exactly the engine's output or error, and the counters say
// which path ran.
func TestFastPathDeclines(t *testing.T) {
	tmpl, sp := qwen3(t)
	base := func() chat.Input {
		return chat.Input{AddGenerationPrompt: true, BOSToken: sp.BOSToken, EOSToken: sp.EOSToken,
			Messages: []chat.Message{{Role: "system", Content: "s"}, {Role: "user", Content: "hi"}}}
	}
	deep := json.RawMessage(strings.Repeat("[", 100) + strings.Repeat("]", 100))
	for _, tc := range []struct {
		name string
		edit func(*chat.Input)
	}{
		{"tools", func(in *chat.Input) { in.Tools = []any{json.RawMessage(`{"type":"function","function":{"name":"f"}}`)} }},
		{"empty-tools", func(in *chat.Input) { in.Tools = []any{} }},
		{"tool-calls", func(in *chat.Input) {
			in.Messages = append(in.Messages, chat.Message{Role: "assistant", ToolCalls: []any{json.RawMessage(`{"type":"function","function":{"name":"f","arguments":"{}"}}`)}})
		}},
		{"unknown-kwarg", func(in *chat.Input) { in.Extra = map[string]any{"foo": true} }},
		{"non-bool-thinking", func(in *chat.Input) { in.Extra = map[string]any{"enable_thinking": json.RawMessage(`0`)} }},
		{"extra-reasoning", func(in *chat.Input) {
			in.Messages = append(in.Messages, chat.Message{Role: "assistant", Content: "a", Extra: map[string]any{"reasoning_content": "r"}})
		}},
		{"deep-extra", func(in *chat.Input) { in.Messages[1].Extra = map[string]any{"meta": deep} }},
		{"no-role", func(in *chat.Input) { in.Messages[1].Role = "" }},
		{"bad-content", func(in *chat.Input) { in.Messages[1].Content = 42 }},
		{"no-messages", func(in *chat.Input) { in.Messages = nil }},
		{"output-limit", func(in *chat.Input) { in.MaxOutputBytes = 10 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := base()
			tc.edit(&in)
			if out, ok := chat.RenderFast(tmpl, in); ok {
				t.Fatalf("fast path accepted it: %q", out)
			}
			before := tmpl.Stats()
			got, err := tmpl.Render(t.Context(), in)
			want, wantErr := chat.RenderEngine(t.Context(), tmpl, in)
			if got != want || (err == nil) != (wantErr == nil) || (err != nil && err.Error() != wantErr.Error()) {
				t.Errorf("Render = %q, %v; engine = %q, %v", got, err, want, wantErr)
			}
			if d := tmpl.Stats(); d.Engine != before.Engine+1 || d.Fast != before.Fast {
				t.Errorf("stats %+v → %+v, want one more engine render", before, d)
			}
		})
	}

	// A plain conversation, with message extras a client echoes back and
	// content parts, takes the fast path and counts as fast.
	in := base()
	in.Messages[1].Content = json.RawMessage(`[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"b"}]`)
	in.Messages = append(in.Messages, chat.Message{Role: "assistant", Content: "ok", Extra: map[string]any{"refusal": nil, "annotations": json.RawMessage(`[]`)}},
		chat.Message{Role: "user", Content: "more"})
	in.Extra = map[string]any{"enable_thinking": false}
	before := tmpl.Stats()
	got, err := tmpl.Render(t.Context(), in)
	if err != nil {
		t.Fatal(err)
	}
	if want, _ := chat.RenderEngine(t.Context(), tmpl, in); got != want {
		t.Errorf("fast %q, engine %q", got, want)
	}
	if d := tmpl.Stats(); d.Fast != before.Fast+1 || d.Engine != before.Engine {
		t.Errorf("stats %+v → %+v, want one more fast render", before, d)
	}
}

// TestFastPathExactSource: a template that differs from a known one by a
// single byte gets no fast path.
func TestFastPathExactSource(t *testing.T) {
	tmpl, _ := qwen3(t)
	edited, err := chat.Compile(tmpl.Source() + " ")
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.FastPath() != "qwen3" || edited.FastPath() != "" {
		t.Errorf("FastPath: original %q, edited %q", tmpl.FastPath(), edited.FastPath())
	}
}

// fuzzConversation builds a conversation from fuzz input: one message per
// byte of roles (its low bits pick the role; bit 3 gives an assistant a
// reasoning_content; bit 4 sends the content as text parts; bit 5 adds an
// extra key), contents taken in turn from text split at "|".
func fuzzConversation(roles []byte, text string) []chat.Message {
	names := []string{"user", "assistant", "system", "tool", "wizard"}
	parts := strings.Split(text, "|")
	next := func() string {
		p := parts[0]
		parts = append(parts[1:], p)
		return p
	}
	var msgs []chat.Message
	for _, r := range roles[:min(len(roles), 64)] {
		m := chat.Message{Role: names[int(r&7)%len(names)]}
		m.Content = next()
		if r&0x10 != 0 {
			raw, _ := json.Marshal([]map[string]string{{"type": "text", "text": m.Content.(string)}, {"type": "text", "text": next()}})
			m.Content = json.RawMessage(raw)
		}
		if r&0x08 != 0 && m.Role == "assistant" {
			rc := next()
			m.ReasoningContent = &rc
		}
		if r&0x20 != 0 {
			m.Extra = map[string]any{"refusal": nil}
		}
		msgs = append(msgs, m)
	}
	return msgs
}

// FuzzFastPath renders random conversations with each model's fast path and
// with the engine: the fast path either declines or gives the engine's
// output exactly.
func FuzzFastPath(f *testing.F) {
	var tmpls []*chat.Template
	var specials []chat.Special
	for _, m := range models(f) {
		tmpl, err := chat.Compile(m.src)
		if err != nil {
			f.Fatal(err)
		}
		if tmpl.FastPath() != "" {
			tmpls, specials = append(tmpls, tmpl), append(specials, m.sp)
		}
	}
	if len(tmpls) == 0 {
		f.Fatal("no template with a fast path")
	}
	for i := range tmpls {
		model := uint8(i)
		f.Add(model, []byte{2, 0, 1, 0}, "s|q|<think>\nr\n</think>\n\na|q2", true, uint8(0))
		f.Add(model, []byte{0, 1}, "q|\n\n</think>\n\na\n", false, uint8(1))
		f.Add(model, []byte{0, 1 | 8, 3, 3, 0}, "q|\na|\nr\n|t1|t2|<tool_response>x</tool_response>", true, uint8(2))
		f.Add(model, []byte{0x10, 1 | 0x20, 2}, " a | b\x1c|ok|late", true, uint8(3))
		f.Add(model, []byte{1, 4, 0, 1 | 8}, "<think>x<think>y</think>z</think>w|?|q|\n a|", false, uint8(0))
	}
	f.Fuzz(func(t *testing.T, model uint8, roles []byte, text string, addGen bool, thinking uint8) {
		i := int(model) % len(tmpls)
		tmpl := tmpls[i]
		in := chat.Input{Messages: fuzzConversation(roles, text), AddGenerationPrompt: addGen,
			BOSToken: specials[i].BOSToken, EOSToken: specials[i].EOSToken, MaxOutputBytes: 1 << 20}
		switch thinking % 4 {
		case 1:
			in.Extra = map[string]any{"enable_thinking": json.RawMessage("false")}
		case 2:
			in.Extra = map[string]any{"enable_thinking": true}
		case 3:
			in.Extra = map[string]any{"enable_thinking": "no"}
		}
		fast, ok := chat.RenderFast(tmpl, in)
		if !ok {
			return
		}
		eng, err := chat.RenderEngine(t.Context(), tmpl, in)
		if err != nil {
			t.Fatalf("%s: fast path accepted an input the engine rejects: %v", tmpl.FastPath(), err)
		}
		if fast != eng {
			t.Fatalf("%s: fast path differs from the engine\nfast   %q\nengine %q", tmpl.FastPath(), fast, eng)
		}
	})
}
