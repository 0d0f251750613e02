package kvindex

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/zeebo/xxh3"
)

// sharedVectors is the golden file shared by every implementation of the
// scheme; CI clones main with shared/ beside it.
var sharedVectors = filepath.Join("..", "..", "..", "shared", "testdata", "block-hashes.json")

// u64 decodes a JSON number or a decimal string into a uint64 (the golden
// file writes values above 2^53 as strings).
type u64 uint64

func (v *u64) UnmarshalJSON(b []byte) error {
	s := string(b)
	if uq, err := strconv.Unquote(s); err == nil {
		s = uq
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return fmt.Errorf("u64 %s: %w", b, err)
	}
	*v = u64(n)
	return nil
}

type goldenFile struct {
	XXH3 []struct {
		Input string `json:"input_utf8"`
		Seed  u64    `json:"seed"`
		Hash  u64    `json:"hash"`
	} `json:"xxh3_64"`
	Sequences []struct {
		Tokens    []uint32 `json:"tokens"`
		BlockSize int      `json:"block_size"`
		Local     []u64    `json:"local"`
		Seq       []u64    `json:"seq"`
	} `json:"sequences"`
	Salted []struct {
		Tokens    []uint32 `json:"tokens"`
		BlockSize int      `json:"block_size"`
		LoRA      string   `json:"lora_name"`
		Namespace string   `json:"cache_namespace"`
		Seed      u64      `json:"seed"`
		Local     u64      `json:"local"`
	} `json:"salted_block"`
}

func loadGolden(t *testing.T) goldenFile {
	t.Helper()
	b, err := os.ReadFile(sharedVectors)
	if err != nil {
		t.Fatalf("golden vectors (shared/ must sit beside the repository): %v", err)
	}
	var g goldenFile
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatalf("decode %s: %v", sharedVectors, err)
	}
	if len(g.XXH3) == 0 || len(g.Sequences) == 0 || len(g.Salted) == 0 {
		t.Fatalf("%s: a section is empty: %+v", sharedVectors, g)
	}
	return g
}

func TestGoldenXXH3(t *testing.T) {
	for _, v := range loadGolden(t).XXH3 {
		if got := xxh3.HashSeed([]byte(v.Input), uint64(v.Seed)); got != uint64(v.Hash) {
			t.Errorf("XXH3_64(%q, %d) = %d, want %d", v.Input, v.Seed, got, v.Hash)
		}
	}
}

func TestGoldenSequences(t *testing.T) {
	for i, v := range loadGolden(t).Sequences {
		t.Run(fmt.Sprintf("%d/block=%d", i, v.BlockSize), func(t *testing.T) {
			n := len(v.Tokens) / v.BlockSize
			if len(v.Local) != n {
				t.Fatalf("vector has %d local hashes for %d blocks", len(v.Local), n)
			}
			for b := range n {
				got := LocalHash(v.Tokens[b*v.BlockSize:(b+1)*v.BlockSize], BaseSeed)
				if got != uint64(v.Local[b]) {
					t.Errorf("local[%d] = %d, want %d", b, got, v.Local[b])
				}
			}
			keys := AppendBlockKeys(nil, v.Tokens, v.BlockSize, Seed("", ""))
			if len(keys) != n {
				t.Fatalf("AppendBlockKeys gave %d keys, want %d", len(keys), n)
			}
			// Continued from any number of leading keys, the chain is the same.
			for k := range n + 1 {
				if got := ExtendBlockKeys(slices.Clone(keys[:k]), v.Tokens, v.BlockSize, Seed("", "")); !slices.Equal(got, keys) {
					t.Errorf("ExtendBlockKeys from %d keys differs from AppendBlockKeys", k)
				}
			}
			if len(v.Seq) == 0 {
				if keys[0] != uint64(v.Local[0]) {
					t.Errorf("key[0] = %d, want local[0] %d", keys[0], v.Local[0])
				}
				return
			}
			for b, want := range v.Seq {
				if keys[b] != uint64(want) {
					t.Errorf("seq[%d] = %d, want %d", b, keys[b], want)
				}
				if b > 0 {
					if got := ChainHash(uint64(v.Seq[b-1]), uint64(v.Local[b])); got != uint64(want) {
						t.Errorf("ChainHash(seq[%d], local[%d]) = %d, want %d", b-1, b, got, want)
					}
				}
			}
		})
	}
}

func TestGoldenSalted(t *testing.T) {
	for _, v := range loadGolden(t).Salted {
		t.Run(fmt.Sprintf("lora=%q/ns=%q", v.LoRA, v.Namespace), func(t *testing.T) {
			seed := Seed(v.LoRA, v.Namespace)
			if seed != uint64(v.Seed) {
				t.Fatalf("Seed = %d, want %d", seed, v.Seed)
			}
			if got := LocalHash(v.Tokens[:v.BlockSize], seed); got != uint64(v.Local) {
				t.Errorf("LocalHash = %d, want %d", got, v.Local)
			}
			keys := AppendBlockKeys(nil, v.Tokens, v.BlockSize, seed)
			if len(keys) != 1 || keys[0] != uint64(v.Local) {
				t.Errorf("AppendBlockKeys = %v, want [%d]", keys, v.Local)
			}
		})
	}
}

func TestSeedSaltDomains(t *testing.T) {
	if Seed("", "") != BaseSeed {
		t.Fatalf("unsalted seed = %d", Seed("", ""))
	}
	// The inner seeds 0 and 1 keep a LoRA "x" apart from a namespace "x".
	if Seed("x", "") == Seed("", "x") {
		t.Fatal("lora and namespace salts collide")
	}
}

func TestAppendBlockKeysShapes(t *testing.T) {
	tokens := make([]uint32, 103)
	for i := range tokens {
		tokens[i] = uint32(i * 7)
	}
	full := AppendBlockKeys(nil, tokens[:96], 16, BaseSeed)
	tests := []struct {
		name      string
		tokens    []uint32
		blockSize int
		want      int
	}{
		{"no tokens", nil, 16, 0},
		{"fewer than a block", tokens[:15], 16, 0},
		{"exact blocks", tokens[:96], 16, 6},
		{"partial tail ignored", tokens, 16, 6},
		{"block size zero", tokens, 0, 0},
		{"negative block size", tokens, -4, 0},
		{"block size one", tokens[:5], 1, 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix := []uint64{42}
			got := AppendBlockKeys(prefix, tt.tokens, tt.blockSize, BaseSeed)
			if len(got) != 1+tt.want || got[0] != 42 {
				t.Fatalf("got %d keys (head %v), want 1+%d", len(got), got[:1], tt.want)
			}
			if tt.blockSize == 16 {
				for i, k := range got[1:] {
					if k != full[i] {
						t.Errorf("key %d differs from the exact-block chain", i)
					}
				}
			}
		})
	}
}

func TestAppendBlockKeysNoAllocs(t *testing.T) {
	tokens := make([]uint32, 8192)
	dst := make([]uint64, 0, 512)
	allocs := testing.AllocsPerRun(20, func() {
		dst = AppendBlockKeys(dst[:0], tokens, 16, BaseSeed)
	})
	if allocs != 0 {
		t.Fatalf("AppendBlockKeys allocated %.0f times per run", allocs)
	}
}

// BenchmarkBlockKeys measures hashing a prompt into chained block keys
// (budget: 9µs for 8192 tokens in blocks of 16).
func BenchmarkBlockKeys(b *testing.B) {
	for _, n := range []int{512, 8192, 131072} {
		b.Run(fmt.Sprintf("tokens=%d", n), func(b *testing.B) {
			tokens := make([]uint32, n)
			for i := range tokens {
				tokens[i] = uint32(i) * 2654435761 % 150000
			}
			dst := make([]uint64, 0, n/16)
			b.ReportAllocs()
			b.SetBytes(int64(4 * n))
			for b.Loop() {
				dst = AppendBlockKeys(dst[:0], tokens, 16, BaseSeed)
			}
		})
	}
}

// TestChainHashIsXXH3: the written-out chain step equals XXH3-64 of
// le64(parent) || le64(local) with BaseSeed, on edge and random words.
func TestChainHashIsXXH3(t *testing.T) {
	words := []uint64{0, 1, BaseSeed, math.MaxUint64, 1 << 63, 0x0123456789abcdef}
	rnd := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		words = append(words, rnd.Uint64())
	}
	for i, p := range words {
		l := words[(i*7+3)%len(words)]
		var b [16]byte
		binary.LittleEndian.PutUint64(b[:8], p)
		binary.LittleEndian.PutUint64(b[8:], l)
		if got, want := ChainHash(p, l), xxh3.HashSeed(b[:], BaseSeed); got != want {
			t.Fatalf("ChainHash(%#x, %#x) = %#x, xxh3 says %#x", p, l, got, want)
		}
	}
}

// TestAppendKeys16IsXXH3: the 16-token fast path gives the keys of the
// general definition (LocalHash through xxh3, ChainHash) for random
// tokens, seeds (salted or not) and block counts, a trailing partial block
// ignored.
func TestAppendKeys16IsXXH3(t *testing.T) {
	rnd := rand.New(rand.NewPCG(3, 4))
	for trial := range 300 {
		toks := make([]uint32, rnd.IntN(40*16))
		for i := range toks {
			toks[i] = rnd.Uint32()
		}
		seed := BaseSeed
		if trial%2 == 1 {
			seed = Seed(fmt.Sprint("lora", trial), fmt.Sprint("ns", trial%3))
		}
		got := AppendBlockKeys([]uint64{42}, toks, 16, seed)
		want := []uint64{42}
		for i := 0; i+16 <= len(toks); i += 16 {
			b := make([]byte, 64)
			for j, tk := range toks[i : i+16] {
				binary.LittleEndian.PutUint32(b[4*j:], tk)
			}
			local := xxh3.HashSeed(b, seed)
			if i == 0 {
				want = append(want, local)
			} else {
				var c [16]byte
				binary.LittleEndian.PutUint64(c[:8], want[len(want)-1])
				binary.LittleEndian.PutUint64(c[8:], local)
				want = append(want, xxh3.HashSeed(c[:], BaseSeed))
			}
		}
		if !slices.Equal(got, want) {
			t.Fatalf("trial %d (%d tokens, seed %#x): keys differ\ngot  %x\nwant %x", trial, len(toks), seed, got, want)
		}
	}
}
