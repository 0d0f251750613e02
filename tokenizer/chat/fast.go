package chat

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"strings"
)

// A fast path writes the output of one known chat template directly in Go.
// It is chosen by the SHA-256 of the exact template source, so an edited
// template never takes it. It returns false (declines) for any input whose
// output it does not reproduce exactly, and Render then runs the engine;
// a fast path never returns an error, so every error (invalid input,
// raise_exception, output too large) comes from the engine.
//
// The contract, checked by TestFastPathOracle (every case of the oracle
// corpus: fast == engine == Python's Jinja2) and FuzzFastPath (random
// conversations: fast == engine, or the fast path declines): when a fast path
// accepts an input, its output is byte for byte the engine's.
type fastPath struct {
	name   string
	render func(b *strings.Builder, in *Input, msgs []fastMessage) bool
	// kwargs lists the template variables of Input.Extra this fast path
	// reads (with boolean values only); any other key makes it decline.
	kwargs []string
}

// fastPathFor returns the fast path for a template source, if there is one.
func fastPathFor(src string) *fastPath {
	sum := sha256.Sum256([]byte(src))
	switch hex.EncodeToString(sum[:]) {
	case "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5":
		// Qwen3 (Qwen/Qwen3-* tokenizer_config.json).
		return &fastPath{name: "qwen3", render: renderQwen3, kwargs: []string{"enable_thinking"}}
	case "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122":
		// Meta-Llama-3-*-Instruct's template (also the llama3_1 test
		// fixture's). Llama 3.1's template with tools and a date block has
		// another hash and runs the engine.
		return &fastPath{name: "llama3", render: renderLlama3}
	case "26a59556925c987317ce5291811ba3b7f32ec4c647c400c6cc7e3a9993007ba7":
		// Mistral-7B-Instruct v0.1.
		return &fastPath{name: "mistral-instruct", render: renderMistral}
	}
	return nil
}

// fastMessage is a message as the fast paths read it: content already made
// a string the way prepareMessages does for FormatString templates.
type fastMessage struct {
	role, content string
	// reasoning is ReasoningContent of an assistant message (nil for other
	// roles, as prepareMessages sets it only on assistant messages).
	reasoning *string
}

// run renders in through the fast path, or reports false. It declines
// everything the engine would see differently from what the fast paths
// model: tools, assistant tool calls, message Extra keys that a template
// may read, kwargs other than p.kwargs, and any input the engine would
// reject (no role, malformed content or Extra values).
func (p *fastPath) run(in *Input) (string, bool) {
	if in.Tools != nil {
		return "", false
	}
	for k, v := range in.Extra {
		if !p.readsKwarg(k) {
			return "", false
		}
		if _, ok := kwargBool(v); !ok {
			return "", false
		}
	}
	msgs := make([]fastMessage, 0, len(in.Messages))
	size := 64
	for _, m := range in.Messages {
		if m.Role == "" || (m.Role == "assistant" && m.ToolCalls != nil) {
			return "", false
		}
		if !fastExtraOK(m.Extra) {
			return "", false
		}
		content, ok := stringContent(m.Content)
		if !ok {
			return "", false
		}
		fm := fastMessage{role: m.Role, content: content}
		if m.Role == "assistant" {
			fm.reasoning = m.ReasoningContent
		}
		size += len(m.Role) + len(content) + 48
		msgs = append(msgs, fm)
	}
	limit := in.MaxOutputBytes
	if limit <= 0 {
		limit = DefaultMaxOutput
	}
	var b strings.Builder
	b.Grow(min(size, limit+1))
	if !p.render(&b, in, msgs) || b.Len() > limit {
		return "", false // over the limit: the engine reports ErrOutputTooLarge
	}
	return b.String(), true
}

func (p *fastPath) readsKwarg(k string) bool {
	for _, name := range p.kwargs {
		if name == k {
			return true
		}
	}
	return false
}

// kwargBool reads a boolean template variable given as a Go bool or as the
// JSON literal true/false (models.ChatInput passes chat_template_kwargs as
// raw JSON).
func kwargBool(v any) (bool, bool) {
	switch v := v.(type) {
	case bool:
		return v, true
	case json.RawMessage:
		switch string(v) {
		case "true":
			return true, true
		case "false":
			return false, true
		}
	}
	return false, false
}

// fastExtraOK reports whether a message's Extra keys leave the template's
// view of the message unchanged: the keys the fast paths model must not be
// supplied through Extra, and every value must convert as prepareMessages
// converts it (so the engine would not reject it).
func fastExtraOK(extra map[string]any) bool {
	for k, v := range extra {
		switch k {
		case "reasoning_content", "reasoning", "tool_calls", "content", "role":
			return false
		}
		if _, err := convert(v, 1); err != nil {
			return false
		}
	}
	return true
}

// stringContent is a message's content as a FormatString template sees it;
// false when prepareMessages would reject it.
func stringContent(c any) (string, bool) {
	switch c := c.(type) {
	case nil:
		return "", true
	case string:
		return c, true
	}
	parts, err := contentParts(c)
	if err != nil {
		return "", false
	}
	return joinText(parts), true
}

// renderQwen3 is the Qwen3 template without tools and tool calls.
func renderQwen3(b *strings.Builder, in *Input, msgs []fastMessage) bool {
	if len(msgs) == 0 {
		return false // messages[0] is undefined: leave it to the engine
	}
	if msgs[0].role == "system" {
		b.WriteString("<|im_start|>system\n")
		b.WriteString(msgs[0].content)
		b.WriteString("<|im_end|>\n")
	}
	// The last user message that is not a tool response; assistant turns
	// after it keep their reasoning.
	lastQuery := len(msgs) - 1
	for i := len(msgs) - 1; i >= 0; i-- {
		m := msgs[i]
		if m.role == "user" && !(strings.HasPrefix(m.content, "<tool_response>") && strings.HasSuffix(m.content, "</tool_response>")) {
			lastQuery = i
			break
		}
	}
	for i, m := range msgs {
		switch {
		case m.role == "user" || (m.role == "system" && i > 0):
			b.WriteString("<|im_start|>")
			b.WriteString(m.role)
			b.WriteString("\n")
			b.WriteString(m.content)
			b.WriteString("<|im_end|>\n")
		case m.role == "assistant":
			content, reasoning := m.content, ""
			if m.reasoning != nil {
				reasoning = *m.reasoning
			} else if strings.Contains(m.content, "</think>") {
				content = strings.TrimLeft(afterLast(m.content, "</think>"), "\n")
				reasoning = strings.TrimLeft(afterLast(strings.TrimRight(beforeFirst(m.content, "</think>"), "\n"), "<think>"), "\n")
			}
			b.WriteString("<|im_start|>assistant\n")
			if i > lastQuery && (i == len(msgs)-1 || reasoning != "") {
				b.WriteString("<think>\n")
				b.WriteString(strings.Trim(reasoning, "\n"))
				b.WriteString("\n</think>\n\n")
				content = strings.TrimLeft(content, "\n")
			}
			b.WriteString(content)
			b.WriteString("<|im_end|>\n")
		case m.role == "tool":
			if i == 0 || msgs[i-1].role != "tool" {
				b.WriteString("<|im_start|>user")
			}
			b.WriteString("\n<tool_response>\n")
			b.WriteString(m.content)
			b.WriteString("\n</tool_response>")
			if i == len(msgs)-1 || msgs[i+1].role != "tool" {
				b.WriteString("<|im_end|>\n")
			}
		}
	}
	if in.AddGenerationPrompt {
		b.WriteString("<|im_start|>assistant\n")
		if v, ok := in.Extra["enable_thinking"]; ok {
			if think, _ := kwargBool(v); !think {
				b.WriteString("<think>\n\n</think>\n\n")
			}
		}
	}
	return true
}

// renderLlama3 is the Llama 3 template: header, trimmed content, <|eot_id|>,
// bos_token before the first message.
func renderLlama3(b *strings.Builder, in *Input, msgs []fastMessage) bool {
	for i, m := range msgs {
		if strings.ContainsAny(m.content, "\x1c\x1d\x1e\x1f") {
			// Python's str.strip (Jinja's trim) strips these, Go's
			// TrimSpace (the engine's trim) does not: leave them to the
			// engine, which is the reference the fast path must equal.
			return false
		}
		if i == 0 {
			b.WriteString(in.BOSToken)
		}
		b.WriteString("<|start_header_id|>")
		b.WriteString(m.role)
		b.WriteString("<|end_header_id|>\n\n")
		b.WriteString(strings.TrimSpace(m.content))
		b.WriteString("<|eot_id|>")
	}
	if in.AddGenerationPrompt {
		b.WriteString("<|start_header_id|>assistant<|end_header_id|>\n\n")
	}
	return true
}

// renderMistral is Mistral-7B-Instruct v0.1's template for conversations
// that alternate user/assistant starting with user; anything else raises in
// the template, so the engine renders (and reports) it.
func renderMistral(b *strings.Builder, in *Input, msgs []fastMessage) bool {
	b.WriteString(in.BOSToken)
	for i, m := range msgs {
		switch {
		case (m.role == "user") != (i%2 == 0):
			return false
		case m.role == "user":
			b.WriteString("[INST] ")
			b.WriteString(m.content)
			b.WriteString(" [/INST]")
		case m.role == "assistant":
			b.WriteString(m.content)
			b.WriteString(in.EOSToken)
		default:
			return false
		}
	}
	return true
}

// afterLast is Python's s.split(sep)[-1].
func afterLast(s, sep string) string {
	if i := strings.LastIndex(s, sep); i >= 0 {
		return s[i+len(sep):]
	}
	return s
}

// beforeFirst is Python's s.split(sep)[0].
func beforeFirst(s, sep string) string {
	if i := strings.Index(s, sep); i >= 0 {
		return s[:i]
	}
	return s
}
