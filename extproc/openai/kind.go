package openai

import "strings"

// Kind is the OpenAI endpoint a request was sent to.
type Kind uint8

// Request kinds.
const (
	// KindOther is any path that is not one of the two below (models,
	// embeddings, responses, ...): only "model" is read, and it is optional.
	KindOther Kind = iota
	// KindChat is POST /v1/chat/completions.
	KindChat
	// KindCompletion is POST /v1/completions.
	KindCompletion
)

// String returns "chat", "completion" or "other".
func (k Kind) String() string {
	switch k {
	case KindChat:
		return "chat"
	case KindCompletion:
		return "completion"
	}
	return "other"
}

// KindOf classifies an HTTP path (Envoy's :path, query included). The match
// is exact and case-sensitive after the query string is cut: a trailing
// slash or a prefix such as /openai/v1/... gives KindOther.
func KindOf(path string) Kind {
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	switch path {
	case "/v1/chat/completions":
		return KindChat
	case "/v1/completions":
		return KindCompletion
	}
	return KindOther
}
