package extproc

import (
	"context"
	"errors"
	"fmt"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/tokenizer"
	"github.com/kvbandit/kvbandit/tokenizer/models"
)

// ErrNotTokenizable: the request is neither a chat nor a completion request.
var ErrNotTokenizable = errors.New("request kind is not tokenized")

// ModelTokenizer is the [Tokenizer] that uses each model's own tokenizer and
// chat template (tokenizer/models): chat requests are rendered with the
// template and the generation prompt, then encoded without adding special
// tokens, as vLLM's chat endpoint does; completion prompts are encoded as
// they are (token-id prompts are used as given).
//
// With KeyBlockSize set, it is a [KeyTokenizer]: the prompt's block keys at
// that block size come back with the ids, reused from the model's prefix
// cache for the leading part of the prompt the cache served.
type ModelTokenizer struct {
	Registry *models.Registry
	// KeyBlockSize gives the block size to compute block keys at (the
	// the engine's Engine.KeyBlockSize); nil or <= 0: no keys.
	KeyBlockSize func() int
}

var _ KeyTokenizer = ModelTokenizer{}

// KeyTokenizer is a [Tokenizer] that can also give the prompt's block keys
// (routing.BlockKeys) for the request's seed, so that the engine need not
// hash the prompt (it checks that they fit and hashes otherwise).
type KeyTokenizer interface {
	Tokenizer
	EncodeKeys(ctx context.Context, req *openai.Request, body []byte, seed uint64) ([]uint32, routing.BlockKeys, error)
}

// Encode implements [Tokenizer].
func (m ModelTokenizer) Encode(ctx context.Context, req *openai.Request, body []byte) ([]uint32, error) {
	ids, _, err := m.encode(ctx, req, body, tokenizer.KeySpec{})
	return ids, err
}

// EncodeKeys implements [KeyTokenizer]. Completion requests with several
// prompts get no keys.
func (m ModelTokenizer) EncodeKeys(ctx context.Context, req *openai.Request, body []byte, seed uint64) ([]uint32, routing.BlockKeys, error) {
	var spec tokenizer.KeySpec
	if m.KeyBlockSize != nil {
		spec = tokenizer.KeySpec{BlockSize: m.KeyBlockSize(), Seed: seed, Extend: kvindex.ExtendBlockKeys}
	}
	ids, keys, err := m.encode(ctx, req, body, spec)
	if err != nil || keys == nil {
		return ids, routing.BlockKeys{}, err
	}
	return ids, routing.BlockKeys{BlockSize: spec.BlockSize, Seed: seed, Keys: keys}, nil
}

func (m ModelTokenizer) encode(ctx context.Context, req *openai.Request, body []byte, spec tokenizer.KeySpec) ([]uint32, []uint64, error) {
	if req.Kind != openai.KindChat && req.Kind != openai.KindCompletion {
		return nil, nil, ErrNotTokenizable
	}
	mod, err := m.Registry.For(req.Model)
	if err != nil {
		return nil, nil, err
	}
	if req.Kind == openai.KindChat {
		// body is the one req was parsed from, checked valid JSON then.
		in, err := models.ChatInputChecked(body)
		if err != nil {
			return nil, nil, err
		}
		return mod.EncodeChatKeys(ctx, in, spec)
	}
	switch len(req.Prompts) {
	case 0:
		return EstimateTokens(req), nil, nil // token-id prompts
	case 1:
		return mod.EncodeKeys(ctx, req.Prompts[0], spec)
	}
	var out []uint32
	for i, p := range req.Prompts {
		ids, err := mod.Encode(ctx, p)
		if err != nil {
			return nil, nil, fmt.Errorf("prompt %d: %w", i, err)
		}
		out = append(out, ids...)
	}
	return out, nil, nil
}
