package openai

import "github.com/tidwall/gjson"

// Paths of the two kinds, as a data plane that sends no path is taken to
// have asked for (see [KindOfBody]).
const (
	PathChat       = "/v1/chat/completions"
	PathCompletion = "/v1/completions"
)

// KindOfBody classifies a request that came without any path (a data
// plane such as NGINX Gateway Fabric's endpoint picker shim sends none):
// a body whose top-level object has "messages" is a chat request, any
// other body a completion request, the default of GIE's and llm-d's
// endpoint pickers. The body is not validated here: [Parse] does that for
// the kind returned, so a body that is not JSON, or has no "prompt",
// becomes the completion request's 400. Top-level keys are found without
// recursion, whatever the nesting below them.
func KindOfBody(body []byte) Kind {
	if gjson.GetBytes(body, "messages").Exists() {
		return KindChat
	}
	return KindCompletion
}

// Path returns the path of KindChat and KindCompletion, "" for KindOther.
func (k Kind) Path() string {
	switch k {
	case KindChat:
		return PathChat
	case KindCompletion:
		return PathCompletion
	}
	return ""
}
