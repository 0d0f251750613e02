package tokenizer

import (
	"strings"
	"testing"
)

// benchText returns size bytes of mixed text made from the corpus entries
// shorter than 400 bytes plus the Lorem paragraph (leaving out the 500–3000
// character runs of one character, which are stress tests, not text; they are
// measured by BenchmarkEncodeRuns).
func benchText(b *testing.B, seed uint64, size int) string {
	var base []string
	for _, s := range baseCorpus(b) {
		if len(s) < 400 || strings.HasPrefix(s, "Lorem") {
			base = append(base, s)
		}
	}
	var sb strings.Builder
	for sb.Len() < size {
		sb.WriteString(longTexts(base, seed, 1)[0])
		seed++
	}
	return strings.ToValidUTF8(sb.String()[:size], "")
}

// BenchmarkEncode encodes 32 KB of mixed text (generated from the corpus).
// "cold" clears the per-word cache before every iteration.
//
//	go test -run '^$' -bench Encode -benchmem -cpu 1 ./tokenizer/
func BenchmarkEncode(b *testing.B) {
	text := benchText(b, 7, 32<<10)
	for _, name := range oracleModels {
		tok := loadModel(b, name)
		for _, cold := range []bool{false, true} {
			n := name
			if cold {
				n += "/cold"
			}
			b.Run(n, func(b *testing.B) {
				b.SetBytes(int64(len(text)))
				b.ReportAllocs()
				dst := make([]uint32, 0, len(text))
				for b.Loop() {
					if cold {
						tok.clearCache()
					}
					dst = tok.EncodeAppend(dst[:0], text)
				}
			})
		}
	}
}

// BenchmarkEncode128k encodes a prompt of about 128k tokens.
func BenchmarkEncode128k(b *testing.B) {
	for _, name := range oracleModels {
		tok := loadModel(b, name)
		size := 256 << 10
		text := benchText(b, 100, size)
		for n := len(tok.EncodeAppend(nil, text)); n < 128000; n = len(tok.EncodeAppend(nil, text)) {
			size = size * 129000 / n
			text = benchText(b, 100, size)
		}
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			b.ReportAllocs()
			var n int
			for b.Loop() {
				n = len(tok.EncodeAppend(nil, text))
			}
			b.ReportMetric(float64(n), "tokens")
		})
	}
}

// BenchmarkEncodeRuns encodes 32 KB made of long runs of one character
// ("a", "\n", " ", "😀"), the worst case of BPE merging.
func BenchmarkEncodeRuns(b *testing.B) {
	text := strings.Repeat("a", 8<<10) + strings.Repeat("\n", 8<<10) + strings.Repeat(" ", 8<<10) + strings.Repeat("😀", 2<<10)
	for _, name := range oracleModels {
		tok := loadModel(b, name)
		b.Run(name, func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			b.ReportAllocs()
			for b.Loop() {
				tok.EncodeAppend(nil, text)
			}
		})
	}
}
