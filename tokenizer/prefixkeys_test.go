package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// TestPrefixCacheKeys runs random conversations (turn N+1 extends turn N,
// some turns end in an edit, conversations share a system prompt) through
// EncodeKeys with a random key spec per conversation, among block sizes that
// take XXH3's 16-token fast path and the general one and two seeds: the ids
// must equal Encode's and the keys AppendBlockKeys of them, bit for bit. A
// conversation's later turns must take most keys from the cache.
func TestPrefixCacheKeys(t *testing.T) {
	base := shortCorpus(t)
	specs := []KeySpec{
		keySpec(16, kvindex.BaseSeed),
		keySpec(16, kvindex.Seed("", "tenant-b")),
		keySpec(64, kvindex.BaseSeed),
		keySpec(5, kvindex.BaseSeed),
	}
	for _, name := range oracleModels {
		t.Run(name, func(t *testing.T) {
			tok := loadModel(t, name)
			r := rand.New(rand.NewPCG(16, 17))
			c := NewPrefixCache(tok, 8<<20, 256+r.IntN(1024))
			for conv := range 12 {
				spec := specs[r.IntN(len(specs))]
				text := "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
				var before PrefixCacheStats
				for turn := range 10 {
					for range 3 + r.IntN(4) {
						text += base[r.IntN(len(base))] + "\n"
					}
					probe := text
					if r.IntN(4) == 0 { // an edited last turn, not kept
						probe += fmt.Sprintf("edit %d", r.IntN(1000))
					}
					if turn == 9 {
						before = c.Stats()
					}
					ids, keys, err := c.EncodeKeys(t.Context(), probe, spec)
					if err != nil {
						t.Fatal(err)
					}
					if want := tok.EncodeAppend(nil, probe); !slices.Equal(ids, want) {
						t.Fatalf("conversation %d turn %d: ids differ at %d", conv, turn, firstDiff(ids, want))
					}
					if want := kvindex.AppendBlockKeys(nil, ids, spec.BlockSize, spec.Seed); !slices.Equal(keys, want) {
						t.Fatalf("conversation %d turn %d, %+v: %d keys differ from AppendBlockKeys' %d (first at %d)", conv, turn, spec, len(keys), len(want), firstDiffKeys(keys, want))
					}
				}
				st := c.Stats()
				reused, hashed := st.KeysReused-before.KeysReused, st.KeysHashed-before.KeysHashed
				hit, miss := st.HitBytes-before.HitBytes, st.MissBytes-before.MissBytes
				t.Logf("conversation %d, last turn, %+v: %d keys reused, %d hashed; %d text bytes from the cache, %d encoded", conv, spec, reused, hashed, hit, miss)
				if hit > 4*miss && reused <= 2*hashed {
					t.Errorf("conversation %d, last turn: %d keys reused, %d hashed, for %d bytes reused and %d encoded", conv, reused, hashed, hit, miss)
				}
			}
			t.Logf("%+v", c.Stats())
		})
	}
}

// TestPrefixCacheKeysRandom is TestPrefixCacheRandom with keys: random texts
// sharing random prefixes cut anywhere, tiny chunks (so blocks straddle
// chunks), a random spec per text (so stored keys often do not match and the
// chain must be caught up before reusing the next chunk's).
func TestPrefixCacheKeysRandom(t *testing.T) {
	pieces := []string{"<|im_start|>", "<|im_end|>", "<|im_", "start|>", "<s>", "</s>", "\n", "\n\n", " ", "a", "Hello", "é", "日本", "1234", "'s", "!", "😀"}
	r := rand.New(rand.NewPCG(7, 8))
	specs := []KeySpec{keySpec(1, 1), keySpec(2, kvindex.BaseSeed), keySpec(2, 1), keySpec(16, kvindex.BaseSeed), {}}
	for _, name := range oracleModels {
		tok := loadModel(t, name)
		c := NewPrefixCache(tok, 1<<20, 8)
		for _, text := range sharedPrefixTexts(r, pieces, 400) {
			spec := specs[r.IntN(len(specs))]
			ids, keys, err := c.EncodeKeys(t.Context(), text, spec)
			if err != nil {
				t.Fatal(err)
			}
			if want := tok.EncodeAppend(nil, text); !slices.Equal(ids, want) {
				t.Fatalf("%s: text %q: ids differ at %d", name, text, firstDiff(ids, want))
			}
			want := kvindex.AppendBlockKeys(nil, ids, spec.BlockSize, spec.Seed)
			if spec.BlockSize <= 0 {
				want = nil
			}
			if !slices.Equal(keys, want) {
				t.Fatalf("%s: text %q, %+v: keys differ at %d", name, text, spec, firstDiffKeys(keys, want))
			}
		}
		st := c.Stats()
		t.Logf("%s: %+v", name, st)
		if st.KeysReused == 0 {
			t.Errorf("%s: no key was reused", name)
		}
	}
}

// TestPrefixCacheKeysBytes: stored keys count against MaxBytes, 8 bytes
// each, and a cache at its limit stays under it.
func TestPrefixCacheKeysBytes(t *testing.T) {
	base := shortCorpus(t)
	tok := loadModel(t, "qwen3")
	text := conversation(base, "qwen3", 6, "")
	plain := NewPrefixCache(tok, 64<<20, 512)
	keyed := NewPrefixCache(tok, 64<<20, 512)
	if _, err := plain.Encode(t.Context(), text); err != nil {
		t.Fatal(err)
	}
	_, keys, err := keyed.EncodeKeys(t.Context(), text, keySpec(16, kvindex.BaseSeed))
	if err != nil {
		t.Fatal(err)
	}
	// Every complete block ends in a stored chunk except those after
	// the last safe cut (the unstored tail).
	p, k := plain.Stats(), keyed.Stats()
	stored := (k.Bytes - p.Bytes) / 8
	if (k.Bytes-p.Bytes)%8 != 0 || stored == 0 || stored > int64(len(keys)) || int64(len(keys))-stored > 8 {
		t.Fatalf("keyed cache holds %d bytes, plain %d: %d stored keys for a prompt of %d", k.Bytes, p.Bytes, stored, len(keys))
	}
	small := NewPrefixCache(tok, 16<<10, 512)
	for turn := 1; turn <= 10; turn++ {
		text := conversation(base, "qwen3", turn, "")
		ids, keys, err := small.EncodeKeys(t.Context(), text, keySpec(16, kvindex.BaseSeed))
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(keys, kvindex.AppendBlockKeys(nil, ids, 16, kvindex.BaseSeed)) {
			t.Fatalf("turn %d: keys differ", turn)
		}
	}
	if st := small.Stats(); st.Bytes > 16<<10 {
		t.Errorf("cache holds %d bytes, limit %d", st.Bytes, 16<<10)
	}
}

func firstDiffKeys(a, b []uint64) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// BenchmarkPrefixCacheKeys is turn N+1 of a long Qwen3 conversation (about
// 8k and 128k tokens; turns 1..N were encoded before) through a warm prefix
// cache, with the prompt's block keys (16 tokens, unsalted): "fresh" encodes
// and then hashes every block (kvindex.AppendBlockKeys, what the engine did
// before), "cached" takes the keys of the cached turns from the cache and
// hashes the rest. Each iteration encodes one of several variants of turn
// N+1 (its last user message differs), so that most of the last turn is new.
//
//	go test -run '^$' -bench 'PrefixCacheKeys' -benchmem ./tokenizer/
func BenchmarkPrefixCacheKeys(b *testing.B) {
	base := shortCorpus(b)
	tok := loadModel(b, "qwen3")
	spec := keySpec(16, kvindex.BaseSeed)
	for _, c := range []struct {
		name        string
		turns, vars int
	}{{"tokens=8k", 7, 256}, {"tokens=128k", 107, 24}} {
		prev := conversation(base, "qwen3", c.turns-1, "")
		texts := make([]string, c.vars)
		for i := range texts {
			texts[i] = conversation(base, "qwen3", c.turns, fmt.Sprintf("%d ", i))
		}
		for _, impl := range []string{"fresh", "cached"} {
			b.Run(c.name+"/impl="+impl, func(b *testing.B) {
				pc := NewPrefixCache(tok, 256<<20, 0)
				if _, _, err := pc.EncodeKeys(b.Context(), prev, spec); err != nil {
					b.Fatal(err)
				}
				warm := pc.Stats()
				var ntok int
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					text := texts[i%len(texts)]
					i++
					if impl == "fresh" {
						ids, err := pc.Encode(b.Context(), text)
						if err != nil {
							b.Fatal(err)
						}
						_ = kvindex.AppendBlockKeys(nil, ids, spec.BlockSize, spec.Seed)
						ntok = len(ids)
						continue
					}
					ids, _, err := pc.EncodeKeys(b.Context(), text, spec)
					if err != nil {
						b.Fatal(err)
					}
					ntok = len(ids)
				}
				st := pc.Stats()
				b.ReportMetric(float64(ntok), "tokens")
				b.ReportMetric(float64(st.MissBytes-warm.MissBytes)/float64(i), "encoded-B/op")
				if impl == "cached" {
					b.ReportMetric(float64(st.KeysHashed-warm.KeysHashed)/float64(i), "hashed-blocks/op")
				} else {
					b.ReportMetric(float64(ntok/spec.BlockSize), "hashed-blocks/op")
				}
			})
		}
	}
}

// keySpec is the spec of keys at bs with seed, hashed as the engine does.
func keySpec(bs int, seed uint64) KeySpec {
	return KeySpec{BlockSize: bs, Seed: seed, Extend: kvindex.ExtendBlockKeys}
}
