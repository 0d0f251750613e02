package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
)

// conversation renders a ChatML (Qwen) or Llama 3 style conversation of turns
// user/assistant pairs from corpus texts; the last user message is prefixed
// with tag.
func conversation(base []string, model string, turns int, tag string) string {
	r := rand.New(rand.NewPCG(11, 12))
	var b strings.Builder
	msg := func(role, content string) {
		switch model {
		case "llama3_1":
			fmt.Fprintf(&b, "<|start_header_id|>%s<|end_header_id|>\n\n%s<|eot_id|>", role, content)
		case "llama2":
			if role == "user" {
				fmt.Fprintf(&b, "<s>[INST] %s [/INST]", content)
			} else {
				fmt.Fprintf(&b, " %s</s>", content)
			}
		default:
			fmt.Fprintf(&b, "<|im_start|>%s\n%s<|im_end|>\n", role, content)
		}
	}
	text := func() string {
		var sb strings.Builder
		for sb.Len() < 1500 {
			sb.WriteString(base[r.IntN(len(base))])
			sb.WriteString("\n")
		}
		return sb.String()
	}
	msg("system", "You are a helpful assistant.")
	for i := 1; i <= turns; i++ {
		u := text()
		if i == turns {
			u = tag + u
		}
		msg("user", u)
		if i < turns {
			msg("assistant", text())
		}
	}
	return b.String()
}

func shortCorpus(t testing.TB) []string {
	var base []string
	for _, s := range baseCorpus(t) {
		if len(s) < 400 {
			base = append(base, s)
		}
	}
	return base
}

func TestPrefixCache(t *testing.T) {
	base := shortCorpus(t)
	for _, name := range oracleModels {
		t.Run(name, func(t *testing.T) {
			tok := loadModel(t, name)
			c := NewPrefixCache(tok, 4<<20, 1024)
			for turn := 1; turn <= 12; turn++ {
				for _, tag := range []string{"", "x"} {
					text := conversation(base, name, turn, tag)
					got, err := c.Encode(t.Context(), text)
					if err != nil {
						t.Fatal(err)
					}
					if want := tok.EncodeAppend(nil, text); !slices.Equal(got, want) {
						t.Fatalf("turn %d: cached encode differs at %d", turn, firstDiff(got, want))
					}
				}
			}
			st := c.Stats()
			t.Logf("%s: %+v", name, st)
			if st.HitBytes == 0 {
				t.Errorf("no cache hits")
			}
		})
	}
	t.Run("evicts", func(t *testing.T) {
		tok := loadModel(t, "qwen3")
		c := NewPrefixCache(tok, 16<<10, 512)
		for turn := 1; turn <= 10; turn++ {
			text := conversation(base, "qwen3", turn, "")
			got, _ := c.Encode(t.Context(), text)
			if !slices.Equal(got, tok.EncodeAppend(nil, text)) {
				t.Fatalf("turn %d differs", turn)
			}
		}
		if st := c.Stats(); st.Bytes > 16<<10 {
			t.Errorf("cache holds %d bytes, limit %d", st.Bytes, 16<<10)
		}
	})
}

// BenchmarkChatPrefixCache encodes turn 20 of a growing conversation whose
// first 19 turns (about 95% of the text) were encoded before: "cached" goes
// through a warm PrefixCache, "uncached" through Encode.
func BenchmarkChatPrefixCache(b *testing.B) {
	base := shortCorpus(b)
	for _, name := range oracleModels {
		tok := loadModel(b, name)
		prev := conversation(base, name, 19, "")
		full := conversation(base, name, 20, "")
		b.Run(name+"/uncached", func(b *testing.B) {
			b.SetBytes(int64(len(full)))
			for b.Loop() {
				tok.EncodeAppend(nil, full)
			}
		})
		b.Run(name+"/cached", func(b *testing.B) {
			c := NewPrefixCache(tok, 64<<20, 0)
			if _, err := c.Encode(b.Context(), prev); err != nil {
				b.Fatal(err)
			}
			texts := make([]string, 0, 1024)
			for i := range 1024 {
				texts = append(texts, conversation(base, name, 20, fmt.Sprintf("%d ", i)))
			}
			b.SetBytes(int64(len(full)))
			b.ReportAllocs()
			warm := c.Stats()
			i := 0
			for b.Loop() {
				if _, err := c.Encode(b.Context(), texts[i%len(texts)]); err != nil {
					b.Fatal(err)
				}
				i++
			}
			st := c.Stats()
			hit, miss := st.HitBytes-warm.HitBytes, st.MissBytes-warm.MissBytes
			b.ReportMetric(float64(hit)/float64(hit+miss), "hit-ratio")
			b.ReportMetric(float64(miss)/float64(i), "encoded-B/op")
		})
	}
}

// TestPrefixCacheRandom encodes random texts that share random prefixes (cut
// anywhere, including inside added tokens and right after "\n") through a cache
// with tiny chunks, and compares with Encode.
func TestPrefixCacheRandom(t *testing.T) {
	pieces := []string{"<|im_start|>", "<|im_end|>", "<|im_", "start|>", "<|eot_id|>", "<|eot", "<s>", "</s>", "<", "s>",
		"\n", "\n\n", " ", "  ", "a", "Hello", "é", "e\u0301", "日本", "مرحبا", "1234", "'s", "!", "\t", "▁", "😀"}
	r := rand.New(rand.NewPCG(5, 6))
	for _, name := range oracleModels {
		tok := loadModel(t, name)
		c := NewPrefixCache(tok, 1<<20, 8)
		for _, text := range sharedPrefixTexts(r, pieces, 400) {
			got, err := c.Encode(t.Context(), text)
			if err != nil {
				t.Fatal(err)
			}
			if want := tok.EncodeAppend(nil, text); !slices.Equal(got, want) {
				t.Fatalf("%s: text %q: cached encode differs at %d", name, text, firstDiff(got, want))
			}
		}
		t.Logf("%s: %+v", name, c.Stats())
	}
}

// sharedPrefixTexts returns n random texts of up to 60 pieces, three in four
// starting with a random prefix (cut anywhere) of an earlier one.
func sharedPrefixTexts(r *rand.Rand, pieces []string, n int) []string {
	texts := make([]string, 0, n)
	for i := range n {
		var b strings.Builder
		for range 1 + r.IntN(60) {
			b.WriteString(pieces[r.IntN(len(pieces))])
		}
		text := b.String()
		if i > 0 && i%4 != 0 {
			p := texts[r.IntN(len(texts))]
			text = p[:r.IntN(len(p)+1)] + text
		}
		texts = append(texts, text)
	}
	return texts
}

func TestConcurrentEncode(t *testing.T) {
	texts := shortCorpus(t)
	for _, name := range oracleModels {
		tok := loadModel(t, name)
		c := NewPrefixCache(tok, 1<<20, 64)
		want := make([][]uint32, len(texts))
		for i, s := range texts {
			want[i] = tok.EncodeAppend(nil, s)
		}
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				for i := range texts {
					j := (i + g*7) % len(texts)
					got, err := tok.Encode(t.Context(), texts[j])
					got2, err2 := c.Encode(t.Context(), texts[j])
					if err != nil || err2 != nil || !slices.Equal(got, want[j]) || !slices.Equal(got2, want[j]) {
						t.Errorf("%s: concurrent encode of text %d differs", name, j)
						return
					}
				}
			})
		}
		wg.Wait()
	}
}
