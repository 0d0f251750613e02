package openai

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestKindOf(t *testing.T) {
	t.Parallel()
	tests := []struct {
		path string
		want Kind
	}{
		{"/v1/chat/completions", KindChat},
		{"/v1/chat/completions?api-version=1", KindChat},
		{"/v1/completions", KindCompletion},
		{"/v1/completions?", KindCompletion},
		{"/v1/models", KindOther},
		{"/v1/chat/completions/", KindOther},
		{"/V1/chat/completions", KindOther},
		{"/openai/v1/chat/completions", KindOther},
		{"", KindOther},
		{"?/v1/completions", KindOther},
		// Classified on the cleaned path.
		{"/v1/chat/completions/../models", KindOther},
		{"/v1/chat/completions/../../completions", KindCompletion},
		{"/v1/models/../chat/completions?x=1", KindChat},
		{"//v1//chat/completions", KindChat},
		{"/v1/./completions", KindCompletion},
		{"/v1/chat/%63ompletions", KindChat},
		{"/v1/chat/completions%2F", KindOther},
		{"/v1/x/%2e%2e/completions", KindOther},
	}
	for _, tt := range tests {
		if got := KindOf(tt.path); got != tt.want {
			t.Errorf("KindOf(%q) = %v, want %v", tt.path, got, tt.want)
		}
	}
}

func TestParse(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		kind Kind
		body string
		want *Request
	}{
		{
			name: "chat string content",
			kind: KindChat,
			body: `{"model":"qwen3","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi\nthere \"you\" \u00e9"}]}`,
			want: &Request{Kind: KindChat, Model: "qwen3", Messages: []Message{
				{Role: "system", Content: "Be brief."},
				{Role: "user", Content: "Hi\nthere \"you\" é"},
			}},
		},
		{
			name: "chat content parts",
			kind: KindChat,
			body: `{"model":"m","messages":[{"role":"user","name":"bob","content":[
				{"type":"text","text":"What is"},
				{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},
				"in this",
				{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}},
				{"type":"text","text":"picture?"},
				{"type":"refusal","refusal":"no"},
				{"type":"text","text":null}]}]}`,
			want: &Request{Kind: KindChat, Model: "m", Messages: []Message{{
				Role: "user", Name: "bob",
				Content: "What is\nin this\npicture?\nno",
				Parts: []ContentPart{
					{Type: "text", Text: "What is"},
					{Type: "image_url"},
					{Type: "text", Text: "in this"},
					{Type: "input_audio"},
					{Type: "text", Text: "picture?"},
					{Type: "refusal", Text: "no"},
					{Type: "text"},
				},
			}}},
		},
		{
			name: "single text part is used as is",
			kind: KindChat,
			body: `{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"describe"}]}]}`,
			want: &Request{Kind: KindChat, Model: "m", Messages: []Message{{
				Role: "user", Content: "describe",
				Parts: []ContentPart{{Type: "image_url"}, {Type: "text", Text: "describe"}},
			}}},
		},
		{
			name: "empty parts and empty text parts",
			kind: KindChat,
			body: `{"model":"m","messages":[{"role":"user","content":[]},{"role":"user","content":[{"type":"text","text":""},{"type":"text","text":"a"}]}]}`,
			want: &Request{Kind: KindChat, Model: "m", Messages: []Message{
				{Role: "user", Parts: []ContentPart{}},
				{Role: "user", Content: "\na", Parts: []ContentPart{{Type: "text"}, {Type: "text", Text: "a"}}},
			}},
		},
		{
			name: "assistant tool calls with null content",
			kind: KindChat,
			body: `{"model":"m","messages":[
				{"role":"user","content":"weather?"},
				{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get","arguments":"{}"}}]},
				{"role":"tool","tool_call_id":"c1","content":"sunny"},
				{"role":"assistant","tool_calls":[]},
				{"role":"assistant","tool_calls":null}]}`,
			want: &Request{Kind: KindChat, Model: "m", Messages: []Message{
				{Role: "user", Content: "weather?"},
				{Role: "assistant", HasToolCalls: true},
				{Role: "tool", Content: "sunny"},
				{Role: "assistant"},
				{Role: "assistant"},
			}},
		},
		{
			name: "stream options and max tokens",
			kind: KindChat,
			body: `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":100,"messages":[]}`,
			want: &Request{Kind: KindChat, Model: "m", Stream: true, IncludeUsage: true, MaxTokens: 100, Messages: []Message{}},
		},
		{
			name: "max_completion_tokens wins over max_tokens in either order",
			kind: KindChat,
			body: `{"model":"m","max_completion_tokens":7,"max_tokens":100}`,
			want: &Request{Kind: KindChat, Model: "m", MaxTokens: 7},
		},
		{
			name: "null max_completion_tokens falls back to max_tokens",
			kind: KindChat,
			body: `{"model":"m","max_tokens":100,"max_completion_tokens":null}`,
			want: &Request{Kind: KindChat, Model: "m", MaxTokens: 100},
		},
		{
			name: "integral number forms and clamping",
			kind: KindCompletion,
			body: `{"model":"m","max_tokens":1.5e3,"max_completion_tokens":1e30}`,
			want: &Request{Kind: KindCompletion, Model: "m", MaxTokens: 1<<31 - 1},
		},
		{
			name: "nulls mean not given",
			kind: KindChat,
			body: `{"model":"m","stream":null,"stream_options":null,"max_tokens":null,"messages":null,"cache_salt":null,"nvext":null}`,
			want: &Request{Kind: KindChat, Model: "m"},
		},
		{
			name: "last duplicate key wins, as in Python",
			kind: KindChat,
			body: `{"model":"a","stream":true,"messages":[{"role":"user","content":"x"}],"model":"b","stream":false,"messages":[{"role":"user","content":"y","content":"z"}]}`,
			want: &Request{Kind: KindChat, Model: "b", Messages: []Message{{Role: "user", Content: "z"}}},
		},
		{
			name: "escaped keys are unescaped",
			kind: KindChat,
			body: `{"mo\u0064el":"m\u00fc","me\u0073sages":[{"r\u006fle":"user","content":"x"}]}`,
			want: &Request{Kind: KindChat, Model: "mü", Messages: []Message{{Role: "user", Content: "x"}}},
		},
		{
			name: "completion string prompt",
			kind: KindCompletion,
			body: `{"model":"m","prompt":"Once upon a time","max_tokens":16}`,
			want: &Request{Kind: KindCompletion, Model: "m", Prompts: []string{"Once upon a time"}, MaxTokens: 16},
		},
		{
			name: "completion prompt array of strings",
			kind: KindCompletion,
			body: `{"model":"m","prompt":[ "a", "bc" ]}`,
			want: &Request{Kind: KindCompletion, Model: "m", Prompts: []string{"a", "bc"}},
		},
		{
			name: "completion prompt token ids",
			kind: KindCompletion,
			body: `{"model":"m","prompt":[1, 2 ,3,4294967295, 0]}`,
			want: &Request{Kind: KindCompletion, Model: "m", PromptTokenIDs: [][]uint32{{1, 2, 3, 4294967295, 0}}},
		},
		{
			name: "completion prompt arrays of token ids",
			kind: KindCompletion,
			body: `{"model":"m","prompt":[[1,2],[],[ 3 ]]}`,
			want: &Request{Kind: KindCompletion, Model: "m", PromptTokenIDs: [][]uint32{{1, 2}, {}, {3}}},
		},
		{
			name: "completion empty prompt array",
			kind: KindCompletion,
			body: `{"model":"m","prompt":[ ]}`,
			want: &Request{Kind: KindCompletion, Model: "m"},
		},
		{
			name: "chat ignores prompt, completion ignores messages",
			kind: KindCompletion,
			body: `{"model":"m","messages":5,"prompt":"p"}`,
			want: &Request{Kind: KindCompletion, Model: "m", Prompts: []string{"p"}},
		},
		{
			name: "top-level cache_salt wins over nvext",
			kind: KindChat,
			body: `{"model":"m","nvext":{"cache_salt":"inner"},"cache_salt":"outer"}`,
			want: &Request{Kind: KindChat, Model: "m", CacheSalt: "outer", NVExt: NVExt{CacheSalt: "inner"}},
		},
		{
			name: "nvext cache_salt when top-level is absent or empty",
			kind: KindChat,
			body: `{"model":"m","cache_salt":"","nvext":{"cache_salt":"inner"}}`,
			want: &Request{Kind: KindChat, Model: "m", CacheSalt: "inner", NVExt: NVExt{CacheSalt: "inner"}},
		},
		{
			name: "nvext annotations and agent hints",
			kind: KindChat,
			body: `{"model":"m","nvext":{"annotations":["prefix_id:s1","total_requests:4",7,"osl:HIGH"],
				"agent_hints":{"prefix_id":"s2","total_requests":12,"osl":300,"iat":null,"priority":-1,"latency_sensitivity":0.5,"other":true}}}`,
			want: &Request{Kind: KindChat, Model: "m", NVExt: NVExt{
				Annotations: []string{"prefix_id:s1", "total_requests:4", "osl:HIGH"},
				AgentHints:  AgentHints{PrefixID: `"s2"`, TotalRequests: "12", OSL: "300", Priority: "-1", LatencySensitivity: "0.5"},
				Ignored:     []string{"nvext.annotations[]"},
			}},
		},
		{
			name: "nvext of wrong types never fails",
			kind: KindChat,
			body: `{"model":"m","nvext":{"annotations":"x","agent_hints":[1],"cache_salt":5}}`,
			want: &Request{Kind: KindChat, Model: "m", NVExt: NVExt{
				Ignored: []string{"nvext.annotations", "nvext.agent_hints", "nvext.cache_salt"},
			}},
		},
		{
			name: "nvext not an object",
			kind: KindChat,
			body: `{"model":"m","nvext":"x"}`,
			want: &Request{Kind: KindChat, Model: "m", NVExt: NVExt{Ignored: []string{"nvext"}}},
		},
		{
			name: "other kind reads only the model",
			kind: KindOther,
			body: `{"model":"emb","input":"x","stream":"not checked","messages":1}`,
			want: &Request{Kind: KindOther, Model: "emb"},
		},
		{
			name: "other kind without model",
			kind: KindOther,
			body: `{"input":"x"}`,
			want: &Request{Kind: KindOther},
		},
		{
			name: "other kind empty body",
			kind: KindOther,
			body: "",
			want: &Request{Kind: KindOther},
		},
		{
			name: "other kind whitespace body",
			kind: KindOther,
			body: " \r\n\t",
			want: &Request{Kind: KindOther},
		},
		{
			name: "surrounding whitespace",
			kind: KindChat,
			body: "\n\t {\"model\" : \"m\" } \r\n",
			want: &Request{Kind: KindChat, Model: "m"},
		},
		{
			name: "unknown fields and role left as sent",
			kind: KindChat,
			body: `{"model":"m","temperature":0.2,"tools":[{"type":"function"}],"messages":[{"role":"narrator","content":"x","extra":{"a":[1]}}]}`,
			want: &Request{Kind: KindChat, Model: "m", Messages: []Message{{Role: "narrator", Content: "x"}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			body := []byte(tt.body)
			got, err := Parse(tt.kind, body)
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Parse mismatch (-want +got):\n%s", diff)
			}
			// The Request must not alias the body.
			for i := range body {
				body[i] = 'X'
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Request changed when the body was overwritten (-want +got):\n%s", diff)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		kind  Kind
		body  string
		want  error
		field string // FieldError.Field, when the error is one
	}{
		{"empty chat body", KindChat, "", ErrInvalidJSON, ""},
		{"whitespace completion body", KindCompletion, "  \n", ErrInvalidJSON, ""},
		{"not JSON", KindChat, "model=m", ErrInvalidJSON, ""},
		{"truncated", KindChat, `{"model":"m","messages":[{"role":"user","content":"hel`, ErrInvalidJSON, ""},
		{"truncated after value", KindChat, `{"model":"m"`, ErrInvalidJSON, ""},
		{"trailing garbage", KindChat, `{"model":"m"} x`, ErrInvalidJSON, ""},
		{"two values", KindChat, `{"model":"m"}{}`, ErrInvalidJSON, ""},
		{"trailing comma", KindChat, `{"model":"m",}`, ErrInvalidJSON, ""},
		{"single quotes", KindChat, `{'model':'m'}`, ErrInvalidJSON, ""},
		{"NaN literal", KindChat, `{"model":"m","temperature":NaN}`, ErrInvalidJSON, ""},
		{"control char in string", KindChat, "{\"model\":\"m\x01\"}", ErrInvalidJSON, ""},
		{"top-level array", KindChat, `[{"model":"m"}]`, ErrInvalidJSON, ""},
		{"top-level string", KindOther, `"m"`, ErrInvalidJSON, ""},
		{"invalid JSON for other kind", KindOther, `{"model":`, ErrInvalidJSON, ""},
		{"invalid UTF-8 in a string", KindChat, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}", ErrInvalidUTF8, ""},
		{"overlong UTF-8", KindOther, "{\"model\":\"\xc0\xaf\"}", ErrInvalidUTF8, ""},
		{"UTF-8 BOM", KindChat, "\xef\xbb\xbf{\"model\":\"m\"}", ErrInvalidJSON, ""},
		{"too deep", KindOther, `{"a":` + strings.Repeat("[", MaxDepth) + strings.Repeat("]", MaxDepth) + `}`, ErrInvalidJSON, ""},
		{"missing model", KindChat, `{"messages":[]}`, ErrMissingModel, "model"},
		{"empty model", KindCompletion, `{"model":"","prompt":"x"}`, ErrMissingModel, "model"},
		{"null model", KindChat, `{"model":null}`, ErrMissingModel, "model"},
		{"later null model", KindChat, `{"model":"m","model":null}`, ErrMissingModel, "model"},
		{"model number", KindChat, `{"model":5}`, ErrInvalidField, "model"},
		{"model number for other kind", KindOther, `{"model":["m"]}`, ErrInvalidField, "model"},
		{"stream string", KindChat, `{"model":"m","stream":"true"}`, ErrInvalidField, "stream"},
		{"stream_options array", KindChat, `{"model":"m","stream_options":[]}`, ErrInvalidField, "stream_options"},
		{"include_usage number", KindChat, `{"model":"m","stream_options":{"include_usage":1}}`, ErrInvalidField, "stream_options.include_usage"},
		{"max_tokens negative", KindChat, `{"model":"m","max_tokens":-1}`, ErrInvalidField, "max_tokens"},
		{"max_tokens fraction", KindChat, `{"model":"m","max_tokens":1.5}`, ErrInvalidField, "max_tokens"},
		{"max_tokens string", KindChat, `{"model":"m","max_tokens":"10"}`, ErrInvalidField, "max_tokens"},
		{"max_completion_tokens bool", KindChat, `{"model":"m","max_completion_tokens":true}`, ErrInvalidField, "max_completion_tokens"},
		{"cache_salt number", KindChat, `{"model":"m","cache_salt":1}`, ErrInvalidField, "cache_salt"},
		{"messages object", KindChat, `{"model":"m","messages":{"role":"user"}}`, ErrInvalidField, "messages"},
		{"message not object", KindChat, `{"model":"m","messages":[{"role":"user","content":"x"},"hi"]}`, ErrInvalidField, "messages[1]"},
		{"content number", KindChat, `{"model":"m","messages":[{"role":"user","content":42}]}`, ErrInvalidField, "messages[0].content"},
		{"content object", KindChat, `{"model":"m","messages":[{"role":"user","content":{"type":"text"}}]}`, ErrInvalidField, "messages[0].content"},
		{"content part number", KindChat, `{"model":"m","messages":[{"role":"user","content":["a",1]}]}`, ErrInvalidField, "messages[0].content[1]"},
		{"text part text number", KindChat, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":1}]}]}`, ErrInvalidField, "messages[0].content[0].text"},
		{"role number", KindChat, `{"model":"m","messages":[{"role":1}]}`, ErrInvalidField, "messages[0].role"},
		{"name array", KindChat, `{"model":"m","messages":[{"role":"user","name":[]}]}`, ErrInvalidField, "messages[0].name"},
		{"tool_calls object", KindChat, `{"model":"m","messages":[{"role":"assistant","tool_calls":{}}]}`, ErrInvalidField, "messages[0].tool_calls"},
		{"prompt number", KindCompletion, `{"model":"m","prompt":5}`, ErrInvalidField, "prompt"},
		{"prompt object", KindCompletion, `{"model":"m","prompt":{}}`, ErrInvalidField, "prompt"},
		{"prompt mixed strings", KindCompletion, `{"model":"m","prompt":["a",1]}`, ErrInvalidField, "prompt[1]"},
		{"prompt mixed ids", KindCompletion, `{"model":"m","prompt":[1,"a"]}`, ErrInvalidField, "prompt[1]"},
		{"prompt negative id", KindCompletion, `{"model":"m","prompt":[1,-2]}`, ErrInvalidField, "prompt[1]"},
		{"prompt fractional id", KindCompletion, `{"model":"m","prompt":[1.5]}`, ErrInvalidField, "prompt[0]"},
		{"prompt exponent id", KindCompletion, `{"model":"m","prompt":[1e3]}`, ErrInvalidField, "prompt[0]"},
		{"prompt id over uint32", KindCompletion, `{"model":"m","prompt":[4294967296]}`, ErrInvalidField, "prompt[0]"},
		{"prompt bools", KindCompletion, `{"model":"m","prompt":[true]}`, ErrInvalidField, "prompt[0]"},
		{"prompt nested mixed", KindCompletion, `{"model":"m","prompt":[[1],2]}`, ErrInvalidField, "prompt[1]"},
		{"prompt nested bad id", KindCompletion, `{"model":"m","prompt":[[1],[2,"x"]]}`, ErrInvalidField, "prompt[1][1]"},
		{"too many messages", KindChat, `{"model":"m","messages":[` + strings.Repeat(`{},`, MaxItems) + `{}]}`, ErrInvalidField, "messages"},
		{"too many prompts", KindCompletion, `{"model":"m","prompt":[` + strings.Repeat(`[],`, MaxItems) + `[]]}`, ErrInvalidField, "prompt"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := Parse(tt.kind, []byte(tt.body))
			if !errors.Is(err, tt.want) {
				t.Fatalf("Parse error = %v, want %v", err, tt.want)
			}
			if got != nil {
				t.Errorf("Parse returned a Request with an error: %+v", got)
			}
			var fe *FieldError
			if tt.field == "" {
				if errors.As(err, &fe) {
					t.Errorf("error %v is a FieldError, want a plain %v", err, tt.want)
				}
				return
			}
			if !errors.As(err, &fe) {
				t.Fatalf("error %v is not a FieldError", err)
			}
			if fe.Field != tt.field {
				t.Errorf("FieldError.Field = %q, want %q (error: %v)", fe.Field, tt.field, err)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Errorf("error text %q does not name the field %q", err, tt.field)
			}
		})
	}
}

func TestParseUTF8ErrorIsInvalidJSON(t *testing.T) {
	t.Parallel()
	_, err := Parse(KindChat, []byte("{\"model\":\"\xff\"}"))
	if !errors.Is(err, ErrInvalidUTF8) || !errors.Is(err, ErrInvalidJSON) {
		t.Fatalf("err = %v, want both ErrInvalidUTF8 and ErrInvalidJSON", err)
	}
}

// A body that nests far deeper than the goroutine stack could follow must be
// rejected quickly, not crash the process.
func TestParseDeepNesting(t *testing.T) {
	t.Parallel()
	for _, open := range []string{"[", `{"a":`} {
		body := []byte(`{"model":"m","x":` + strings.Repeat(open, 16<<20/len(open)))
		_, err := Parse(KindChat, body)
		if !errors.Is(err, ErrInvalidJSON) {
			t.Errorf("Parse(deep %q) error = %v, want ErrInvalidJSON", open, err)
		}
	}
	// Brackets inside strings do not count, escaped quotes included.
	s := `"\\\"` + strings.Repeat("[", 2*MaxDepth) + `\\"`
	body := []byte(`{"model":"m","messages":[{"role":"user","content":` + s + `}]}`)
	r, err := Parse(KindChat, body)
	if err != nil {
		t.Fatalf("Parse(brackets in a string): %v", err)
	}
	if want := `\"` + strings.Repeat("[", 2*MaxDepth) + `\`; r.Messages[0].Content != want {
		t.Errorf("content = %.40q..., want %.40q...", r.Messages[0].Content, want)
	}
	if !tooDeep([]byte(strings.Repeat("[", MaxDepth+1)), MaxDepth) || tooDeep([]byte(strings.Repeat("[", MaxDepth)), MaxDepth) {
		t.Error("tooDeep limit is off by one")
	}
}

func TestParseTextLen(t *testing.T) {
	t.Parallel()
	r, err := Parse(KindChat, []byte(`{"model":"m","messages":[{"role":"user","content":"abc"},{"role":"assistant","content":[{"type":"text","text":"d"},{"type":"text","text":"ef"}]}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := r.TextLen(); got != 3+len("d\nef") {
		t.Errorf("TextLen = %d, want %d", got, 3+len("d\nef"))
	}
	r, err = Parse(KindCompletion, []byte(`{"model":"m","prompt":["ab","cde"]}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := r.TextLen(); got != 5 {
		t.Errorf("TextLen = %d, want 5", got)
	}
	r, err = Parse(KindCompletion, []byte(`{"model":"m","prompt":[1,2,3]}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := r.TextLen(); got != 0 {
		t.Errorf("TextLen(token ids) = %d, want 0", got)
	}
}

// A 10 MB body parses correctly and in bounded time.
func TestParseLargeBody(t *testing.T) {
	t.Parallel()
	content := strings.Repeat("The quick brown fox\\njumps over the \\\"lazy\\\" dog. ", 10<<20/50)
	body := []byte(`{"model":"m","stream":true,"messages":[{"role":"system","content":"sys"},{"role":"user","content":"` + content + `"}],"max_tokens":5}`)
	if len(body) < 10<<20 {
		t.Fatalf("body is %d bytes, want >= 10 MiB", len(body))
	}
	start := time.Now()
	r, err := Parse(KindChat, body)
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	wantLen := len(strings.ReplaceAll(strings.ReplaceAll(content, `\n`, "\n"), `\"`, `"`))
	if len(r.Messages) != 2 || len(r.Messages[1].Content) != wantLen || r.MaxTokens != 5 || !r.Stream {
		t.Fatalf("unexpected result: %d messages, content %d bytes (want %d)", len(r.Messages), len(r.Messages[1].Content), wantLen)
	}
	// About 20 ms without the race detector; generous for -race and a
	// loaded CI machine.
	if elapsed > 10*time.Second {
		t.Errorf("Parse of %d bytes took %v", len(body), elapsed)
	}
	// A 10 MB token-id prompt.
	ids := bytes.Repeat([]byte("123456,"), 10<<20/7)
	body = append(append([]byte(`{"model":"m","prompt":[`), ids...), `0]}`...)
	r, err = Parse(KindCompletion, body)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(r.PromptTokenIDs[0]); n != 10<<20/7+1 || r.PromptTokenIDs[0][0] != 123456 {
		t.Errorf("token prompt: %d ids", n)
	}
}

func TestParseNVExt(t *testing.T) {
	t.Parallel()
	tests := []struct {
		raw  string
		want NVExt
	}{
		{"", NVExt{}},
		{"null", NVExt{}},
		{`{"annotations":["a"],"agent_hints":{"osl":"HIGH"}}`, NVExt{Annotations: []string{"a"}, AgentHints: AgentHints{OSL: `"HIGH"`}}},
		{`{"annotations":[`, NVExt{Ignored: []string{"nvext"}}},
		{`[1]`, NVExt{Ignored: []string{"nvext"}}},
		{`{"annotations":[` + strings.Repeat(`"a",`, MaxAnnotations) + `"b"]}`, NVExt{Annotations: strings.Split(strings.Repeat("a", MaxAnnotations), ""), Ignored: []string{"nvext.annotations"}}},
	}
	for _, tt := range tests {
		if diff := cmp.Diff(tt.want, ParseNVExt([]byte(tt.raw))); diff != "" {
			t.Errorf("ParseNVExt(%.40q) mismatch (-want +got):\n%s", tt.raw, diff)
		}
	}
}
