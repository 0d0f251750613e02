package extproc

import (
	"encoding/binary"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/extproc/openai"
)

func TestEstimateTokensSharesPrefixes(t *testing.T) {
	parse := func(body string) *openai.Request {
		t.Helper()
		r, err := openai.Parse(openai.KindChat, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	turn1 := EstimateTokens(parse(`{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant with a long system prompt."},{"role":"user","content":"first question"}]}`))
	turn2 := EstimateTokens(parse(`{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant with a long system prompt."},{"role":"user","content":"first question"},{"role":"assistant","content":"an answer"},{"role":"user","content":"second"}]}`))
	if len(turn1) < 10 || len(turn2) <= len(turn1) {
		t.Fatalf("lengths %d %d", len(turn1), len(turn2))
	}
	// Everything but turn 1's last (padded) group is a prefix of turn 2.
	if !slices.Equal(turn1[:len(turn1)-1], turn2[:len(turn1)-1]) {
		t.Fatal("a growing conversation does not share its prefix tokens")
	}
	other := EstimateTokens(parse(`{"model":"m","messages":[{"role":"system","content":"Different."}]}`))
	if slices.Equal(other[:2], turn1[:2]) {
		t.Fatal("different prompts share tokens")
	}
	ids, err := openai.Parse(openai.KindCompletion, []byte(`{"model":"m","prompt":[1,2,3,40000]}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := EstimateTokens(ids); !slices.Equal(got, []uint32{1, 2, 3, 40000}) {
		t.Fatalf("token-id prompt: %v", got)
	}
	if got := EstimateTokens(&openai.Request{}); len(got) != 0 {
		t.Fatalf("empty: %v", got)
	}
}

// estimateByCopy is EstimateTokens as first written: build the canonical
// string, pad it, then cut it into 4-byte groups. The packer must agree.
func estimateByCopy(r *openai.Request) []uint32 {
	var buf []byte
	for i := range r.Messages {
		buf = append(buf, r.Messages[i].Role...)
		buf = append(buf, '\n')
		buf = append(buf, r.Messages[i].Content...)
		buf = append(buf, 0)
	}
	for i, p := range r.Prompts {
		if i > 0 {
			buf = append(buf, 0)
		}
		buf = append(buf, p...)
	}
	for len(buf)%4 != 0 {
		buf = append(buf, 0)
	}
	out := make([]uint32, len(buf)/4)
	for i := range out {
		out[i] = binary.LittleEndian.Uint32(buf[4*i:])
	}
	return out
}

// TestEstimateTokensPacksLikeCopy: the packer gives the same pseudo-tokens
// as building the string and cutting it, for every alignment of roles,
// contents and prompts (lengths 0 to 9, so every offset mod 4 is met).
func TestEstimateTokensPacksLikeCopy(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 16))
	text := func() string {
		var b strings.Builder
		for range rng.IntN(10) {
			b.WriteByte(byte(rng.IntN(256)))
		}
		return b.String()
	}
	for range 2000 {
		r := &openai.Request{}
		for range rng.IntN(4) {
			r.Messages = append(r.Messages, openai.Message{Role: text(), Content: text()})
		}
		for range rng.IntN(4) {
			r.Prompts = append(r.Prompts, text())
		}
		if got, want := EstimateTokens(r), estimateByCopy(r); !slices.Equal(got, want) {
			t.Fatalf("%+v: got %v, want %v", r, got, want)
		}
	}
}

// BenchmarkEstimateTokens: a 4 KiB chat prompt.
func BenchmarkEstimateTokens(b *testing.B) {
	r := &openai.Request{Messages: []openai.Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: strings.Repeat("lorem ipsum dolor sit amet ", 150)}}}
	b.ReportAllocs()
	for b.Loop() {
		EstimateTokens(r)
	}
}
