package openai

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/tidwall/gjson"
)

// chatBody builds a realistic multi-turn chat request of about size bytes:
// a system prompt, then user and assistant turns of prose and code with the
// newlines, quotes and tabs that JSON escapes, and nvext hints.
func chatBody(size int) []byte {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	req := struct {
		Model         string         `json:"model"`
		Messages      []msg          `json:"messages"`
		Stream        bool           `json:"stream"`
		StreamOptions map[string]any `json:"stream_options"`
		MaxTokens     int            `json:"max_tokens"`
		Temperature   float64        `json:"temperature"`
		NVExt         map[string]any `json:"nvext"`
	}{
		Model:         "Qwen/Qwen3-8B",
		Messages:      []msg{{"system", "You are a careful coding assistant.\nAnswer with \"code\" and short explanations."}},
		Stream:        true,
		StreamOptions: map[string]any{"include_usage": true},
		MaxTokens:     512,
		Temperature:   0.7,
		NVExt:         map[string]any{"annotations": []string{"prefix_id:agent-42"}, "agent_hints": map[string]any{"osl": 300, "iat": 250}},
	}
	turn := "Here is the function:\n\tfunc add(a, b int) int {\n\t\treturn a + b // \"sum\"\n\t}\nIt returns the sum of its arguments, and caf\u00e9 is a word. "
	for i := 0; ; i++ {
		b, _ := json.Marshal(req)
		if len(b) >= size {
			return b[:len(b):len(b)]
		}
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		n := min(len(turn)*8, size-len(b))
		req.Messages = append(req.Messages, msg{role, strings.Repeat(turn, n/len(turn)+1)[:max(n-40, 1)]})
	}
}

// BenchmarkParse measures Parse on chat bodies of 4 KB and 256 KB. Compare
// runs with benchstat:
//
//	go test -run '^$' -bench Parse -benchmem -count 6 ./extproc/openai/ > new.txt
//	benchstat old.txt new.txt
func BenchmarkParse(b *testing.B) {
	for _, size := range []int{4 << 10, 256 << 10} {
		body := chatBody(size)
		b.Run(fmt.Sprintf("body=%dKB", size>>10), func(b *testing.B) {
			if _, err := Parse(KindChat, body); err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if _, err := Parse(KindChat, body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkStreamParser measures Feed on a vLLM chat stream.
func BenchmarkStreamParser(b *testing.B) {
	stream := []byte(strings.Repeat(vllmChatStream[:strings.Index(vllmChatStream, "data: [DONE]")], 50))
	b.ReportAllocs()
	b.SetBytes(int64(len(stream)))
	for b.Loop() {
		p := NewStreamParser(0)
		p.Feed(stream)
	}
}

// BenchmarkCheckJSON compares, in one run, checkJSON's single pass with
// the three passes it replaced (tooDeep, gjson's validator, utf8.Valid) on
// BenchmarkParse's bodies.
//
//	go test -run '^$' -bench CheckJSON -benchmem -count 6 ./extproc/openai/
func BenchmarkCheckJSON(b *testing.B) {
	impls := []struct {
		name  string
		check func([]byte) bool
	}{
		{"onepass", func(body []byte) bool { return checkJSON(body) == nil }},
		{"threepass", func(body []byte) bool {
			return !tooDeep(body, MaxDepth) && gjson.ValidBytes(body) && utf8.Valid(body)
		}},
	}
	for _, size := range []int{4 << 10, 256 << 10} {
		body := chatBody(size)
		for _, impl := range impls {
			b.Run(fmt.Sprintf("body=%dKB/impl=%s", size>>10, impl.name), func(b *testing.B) {
				b.SetBytes(int64(len(body)))
				for b.Loop() {
					if !impl.check(body) {
						b.Fatal("rejected")
					}
				}
			})
		}
	}
}
