// Package tokenizers is a pure-Go stand-in for github.com/daulet/tokenizers
// v1.22.1 (cgo bindings over HF's Rust tokenizers), with the part of its API
// that llm-d-kv-cache-manager v0.4.0 uses. Encoding is done by ./bpe, a copy
// of kvbandit's tokenizer package (byte-level BPE as in Qwen2/3, Llama 3 and
// DeepSeek-V3, and SentencePiece-style BPE as in Mistral 7B / Llama 2), which
// matches HF token ids on its oracle corpus.
//
// Differences from the original:
//   - FromPretrained never downloads: it loads <cacheDir>/<modelID>/tokenizer.json
//     if that file exists and fails otherwise;
//   - offsets are byte offsets into the text as tokenized, i.e. after the
//     tokenizer's normalizer (equal to HF's for NFC text, which is all ASCII);
//   - type ids, attention mask and special-tokens mask are all zeros/ones of
//     the right length (nothing in llm-d reads them).
package tokenizers

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/daulet/tokenizers/bpe"
)

// Tokenizer encodes text with a tokenizer.json.
type Tokenizer struct {
	bpe *bpe.BPE
}

type tokenizerOpts struct {
	encodeSpecialTokens bool
}

// TokenizerOption configures FromBytes.
type TokenizerOption func(to *tokenizerOpts)

// WithEncodeSpecialTokens is accepted for compatibility; added tokens present
// in the text are always matched, as HF does.
func WithEncodeSpecialTokens() TokenizerOption {
	return func(to *tokenizerOpts) { to.encodeSpecialTokens = true }
}

// FromBytes parses a tokenizer.json held in memory.
func FromBytes(data []byte, opts ...TokenizerOption) (*Tokenizer, error) {
	b, err := bpe.Parse(data, nil)
	if err != nil {
		return nil, err
	}
	return &Tokenizer{bpe: b}, nil
}

// FromFile loads a tokenizer.json file (or a directory holding one).
func FromFile(path string) (*Tokenizer, error) {
	b, err := bpe.Load(path)
	if err != nil {
		return nil, err
	}
	return &Tokenizer{bpe: b}, nil
}

type tokenizerConfig struct {
	cacheDir  *string
	authToken *string
}

// TokenizerConfigOption configures FromPretrained.
type TokenizerConfigOption func(cfg *tokenizerConfig)

// WithCacheDir sets the directory FromPretrained looks in.
func WithCacheDir(path string) TokenizerConfigOption {
	return func(cfg *tokenizerConfig) { cfg.cacheDir = &path }
}

// WithAuthToken is accepted for compatibility and ignored (nothing is downloaded).
func WithAuthToken(token string) TokenizerConfigOption {
	return func(cfg *tokenizerConfig) { cfg.authToken = &token }
}

// ErrNoDownload is returned by FromPretrained when the tokenizer is not on disk.
var ErrNoDownload = errors.New("tokenizers (pure-Go stand-in): FromPretrained does not download; put tokenizer.json in the cache dir or use a local tokenizer")

// FromPretrained loads <cacheDir>/<modelID>/tokenizer.json (the layout the
// original downloads into); cacheDir defaults to $HF_HOME or ./.cache. It
// never goes to the network.
func FromPretrained(modelID string, opts ...TokenizerConfigOption) (*Tokenizer, error) {
	cfg := &tokenizerConfig{}
	for _, o := range opts {
		o(cfg)
	}
	dir := ""
	if cfg.cacheDir != nil {
		dir = *cfg.cacheDir
	} else if h := os.Getenv("HF_HOME"); h != "" {
		dir = h
	} else {
		dir = ".cache"
	}
	path := filepath.Join(dir, modelID, "tokenizer.json")
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrNoDownload, modelID, err)
	}
	return FromFile(path)
}

// Close releases nothing.
func (t *Tokenizer) Close() error { return nil }

// Offset is a [start, end) byte range of a token in the text.
type Offset [2]uint

// Encoding is the result of EncodeWithOptions.
type Encoding struct {
	IDs               []uint32
	TypeIDs           []uint32
	SpecialTokensMask []uint32
	AttentionMask     []uint32
	Tokens            []string
	Offsets           []Offset
}

type encodeOpts struct {
	ReturnTypeIDs           bool
	ReturnTokens            bool
	ReturnSpecialTokensMask bool
	ReturnAttentionMask     bool
	ReturnOffsets           bool
}

// EncodeOption selects what EncodeWithOptions returns besides ids.
type EncodeOption func(eo *encodeOpts)

// WithReturnAllAttributes returns everything.
func WithReturnAllAttributes() EncodeOption {
	return func(eo *encodeOpts) {
		eo.ReturnTypeIDs, eo.ReturnTokens, eo.ReturnSpecialTokensMask = true, true, true
		eo.ReturnAttentionMask, eo.ReturnOffsets = true, true
	}
}

// WithReturnTypeIDs returns type ids (all zero).
func WithReturnTypeIDs() EncodeOption { return func(eo *encodeOpts) { eo.ReturnTypeIDs = true } }

// WithReturnSpecialTokensMask returns the special-tokens mask (all zero).
func WithReturnSpecialTokensMask() EncodeOption {
	return func(eo *encodeOpts) { eo.ReturnSpecialTokensMask = true }
}

// WithReturnTokens returns each token's decoded text.
func WithReturnTokens() EncodeOption { return func(eo *encodeOpts) { eo.ReturnTokens = true } }

// WithReturnAttentionMask returns the attention mask (all one).
func WithReturnAttentionMask() EncodeOption {
	return func(eo *encodeOpts) { eo.ReturnAttentionMask = true }
}

// WithReturnOffsets returns byte offsets.
func WithReturnOffsets() EncodeOption { return func(eo *encodeOpts) { eo.ReturnOffsets = true } }

// Encode returns the ids and token texts of str. addSpecialTokens is ignored:
// no BOS/EOS is added (HF's add_special_tokens=False); the tokenizers llm-d
// targets (Qwen3, Llama 3 chat) get their specials from the chat template.
func (t *Tokenizer) Encode(str string, addSpecialTokens bool) ([]uint32, []string) {
	e := t.EncodeWithOptions(str, addSpecialTokens, WithReturnTokens())
	return e.IDs, e.Tokens
}

// EncodeWithOptions encodes str.
func (t *Tokenizer) EncodeWithOptions(str string, addSpecialTokens bool, opts ...EncodeOption) Encoding {
	var o encodeOpts
	for _, f := range opts {
		f(&o)
	}
	ids, err := t.bpe.Encode(context.Background(), str)
	if err != nil {
		return Encoding{}
	}
	enc := Encoding{IDs: ids}
	n := len(ids)
	if o.ReturnTypeIDs {
		enc.TypeIDs = make([]uint32, n)
	}
	if o.ReturnSpecialTokensMask {
		enc.SpecialTokensMask = make([]uint32, n)
	}
	if o.ReturnAttentionMask {
		enc.AttentionMask = make([]uint32, n)
		for i := range enc.AttentionMask {
			enc.AttentionMask[i] = 1
		}
	}
	if o.ReturnTokens || o.ReturnOffsets {
		if o.ReturnTokens {
			enc.Tokens = make([]string, n)
		}
		if o.ReturnOffsets {
			enc.Offsets = make([]Offset, n)
		}
		var pos uint
		for i, id := range ids {
			piece, _ := t.bpe.Decode([]uint32{id})
			if o.ReturnTokens {
				enc.Tokens[i] = piece
			}
			if o.ReturnOffsets {
				enc.Offsets[i] = Offset{pos, pos + uint(len(piece))}
			}
			pos += uint(len(piece))
		}
	}
	return enc
}

// Decode returns the text of tokenIDs (skipSpecialTokens is ignored).
func (t *Tokenizer) Decode(tokenIDs []uint32, skipSpecialTokens bool) string {
	s, _ := t.bpe.Decode(tokenIDs)
	return s
}

// VocabSize returns the vocabulary size.
func (t *Tokenizer) VocabSize() uint32 { return uint32(t.bpe.VocabSize()) }
