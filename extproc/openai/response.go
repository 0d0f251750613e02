package openai

import (
	"github.com/tidwall/gjson"
)

// Usage is the token accounting a worker reports. A field is -1 when the
// worker did not report it (or reported something that is not a
// non-negative integer).
type Usage struct {
	// PromptTokens is usage.prompt_tokens.
	PromptTokens int
	// CompletionTokens is usage.completion_tokens.
	CompletionTokens int
	// CachedTokens is usage.prompt_tokens_details.cached_tokens: prompt
	// tokens served from the prefix cache (vLLM reports it with
	// --enable-prompt-tokens-details; SGLang always).
	CachedTokens int
}

// unreported returns a Usage with nothing reported.
func unreported() Usage {
	return Usage{PromptTokens: -1, CompletionTokens: -1, CachedTokens: -1}
}

// ParseUsage reads the top-level "usage" object of a non-streaming JSON
// response. ok is false when the body is not a valid JSON object or has no
// usage object (absent or null). The body is not retained.
func ParseUsage(body []byte) (u Usage, ok bool) {
	if firstByte(body) != '{' || !wellFormed(body) {
		return unreported(), false
	}
	return usageOf(gjson.Parse(view(body)))
}

// usageOf reads the last non-null "usage" member of a top-level object.
func usageOf(top gjson.Result) (Usage, bool) {
	var uv gjson.Result
	each(top, func(k string, v gjson.Result) bool {
		if k == "usage" {
			uv = v
		}
		return true
	})
	if !uv.IsObject() {
		return unreported(), false
	}
	return readUsage(uv), true
}

func readUsage(v gjson.Result) Usage {
	u := unreported()
	each(v, func(k string, v gjson.Result) bool {
		switch k {
		case "prompt_tokens":
			u.PromptTokens = count(v)
		case "completion_tokens":
			u.CompletionTokens = count(v)
		case "prompt_tokens_details":
			u.CachedTokens = -1
			if v.IsObject() {
				each(v, func(k string, v gjson.Result) bool {
					if k == "cached_tokens" {
						u.CachedTokens = count(v)
					}
					return true
				})
			}
		}
		return true
	})
	return u
}

// count reads a usage count, -1 when it is not a non-negative integer.
func count(v gjson.Result) int {
	if n, ok := nonNegInt(v, maxCount); ok {
		return n
	}
	return -1
}
