package extproc

import (
	"github.com/kvbandit/kvbandit/extproc/openai"
)

// EstimateTokens stands in for a tokenizer: it renders the prompt into a
// canonical byte string (roles and contents of chat messages, or the
// completion prompts) and packs every 4 bytes into one pseudo-token, about
// the ratio of real BPE tokenizers on English. Requests whose rendered
// prompts share a prefix share the pseudo-tokens of that prefix (up to the
// last whole 4-byte group), so block hashing, the KV index and prefix
// affinity keep working without the model's tokenizer. A completion prompt
// given as token ids is used as is. The simulated workers
// (internal/simworker) tokenize with it too, so that without a tokenizer
// their KV events and kvbandit's block keys agree.
func EstimateTokens(r *openai.Request) []uint32 {
	if len(r.PromptTokenIDs) > 0 && len(r.Prompts) == 0 {
		n := 0
		for _, ids := range r.PromptTokenIDs {
			n += len(ids)
		}
		out := make([]uint32, 0, n)
		for _, ids := range r.PromptTokenIDs {
			out = append(out, ids...)
		}
		return out
	}
	size := 0
	for i := range r.Messages {
		size += len(r.Messages[i].Role) + len(r.Messages[i].Content) + 2
	}
	for i, p := range r.Prompts {
		size += len(p)
		if i > 0 {
			size++
		}
	}
	// The canonical string is packed as it is written, without building it.
	w := packer{out: make([]uint32, (size+3)/4)}
	for i := range r.Messages {
		w.str(r.Messages[i].Role)
		w.byte('\n')
		w.str(r.Messages[i].Content)
		w.byte(0)
	}
	for i, p := range r.Prompts {
		if i > 0 {
			w.byte(0)
		}
		w.str(p)
	}
	return w.out
}

// packer writes bytes into little-endian uint32s: byte n goes to bits
// 8*(n%4) of out[n/4]. out starts zeroed, which pads the last group.
type packer struct {
	out []uint32
	n   int
}

func (w *packer) byte(c byte) {
	w.out[w.n>>2] |= uint32(c) << (8 * (w.n & 3))
	w.n++
}

func (w *packer) str(s string) {
	for len(s) > 0 && w.n&3 != 0 {
		w.byte(s[0])
		s = s[1:]
	}
	out := w.out[w.n>>2:]
	k := 0
	for ; len(s) >= 4; k++ {
		out[k] = uint32(s[0]) | uint32(s[1])<<8 | uint32(s[2])<<16 | uint32(s[3])<<24
		s = s[4:]
	}
	w.n += 4 * k
	for i := 0; i < len(s); i++ {
		w.byte(s[i])
	}
}
