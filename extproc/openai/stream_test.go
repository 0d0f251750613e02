package openai

import (
	"strings"
	"testing"
)

// vllmChatStream is a chat stream as vLLM sends it with
// stream_options.include_usage: a role chunk with empty content, content
// chunks, a finish chunk and a final usage chunk with no choices.
const vllmChatStream = `data: {"id":"chatcmpl-9f","object":"chat.completion.chunk","created":1730000000,"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}

data: {"id":"chatcmpl-9f","object":"chat.completion.chunk","created":1730000000,"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}],"usage":null}

data: {"id":"chatcmpl-9f","object":"chat.completion.chunk","created":1730000000,"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"content":", world\n\n"},"logprobs":null,"finish_reason":null}],"usage":null}

data: {"id":"chatcmpl-9f","object":"chat.completion.chunk","created":1730000000,"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"content":""},"logprobs":null,"finish_reason":"stop","stop_reason":null}],"usage":null}

data: {"id":"chatcmpl-9f","object":"chat.completion.chunk","created":1730000000,"model":"Qwen/Qwen3-0.6B","choices":[],"usage":{"prompt_tokens":21,"total_tokens":25,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":16}}}

data: [DONE]

`

// streamResult is everything a StreamParser reports.
type streamResult struct {
	Usage                        Usage
	HasUsage, Done, Failed       bool
	Events, Oversized, Malformed int
	FirstContent                 int // Feed calls that returned true
}

func resultOf(p *StreamParser, first int) streamResult {
	u, ok := p.Usage()
	return streamResult{u, ok, p.Done(), p.Failed(), p.Events(), p.Oversized(), p.Malformed(), first}
}

// feedAll feeds the chunks and returns the result and the index of the chunk
// whose Feed returned true (-1 if none).
func feedAll(maxEvent int, chunks ...[]byte) (streamResult, int) {
	p := NewStreamParser(maxEvent)
	firsts, at := 0, -1
	for i, c := range chunks {
		if p.Feed(c) {
			firsts++
			at = i
		}
	}
	return resultOf(p, firsts), at
}

// completingOffset returns the offset of the byte that completes the event
// containing marker: the line end of the blank line after it.
func completingOffset(t *testing.T, stream, marker string) int {
	t.Helper()
	i := strings.Index(stream, marker)
	if i < 0 {
		t.Fatalf("marker %q not in stream", marker)
	}
	for _, sep := range []string{"\r\n\r\n", "\n\n", "\r\r", "\n\r", "\r\n\r", "\n\r\n"} {
		if j := strings.Index(stream[i:], sep); j >= 0 {
			// The blank line's end is the last byte of sep that ends a
			// line: for "\r\n\r\n" it is the second '\r'.
			switch sep {
			case "\r\n\r\n":
				return i + j + 2
			default:
				return i + j + len(sep) - 1
			}
		}
	}
	t.Fatalf("no event end after %q", marker)
	return 0
}

func TestStreamParserVLLM(t *testing.T) {
	t.Parallel()
	want := streamResult{
		Usage:    Usage{PromptTokens: 21, CompletionTokens: 4, CachedTokens: 16},
		HasUsage: true, Done: true, Events: 6, FirstContent: 1,
	}
	variants := map[string]string{
		"LF":   vllmChatStream,
		"CRLF": strings.ReplaceAll(vllmChatStream, "\n", "\r\n"),
		"CR":   strings.ReplaceAll(vllmChatStream, "\n", "\r"),
	}
	for name, stream := range variants {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			first := completingOffset(t, stream, `"Hello"`)
			whole, _ := feedAll(0, []byte(stream))
			if whole != want {
				t.Fatalf("single Feed = %+v, want %+v", whole, want)
			}
			// Two chunks, split at every offset.
			for cut := 0; cut <= len(stream); cut++ {
				got, at := feedAll(0, []byte(stream[:cut]), []byte(stream[cut:]))
				if got != want {
					t.Fatalf("split at %d: %+v, want %+v", cut, got, want)
				}
				wantAt := 0
				if first >= cut {
					wantAt = 1
				}
				if at != wantAt {
					t.Fatalf("split at %d: first content on chunk %d, want %d (event completes at byte %d)", cut, at, wantAt, first)
				}
			}
			// One byte at a time.
			chunks := make([][]byte, len(stream))
			for i := range chunks {
				chunks[i] = []byte{stream[i]}
			}
			got, at := feedAll(0, chunks...)
			if got != want || at != first {
				t.Fatalf("byte by byte: %+v at byte %d, want %+v at byte %d", got, at, want, first)
			}
		})
	}
}

func TestStreamParser(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		maxEvent int
		stream   string
		want     streamResult
	}{
		{
			name:   "completions text",
			stream: "data: {\"choices\":[{\"index\":0,\"text\":\"\"}]}\n\ndata: {\"choices\":[{\"index\":0,\"text\":\" the\"}]}\n\ndata: [DONE]\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Done: true, Events: 3, FirstContent: 1},
		},
		{
			name:   "reasoning content counts",
			stream: "data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hmm\"}}]}\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 1, FirstContent: 1},
		},
		{
			name:   "reasoning (newer vLLM) counts",
			stream: "data: {\"choices\":[{\"delta\":{\"reasoning\":\"hmm\"}}]}\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 1, FirstContent: 1},
		},
		{
			name:   "tool calls count",
			stream: "data: {\"choices\":[{\"delta\":{\"content\":null,\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"f\"}}]}}]}\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 1, FirstContent: 1},
		},
		{
			name:   "empty tool calls and role-only deltas do not count",
			stream: "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"tool_calls\":[]}}]}\n\ndata: {\"choices\":[{\"delta\":{}}]}\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 2},
		},
		{
			name:   "content in a later choice",
			stream: "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\"}},{\"index\":1,\"delta\":{\"content\":\"x\"}}]}\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 1, FirstContent: 1},
		},
		{
			name:   "first content reported once",
			stream: "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 2, FirstContent: 1},
		},
		{
			name:   "multi-line data joined with LF",
			stream: "data: {\"choices\":\ndata: [{\"delta\":{\"content\":\"x\"}}]}\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 1, FirstContent: 1},
		},
		{
			name:   "comments, other fields and no space after colon",
			stream: ": keep-alive\nevent: message\nid: 7\nretry: 100\ndata:{\"usage\":{\"prompt_tokens\":3}}\n\n:\n\n",
			want:   streamResult{Usage: Usage{3, -1, -1}, HasUsage: true, Events: 1},
		},
		{
			name:   "only one leading space is removed",
			stream: "data:  [DONE]\n\ndata:[DONE]\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Done: true, Events: 2},
		},
		{
			name:   "field names are exact",
			stream: "Data: [DONE]\n\ndatax: [DONE]\n\n data: [DONE]\n\ndat: [DONE]\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}},
		},
		{
			name:   "empty data is no event; two empty lines are",
			stream: "data:\n\ndata\n\ndata\ndata\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 1, Malformed: 1},
		},
		{
			name:   "malformed events are counted and skipped",
			stream: "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]\n\ndata: 42\n\ndata: not json\n\ndata: {\"usage\":{\"prompt_tokens\":1}}\n\n",
			want:   streamResult{Usage: Usage{1, -1, -1}, HasUsage: true, Events: 4, Malformed: 3},
		},
		{
			name:     "oversized event skipped, the next one read",
			maxEvent: 64,
			stream:   "data: {\"choices\":[{\"delta\":{\"content\":\"" + strings.Repeat("x", 100) + "\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"y\"}}]}\n\n",
			want:     streamResult{Usage: Usage{-1, -1, -1}, Events: 2, Oversized: 1, FirstContent: 1},
		},
		{
			name:     "limit counts joined lines",
			maxEvent: 9,
			stream:   "data: 1234\ndata: 5678\n\ndata: 12345\ndata: 6789\n\n",
			want:     streamResult{Usage: Usage{-1, -1, -1}, Events: 2, Oversized: 1, Malformed: 1},
		},
		{
			name:   "last usage wins, null usage ignored",
			stream: "data: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: {\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\ndata: {\"usage\":null}\n\n",
			want:   streamResult{Usage: Usage{1, 2, -1}, HasUsage: true, Events: 3},
		},
		{
			name:   "mid-stream error",
			stream: "data: {\"error\":{\"message\":\"boom\",\"type\":\"InternalServerError\",\"code\":500}}\n\ndata: [DONE]\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Failed: true, Done: true, Events: 2},
		},
		{
			name:   "old vLLM error object",
			stream: "data: {\"object\":\"error\",\"message\":\"boom\"}\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Failed: true, Events: 1},
		},
		{
			name:   "unterminated last event is discarded",
			stream: "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}},
		},
		{
			name:   "deep event is malformed",
			stream: "data: {\"a\":" + strings.Repeat("[", 5000) + "\n\n",
			want:   streamResult{Usage: Usage{-1, -1, -1}, Events: 1, Malformed: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, _ := feedAll(tt.maxEvent, []byte(tt.stream))
			if got != tt.want {
				t.Errorf("got %+v\nwant %+v", got, tt.want)
			}
			for cut := 0; cut <= len(tt.stream); cut++ {
				split, _ := feedAll(tt.maxEvent, []byte(tt.stream[:cut]), []byte(tt.stream[cut:]))
				if split != got {
					t.Fatalf("split at %d: %+v, want %+v", cut, split, got)
				}
			}
		})
	}
}

func TestStreamParserZeroValue(t *testing.T) {
	t.Parallel()
	var p StreamParser
	if !p.Feed([]byte(vllmChatStream)) || !p.Done() {
		t.Fatal("zero StreamParser did not parse the stream")
	}
	if _, ok := p.Usage(); !ok {
		t.Fatal("no usage")
	}
}

// The event buffer stays bounded whatever the stream does.
func TestStreamParserBoundedMemory(t *testing.T) {
	t.Parallel()
	p := NewStreamParser(1 << 10)
	line := []byte(strings.Repeat("x", 4096))
	p.Feed([]byte("data: "))
	for range 1000 {
		p.Feed(line)
		if cap(p.buf) > 1<<10 {
			t.Fatalf("buffer grew to %d bytes", cap(p.buf))
		}
	}
	p.Feed([]byte("\n\n"))
	if p.Oversized() != 1 || p.Events() != 1 {
		t.Fatalf("oversized=%d events=%d, want 1, 1", p.Oversized(), p.Events())
	}
	// Ignored lines are never buffered, however long.
	p.Feed([]byte(": "))
	for range 1000 {
		p.Feed(line)
	}
	if cap(p.buf) > 1<<10 {
		t.Fatalf("buffer grew to %d bytes on a comment", cap(p.buf))
	}
}
