// Package chat renders OpenAI chat messages into a prompt string with a
// Hugging Face chat template, the way a vLLM worker does before tokenizing.
//
// # Overview
//
// A [Template] is compiled once from the chat_template of a model's
// tokenizer_config.json ([FromTokenizerConfig] or [Compile]) and rendered per
// request with [Template.Render]. Rendering follows transformers'
// apply_chat_template: trim_blocks, lstrip_blocks, loop controls,
// raise_exception, strftime_now, and tojson as json.dumps with
// ensure_ascii=False (", " and ": " separators, indent, key order kept). The
// template sees messages, tools (none when absent), documents (none),
// add_generation_prompt, bos_token, eos_token and [Input.Extra].
//
// Messages are prepared as vLLM's parse_chat_messages does:
//   - content is a string for [FormatString] templates (text parts joined
//     with "\n", other parts dropped) and a list of parts for [FormatOpenAI]
//     templates (a string becomes one text part); missing content is "" or
//     an empty list;
//   - an assistant's tool_calls are kept, with function.arguments decoded
//     from a JSON string into an object ("" or missing becomes {});
//   - reasoning_content is copied to reasoning and reasoning_content;
//     tool_call_id is kept for tool messages, name for any message.
//
// [Template.ContentFormat] reproduces vLLM's chat_template_content_format
// "auto" detection (_detect_content_format): "openai" when the template has
// a for loop over <message>.content or <message>['content'] (possibly through
// filters, tests or slices), where <message> is the target of a for loop
// over messages or over a variable assigned from messages (followed
// transitively, as vLLM's breadth-first search does); "string" otherwise.
// vLLM walks Jinja's AST; this package applies the same rules to the
// statement text, since the engine does not expose assignments. The tests
// compare both detections on every template they render.
//
// Object key order matters to tojson. Pass tools, tool calls and content
// parts as json.RawMessage to keep the request's order; Go maps are
// rendered with sorted keys.
//
// # Engine
//
// The engine is github.com/nikolalohinski/gonja/v2 (a maintained Go Jinja2
// implementation). Where it disagrees with Python Jinja2 on what chat
// templates use, this package overrides it: tojson; str.strip, lstrip,
// rstrip (gonja fails without an argument), replace (gonja requires count)
// and split (no separator); dict keys/values/items/get (gonja sorts keys);
// lstrip_blocks (gonja also strips before tags in the middle of a line). It
// registers raise_exception and strftime_now. Templates are compiled with a
// loader that holds only the template, so include/import/extends cannot read
// files.
//
// Subscripts: gonja returns none for x[-len(x)] (so x[-1] on a one-element
// list, as str.split gives when the separator is absent: Qwen3's
// reasoning_content extraction) and indexes strings by byte. Before parsing,
// every subscript whose index is not a string literal is rewritten (from
// gonja's own tokens) into a call of a registered global with Python's
// indexing; the lists this package creates index correctly by themselves,
// so x.split(s)[i] is left to the engine (see subscript.go). These lists
// also print as Python's str(list), items in repr(): Kimi-K2 prints content
// parts with {{ message['content'] }}.
//
// Known differences that remain (asserted in testdata/probes.json):
// the default filter also replaces none; `x in y|f` parses as `(x in y)|f`;
// ** on integers gives a float; {{ none }} prints ""; a method called on a
// parenthesised expression, (x).upper(), fails; a dict printed with {{ }}
// shows its strings without repr(). The Qwen3, Llama 3, Kimi-K2 and
// Mistral-Instruct templates do not hit them.
//
// # Fast paths
//
// The templates of Qwen3, Meta-Llama-3-Instruct and Mistral-7B-Instruct
// v0.1, recognised by the SHA-256 of their exact source, also have a Go
// implementation ([Template.FastPath]) that [Template.Render] uses for the
// inputs it reproduces exactly (no tools, no tool calls, known kwargs,
// input the engine accepts); it declines anything else, and the engine
// renders it, so every error still comes from the engine. The tests hold
// it to the engine's and Python Jinja2's output on the oracle corpus and
// to the engine's on random conversations (FuzzFastPath).
// [Template.Stats] counts renders by path.
//
// # Errors
//
// A template the engine cannot parse or execute gives an error wrapping
// [ErrUnsupported]: the caller should fall back (for example, count tokens
// without a template). A template that rejects the request through
// raise_exception gives an error wrapping [ErrRender] whose text ends with
// the template's own message. Malformed input (a message without a role,
// content that is neither a string nor parts, invalid tool-call arguments,
// nesting beyond [MaxDepth], output beyond [Input.MaxOutputBytes]) wraps
// [ErrInvalidInput]. An engine panic is recovered and wraps ErrUnsupported.
//
// # Concurrency
//
// A [Template] is immutable after compilation; Render may be called from
// many goroutines at once. Rendering does no I/O. The context is checked
// before rendering and at every write of output, so a template loop that
// writes nothing is not interrupted: templates are trusted configuration,
// only messages come from clients.
package chat
