package extproc

import (
	"slices"
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
