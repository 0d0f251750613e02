package tokenizer

import (
	"slices"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// FuzzEncode checks, for all three fixture tokenizers, that Encode does not
// panic, returns ids below VocabSize that decode back to the (normalized)
// text for byte-level models, and that SafeSplit(text, n) is safe.
// Seeds are in testdata/fuzz/FuzzEncode plus the ones below.
//
//	go test -run '^$' -fuzz FuzzEncode -fuzztime 60s ./tokenizer/
func FuzzEncode(f *testing.F) {
	for _, s := range []string{"", "Hello world", "<|im_start|>user\nhi<|im_end|>\n", "\xff\xfe<s>", "a\n\nb 's 'LL", "١٢٣ 😀‍👩 e\u0301"} {
		f.Add(s, 3)
	}
	toks := []*BPE{loadModel(f, "qwen3"), loadModel(f, "llama3_1"), loadModel(f, "llama2")}
	f.Fuzz(func(t *testing.T, text string, n int) {
		for _, tok := range toks {
			ids := tok.EncodeAppend(nil, text)
			for _, id := range ids {
				if int(id) >= tok.VocabSize() {
					t.Fatalf("id %d ≥ vocab size %d", id, tok.VocabSize())
				}
			}
			dec, err := tok.Decode(ids)
			if err != nil {
				t.Fatal(err)
			}
			if tok.kind == kindByteLevel {
				want := text
				if !utf8.ValidString(want) {
					want = toValidUTF8(want)
				}
				if tok.norm.nfc {
					want = norm.NFC.String(want)
				}
				if dec != want {
					t.Fatalf("Decode(Encode(%q)) = %q", text, dec)
				}
			}
			n := int(uint(n) % uint(len(text)+1))
			b := tok.SafeSplit(text, n)
			if b < 0 || b > n {
				t.Fatalf("SafeSplit(%d) = %d", n, b)
			}
			if split := tok.EncodeAppend(tok.EncodeAppend(nil, text[:b]), text[b:]); !slices.Equal(split, ids) {
				t.Fatalf("SafeSplit(%q, %d) = %d is not safe", text, n, b)
			}
		}
	})
}
