package tokenizer

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestSafeSplit checks Encode(text) == Encode(text[:b]) ++ Encode(text[b:]) for
// b = SafeSplit(text, n) at many offsets n of every corpus text.
func TestSafeSplit(t *testing.T) {
	texts := append(oracleCorpus(t), "a\nb", "\nb", "x \nb", "  \n\nb", "<|im_start|>user\nHi\n<|im_end|>\nb", "a\n\u0301b\nc")
	r := rand.New(rand.NewPCG(3, 4))
	for _, name := range oracleModels {
		t.Run(name, func(t *testing.T) {
			tok := loadModel(t, name)
			checked, long, near := 0, 0, 0
			for i, text := range texts {
				want := tok.EncodeAppend(nil, text)
				offs := []int{0, len(text), len(text) / 2}
				for range 15 {
					offs = append(offs, r.IntN(len(text)+1))
				}
				for _, n := range offs {
					b := tok.SafeSplit(text, n)
					if b < 0 || b > n {
						t.Fatalf("text %d: SafeSplit(%d) = %d", i, n, b)
					}
					got := tok.EncodeAppend(tok.EncodeAppend(nil, text[:b]), text[b:])
					if !slices.Equal(got, want) {
						t.Errorf("text %d: SafeSplit(%d) = %d (%q|%q) is not safe: first difference at %d",
							i, n, b, text[max(0, b-10):b], text[b:min(len(text), b+10)], firstDiff(got, want))
					}
					checked++
					if n >= 8192 {
						long++
						if n-b < 4096 {
							near++
						}
					}
				}
			}
			t.Logf("%s: %d splits checked; for n ≥ 8 KiB, %d/%d within 4 KiB of n", name, checked, near, long)
			if tok.kind == kindByteLevel && near < long*9/10 {
				t.Errorf("SafeSplit is too conservative on long texts: %d/%d within 4 KiB", near, long)
			}
		})
	}
}
