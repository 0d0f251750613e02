package bpe

import (
	"strings"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// SafeSplit returns the largest byte offset b ≤ n (0 ≤ b ≤ len(text)) at which
// text can be cut without changing its tokenization:
//
//	Encode(text) == Encode(text[:b]) ++ Encode(text[b:])
//
// b is one of:
//
//   - 0;
//   - the start or the end of an added token that Encode matches in text (added
//     tokens with normalized=false split the text before anything else, and each
//     piece between them is normalized, pre-tokenized and merged on its own);
//   - for byte-level models whose pre-tokenizer is one of the recognised Split
//     patterns (GPT-2, Llama 3, Qwen2) and whose normalizer is none or NFC, and
//     that have no normalized added tokens: an offset right after "\n" and right
//     before a letter that starts an NFC segment. In those patterns no pre-token
//     crosses such an offset: the only alternatives that can hold "\n" are
//     `\s*[\r\n]+` and ` ?[^\s\p{L}\p{N}]+[\r\n]*`, which both stop before a
//     letter and look no further than it, and the letter starts a new pre-token
//     in the rest. For GPT-2, whose `\s+(?!\S)` looks ahead, the "\n" must also
//     follow a non-space, so the space run is that single "\n" either way. BPE
//     never merges across pre-tokens, and NFC cannot compose across a "\n".
//
// For SentencePiece models only added-token boundaries qualify, because the
// Prepend normalizer adds "▁" to every piece. n outside [0, len(text)] is clamped.
func (t *BPE) SafeSplit(text string, n int) int {
	n = min(max(n, 0), len(text))
	best := 0
	t.cuts(text, 0, n, func(b int, _ cutKind) bool {
		best = b
		return true
	})
	return best
}

// cutKind says why an offset is safe.
type cutKind uint8

const (
	cutInSegment  cutKind = iota + 1 // "\n" then a letter, inside a text segment
	cutMatchStart                    // an added token starts here
	cutMatchEnd                      // an added token ends here
)

// cuts calls fn, in increasing order, with every safe offset from < b ≤ limit
// described by SafeSplit. from must be 0 or a safe offset. fn returns false to
// stop.
func (t *BPE) cuts(text string, from, limit int, fn func(b int, k cutKind) bool) {
	inSeg := t.inSegmentCuts()
	gpt2 := false
	if inSeg {
		_, gpt2 = t.split.(gpt2Splitter)
	}
	last := from // end of the previous added token
	segment := func(lo, hi int) bool {
		if !inSeg {
			return true
		}
		for i := lo; i < hi; {
			k := strings.IndexByte(text[i:hi], '\n')
			if k < 0 {
				return true
			}
			b := i + k + 1
			i = b
			if b > limit {
				return false
			}
			if b >= hi {
				return true
			}
			if !t.letterStarter(text[b:hi]) {
				continue
			}
			if gpt2 && b-1 > lo {
				r, _ := utf8.DecodeLastRuneInString(text[lo : b-1])
				if unicode.IsSpace(r) {
					continue
				}
			}
			if !fn(b, cutInSegment) {
				return false
			}
		}
		return true
	}
	if t.added == nil {
		segment(from, len(text))
		return
	}
	// Matches starting after limit cannot change the cuts at or before it, but an
	// earlier one may end after limit; scan a little beyond it.
	// (+UTFMax: single_word looks at the rune after a match).
	scan := text[:min(len(text), limit+t.added.maxLen+utf8.UTFMax)]
	stop := false
	t.added.find(scan, from, func(sp span) bool {
		if !segment(last, sp.start) || sp.start > limit {
			stop = true
			return false
		}
		if sp.start > from && sp.start != last && !fn(sp.start, cutMatchStart) {
			stop = true
			return false
		}
		if sp.end > limit || !fn(sp.end, cutMatchEnd) {
			stop = true
			return false
		}
		last = sp.end
		return true
	})
	if !stop {
		segment(last, len(text))
	}
}

func (t *BPE) inSegmentCuts() bool {
	if t.kind != kindByteLevel || t.addedN != nil || len(t.norm.steps) > 0 {
		return false
	}
	switch t.split.(type) {
	case llamaSplitter, gpt2Splitter:
		return true
	}
	return false
}

// letterStarter reports whether s starts with a letter that NFC cannot
// combine with what precedes it.
func (t *BPE) letterStarter(s string) bool {
	if s == "" {
		return false
	}
	if s[0] < utf8.RuneSelf {
		return asciiClass[s[0]] == clLetter
	}
	r, n := utf8.DecodeRuneInString(s)
	if r == utf8.RuneError && n == 1 || !unicode.IsLetter(r) {
		return false
	}
	return !t.norm.nfc || norm.NFC.PropertiesString(s).BoundaryBefore()
}

// stillCut reports whether e, a safe offset of kind k in an earlier text that
// shares text[:e] with this one, is safe in text too. It looks only near e: no
// added token may start before e and end after it (the matcher would then see
// a different token), and the condition that made e safe must hold on what
// follows e. It answers false when unsure (tokens with lstrip, rstrip or
// single_word).
func (t *BPE) stillCut(text string, e int, k cutKind) bool {
	if e <= 0 || e > len(text) {
		return false
	}
	if m := t.added; m != nil {
		if m.flags {
			return false
		}
		for p := max(0, e-m.maxLen+1); p < e; p++ {
			if m.first[text[p]] {
				if tok, end := m.longestAt(text, p); tok >= 0 && end > e {
					return false
				}
			}
		}
	}
	switch k {
	case cutMatchEnd:
		return true
	case cutMatchStart:
		tok, _ := t.added.longestAt(text, e)
		return tok >= 0
	case cutInSegment:
		return e < len(text) && text[e-1] == '\n' && t.letterStarter(text[e:])
	}
	return false
}
