//go:build hftokenizers

package hf

import (
	"context"
	"fmt"

	hftok "github.com/daulet/tokenizers"

	"github.com/kvbandit/kvbandit/tokenizer"
)

// Tokenizer wraps a native Hugging Face tokenizer.
type Tokenizer struct {
	tk *hftok.Tokenizer
}

var _ tokenizer.Tokenizer = (*Tokenizer)(nil)

// Load reads a tokenizer.json file.
func Load(path string) (*Tokenizer, error) {
	tk, err := hftok.FromFile(path)
	if err != nil {
		return nil, fmt.Errorf("hf tokenizer %s: %w", path, err)
	}
	return &Tokenizer{tk: tk}, nil
}

// Encode implements [tokenizer.Tokenizer] with add_special_tokens=false,
// as the pure-Go tokenizer does. The native call cannot be interrupted; ctx
// is checked before it.
func (t *Tokenizer) Encode(ctx context.Context, text string) ([]uint32, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ids, _ := t.tk.Encode(text, false)
	return ids, nil
}

// Close frees the native tokenizer.
func (t *Tokenizer) Close() error { return t.tk.Close() }
