package bpe

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"unicode/utf8"
)

// Tokenizer turns text into token ids.
//
// Encode has add_special_tokens=false semantics (no BOS/EOS is added) but special
// tokens occurring in text are matched. It returns ctx.Err() if ctx is cancelled
// while encoding. Implementations are safe for concurrent use; the returned slice
// belongs to the caller.
type Tokenizer interface {
	Encode(ctx context.Context, text string) ([]uint32, error)
}

var _ Tokenizer = (*BPE)(nil)

var (
	// ErrUnsupported is wrapped by Load and Parse when tokenizer.json uses a model,
	// normalizer or pre-tokenizer type (or an option of one) this package does not
	// implement. The message names the type.
	ErrUnsupported = errors.New("unsupported tokenizer feature")
	// ErrCorrupt is wrapped by Load and Parse when tokenizer.json or
	// tokenizer_config.json is not valid JSON or is internally inconsistent.
	ErrCorrupt = errors.New("corrupt tokenizer file")
)

// Config holds the parts of tokenizer_config.json the router needs. Fields are
// empty when the file or the key is absent.
type Config struct {
	BOSToken     string // e.g. "<s>", "<|begin_of_text|>"
	EOSToken     string
	ChatTemplate string // the default chat template (Jinja source)
	AddBOSToken  bool
}

// BPE is a Hugging Face BPE tokenizer loaded from tokenizer.json.
type BPE struct {
	kind         modelKind
	vocabSize    int
	vocab        map[string]uint32 // HF token string -> id (including added tokens)
	rawVocab     map[string]uint32 // byte-level: raw bytes -> id (for ignore_merges)
	merges       map[uint64]mergeVal
	byteIDs      [256]int32 // byte-level: initial symbol of a byte; SentencePiece: <0xXX> fallback; -1 if none
	runeIDs      map[rune]uint32
	ignoreMerges bool
	unkID        int32 // -1 if none
	fuseUnk      bool
	byteFallback bool

	norm   normalizer
	split  splitter      // nil: the whole segment is one word
	added  *addedMatcher // tokens with normalized=false, matched on the raw text
	addedN *addedMatcher // tokens with normalized=true, matched on normalized text (nil if none)

	pieces []*string // id -> decoded text (Decode)

	cfg   Config
	seed  maphash.Seed
	cache []cacheSlot
	pool  sync.Pool // *scratch
}

type modelKind int

const (
	kindByteLevel modelKind = iota + 1
	kindSentencePiece
)

// Load reads a tokenizer from path, which is either a tokenizer.json file or a
// directory holding tokenizer.json and, optionally, tokenizer_config.json
// (only read for a directory; [BPE.Config] is empty otherwise). Errors wrap
// [ErrUnsupported], [ErrCorrupt] or the fs error.
func Load(path string) (*BPE, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	tokPath, cfgPath := path, ""
	if st.IsDir() {
		tokPath = filepath.Join(path, "tokenizer.json")
		cfgPath = filepath.Join(path, "tokenizer_config.json")
	}
	data, err := os.ReadFile(tokPath)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	var cfg []byte
	if cfgPath != "" {
		cfg, err = os.ReadFile(cfgPath)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("tokenizer: %w", err)
		}
	}
	t, err := Parse(data, cfg)
	if err != nil {
		return nil, fmt.Errorf("%w (%s)", err, tokPath)
	}
	return t, nil
}

// Config returns the settings read from tokenizer_config.json.
func (t *BPE) Config() Config { return t.cfg }

// VocabSize returns one more than the largest token id.
func (t *BPE) VocabSize() int { return t.vocabSize }

// TokenID returns the id of a token given as it is spelled in tokenizer.json
// (for byte-level models, "Ġthe" rather than " the"), including added tokens.
func (t *BPE) TokenID(s string) (uint32, bool) {
	id, ok := t.vocab[s]
	return id, ok
}

// Encode implements [Tokenizer]. ctx is checked every 256 pre-tokens and,
// inside a very long pre-token, every 65536 merges.
func (t *BPE) Encode(ctx context.Context, text string) ([]uint32, error) {
	return t.encode(ctx, nil, text)
}

// EncodeAppend appends the ids of text to dst and returns the extended slice.
func (t *BPE) EncodeAppend(dst []uint32, text string) []uint32 {
	dst, _ = t.encode(context.Background(), dst, text)
	return dst
}

const (
	ctxCheckEvery = 256     // pre-tokens between ctx checks
	maxPooled     = 1 << 16 // largest scratch buffers kept for reuse
)

func (t *BPE) encode(ctx context.Context, dst []uint32, text string) ([]uint32, error) {
	if !utf8.ValidString(text) {
		text = toValidUTF8(text)
	}
	sc := t.getScratch()
	defer t.pool.Put(sc)
	sc.ctx = ctx
	sc.err = nil
	sc.n = 0
	sc.out = dst
	t.added.each(text, func(seg string, id int32) bool {
		if id >= 0 {
			sc.out = append(sc.out, uint32(id))
			return true
		}
		t.encodeSegment(sc, seg)
		return sc.err == nil
	})
	out, err := sc.out, sc.err
	sc.out, sc.ctx = nil, nil
	if cap(sc.syms) > maxPooled || cap(sc.heap) > maxPooled {
		sc.syms, sc.heap = nil, nil // do not keep a huge word's buffers
	}
	if err != nil {
		return nil, err
	}
	return out, nil
}

// encodeSegment normalizes, splits on normalized added tokens, pre-tokenizes and
// runs BPE on text that holds no raw added token.
func (t *BPE) encodeSegment(sc *scratch, seg string) {
	seg = t.norm.apply(seg)
	if t.addedN != nil {
		t.addedN.each(seg, func(s string, id int32) bool {
			if id >= 0 {
				sc.out = append(sc.out, uint32(id))
				return true
			}
			t.pretokenize(sc, s)
			return sc.err == nil
		})
		return
	}
	t.pretokenize(sc, seg)
}

func (t *BPE) pretokenize(sc *scratch, s string) {
	if s == "" {
		return
	}
	if t.split == nil {
		t.word(sc, s)
		return
	}
	if sc.ctx != nil && sc.ctx.Err() != nil {
		sc.err = sc.ctx.Err()
		return
	}
	t.split.split(s, func(w string) bool {
		sc.n++
		if sc.ctx != nil && sc.n%ctxCheckEvery == 0 {
			if err := sc.ctx.Err(); err != nil {
				sc.err = err
				return false
			}
		}
		t.word(sc, w)
		return sc.err == nil
	})
}

// toValidUTF8 replaces each byte that is not part of a valid UTF-8 sequence
// with U+FFFD.
func toValidUTF8(s string) string {
	var b strings.Builder
	b.Grow(len(s) + 16)
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteString("\uFFFD")
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}
