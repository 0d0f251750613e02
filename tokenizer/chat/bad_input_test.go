package chat_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/tokenizer/chat"
)

func qwen3(t testing.TB) (*chat.Template, chat.Special) {
	t.Helper()
	raw, _ := loadConfig(t, "qwen3")
	tmpl, sp, err := chat.FromTokenizerConfig(raw)
	if err != nil {
		t.Fatal(err)
	}
	return tmpl, sp
}

func TestCompileUnsupported(t *testing.T) {
	for _, src := range []string{
		"{% for x in %}",
		"{{ unclosed",
		"{% if x %}no endif",
		"{% unknowntag %}",
	} {
		if _, err := chat.Compile(src); !errors.Is(err, chat.ErrUnsupported) {
			t.Errorf("Compile(%q) = %v, want ErrUnsupported", src, err)
		}
	}
}

func TestRenderErrors(t *testing.T) {
	ctx := t.Context()
	user := []chat.Message{{Role: "user", Content: "hi"}}
	for _, tc := range []struct {
		name string
		src  string
		in   chat.Input
		want error
		msg  string
	}{
		{"raise", "{{ raise_exception('roles must alternate') }}", chat.Input{Messages: user}, chat.ErrRender, "roles must alternate"},
		{"raise-in-loop", "{% for m in messages %}{% if m.role != 'user' %}{{ raise_exception('bad role ' + m.role) }}{% endif %}{% endfor %}",
			chat.Input{Messages: []chat.Message{{Role: "user", Content: "a"}, {Role: "robot", Content: "b"}}}, chat.ErrRender, "bad role robot"},
		{"unknown-filter", "{{ messages|nosuchfilter }}", chat.Input{Messages: user}, chat.ErrUnsupported, ""},
		{"no-role", "{{ messages }}", chat.Input{Messages: []chat.Message{{Content: "x"}}}, chat.ErrInvalidInput, "no role"},
		{"content-int", "{{ messages }}", chat.Input{Messages: []chat.Message{{Role: "user", Content: 42}}}, chat.ErrInvalidInput, "unexpected type int"},
		{"content-part-not-object", "{{ messages }}", chat.Input{Messages: []chat.Message{{Role: "user", Content: []any{"x"}}}}, chat.ErrInvalidInput, "want an object"},
		{"content-part-no-text", "{{ messages }}", chat.Input{Messages: []chat.Message{{Role: "user", Content: json.RawMessage(`[{"type":"text"}]`)}}}, chat.ErrInvalidInput, "no text"},
		{"content-bad-json", "{{ messages }}", chat.Input{Messages: []chat.Message{{Role: "user", Content: json.RawMessage(`[{`)}}}, chat.ErrInvalidInput, ""},
		{"tool-call-bad-args", "{{ messages }}", chat.Input{Messages: []chat.Message{{Role: "assistant", ToolCalls: []any{
			json.RawMessage(`{"type":"function","function":{"name":"f","arguments":"{not json"}}`)}}}}, chat.ErrInvalidInput, "arguments"},
		{"tool-call-no-function", "{{ messages }}", chat.Input{Messages: []chat.Message{{Role: "assistant", ToolCalls: []any{"x"}}}}, chat.ErrInvalidInput, "not an object"},
		{"output-limit", "{% for i in range(1000) %}{{ messages[0].content }}{% endfor %}",
			chat.Input{Messages: []chat.Message{{Role: "user", Content: strings.Repeat("x", 1000)}}, MaxOutputBytes: 10000}, chat.ErrOutputTooLarge, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tmpl, err := chat.Compile(tc.src)
			if err != nil {
				t.Fatal(err)
			}
			got, err := tmpl.Render(ctx, tc.in)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Render = %q, %v; want %v", got, err, tc.want)
			}
			if !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("error %q does not mention %q", err, tc.msg)
			}
		})
	}
}

func TestRoleErrorsFromRealTemplates(t *testing.T) {
	for _, m := range models(t) {
		tmpl, err := chat.Compile(m.src)
		if err != nil {
			t.Fatal(err)
		}
		// Unknown roles and wrong alternation: Mistral raises, the others
		// render (Qwen3 drops unknown roles, Llama 3 prints them).
		in := chat.Input{Messages: []chat.Message{{Role: "user", Content: "a"}, {Role: "user", Content: "b"}, {Role: "wizard", Content: "c"}}}
		_, err = tmpl.Render(t.Context(), in)
		if m.name == "mistral" {
			if !errors.Is(err, chat.ErrRender) || !strings.Contains(err.Error(), "Conversation roles must alternate") {
				t.Errorf("mistral: got %v, want ErrRender with the template's message", err)
			}
		} else if err != nil {
			t.Errorf("%s: %v", m.name, err)
		}
	}
}

func TestDeepNesting(t *testing.T) {
	tmpl, err := chat.Compile("{{ messages|tojson }}")
	if err != nil {
		t.Fatal(err)
	}
	deep := strings.Repeat("[", 10000) + strings.Repeat("]", 10000)
	var nested any = "leaf"
	for range 1000 {
		nested = map[string]any{"a": nested}
	}
	for name, in := range map[string]chat.Input{
		"raw-json-content": {Messages: []chat.Message{{Role: "user", Content: json.RawMessage(deep)}}},
		"tool-schema":      {Messages: []chat.Message{{Role: "user", Content: "x"}}, Tools: []any{nested}},
		"raw-json-tool":    {Messages: []chat.Message{{Role: "user", Content: "x"}}, Tools: []any{json.RawMessage(deep)}},
		"message-extra":    {Messages: []chat.Message{{Role: "user", Content: "x", Extra: map[string]any{"meta": nested}}}},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := tmpl.Render(t.Context(), in)
			if !errors.Is(err, chat.ErrInvalidInput) || !strings.Contains(err.Error(), "nested deeper") {
				t.Errorf("got %v, want ErrInvalidInput about nesting", err)
			}
		})
	}
}

func TestHugeMessage(t *testing.T) {
	tmpl, sp := qwen3(t)
	content := strings.Repeat("0123456789abcdef", 10<<20/16) // 10 MiB
	in := chat.Input{Messages: []chat.Message{{Role: "user", Content: content}}, AddGenerationPrompt: true, BOSToken: sp.BOSToken, EOSToken: sp.EOSToken}
	start := time.Now()
	got, err := tmpl.Render(t.Context(), in)
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(got, content) {
		t.Fatal("content missing from output")
	}
	t.Logf("10 MiB user message rendered in %v (%d bytes out)", elapsed, len(got))
	if elapsed > 10*time.Second {
		t.Errorf("10 MiB message took %v", elapsed)
	}
}

func TestContextCancelled(t *testing.T) {
	tmpl, sp := qwen3(t)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err := tmpl.Render(ctx, chat.Input{Messages: []chat.Message{{Role: "user", Content: "x"}}, BOSToken: sp.BOSToken})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("got %v, want context.Canceled", err)
	}
}

func TestFromTokenizerConfig(t *testing.T) {
	for _, tc := range []struct {
		name, cfg string
		want      error
		bos, eos  string
		out       string
	}{
		{"string", `{"chat_template":"{{ bos_token }}{{ messages[0].content }}","bos_token":"<s>","eos_token":"</s>"}`, nil, "<s>", "</s>", "<s>hi"},
		{"token-objects", `{"chat_template":"x","bos_token":{"content":"<|b|>","lstrip":false},"eos_token":{"__type":"AddedToken","content":"<|e|>"}}`, nil, "<|b|>", "<|e|>", "x"},
		{"named-list", `{"chat_template":[{"name":"tool_use","template":"tools"},{"name":"default","template":"default"}]}`, nil, "", "", "default"},
		{"named-list-no-default", `{"chat_template":[{"name":"tool_use","template":"tools"}]}`, chat.ErrInvalidInput, "", "", ""},
		{"missing", `{"bos_token":"<s>"}`, chat.ErrInvalidInput, "", "", ""},
		{"null-tokens", `{"chat_template":"x","bos_token":null}`, nil, "", "", "x"},
		{"bad-token", `{"chat_template":"x","bos_token":5}`, chat.ErrInvalidInput, "", "", ""},
		{"bad-template-type", `{"chat_template":5}`, chat.ErrInvalidInput, "", "", ""},
		{"not-json", `{`, chat.ErrInvalidInput, "", "", ""},
		{"unparsable", `{"chat_template":"{% for %}"}`, chat.ErrUnsupported, "", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tmpl, sp, err := chat.FromTokenizerConfig([]byte(tc.cfg))
			if !errors.Is(err, tc.want) || (tc.want != nil && err == nil) {
				t.Fatalf("err = %v, want %v", err, tc.want)
			}
			if err != nil {
				return
			}
			if sp.BOSToken != tc.bos || sp.EOSToken != tc.eos {
				t.Errorf("special = %+v", sp)
			}
			out, err := tmpl.Render(t.Context(), chat.Input{Messages: []chat.Message{{Role: "user", Content: "hi"}}, BOSToken: sp.BOSToken})
			if err != nil || out != tc.out {
				t.Errorf("render = %q, %v; want %q", out, err, tc.out)
			}
		})
	}
}

// TestContentFormat checks the content-format detection against vLLM's
// (run by the oracle) on templates of both kinds, and that both sides render
// content parts the same way.
func TestContentFormat(t *testing.T) {
	templates := map[string]string{
		"string":             "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
		"openai":             "{% for m in messages %}{{ m.role }}:{% for p in m['content'] %}[{{ p.type }}:{{ p.text }}]{% endfor %}\n{% endfor %}",
		"openai-attr":        "{% for message in messages %}{% for c in message.content %}{{ c['text'] }}|{% endfor %}{% endfor %}",
		"openai-via-set":     "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
		"openai-filtered":    "{%- for m in messages -%}{%- for p in m.content | selectattr('type', 'equalto', 'text') -%}{{ p.text }};{%- endfor -%}{%- endfor -%}",
		"string-is-string":   "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in other %}{% endfor %}{% endif %}{% endfor %}",
		"openai-in-is-block": "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endif %}{% endfor %}",
	}
	c := testCase{Messages: []json.RawMessage{
		json.RawMessage(`{"role":"system","content":"plain"}`),
		json.RawMessage(`{"role":"user","content":[{"type":"text","text":"one"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"two"}]}`),
	}}
	var names []string
	var req []map[string]any
	for name, src := range templates {
		names = append(names, name)
		req = append(req, map[string]any{"template": src, "messages": c.Messages})
	}
	want := runOracle(t, req)
	for i, name := range names {
		tmpl, err := chat.Compile(templates[name])
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if got := tmpl.ContentFormat().String(); got != want[i].Format {
			t.Errorf("%s: format %s, vLLM detects %s", name, got, want[i].Format)
		}
		got, err := tmpl.Render(t.Context(), c.input(t, chat.Special{}))
		if err != nil || want[i].Out == nil || got != *want[i].Out {
			t.Errorf("%s: render %q, %v; oracle %+v", name, got, err, want[i])
		}
	}
}

func TestConcurrentRender(t *testing.T) {
	tmpl, sp := qwen3(t)
	in := conversation(20, sp)
	want, err := tmpl.Render(t.Context(), in)
	if err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 8)
	for range 8 {
		go func() {
			for range 20 {
				got, err := tmpl.Render(t.Context(), in)
				if err == nil && got != want {
					err = errors.New("concurrent render differs")
				}
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range 8 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
}

func conversation(turns int, sp chat.Special) chat.Input {
	in := chat.Input{AddGenerationPrompt: true, BOSToken: sp.BOSToken, EOSToken: sp.EOSToken}
	in.Messages = append(in.Messages, chat.Message{Role: "system", Content: "You are a helpful assistant."})
	for i := range turns {
		in.Messages = append(in.Messages,
			chat.Message{Role: "user", Content: fmt.Sprintf("Question %d: explain the routing of request %d in a few sentences.", i, i)},
			chat.Message{Role: "assistant", Content: fmt.Sprintf("<think>\nThinking about %d.\n</think>\n\nAnswer %d: it goes to the endpoint with the longest cached prefix.", i, i)})
	}
	in.Messages = append(in.Messages, chat.Message{Role: "user", Content: "Thanks, and the last one?"})
	return in
}

// BenchmarkRender renders a Qwen3 conversation of 1, 5 and 20 turns (a
// system prompt, turns of user question and assistant answer with reasoning,
// then a new question: the request of turn N+1) with the Jinja engine
// (engine=gonja) and through Render, which takes the compiled fast path
// (engine=fast). There is no rendered-prefix cache: a conversation whose
// earlier turns were seen costs what engine=fast does.
//
//	go test -run '^$' -bench Render -benchmem -count 6 ./tokenizer/chat/ | benchstat -
func BenchmarkRender(b *testing.B) {
	tmpl, sp := qwen3(b)
	for _, turns := range []int{1, 5, 20} {
		in := conversation(turns, sp)
		b.Run(fmt.Sprintf("engine=gonja/turns=%d", turns), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := chat.RenderEngine(b.Context(), tmpl, in); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("engine=fast/turns=%d", turns), func(b *testing.B) {
			before := tmpl.Stats()
			b.ReportAllocs()
			for b.Loop() {
				if _, err := tmpl.Render(b.Context(), in); err != nil {
					b.Fatal(err)
				}
			}
			if tmpl.Stats().Engine != before.Engine {
				b.Fatal("the fast path declined: this measured the engine")
			}
		})
	}
}

func BenchmarkCompile(b *testing.B) {
	raw, _ := loadConfig(b, "qwen3")
	b.ReportAllocs()
	for b.Loop() {
		if _, _, err := chat.FromTokenizerConfig(raw); err != nil {
			b.Fatal(err)
		}
	}
}

func TestNoFileSystemAccess(t *testing.T) {
	for _, src := range []string{
		"{% include '/etc/hostname' %}",
		"{% include 'chat_test.go' %}",
		"{% from 'chat_test.go' import x %}",
		"{% extends '/etc/hostname' %}",
	} {
		tmpl, err := chat.Compile(src)
		if err != nil {
			if !errors.Is(err, chat.ErrUnsupported) {
				t.Errorf("Compile(%q) = %v", src, err)
			}
			continue
		}
		out, err := tmpl.Render(t.Context(), chat.Input{Messages: []chat.Message{{Role: "user", Content: "x"}}})
		if err == nil {
			t.Errorf("Render(%q) read a file: %q", src, out)
		}
	}
}
