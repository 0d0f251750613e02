package chat_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/tokenizer/chat"
)

// FuzzRender feeds arbitrary templates and message JSON. The property: no
// panic, and every error wraps one of the package's sentinels or the
// context's.
func FuzzRender(f *testing.F) {
	f.Add("{% for m in messages %}{{ m.role }}:{{ m.content }}{% endfor %}", `[{"role":"user","content":"hi"}]`)
	f.Add("{{ messages|tojson(indent=2) }}", `[{"role":"user","content":[{"type":"text","text":"a"}]}]`)
	f.Add("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", `[{"role":"user","content":"x"}]`)
	f.Add("{{ raise_exception('no') }}", `[]`)
	f.Add("{{ messages[0].content.split('</think>')[-1].lstrip('\\n') }}", `[{"role":"assistant","content":"<think>a</think>\nb"}]`)
	f.Add("{% for m in messages %}{% if '</think>' in m.content %}{{ m.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}|{{ m.content.split('</think>')[-1].lstrip('\\n') }}{% endif %}{{ messages[loop.index0 - 1].role }}{% endfor %}{{ messages[-1].content[-1] }}", `[{"role":"assistant","content":"reasoning\n</think>\n\nanswer"}]`)
	f.Add("{{ messages[0].content }}{{ messages }}", `[{"role":"user","content":[{"type":"text","text":"I'll say \"hi\"\n\u0001"}]}]`)
	f.Add("{% set ns = namespace(x=1) %}{% for m in messages[::-1] %}{% set ns.x = ns.x * 2 %}{% endfor %}{{ ns.x }}", `[{"role":"user","content":"a"},{"role":"user","content":"b"}]`)
	f.Add("{{ messages[0].tool_calls|tojson }}", `[{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"f","arguments":"{\"a\":[1,2.5,null]}"}}]}]`)
	f.Fuzz(func(t *testing.T, src, messages string) {
		tmpl, err := chat.Compile(src)
		if err != nil {
			if !errors.Is(err, chat.ErrUnsupported) {
				t.Fatalf("Compile error %v does not wrap ErrUnsupported", err)
			}
			return
		}
		var raw []json.RawMessage
		if json.Unmarshal([]byte(messages), &raw) != nil {
			return
		}
		var in chat.Input
		for _, r := range raw {
			var m struct {
				Role      string            `json:"role"`
				Content   json.RawMessage   `json:"content"`
				ToolCalls []json.RawMessage `json:"tool_calls"`
			}
			if json.Unmarshal(r, &m) != nil {
				return
			}
			msg := chat.Message{Role: m.Role}
			if len(m.Content) > 0 && string(m.Content) != "null" {
				msg.Content = m.Content
			}
			for _, c := range m.ToolCalls {
				msg.ToolCalls = append(msg.ToolCalls, c)
			}
			in.Messages = append(in.Messages, msg)
		}
		in.MaxOutputBytes = 1 << 20
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, err = tmpl.Render(ctx, in)
		if err != nil && !errors.Is(err, chat.ErrUnsupported) && !errors.Is(err, chat.ErrRender) &&
			!errors.Is(err, chat.ErrInvalidInput) && !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Render error %v wraps no known sentinel", err)
		}
	})
}
