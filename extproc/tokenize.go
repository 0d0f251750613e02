package extproc

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/tokenizer/models"
)

// ErrNotTokenizable: the request is neither a chat nor a completion request.
var ErrNotTokenizable = errors.New("request kind is not tokenized")

// ModelTokenizer is the [Tokenizer] that uses each model's own tokenizer and
// chat template (tokenizer/models): chat requests are rendered with the
// template and the generation prompt, then encoded without adding special
// tokens, as vLLM's chat endpoint does; completion prompts are encoded as
// they are (token-id prompts are used as given).
type ModelTokenizer struct {
	Registry *models.Registry
}

var _ Tokenizer = ModelTokenizer{}

// Encode implements [Tokenizer].
func (m ModelTokenizer) Encode(ctx context.Context, req *openai.Request, body []byte) ([]uint32, error) {
	if req.Kind != openai.KindChat && req.Kind != openai.KindCompletion {
		return nil, ErrNotTokenizable
	}
	mod, err := m.Registry.For(req.Model)
	if err != nil {
		return nil, err
	}
	if req.Kind == openai.KindChat {
		in, err := models.ChatInput(body)
		if err != nil {
			return nil, err
		}
		return mod.EncodeChat(ctx, in)
	}
	if len(req.Prompts) == 0 {
		return EstimateTokens(req), nil // token-id prompts
	}
	var out []uint32
	for i, p := range req.Prompts {
		ids, err := mod.Encode(ctx, p)
		if err != nil {
			return nil, fmt.Errorf("prompt %d: %w", i, err)
		}
		out = append(out, ids...)
	}
	return out, nil
}
