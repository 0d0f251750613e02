package extproc

import (
	"encoding/binary"

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
	for _, p := range r.Prompts {
		size += len(p) + 1
	}
	buf := make([]byte, 0, size+3)
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
