package bpe

import (
	"fmt"
	"strings"
)

// Decode returns the text of ids, the inverse of Encode up to normalization:
// for byte-level models Decode(Encode(s)) is the NFC form (if the model
// normalizes) of s with invalid UTF-8 replaced; for SentencePiece models "▁"
// becomes a space, so every text piece between added tokens gains the leading
// space the Prepend normalizer added. Added tokens decode to their content. It
// fails on an id that is not in the vocabulary. The result may hold invalid
// UTF-8 when ids end inside a multi-byte character.
func (t *BPE) Decode(ids []uint32) (string, error) {
	var b strings.Builder
	for _, id := range ids {
		if int(id) >= len(t.pieces) || t.pieces[id] == nil {
			return "", fmt.Errorf("tokenizer: decode: id %d not in vocabulary", id)
		}
		b.WriteString(*t.pieces[id])
	}
	return b.String(), nil
}

// buildPieces fills t.pieces, the decoded text of every id.
func (t *BPE) buildPieces(vocab map[string]uint32, added []addedToken) {
	t.pieces = make([]*string, t.vocabSize)
	set := func(id uint32, s string) { t.pieces[id] = &s }
	if t.kind == kindByteLevel {
		for raw, id := range t.rawVocab {
			set(id, raw)
		}
	} else {
		for s, id := range vocab {
			var b byte
			if n, err := fmt.Sscanf(s, "<0x%02X>", &b); err == nil && n == 1 && len(s) == 6 {
				set(id, string([]byte{b}))
				continue
			}
			set(id, strings.ReplaceAll(s, metaspace, " "))
		}
	}
	for _, a := range added {
		set(a.ID, a.Content)
	}
}
