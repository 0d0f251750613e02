package bpe

import (
	"strings"

	"golang.org/x/text/unicode/norm"
)

// normalizer is the supported subset of HF normalizers: nothing, NFC, or a
// sequence of Prepend and Replace(String) steps (SentencePiece style).
type normalizer struct {
	nfc   bool
	steps []normStep
}

type normStep struct {
	prepend  string // Prepend: if non-empty, prepended to non-empty text
	old, new string // Replace
}

func (n *normalizer) apply(s string) string {
	if n.nfc && !norm.NFC.IsNormalString(s) {
		s = norm.NFC.String(s)
	}
	for _, st := range n.steps {
		if st.prepend != "" {
			if s != "" {
				s = st.prepend + s
			}
			continue
		}
		s = strings.ReplaceAll(s, st.old, st.new)
	}
	return s
}
