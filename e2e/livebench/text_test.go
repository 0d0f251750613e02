package livebench

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim/trace"
	"github.com/kvbandit/kvbandit/tokenizer"
	"github.com/kvbandit/kvbandit/tokenizer/tokenizertest"
)

// mooncake reads JSONL lines with no grid spreading (Grid < 0).
func mooncake(t *testing.T, lines ...string) []Request {
	t.Helper()
	w, _, err := ReadMooncake(strings.NewReader(strings.Join(lines, "\n")), Options{Grid: -1, Strict: true})
	if err != nil {
		t.Fatal(err)
	}
	return w.Requests
}

func TestVocabulary(t *testing.T) {
	v := vocabulary()
	if len(v) != 512 {
		t.Fatalf("%d words, want 512 (a power of two)", len(v))
	}
	seen := map[string]bool{}
	for _, w := range v {
		if seen[w] {
			t.Errorf("word %q twice", w)
		}
		seen[w] = true
	}
}

// TestTextSharing: requests sharing leading hash ids share the same text
// prefix (the text of those blocks), requests with different ids
// differ, the text is the same on every read, and the last block is cut
// to input_length.
func TestTextSharing(t *testing.T) {
	read := func() []Request {
		return mooncake(t,
			`{"timestamp": 0, "input_length": 1536, "output_length": 10, "hash_ids": [0, 1, 2]}`,
			`{"timestamp": 1, "input_length": 1300, "output_length": 10, "hash_ids": [0, 1, 3]}`,
			`{"timestamp": 2, "input_length": 1024, "output_length": 10, "hash_ids": [4, 5]}`,
			`{"timestamp": 3, "input_length": 512, "output_length": 10, "hash_ids": [2]}`,
		)
	}
	reqs := read()
	p := make([]string, len(reqs))
	for i := range reqs {
		p[i] = reqs[i].Prompt()
		if got := len(strings.Fields(p[i])); got != len(reqs[i].Tokens) {
			t.Errorf("request %d: %d words for %d tokens", i, got, len(reqs[i].Tokens))
		}
	}
	if n := len(strings.Fields(p[1])); n != 1300 {
		t.Errorf("partial last block: %d words, want input_length 1300", n)
	}
	shared := Text(reqs[0].Tokens[:1024]) // blocks 0 and 1
	for i := range 2 {
		if !strings.HasPrefix(p[i], shared+" ") {
			t.Errorf("request %d does not start with the text of blocks 0, 1", i)
		}
	}
	block2 := p[0][len(shared)+1:]
	if block2 != p[3] {
		t.Error("hash id 2 has different text at position 2 and position 0")
	}
	if tail := p[1][len(shared)+1:]; strings.HasPrefix(block2, tail[:40]) {
		t.Error("hash ids 2 and 3 start with the same text")
	}
	if strings.HasPrefix(p[2], p[0][:40]) {
		t.Error("hash ids 4 and 0 start with the same text")
	}
	again := read()
	for i := range again {
		if again[i].Prompt() != p[i] {
			t.Errorf("request %d: text differs between reads", i)
		}
	}
}

// TestChunkTokenLength: the chunk of a hash id is 512 ±25% Qwen3 tokens,
// and so is a whole prompt against its input_length.
func TestChunkTokenLength(t *testing.T) {
	dir := tokenizertest.Require(t, "qwen3/tokenizer.json", "qwen3/tokenizer_config.json")
	tok, err := tokenizer.Load(filepath.Join(dir, "qwen3"))
	if err != nil {
		t.Fatal(err)
	}
	reqs := mooncake(t,
		`{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7]}`,
		`{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [123456]}`,
		`{"timestamp": 0, "input_length": 6000, "output_length": 1, "hash_ids": [0,1,2,3,4,5,6,7,8,9,10,11]}`,
	)
	for i, r := range reqs {
		text := r.Prompt()
		ids, err := tok.Encode(context.Background(), text)
		if err != nil {
			t.Fatal(err)
		}
		want := len(r.Tokens)
		if n := len(ids); n < want*3/4 || n > want*5/4 {
			t.Errorf("request %d: %d Qwen3 tokens for %d trace tokens (%d bytes), want within 25%%", i, n, want, len(text))
		} else {
			t.Logf("request %d: %d Qwen3 tokens for %d trace tokens, %.2f bytes per token", i, n, want, float64(len(text))/float64(n))
		}
	}
}

func TestBody(t *testing.T) {
	r := mooncake(t, `{"timestamp": 0, "input_length": 700, "output_length": 42, "hash_ids": [0, 1]}`)[0]
	r.Model = "m"
	b, err := r.Body()
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Model    string `json:"model"`
		Messages []struct {
			Role, Content string
		} `json:"messages"`
		MaxTokens     int  `json:"max_tokens"`
		IgnoreEOS     bool `json:"ignore_eos"`
		Stream        bool `json:"stream"`
		StreamOptions struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	switch {
	case got.Model != "m", got.MaxTokens != 42, !got.IgnoreEOS, !got.Stream, !got.StreamOptions.IncludeUsage:
		t.Errorf("body fields: %+v", got)
	case len(got.Messages) != 1 || got.Messages[0].Role != "user" || got.Messages[0].Content != r.Prompt():
		t.Error("body messages: want one user message holding the prompt")
	}
	if len(r.Header()) != 0 {
		t.Errorf("a Mooncake request has hint headers: %v", r.Header())
	}
}

// TestReadMooncakeWindow: lines past the window are dropped before the
// reader, whose line numbers stay right.
func TestReadMooncakeWindow(t *testing.T) {
	in := strings.Join([]string{
		`{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}`,
		`{"timestamp": 60000, "input_length": 512, "output_length": 1, "hash_ids": [1]}`,
		`{"timestamp": 3000, "input_length": 512, "output_length": 1, "hash_ids": [2]}`,
		`{"timestamp": 90000, "input_length": 512, "output_length": 1, "hash_ids": [3]}`,
		`{"timestamp": 6000, "input_length": 512, "output_length": 1}`,
	}, "\n")
	w, rep, err := ReadMooncake(strings.NewReader(in), Options{Window: 30 * time.Second, Grid: -1})
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 2 {
		t.Fatalf("%d requests, want the 2 valid ones in the first 30 s", len(w.Requests))
	}
	if rep.Skipped != 1 || len(rep.Errors) != 1 || !strings.HasPrefix(rep.Errors[0].Error(), "line 5:") {
		t.Errorf("report %+v: want line 5 skipped", rep)
	}
	if _, _, err := ReadMooncake(strings.NewReader(in), Options{Window: 30 * time.Second, Strict: true}); err == nil {
		t.Error("strict: the bad line 5 was accepted")
	}
	if _, err := FromTrace(nil, Options{}); !errors.Is(err, trace.ErrEmpty) {
		t.Errorf("empty trace: %v, want trace.ErrEmpty", err)
	}
	if _, _, err := ReadMooncake(strings.NewReader(in), Options{RateScale: -1}); err == nil {
		t.Error("a negative rate scale was accepted")
	}
}
