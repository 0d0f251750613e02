package kvindex

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestExtendBlockKeys: keys continued from the keys of any leading blocks
// (cut at any token, so the last of those blocks may be followed by a partial
// one) are AppendBlockKeys of the whole prompt, for the 16-token fast path and
// the general one, with and without a salt; keys beyond the prompt's blocks
// are cut; and the continuation depends on the key it starts from.
func TestExtendBlockKeys(t *testing.T) {
	r := rand.New(rand.NewPCG(16, 1))
	for range 2000 {
		bs := []int{1, 3, 16, 17, 64}[r.IntN(5)]
		seed := []uint64{BaseSeed, Seed("lora", ""), Seed("", "tenant"), r.Uint64()}[r.IntN(4)]
		tokens := make([]uint32, r.IntN(40*bs+1))
		for i := range tokens {
			tokens[i] = r.Uint32N(200000)
		}
		want := AppendBlockKeys(nil, tokens, bs, seed)
		cut := r.IntN(len(tokens) + 1)
		prefix := AppendBlockKeys(nil, tokens[:cut], bs, seed)
		if got := ExtendBlockKeys(slices.Clone(prefix), tokens, bs, seed); !slices.Equal(got, want) {
			t.Fatalf("bs %d, %d tokens, prefix of %d tokens: extended keys differ from AppendBlockKeys", bs, len(tokens), cut)
		}
		if got := ExtendBlockKeys(slices.Clone(want), tokens[:cut], bs, seed); !slices.Equal(got, prefix) {
			t.Fatalf("bs %d: keys of %d tokens were not cut to the %d of a %d-token prefix", bs, len(want), len(prefix), cut)
		}
		if len(prefix) > 0 && len(prefix) < len(want) {
			wrong := slices.Clone(prefix)
			wrong[len(wrong)-1]++
			if got := ExtendBlockKeys(wrong, tokens, bs, seed); got[len(prefix)] == want[len(prefix)] {
				t.Fatalf("bs %d: the continuation ignored the key it starts from", bs)
			}
		}
	}
	if got := ExtendBlockKeys([]uint64{1, 2}, make([]uint32, 64), 0, BaseSeed); len(got) != 0 {
		t.Fatalf("block size 0 gave %d keys", len(got))
	}
}

func TestExtendBlockKeysNoAllocs(t *testing.T) {
	tokens := make([]uint32, 8192)
	keys := make([]uint64, 0, 512)
	allocs := testing.AllocsPerRun(20, func() {
		keys = ExtendBlockKeys(AppendBlockKeys(keys[:0], tokens[:4000], 16, BaseSeed), tokens, 16, BaseSeed)
	})
	if allocs != 0 {
		t.Fatalf("ExtendBlockKeys allocated %.0f times per run", allocs)
	}
}

// FuzzExtendBlockKeys: for any tokens (4 bytes each), block size and cut,
// the keys continued from the prefix's keys equal the whole prompt's.
func FuzzExtendBlockKeys(f *testing.F) {
	f.Add([]byte("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123"), uint8(16), uint16(5), uint64(BaseSeed))
	f.Add([]byte("hello, world"), uint8(1), uint16(1), uint64(0))
	f.Fuzz(func(t *testing.T, data []byte, bsb uint8, cut uint16, seed uint64) {
		tokens := make([]uint32, len(data)/4)
		for i := range tokens {
			tokens[i] = binary.LittleEndian.Uint32(data[4*i:])
		}
		bs := int(bsb%70) + 1
		c := int(cut) % (len(tokens) + 1)
		want := AppendBlockKeys(nil, tokens, bs, seed)
		if got := ExtendBlockKeys(AppendBlockKeys(nil, tokens[:c], bs, seed), tokens, bs, seed); !slices.Equal(got, want) {
			t.Fatalf("bs %d, cut %d of %d tokens: extended keys differ", bs, c, len(tokens))
		}
	})
}
