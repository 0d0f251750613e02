package chat

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nikolalohinski/gonja/v2/config"
	"github.com/nikolalohinski/gonja/v2/exec"
	"github.com/nikolalohinski/gonja/v2/loaders"
)

// Errors callers act on. Every error returned by this package wraps one of
// them.
var (
	// ErrUnsupported: the engine cannot parse or execute this template.
	// Callers fall back to another way of counting tokens.
	ErrUnsupported = errors.New("chat: template not supported by the engine")
	// ErrRender: the template rejected the conversation (raise_exception).
	ErrRender = errors.New("chat: template raised an error")
	// ErrInvalidInput: the messages or tokenizer config are malformed.
	ErrInvalidInput = errors.New("chat: invalid input")
)

// MaxDepth bounds the nesting of any value handed to the template (content
// parts, tool calls, tool schemas). Deeper input wraps [ErrInvalidInput].
const MaxDepth = 64

// DefaultMaxOutput bounds the rendered prompt when [Input.MaxOutputBytes] is 0.
const DefaultMaxOutput = 64 << 20

// ContentFormat says how message content reaches the template, as vLLM's
// chat_template_content_format.
type ContentFormat int

const (
	// FormatString: content is a string; text parts are joined with "\n".
	FormatString ContentFormat = iota
	// FormatOpenAI: content is a list of parts ({"type": "text", "text": ...});
	// a string content becomes one text part.
	FormatOpenAI
)

func (f ContentFormat) String() string {
	if f == FormatOpenAI {
		return "openai"
	}
	return "string"
}

// Part is one element of a content-part array.
type Part struct {
	Type string `json:"type"`
	Text string `json:"text,omitempty"`
}

// Message is one chat message as the OpenAI API carries it.
//
// Content is nil, a string, a []Part, or a []any / json.RawMessage holding
// parts decoded from JSON. ToolCalls and the values in Extra may be Go values
// (maps are rendered with sorted keys) or json.RawMessage (object keys keep
// their order, which matters to tojson). A tool call's function.arguments
// given as a JSON string is decoded into an object, as vLLM does.
type Message struct {
	Role             string
	Content          any
	Name             string
	ToolCallID       string
	ToolCalls        []any
	ReasoningContent *string
	// Extra holds any other message keys, passed to the template as is; it
	// cannot override the keys above.
	Extra map[string]any
}

// Input is one render request.
type Input struct {
	Messages            []Message
	AddGenerationPrompt bool
	BOSToken, EOSToken  string
	// Tools is the request's tools list; nil renders as none. Elements may be
	// json.RawMessage to keep key order.
	Tools []any
	// Extra holds further template variables (vLLM's chat_template_kwargs,
	// e.g. enable_thinking). They override nothing above.
	Extra map[string]any
	// MaxOutputBytes bounds the rendered prompt; 0 means DefaultMaxOutput.
	MaxOutputBytes int
	// Now is used by strftime_now; nil means time.Now.
	Now func() time.Time
}

// Special holds the special tokens read from tokenizer_config.json.
type Special struct {
	BOSToken, EOSToken string
}

// Template is a compiled chat template. It is safe for concurrent use.
type Template struct {
	src    string
	tmpl   *exec.Template
	format ContentFormat
	fast   *fastPath // nil: no fast path for this source
	// Renders by path, for [Template.Stats].
	fastRenders, engineRenders atomic.Uint64
}

// Compile parses a chat template. A template the engine cannot parse gives an
// error wrapping [ErrUnsupported].
func Compile(src string) (t *Template, err error) {
	defer func() {
		if r := recover(); r != nil {
			t, err = nil, fmt.Errorf("%w: parser panic: %v", ErrUnsupported, r)
		}
	}()
	cfg := config.New()
	cfg.TrimBlocks = true
	cfg.LeftStripBlocks = false // done by lstripBlocks
	cfg.StrictUndefined = false
	// A memory loader holding only this template: {% include %} and
	// {% import %} cannot reach the file system (Jinja's sandbox in
	// transformers has no loader at all).
	const name = "/chat_template"
	loader, err := loaders.NewMemoryLoader(map[string]string{name: rewriteSubscripts(lstripBlocks(src), cfg)})
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnsupported, err)
	}
	tmpl, err := exec.NewTemplate(name, cfg, loader, newEnvironment())
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnsupported, err)
	}
	return &Template{src: src, tmpl: tmpl, format: detectContentFormat(src), fast: fastPathFor(src)}, nil
}

// FastPath names the compiled fast path of this template ("qwen3", "llama3",
// "mistral-instruct"), or returns "" when every render runs the engine.
func (t *Template) FastPath() string {
	if t.fast == nil {
		return ""
	}
	return t.fast.name
}

// RenderStats counts renders by the path that produced them.
type RenderStats struct {
	// Fast: rendered by the template's compiled fast path.
	Fast uint64
	// Engine: rendered (or rejected) by the Jinja engine, because the
	// template has no fast path or the fast path declined the input.
	Engine uint64
}

// Stats returns the template's render counters since it was compiled.
func (t *Template) Stats() RenderStats {
	return RenderStats{Fast: t.fastRenders.Load(), Engine: t.engineRenders.Load()}
}

// ContentFormat reports how this template wants message content, detected
// as vLLM does for chat_template_content_format="auto": a template that loops
// over a message's content ({% for part in message['content'] %}, where
// message comes from a loop over messages or a variable set from it) gets
// FormatOpenAI, any other gets FormatString.
func (t *Template) ContentFormat() ContentFormat { return t.format }

// Source returns the template text.
func (t *Template) Source() string { return t.src }

// Render renders in. It stops early when ctx is done or the output exceeds
// in.MaxOutputBytes.
//
// A template with a fast path ([Template.FastPath]) renders the inputs that
// path handles without the engine, with the same output; others, and every
// error, come from the engine.
func (t *Template) Render(ctx context.Context, in Input) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	if t.fast != nil {
		if out, ok := t.fast.run(&in); ok {
			t.fastRenders.Add(1)
			return out, nil
		}
	}
	t.engineRenders.Add(1)
	return t.renderEngine(ctx, in)
}

// renderEngine renders in with the Jinja engine.
func (t *Template) renderEngine(ctx context.Context, in Input) (out string, err error) {
	if err := ctx.Err(); err != nil {
		return "", err
	}
	msgs, err := prepareMessages(in.Messages, t.format)
	if err != nil {
		return "", err
	}
	tools, err := toList(in.Tools, 0)
	if err != nil {
		return "", fmt.Errorf("%w: tools: %v", ErrInvalidInput, err)
	}
	data := map[string]any{}
	for k, v := range in.Extra {
		cv, err := convert(v, 0)
		if err != nil {
			return "", fmt.Errorf("%w: extra %q: %v", ErrInvalidInput, k, err)
		}
		data[k] = cv
	}
	data["messages"] = msgs
	if in.Tools != nil {
		data["tools"] = tools
	} else {
		data["tools"] = nil
	}
	data["documents"] = nil
	data["add_generation_prompt"] = in.AddGenerationPrompt
	data["bos_token"] = in.BOSToken
	data["eos_token"] = in.EOSToken
	now := in.Now
	if now == nil {
		now = time.Now
	}
	data["strftime_now"] = strftimeNow(now)

	limit := in.MaxOutputBytes
	if limit <= 0 {
		limit = DefaultMaxOutput
	}
	w := &boundedWriter{ctx: ctx, limit: limit}
	defer func() {
		if r := recover(); r != nil {
			out, err = "", fmt.Errorf("%w: engine panic: %v", ErrUnsupported, r)
		}
	}()
	if err := t.tmpl.Execute(w, exec.NewContext(data)); err != nil {
		return "", classify(ctx, w, err)
	}
	return w.buf.String(), nil
}

func classify(ctx context.Context, w *boundedWriter, err error) error {
	var te *templateError
	switch {
	case errors.As(err, &te):
		return fmt.Errorf("%w: %s", ErrRender, te.msg)
	case w.err != nil:
		return w.err
	case ctx.Err() != nil:
		return ctx.Err()
	}
	// gonja wraps with github.com/pkg/errors, which may hide our error type
	// behind a message; look for the marker too.
	if msg, ok := strings.CutPrefix(lastSegment(err.Error(), raisedPrefix), raisedPrefix); ok {
		return fmt.Errorf("%w: %s", ErrRender, msg)
	}
	return fmt.Errorf("%w: %v", ErrUnsupported, err)
}

func lastSegment(s, marker string) string {
	if i := strings.LastIndex(s, marker); i >= 0 {
		return s[i:]
	}
	return s
}

// ErrOutputTooLarge is wrapped when the rendered prompt exceeds the limit.
var ErrOutputTooLarge = fmt.Errorf("%w: rendered prompt too large", ErrInvalidInput)

type boundedWriter struct {
	ctx   context.Context
	buf   bytes.Buffer
	limit int
	err   error
}

func (w *boundedWriter) Write(p []byte) (int, error) {
	if w.err != nil {
		return 0, w.err
	}
	if err := w.ctx.Err(); err != nil {
		w.err = err
		return 0, err
	}
	if w.buf.Len()+len(p) > w.limit {
		w.err = fmt.Errorf("%w (limit %d bytes)", ErrOutputTooLarge, w.limit)
		return 0, w.err
	}
	return w.buf.Write(p)
}

var _ io.Writer = (*boundedWriter)(nil)

// FromTokenizerConfig reads chat_template (a string, or a list of
// {"name", "template"} objects, of which "default" is used) and
// bos_token/eos_token (strings or {"content": ...} objects) from a
// tokenizer_config.json. A config without a chat template wraps
// [ErrInvalidInput]; a template the engine cannot parse wraps
// [ErrUnsupported].
func FromTokenizerConfig(raw []byte) (*Template, Special, error) {
	var cfg struct {
		ChatTemplate json.RawMessage `json:"chat_template"`
		BOSToken     json.RawMessage `json:"bos_token"`
		EOSToken     json.RawMessage `json:"eos_token"`
	}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return nil, Special{}, fmt.Errorf("%w: tokenizer_config.json: %v", ErrInvalidInput, err)
	}
	var sp Special
	var err error
	if sp.BOSToken, err = specialToken(cfg.BOSToken); err != nil {
		return nil, Special{}, fmt.Errorf("%w: bos_token: %v", ErrInvalidInput, err)
	}
	if sp.EOSToken, err = specialToken(cfg.EOSToken); err != nil {
		return nil, Special{}, fmt.Errorf("%w: eos_token: %v", ErrInvalidInput, err)
	}
	src, err := chatTemplate(cfg.ChatTemplate)
	if err != nil {
		return nil, sp, err
	}
	t, err := Compile(src)
	if err != nil {
		return nil, sp, err
	}
	return t, sp, nil
}

func chatTemplate(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", fmt.Errorf("%w: tokenizer_config.json has no chat_template", ErrInvalidInput)
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var named []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if err := json.Unmarshal(raw, &named); err != nil {
		return "", fmt.Errorf("%w: chat_template is neither a string nor a list of named templates", ErrInvalidInput)
	}
	for _, n := range named {
		if n.Name == "default" {
			return n.Template, nil
		}
	}
	return "", fmt.Errorf("%w: chat_template list has no \"default\" entry", ErrInvalidInput)
}

func specialToken(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var obj struct {
		Content *string `json:"content"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil || obj.Content == nil {
		return "", errors.New("want a string or an object with content")
	}
	return *obj.Content, nil
}
