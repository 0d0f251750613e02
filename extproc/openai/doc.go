// Package openai reads the parts of OpenAI-compatible requests and responses
// that routing needs, and nothing more.
//
// # Requests
//
// [Parse] reads a /v1/chat/completions or /v1/completions body (see [KindOf]):
// the model, streaming options, the output limit, the prompt text or token
// ids, the cache salt and Dynamo's nvext extension. The body is never
// re-marshalled; the proxy forwards the original bytes. Parse validates the
// whole body first (JSON syntax, nesting depth, UTF-8) and then walks the
// top-level object once with its own walk over the validated bytes, which
// hands out github.com/tidwall/gjson values, so a large prompt is scanned a
// small, fixed number of times.
//
// Parse reads body without copying it and without keeping a reference to it:
// every string in the returned [Request] is its own copy, so the caller may
// reuse or overwrite the body buffer as soon as Parse returns.
//
// JSON semantics follow the Python servers behind the proxy (vLLM, SGLang):
// when an object repeats a key, the last occurrence wins, and null means
// "not given" for every optional field. Fields are checked only as far as
// routing reads them: a value routing needs but cannot read (a model that is
// not a string, messages that are not an array, ...) is an error, anything
// else is left for the worker to judge. Errors wrap [ErrInvalidJSON],
// [ErrMissingModel] or [ErrInvalidField]; [FieldError] names the field.
//
// # Responses
//
// [ParseUsage] reads the token usage of a non-streaming JSON response.
// [StreamParser] follows a server-sent-events response incrementally, with
// bounded memory, and reports the first generated content (for time to first
// token), the final usage chunk and the end marker.
//
// # Concurrency
//
// Parse and ParseUsage are safe for concurrent use. A StreamParser belongs to
// one response stream and must not be used from several goroutines at once.
// The package has no package-level mutable state.
package openai
