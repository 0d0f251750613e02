package extproc

import (
	"context"
	"errors"
	"time"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/tokenizer/models"
)

// ParseRequest reads an OpenAI request body of the given kind into req:
// model, stream flag, output limit, cache salt, and the routing hints
// (header first, then nvext; see package hints) and the TTFT objective
// (an invalid one is an error, see hints.Objective). A chat or completion body
// that does not parse is an error (mapped by [Reject]); for any other path
// the body is optional and one that does not parse is routed by load only
// (parsed is nil). It is the request-building step shared by the ext_proc
// server and the standalone proxy (extproc/proxy).
func ParseRequest(kind openai.Kind, body []byte, header hints.Getter, req *routing.Request) (parsed *openai.Request, problems hints.Problems, err error) {
	if len(body) > 0 || kind != openai.KindOther {
		parsed, err = openai.Parse(kind, body)
		if err != nil {
			if kind != openai.KindOther {
				return nil, problems, err
			}
			parsed = nil // unknown paths are routed by load only
		}
	}
	nv := openai.NVExt{}
	if parsed != nil {
		req.Model = routing.ModelName(parsed.Model)
		req.Stream = parsed.Stream
		req.MaxTokens = parsed.MaxTokens
		req.CacheSalt = parsed.CacheSalt
		nv = parsed.NVExt
	}
	req.Hints, problems = hints.Parse(header, nv)
	if req.Hints.TTFTObjective, err = hints.Objective(header, nv); err != nil {
		return parsed, problems, err
	}
	return parsed, problems, nil
}

// Tokenizer fallback reasons returned by [TokenizeRequest] (the label
// values of kvbandit_tokenizer_fallbacks_total).
const (
	FallbackNoTokenizer = "no_tokenizer"
	FallbackError       = "error"
	FallbackTimeout     = "timeout"
)

// TokenizeRequest fills req's tokens with tok, bounded by timeout, or with
// the byte-based estimate when tok is nil or fails; a [KeyTokenizer] fills
// req's block keys too, for req's seed (its LoRA and cache salt, so they
// must be set before). fallback is "" when tok succeeded, else one of the
// Fallback reasons; err is the tokenizer's error (for a log line: req is
// filled either way).
func TokenizeRequest(ctx context.Context, tok Tokenizer, timeout time.Duration, parsed *openai.Request, body []byte, req *routing.Request) (fallback string, err error) {
	fallback = FallbackNoTokenizer
	if tok != nil {
		tctx, cancel := context.WithTimeout(ctx, timeout)
		var (
			ids  []uint32
			keys routing.BlockKeys
			terr error
		)
		if kt, ok := tok.(KeyTokenizer); ok {
			ids, keys, terr = kt.EncodeKeys(tctx, parsed, body, kvindex.Seed(req.LoRA, req.CacheSalt))
		} else {
			ids, terr = tok.Encode(tctx, parsed, body)
		}
		cancel()
		if terr == nil {
			req.Tokens, req.TokenCount, req.Keys = ids, len(ids), keys
			return "", nil
		}
		err = terr
		fallback = FallbackError
		switch {
		case errors.Is(terr, context.DeadlineExceeded):
			fallback = FallbackTimeout
		case errors.Is(terr, models.ErrNoTokenizer):
			fallback = FallbackNoTokenizer
		}
	}
	req.Tokens = EstimateTokens(parsed)
	req.TokenCount = len(req.Tokens)
	req.Estimated = true
	return fallback, err
}
