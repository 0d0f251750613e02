package tokenizer

import (
	"slices"
	"testing"
)

func splitAll(sp splitter, s string) []string {
	var out []string
	sp.split(s, func(p string) bool { out = append(out, p); return true })
	return out
}

// TestSplitterMatchesRegexp2 checks the hand-written pre-tokenizers against
// regexp2 running the same pattern, split for split, on the oracle corpus.
func TestSplitterMatchesRegexp2(t *testing.T) {
	texts := append(oracleCorpus(t), "'", "a'", " '", "x 'll", "\r", " \r\n x", "1'2", "\u00a0\u00a0x", " \u3000a")
	texts = append(texts, "a\u0301b \u0301x 3\u0301 .Net ,abc $1 ¥a 　x 1a\n\r\n!! ' (x)\r\n\x00a")
	for _, pat := range []string{patGPT2, patLlama3, patQwen2, patDeepSeekDigits, patDeepSeekCJK, patDeepSeekWords} {
		hand, err := newSplitter(pat, false)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := hand.(*regexpSplitter); ok {
			t.Fatalf("pattern %q not recognised", pat)
		}
		re, err := newSplitter(pat, true)
		if err != nil {
			t.Fatal(err)
		}
		for i, text := range texts {
			got, want := splitAll(hand, text), splitAll(re, text)
			if !slices.Equal(got, want) {
				d := 0
				for d < min(len(got), len(want)) && got[d] == want[d] {
					d++
				}
				t.Errorf("pattern %.20q text %d: split %d differs: hand %q, regexp2 %q", pat, i, d,
					got[d:min(len(got), d+3)], want[d:min(len(want), d+3)])
			}
		}
	}
}
