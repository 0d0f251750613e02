// Package models maps served model names to their tokenization pipeline:
// the model's chat template (tokenizer/chat), its tokenizer (tokenizer) and
// a prefix cache, so that kvbandit computes the token ids the worker will.
// Tokenizers are loaded lazily, once per file, and shared by every stream;
// a load failure is reported once and does not stop serving (callers fall
// back to an estimate). The same code serves `kvbandit tokenize` and the
// request path.
package models

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/tidwall/gjson"

	"github.com/kvbandit/kvbandit/tokenizer"
	"github.com/kvbandit/kvbandit/tokenizer/chat"
)

// Errors.
var (
	// ErrNoTokenizer: no tokenizer is configured for the model.
	ErrNoTokenizer = errors.New("no tokenizer configured for model")
	// ErrNoTemplate: the model's tokenizer_config.json has no chat template.
	ErrNoTemplate = errors.New("model has no chat template")
	// ErrBadChat: the chat request's messages or tools could not be read.
	ErrBadChat = errors.New("invalid chat request")
)

// DefaultCacheBytes is a model's prefix cache size when not configured.
const DefaultCacheBytes = 64 << 20

// Loader loads a tokenizer from a file or model directory (the pure-Go one
// by default; the hftokenizers build swaps in the native library).
type Loader func(path string) (tokenizer.Tokenizer, tokenizer.Config, error)

// Config configures a [Registry].
type Config struct {
	// Default is the tokenizer (tokenizer.json or a model directory) for
	// models without an entry (--tokenizer); empty means none.
	Default string
	// Models maps served model names to tokenizer paths.
	Models map[string]string
	// CacheBytes bounds each tokenizer's prefix cache (0: DefaultCacheBytes,
	// < 0: no cache).
	CacheBytes int64
	// Loader loads tokenizers (nil: the pure-Go tokenizer).
	Loader Loader
}

// Registry resolves model names to pipelines. It is safe for concurrent use;
// lookups after the first load of a path take no lock.
type Registry struct {
	cfg   Config
	log   *slog.Logger
	paths sync.Map // path → *entry
}

type entry struct {
	once sync.Once
	m    *Model
	err  error
	// loaded publishes m to CacheStats, which must not wait on once.
	loaded atomic.Pointer[Model]
}

// New returns a registry; log may be nil.
func New(cfg Config, log *slog.Logger) *Registry {
	if log == nil {
		log = slog.Default()
	}
	if cfg.CacheBytes == 0 {
		cfg.CacheBytes = DefaultCacheBytes
	}
	return &Registry{cfg: cfg, log: log}
}

// Enabled reports whether any tokenizer is configured.
func (r *Registry) Enabled() bool { return r.cfg.Default != "" || len(r.cfg.Models) > 0 }

// For returns the pipeline of model, loading it on first use. A failed load
// is logged once and its error returned on every later call.
func (r *Registry) For(model string) (*Model, error) {
	path, ok := r.cfg.Models[model]
	if !ok {
		path = r.cfg.Default
	}
	if path == "" {
		return nil, fmt.Errorf("%w %q", ErrNoTokenizer, model)
	}
	ei, _ := r.paths.LoadOrStore(path, &entry{})
	e := ei.(*entry)
	e.once.Do(func() {
		e.m, e.err = r.load(path)
		if e.err != nil {
			r.log.Error("tokenizer failed to load; requests for its models are routed on estimated tokens", "path", path, "err", e.err)
		} else {
			e.loaded.Store(e.m)
			fast := ""
			if e.m.tmpl != nil {
				fast = e.m.tmpl.FastPath()
			}
			r.log.Info("tokenizer loaded", "path", path, "chat_template", e.m.tmpl != nil, "chat_fast_path", fast)
			if e.m.tmpl == nil {
				r.log.Warn("tokenizer has no chat template: chat completions for its models are routed on estimated tokens (counted in kvbandit_tokenizer_fallbacks_total); give the model's directory, with tokenizer_config.json and its chat_template, to encode them", "path", path)
			}
		}
	})
	return e.m, e.err
}

func (r *Registry) load(path string) (*Model, error) {
	m := &Model{Path: path}
	var cfg tokenizer.Config
	if r.cfg.Loader != nil {
		tok, c, err := r.cfg.Loader(path)
		if err != nil {
			return nil, err
		}
		m.tok, cfg = tok, c
	} else {
		bpe, err := tokenizer.Load(path)
		if err != nil {
			return nil, err
		}
		m.tok, cfg = bpe, bpe.Config()
		if r.cfg.CacheBytes > 0 {
			m.tok = tokenizer.NewPrefixCache(bpe, r.cfg.CacheBytes, 0)
		}
	}
	m.special = chat.Special{BOSToken: cfg.BOSToken, EOSToken: cfg.EOSToken}
	if cfg.ChatTemplate != "" {
		t, err := chat.Compile(cfg.ChatTemplate)
		if err != nil {
			// Plain-text encoding still works; chat requests fall back.
			r.log.Warn("chat template not usable; chat requests for this tokenizer are routed on estimated tokens", "path", path, "err", err)
		} else {
			m.tmpl = t
		}
	}
	return m, nil
}

// CacheStats returns each loaded tokenizer's prefix-cache counters, by
// path (tokenizers without a cache are left out).
func (r *Registry) CacheStats() map[string]tokenizer.PrefixCacheStats {
	out := map[string]tokenizer.PrefixCacheStats{}
	r.paths.Range(func(k, v any) bool {
		if m := v.(*entry).loaded.Load(); m != nil {
			if pc, ok := m.tok.(*tokenizer.PrefixCache); ok {
				out[k.(string)] = pc.Stats()
			}
		}
		return true
	})
	return out
}

// ChatRenderStats returns, by path, how each loaded tokenizer's chat
// template rendered requests: by its compiled fast path or by the Jinja
// engine (tokenizers without a usable template are left out).
func (r *Registry) ChatRenderStats() map[string]chat.RenderStats {
	out := map[string]chat.RenderStats{}
	r.paths.Range(func(k, v any) bool {
		if m := v.(*entry).loaded.Load(); m != nil && m.tmpl != nil {
			out[k.(string)] = m.tmpl.Stats()
		}
		return true
	})
	return out
}

// Model is one tokenizer with its chat template and prefix cache.
type Model struct {
	Path    string
	tok     tokenizer.Tokenizer
	tmpl    *chat.Template
	special chat.Special
}

// Encode tokenizes plain text (add_special_tokens=false; special tokens
// written in the text are matched), through the prefix cache.
func (m *Model) Encode(ctx context.Context, text string) ([]uint32, error) {
	return m.tok.Encode(ctx, text)
}

// EncodeKeys is [Model.Encode] that also returns the ids' block keys for
// spec (kvindex.AppendBlockKeys), reused from the prefix cache for the
// prompt's leading chunks it served. Without a prefix cache the keys are
// nil: the caller hashes the ids itself.
func (m *Model) EncodeKeys(ctx context.Context, text string, spec tokenizer.KeySpec) ([]uint32, []uint64, error) {
	if pc, ok := m.tok.(*tokenizer.PrefixCache); ok {
		return pc.EncodeKeys(ctx, text, spec)
	}
	ids, err := m.tok.Encode(ctx, text)
	return ids, nil, err
}

// Render renders a chat input with the model's template, with the
// generation prompt and the model's BOS/EOS strings, as vLLM's chat
// endpoint does.
func (m *Model) Render(ctx context.Context, in chat.Input) (string, error) {
	if m.tmpl == nil {
		return "", fmt.Errorf("%w (%s)", ErrNoTemplate, m.Path)
	}
	in.AddGenerationPrompt = true
	in.BOSToken, in.EOSToken = m.special.BOSToken, m.special.EOSToken
	return m.tmpl.Render(ctx, in)
}

// EncodeChat renders and tokenizes a chat input: the ids vLLM's chat
// endpoint computes (the template's text tokenized without adding special
// tokens).
func (m *Model) EncodeChat(ctx context.Context, in chat.Input) ([]uint32, error) {
	ids, _, err := m.EncodeChatKeys(ctx, in, tokenizer.KeySpec{})
	return ids, err
}

// EncodeChatKeys is [Model.EncodeChat] with the block keys of
// [Model.EncodeKeys].
func (m *Model) EncodeChatKeys(ctx context.Context, in chat.Input, spec tokenizer.KeySpec) ([]uint32, []uint64, error) {
	text, err := m.Render(ctx, in)
	if err != nil {
		return nil, nil, err
	}
	return m.EncodeKeys(ctx, text, spec)
}

// ChatInput reads an OpenAI chat completion request body into a template
// input: its messages (keeping content, tool calls and other keys as raw
// JSON, so key order survives for tojson), tools, and
// chat_template_kwargs. Unknown message keys go to Extra.
func ChatInput(body []byte) (chat.Input, error) {
	if !gjson.ValidBytes(body) {
		return chat.Input{}, fmt.Errorf("%w: not valid JSON", ErrBadChat)
	}
	return ChatInputChecked(body)
}

// ChatInputChecked is [ChatInput] for a body its caller has already checked
// to be valid JSON (the ext_proc and proxy paths, whose parser checks every
// body first): it skips the second validation pass over the body.
func ChatInputChecked(body []byte) (chat.Input, error) {
	root := gjson.ParseBytes(body)
	msgs := root.Get("messages")
	if !msgs.IsArray() {
		return chat.Input{}, fmt.Errorf("%w: messages must be an array", ErrBadChat)
	}
	var in chat.Input
	var bad error
	msgs.ForEach(func(_, v gjson.Result) bool {
		if !v.IsObject() {
			bad = fmt.Errorf("%w: a message is not an object", ErrBadChat)
			return false
		}
		var m chat.Message
		v.ForEach(func(k, f gjson.Result) bool {
			switch k.String() {
			case "role":
				m.Role = f.String()
			case "content":
				switch f.Type {
				case gjson.String:
					m.Content = f.String()
				case gjson.Null:
				default:
					m.Content = json.RawMessage(f.Raw)
				}
			case "name":
				m.Name = f.String()
			case "tool_call_id":
				m.ToolCallID = f.String()
			case "tool_calls":
				f.ForEach(func(_, tc gjson.Result) bool {
					m.ToolCalls = append(m.ToolCalls, json.RawMessage(tc.Raw))
					return true
				})
			case "reasoning_content":
				if f.Type == gjson.String {
					s := f.String()
					m.ReasoningContent = &s
				}
			default:
				if m.Extra == nil {
					m.Extra = map[string]any{}
				}
				m.Extra[k.String()] = json.RawMessage(f.Raw)
			}
			return true
		})
		in.Messages = append(in.Messages, m)
		return true
	})
	if bad != nil {
		return chat.Input{}, bad
	}
	if tools := root.Get("tools"); tools.IsArray() && len(tools.Array()) > 0 {
		tools.ForEach(func(_, t gjson.Result) bool {
			in.Tools = append(in.Tools, json.RawMessage(t.Raw))
			return true
		})
	}
	if kw := root.Get("chat_template_kwargs"); kw.IsObject() {
		in.Extra = map[string]any{}
		kw.ForEach(func(k, v gjson.Result) bool {
			in.Extra[k.String()] = json.RawMessage(v.Raw)
			return true
		})
	}
	return in, nil
}
