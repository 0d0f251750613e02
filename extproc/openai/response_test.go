package openai

import (
	"strings"
	"testing"
)

func TestParseUsage(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		body   string
		want   Usage
		wantOK bool
	}{
		{
			name:   "vLLM chat response",
			body:   `{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"total_tokens":14,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}`,
			want:   Usage{PromptTokens: 12, CompletionTokens: 2, CachedTokens: 8},
			wantOK: true,
		},
		{
			name:   "no details",
			body:   `{"usage":{"prompt_tokens":5,"completion_tokens":0,"prompt_tokens_details":null}}`,
			want:   Usage{PromptTokens: 5, CompletionTokens: 0, CachedTokens: -1},
			wantOK: true,
		},
		{
			name:   "hostile counts",
			body:   `{"usage":{"prompt_tokens":-3,"completion_tokens":"7","prompt_tokens_details":{"cached_tokens":1e99}}}`,
			want:   Usage{PromptTokens: -1, CompletionTokens: -1, CachedTokens: 1<<31 - 1},
			wantOK: true,
		},
		{"empty usage object", `{"usage":{}}`, Usage{-1, -1, -1}, true},
		{"null usage", `{"usage":null}`, Usage{-1, -1, -1}, false},
		{"no usage", `{"choices":[]}`, Usage{-1, -1, -1}, false},
		{"nested usage only", `{"choices":[{"usage":{"prompt_tokens":1}}]}`, Usage{-1, -1, -1}, false},
		{"not an object", `[{"usage":{"prompt_tokens":1}}]`, Usage{-1, -1, -1}, false},
		{"truncated", `{"usage":{"prompt_tokens":1`, Usage{-1, -1, -1}, false},
		{"empty", ``, Usage{-1, -1, -1}, false},
		{"deep", `{"usage":{"prompt_tokens":1},"x":` + strings.Repeat("[", 1<<20) + `}`, Usage{-1, -1, -1}, false},
		{"last usage wins", `{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}`, Usage{2, -1, -1}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, ok := ParseUsage([]byte(tt.body))
			if got != tt.want || ok != tt.wantOK {
				t.Errorf("ParseUsage = %+v, %v; want %+v, %v", got, ok, tt.want, tt.wantOK)
			}
		})
	}
}
