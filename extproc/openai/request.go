package openai

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/tidwall/gjson"
)

// ContentPart is one element of a message's content array.
type ContentPart struct {
	// Type is the part's "type" ("text", "image_url", "input_audio", ...);
	// a bare string element counts as "text"; empty when the part has no
	// string "type".
	Type string
	// Text is the part's text for the text-bearing types ("text",
	// "input_text" and "output_text" from "text", "refusal" from
	// "refusal"); empty for every other type.
	Text string
}

// Message is one chat message.
type Message struct {
	// Role is "system", "user", "assistant", "tool", ...; empty if absent.
	Role string
	// Content is the message's text. For a content array it is the text of
	// the text-bearing parts joined with "\n", as vLLM does before it
	// renders a chat template (non-text parts add nothing). Empty for null
	// or absent content.
	Content string
	// Parts holds the content array; nil when content was a string, null
	// or absent, and non-nil (possibly empty) for an array.
	Parts []ContentPart
	// Name is the optional participant name.
	Name string
	// HasToolCalls is set when "tool_calls" is a non-empty array (an
	// assistant turn that called tools, usually with null content).
	HasToolCalls bool
}

// AgentHints holds the fields of nvext.agent_hints as raw JSON values, for
// example `42`, `"session-7"` or `1.5`; a field is empty when it was absent or
// null. Package extproc/hints interprets them.
type AgentHints struct {
	// PrefixID is agent_hints.prefix_id (a string when valid).
	PrefixID string
	// TotalRequests is agent_hints.total_requests (an integer).
	TotalRequests string
	// OSL is agent_hints.osl, the expected output length in tokens.
	OSL string
	// IAT is agent_hints.iat, the expected inter-arrival time in ms.
	IAT string
	// Priority is agent_hints.priority (an integer, higher is more urgent).
	Priority string
	// LatencySensitivity is agent_hints.latency_sensitivity (seconds).
	LatencySensitivity string
	// TTFTSLOMillis is agent_hints.ttft_slo_ms, the TTFT objective in
	// milliseconds.
	TTFTSLOMillis string
}

// NVExt is Dynamo's "nvext" request extension, as far as routing uses it.
// It never makes a request fail: values of the wrong JSON type are skipped
// and named in Ignored.
type NVExt struct {
	// Annotations are the string entries of nvext.annotations, in order,
	// at most MaxAnnotations of them.
	Annotations []string
	// AgentHints are the routing fields of nvext.agent_hints.
	AgentHints AgentHints
	// CacheSalt is nvext.cache_salt.
	CacheSalt string
	// Ignored names the nvext values that were skipped: "nvext" (not an
	// object), "nvext.annotations" (not an array, or over
	// MaxAnnotations), "nvext.annotations[]" (a non-string entry),
	// "nvext.agent_hints" (not an object), "nvext.cache_salt" (not a
	// string). Each name appears at most once.
	Ignored []string
}

// MaxAnnotations bounds the nvext.annotations entries kept per request.
const MaxAnnotations = 256

// Request is what routing reads from an OpenAI request body.
type Request struct {
	// Kind is the endpoint the body was parsed for.
	Kind Kind
	// Model is the requested model; may be empty only for KindOther.
	Model string
	// Stream is set for "stream": true.
	Stream bool
	// IncludeUsage is stream_options.include_usage: the worker sends a
	// final usage chunk only when both Stream and IncludeUsage are set.
	IncludeUsage bool
	// MaxTokens is max_completion_tokens if given, else max_tokens; 0 when
	// neither is given. Values above 2^31-1 are clamped to it.
	MaxTokens int
	// Messages are the chat messages (KindChat).
	Messages []Message
	// Prompts are the completion prompts given as text (KindCompletion):
	// one for a string prompt, several for an array of strings.
	Prompts []string
	// PromptTokenIDs are the completion prompts given as token ids: one
	// for an array of integers, several for an array of arrays.
	PromptTokenIDs [][]uint32
	// CacheSalt is the top-level cache_salt, else nvext.cache_salt; an
	// empty string counts as not given.
	CacheSalt string
	// NVExt is the request's nvext extension.
	NVExt NVExt
}

// TextLen returns the byte length of all prompt text: every message's
// Content for chat, every text prompt for completions. Token-id prompts,
// message names, tool calls and tool definitions are not counted. Use it
// for token estimates (about 4 bytes a token for English text).
func (r *Request) TextLen() int {
	n := 0
	for i := range r.Messages {
		n += len(r.Messages[i].Content)
	}
	for _, p := range r.Prompts {
		n += len(p)
	}
	return n
}

// Parse reads an OpenAI request body for the given kind.
//
// For KindChat and KindCompletion the body must be a JSON object with a
// non-empty string "model"; an empty body is ErrInvalidJSON. For KindOther
// only the JSON is checked and "model" read: an empty (or all-whitespace)
// body, or a body without a model, gives a Request with an empty Model and
// no error; whether that is acceptable is the caller's decision. Bodies that
// are not JSON (multipart uploads to /v1/audio/...) fail with
// ErrInvalidJSON, which callers should not treat as fatal for KindOther.
//
// Missing messages or prompt are not errors here: the worker reports them.
// On error the Request is nil and the error wraps ErrInvalidJSON (including
// ErrInvalidUTF8), ErrMissingModel or ErrInvalidField.
//
// body is neither modified nor retained.
func Parse(kind Kind, body []byte) (*Request, error) {
	first := firstByte(body)
	if first == 0 {
		if kind == KindOther {
			return &Request{Kind: kind}, nil
		}
		return nil, fmt.Errorf("%w: empty body", ErrInvalidJSON)
	}
	if err := checkJSON(body); err != nil {
		return nil, err
	}
	if first != '{' {
		return nil, fmt.Errorf("%w: the body is not a JSON object", ErrInvalidJSON)
	}
	p := parser{owner: newOwner(body), req: &Request{Kind: kind}}
	top := gjson.Parse(view(body))
	if err := eachField(top, p.topField); err != nil {
		return nil, err
	}
	r := p.req
	if r.Model == "" && kind != KindOther {
		return nil, &FieldError{Field: "model", Reason: "a non-empty string is required", Err: ErrMissingModel}
	}
	switch {
	case p.maxCompletionSet:
		r.MaxTokens = p.maxCompletion
	case p.maxTokensSet:
		r.MaxTokens = p.maxTokens
	}
	r.CacheSalt = p.salt
	if r.CacheSalt == "" {
		r.CacheSalt = r.NVExt.CacheSalt
	}
	return r, nil
}

// parser holds the state of one Parse call.
type parser struct {
	owner
	req *Request

	maxTokens, maxCompletion       int
	maxTokensSet, maxCompletionSet bool
	salt                           string
}

func (p *parser) topField(key string, v gjson.Result) error {
	r := p.req
	if key == "model" {
		switch v.Type {
		case gjson.String:
			r.Model = p.keep(v.Str)
		case gjson.Null:
			r.Model = ""
		default:
			return invalid("model", "want a string, got "+typeName(v))
		}
		return nil
	}
	if r.Kind == KindOther {
		return nil
	}
	switch key {
	case "stream":
		b, err := optBool("stream", v)
		r.Stream = b
		return err
	case "stream_options":
		return p.streamOptions(v)
	case "max_tokens":
		n, set, err := optCount(key, v)
		p.maxTokens, p.maxTokensSet = n, set
		return err
	case "max_completion_tokens":
		n, set, err := optCount(key, v)
		p.maxCompletion, p.maxCompletionSet = n, set
		return err
	case "cache_salt":
		switch v.Type {
		case gjson.String:
			p.salt = p.keep(v.Str)
		case gjson.Null:
			p.salt = ""
		default:
			return invalid("cache_salt", "want a string, got "+typeName(v))
		}
	case "nvext":
		r.NVExt = p.nvext(v)
	case "messages":
		if r.Kind == KindChat {
			return p.messages(v)
		}
	case "prompt":
		if r.Kind == KindCompletion {
			return p.prompt(v)
		}
	}
	return nil
}

func optBool(field string, v gjson.Result) (bool, error) {
	switch v.Type {
	case gjson.True:
		return true, nil
	case gjson.False, gjson.Null:
		return false, nil
	}
	return false, invalid(field, "want a boolean, got "+typeName(v))
}

// optCount reads an optional non-negative integer; null is "not given".
func optCount(field string, v gjson.Result) (int, bool, error) {
	if v.Type == gjson.Null {
		return 0, false, nil
	}
	n, ok := nonNegInt(v, maxCount)
	if !ok {
		if v.Type == gjson.Number {
			return 0, false, invalid(field, "want a non-negative integer, got "+v.Raw)
		}
		return 0, false, invalid(field, "want a non-negative integer, got "+typeName(v))
	}
	return n, true, nil
}

func (p *parser) streamOptions(v gjson.Result) error {
	switch {
	case v.Type == gjson.Null:
		p.req.IncludeUsage = false
		return nil
	case !v.IsObject():
		return invalid("stream_options", "want an object, got "+typeName(v))
	}
	p.req.IncludeUsage = false
	return eachField(v, func(key string, v gjson.Result) error {
		if key != "include_usage" {
			return nil
		}
		b, err := optBool("stream_options.include_usage", v)
		p.req.IncludeUsage = b
		return err
	})
}

func (p *parser) messages(v gjson.Result) error {
	r := p.req
	r.Messages = nil
	switch {
	case v.Type == gjson.Null:
		return nil
	case !v.IsArray():
		return invalid("messages", "want an array, got "+typeName(v))
	}
	r.Messages = []Message{}
	return eachElem(v, func(i int, m gjson.Result) error {
		if err := p.count("messages", 1); err != nil {
			return err
		}
		if !m.IsObject() {
			return invalid(index("messages", i), "want an object, got "+typeName(m))
		}
		r.Messages = append(r.Messages, Message{})
		msg := &r.Messages[len(r.Messages)-1]
		return eachField(m, func(key string, f gjson.Result) error {
			return p.messageField(msg, i, key, f)
		})
	})
}

func (p *parser) messageField(msg *Message, i int, key string, v gjson.Result) error {
	switch key {
	case "role":
		switch v.Type {
		case gjson.String:
			msg.Role = p.intern(v.Str)
		case gjson.Null:
			msg.Role = ""
		default:
			return invalid(index("messages", i)+".role", "want a string, got "+typeName(v))
		}
	case "name":
		switch v.Type {
		case gjson.String:
			msg.Name = p.keep(v.Str)
		case gjson.Null:
			msg.Name = ""
		default:
			return invalid(index("messages", i)+".name", "want a string, got "+typeName(v))
		}
	case "tool_calls":
		switch {
		case v.Type == gjson.Null:
			msg.HasToolCalls = false
		case v.IsArray():
			msg.HasToolCalls = !emptyArray(v.Raw)
		default:
			return invalid(index("messages", i)+".tool_calls", "want an array, got "+typeName(v))
		}
	case "content":
		msg.Content, msg.Parts = "", nil
		switch {
		case v.Type == gjson.String:
			msg.Content = p.keep(v.Str)
		case v.Type == gjson.Null:
		case v.IsArray():
			return p.parts(msg, i, v)
		default:
			return invalid(index("messages", i)+".content", "want a string, an array of content parts or null, got "+typeName(v))
		}
	}
	return nil
}

func (p *parser) parts(msg *Message, i int, v gjson.Result) error {
	msg.Parts = []ContentPart{}
	// Text-bearing parts are joined with "\n"; a single one is used as is.
	var joined strings.Builder
	texts := 0
	err := eachElem(v, func(j int, e gjson.Result) error {
		if err := p.count("messages", 1); err != nil {
			return err
		}
		var part ContentPart
		hasText := false
		switch {
		case e.Type == gjson.String:
			part, hasText = ContentPart{Type: "text", Text: p.keep(e.Str)}, true
		case e.IsObject():
			var err error
			if part, hasText, err = p.part(e, i, j); err != nil {
				return err
			}
		default:
			return invalid(fmt.Sprintf("messages[%d].content[%d]", i, j), "want an object or a string, got "+typeName(e))
		}
		msg.Parts = append(msg.Parts, part)
		if !hasText {
			return nil
		}
		switch texts {
		case 0:
			msg.Content = part.Text
		case 1:
			joined.WriteString(msg.Content)
			fallthrough
		default:
			joined.WriteByte('\n')
			joined.WriteString(part.Text)
		}
		texts++
		return nil
	})
	if texts > 1 {
		msg.Content = joined.String()
	}
	return err
}

// part reads one content-part object. hasText reports a text-bearing part
// whose text is a string (vLLM skips those whose text is null).
func (p *parser) part(e gjson.Result, i, j int) (part ContentPart, hasText bool, err error) {
	var text, refusal gjson.Result
	each(e, func(k string, v gjson.Result) bool {
		switch k {
		case "type":
			part.Type = ""
			if v.Type == gjson.String {
				part.Type = p.intern(v.Str)
			}
		case "text":
			text = v
		case "refusal":
			refusal = v
		}
		return true
	})
	src, name := text, "text"
	switch part.Type {
	case "text", "input_text", "output_text":
	case "refusal":
		src, name = refusal, "refusal"
	default:
		return part, false, nil
	}
	switch src.Type {
	case gjson.String:
		part.Text = p.keep(src.Str)
		return part, true, nil
	case gjson.Null:
		return part, false, nil
	}
	return part, false, invalid(fmt.Sprintf("messages[%d].content[%d].%s", i, j, name), "want a string, got "+typeName(src))
}

func (p *parser) prompt(v gjson.Result) error {
	r := p.req
	r.Prompts, r.PromptTokenIDs = nil, nil
	switch {
	case v.Type == gjson.Null:
		return nil
	case v.Type == gjson.String:
		if err := p.count("prompt", 1); err != nil {
			return err
		}
		r.Prompts = []string{p.keep(v.Str)}
		return nil
	case !v.IsArray():
		return invalid("prompt", "want a string, an array of strings, an array of token ids or an array of token-id arrays, got "+typeName(v))
	}
	switch firstByte(v.Raw[1:]) {
	case ']':
		return nil
	case '"':
		return eachElem(v, func(i int, e gjson.Result) error {
			if err := p.count("prompt", 1); err != nil {
				return err
			}
			if e.Type != gjson.String {
				return invalid(index("prompt", i), "want a string like the first element, got "+typeName(e))
			}
			r.Prompts = append(r.Prompts, p.keep(e.Str))
			return nil
		})
	case '[':
		return eachElem(v, func(i int, e gjson.Result) error {
			if err := p.count("prompt", 1); err != nil {
				return err
			}
			if !e.IsArray() {
				return invalid(index("prompt", i), "want an array of token ids like the first element, got "+typeName(e))
			}
			ids, j, ok := tokenArray(e.Raw)
			if !ok {
				return invalid(fmt.Sprintf("prompt[%d][%d]", i, j), "want a token id (an integer from 0 to 4294967295)")
			}
			r.PromptTokenIDs = append(r.PromptTokenIDs, ids)
			return nil
		})
	}
	if err := p.count("prompt", 1); err != nil {
		return err
	}
	ids, j, ok := tokenArray(v.Raw)
	if !ok {
		return invalid(index("prompt", j), "want a token id (an integer from 0 to 4294967295)")
	}
	r.PromptTokenIDs = [][]uint32{ids}
	return nil
}

// nvext reads the nvext extension; it never fails.
func (p *parser) nvext(v gjson.Result) NVExt {
	var nv NVExt
	if v.Type == gjson.Null {
		return nv
	}
	if !v.IsObject() {
		nv.ignore("nvext")
		return nv
	}
	_ = eachField(v, func(key string, v gjson.Result) error {
		switch key {
		case "annotations":
			nv.Annotations = nil
			switch {
			case v.Type == gjson.Null:
			case v.IsArray():
				each(v, func(_ string, e gjson.Result) bool {
					if e.Type != gjson.String {
						nv.ignore("nvext.annotations[]")
						return true
					}
					if len(nv.Annotations) == MaxAnnotations {
						nv.ignore("nvext.annotations")
						return false
					}
					nv.Annotations = append(nv.Annotations, p.keep(e.Str))
					return true
				})
			default:
				nv.ignore("nvext.annotations")
			}
		case "agent_hints":
			nv.AgentHints = AgentHints{}
			switch {
			case v.Type == gjson.Null:
			case v.IsObject():
				p.agentHints(&nv.AgentHints, v)
			default:
				nv.ignore("nvext.agent_hints")
			}
		case "cache_salt":
			nv.CacheSalt = ""
			switch v.Type {
			case gjson.String:
				nv.CacheSalt = p.keep(v.Str)
			case gjson.Null:
			default:
				nv.ignore("nvext.cache_salt")
			}
		}
		return nil
	})
	return nv
}

func (p *parser) agentHints(h *AgentHints, v gjson.Result) {
	each(v, func(k string, v gjson.Result) bool {
		raw := ""
		if v.Type != gjson.Null {
			raw = p.keep(v.Raw)
		}
		switch k {
		case "prefix_id":
			h.PrefixID = raw
		case "total_requests":
			h.TotalRequests = raw
		case "osl":
			h.OSL = raw
		case "iat":
			h.IAT = raw
		case "priority":
			h.Priority = raw
		case "latency_sensitivity":
			h.LatencySensitivity = raw
		case "ttft_slo_ms":
			h.TTFTSLOMillis = raw
		}
		return true
	})
}

func (nv *NVExt) ignore(name string) {
	for _, n := range nv.Ignored {
		if n == name {
			return
		}
	}
	nv.Ignored = append(nv.Ignored, name)
}

// ParseNVExt reads an nvext value on its own, given as raw JSON (an object,
// or null). Invalid or too deeply nested JSON gives an NVExt whose Ignored
// is ["nvext"]. Like Parse, it does not retain raw. It serves tests and
// callers that receive nvext outside a request body.
func ParseNVExt(raw []byte) NVExt {
	if firstByte(raw) == 0 {
		return NVExt{}
	}
	if checkJSON(raw) != nil {
		return NVExt{Ignored: []string{"nvext"}}
	}
	p := parser{owner: newOwner(raw)}
	return p.nvext(gjson.Parse(view(raw)))
}

func index(field string, i int) string {
	return field + "[" + strconv.Itoa(i) + "]"
}

// emptyArray reports whether raw JSON array text has no elements.
func emptyArray(raw string) bool {
	return firstByte(raw[1:]) == ']'
}
