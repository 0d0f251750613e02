package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestAddedTokenFlagsOracle adds tokens with single_word, lstrip, rstrip and
// normalized to the Qwen3 and Mistral tokenizers (the fixtures have none) and
// compares with the HF oracle.
func TestAddedTokenFlagsOracle(t *testing.T) {
	extra := []map[string]any{
		{"content": "<LS>", "lstrip": true},
		{"content": "<RS>", "rstrip": true},
		{"content": "<BOTH>", "lstrip": true, "rstrip": true},
		{"content": "cat", "single_word": true},
		{"content": "e\u0301t\u00e9", "normalized": true},
		{"content": "dog", "normalized": true},
	}
	texts := []string{
		"a <LS> b", "a   <LS>b", "<LS>", "  <LS>  ", "x<RS>   y", "x <RS>\n\ny", "<RS>", "a  <BOTH>  b", "<LS><LS> <RS> <RS>",
		"cat", "a cat b", "concatenate", "cats", "_cat", "cat_", "(cat)", "ca t", "été", "e\u0301te\u0301", "été dog hotdog",
		"<|im_start|>cat<|im_end|> <LS>", "dog<s>dog", "hot dog", "<s>  <LS> cat</s>",
	}
	for _, name := range []string{"qwen3", "llama2"} {
		t.Run(name, func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join(fixturesDir(t), name, "tokenizer.json"))
			if err != nil {
				t.Fatal(err)
			}
			var f map[string]any
			if err := json.Unmarshal(data, &f); err != nil {
				t.Fatal(err)
			}
			added := f["added_tokens"].([]any)
			base := len(f["model"].(map[string]any)["vocab"].(map[string]any)) + len(added)
			for i, e := range extra {
				tok := map[string]any{"id": base + i, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}
				for k, v := range e {
					tok[k] = v
				}
				added = append(added, tok)
			}
			f["added_tokens"] = added
			out, err := json.Marshal(f)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "tokenizer.json")
			if err := os.WriteFile(path, out, 0o644); err != nil {
				t.Fatal(err)
			}
			tok, err := Load(path)
			if err != nil {
				t.Fatal(err)
			}
			want := runOracle(t, path, texts)
			c := NewPrefixCache(tok, 1<<20, 1)
			for i, text := range texts {
				if got := tok.EncodeAppend(nil, text); !slices.Equal(got, want[i]) {
					t.Errorf("%q: got %v, want %v", text, got, want[i])
				}
				for n := 0; n <= len(text); n++ {
					b := tok.SafeSplit(text, n)
					if got := tok.EncodeAppend(tok.EncodeAppend(nil, text[:b]), text[b:]); !slices.Equal(got, want[i]) {
						t.Errorf("%q: SafeSplit(%d) = %d is not safe", text, n, b)
					}
					if got, _ := c.Encode(t.Context(), text[:n]); !slices.Equal(got, tok.EncodeAppend(nil, text[:n])) {
						t.Errorf("%q: PrefixCache differs on text[:%d]", text, n)
					}
				}
			}
		})
	}
}
