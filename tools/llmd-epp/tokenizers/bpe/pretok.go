package bpe

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// splitter cuts a string into pre-tokens. emit returns false to stop early.
// Pre-tokens are substrings of s, in order, covering all of s.
type splitter interface {
	split(s string, emit func(string) bool) bool
}

// The Split patterns recognised by their exact strings (DeepSeek-V3's are in
// pretok_deepseek.go).
const (
	patGPT2   = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
	patLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	patQwen2  = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// newSplitter returns the hand-written splitter for a known pattern, or a
// regexp2 splitter for any other.
func newSplitter(pattern string, forceRegexp bool) (splitter, error) {
	if !forceRegexp {
		switch pattern {
		case patGPT2:
			return gpt2Splitter{}, nil
		case patLlama3:
			return llamaSplitter{maxDigits: 3}, nil
		case patQwen2:
			return llamaSplitter{maxDigits: 1}, nil
		case patDeepSeekDigits:
			return runSplitter{in: unicode.IsNumber, max: 3}, nil
		case patDeepSeekCJK:
			return runSplitter{in: isDeepSeekCJK}, nil
		case patDeepSeekWords:
			return deepSeekWords{}, nil
		}
	}
	re, err := regexp2.Compile(pattern, regexp2.None)
	if err != nil {
		return nil, fmt.Errorf("Split pattern %q: %w: %w", pattern, ErrUnsupported, err)
	}
	return &regexpSplitter{re: re}, nil
}

// regexpSplitter implements Split with behavior Isolated: matches and the gaps
// between them are pre-tokens.
type regexpSplitter struct{ re *regexp2.Regexp }

func (r *regexpSplitter) split(s string, emit func(string) bool) bool {
	// regexp2 works on runes; map rune indices back to byte offsets.
	runes := []rune(s)
	offs := make([]int, len(runes)+1)
	b := 0
	for i, c := range runes {
		offs[i] = b
		b += utf8.RuneLen(c)
	}
	offs[len(runes)] = b
	last := 0
	m, err := r.re.FindRunesMatch(runes)
	for err == nil && m != nil {
		st, en := m.Index, m.Index+m.Length
		if st > last {
			if !emit(s[offs[last]:offs[st]]) {
				return false
			}
		}
		if en > st {
			if !emit(s[offs[st]:offs[en]]) {
				return false
			}
		}
		last = en
		m, err = r.re.FindNextMatch(m)
	}
	if last < len(runes) {
		return emit(s[offs[last]:])
	}
	return true
}

// seqSplitter applies several splitters in turn (pre_tokenizers Sequence).
type seqSplitter []splitter

func (q seqSplitter) split(s string, emit func(string) bool) bool {
	return q.at(0, s, emit)
}

func (q seqSplitter) at(i int, s string, emit func(string) bool) bool {
	if i == len(q) {
		return emit(s)
	}
	return q[i].split(s, func(p string) bool { return q.at(i+1, p, emit) })
}

// character classes
const (
	clOther = iota
	clLetter
	clNumber
	clSpace // \s other than \r \n
	clNL    // \r or \n
)

var asciiClass = func() (t [128]uint8) {
	for c := 0; c < 128; c++ {
		r := rune(c)
		switch {
		case r == '\r' || r == '\n':
			t[c] = clNL
		case unicode.IsSpace(r):
			t[c] = clSpace
		case unicode.IsLetter(r):
			t[c] = clLetter
		case unicode.IsNumber(r):
			t[c] = clNumber
		default:
			t[c] = clOther
		}
	}
	return t
}()

// classAt returns the class of the rune at s[i] and its size.
func classAt(s string, i int) (uint8, int) {
	c := s[i]
	if c < utf8.RuneSelf {
		return asciiClass[c], 1
	}
	r, n := utf8.DecodeRuneInString(s[i:])
	switch {
	case unicode.IsLetter(r):
		return clLetter, n
	case unicode.IsNumber(r):
		return clNumber, n
	case unicode.IsSpace(r):
		return clSpace, n
	}
	return clOther, n
}

func isSpaceClass(c uint8) bool { return c == clSpace || c == clNL }

// contraction returns the length of 's 't 're 've 'm 'll 'd at s[i:]
// (s[i] == '\”), or 0. fold makes it case-insensitive (ASCII only, as the
// corpus-checked regexp2 behaviour).
func contraction(s string, i int, fold bool) int {
	if i+1 >= len(s) {
		return 0
	}
	lower := func(c byte) byte {
		if fold && c >= 'A' && c <= 'Z' {
			return c + 32
		}
		return c
	}
	switch lower(s[i+1]) {
	case 's', 't', 'm', 'd':
		return 2
	case 'r', 'v':
		if i+2 < len(s) && lower(s[i+2]) == 'e' {
			return 3
		}
	case 'l':
		if i+2 < len(s) && lower(s[i+2]) == 'l' {
			return 3
		}
	}
	return 0
}

// spaceRun returns the end of the run of whitespace starting at i and the
// start offset of the last rune of the run and of its last \r or \n (-1 if none).
func spaceRun(s string, i int) (end, lastStart, lastNL int) {
	lastNL = -1
	end = i
	for end < len(s) {
		c, n := classAt(s, end)
		if !isSpaceClass(c) {
			break
		}
		if c == clNL {
			lastNL = end
		}
		lastStart = end
		end += n
	}
	return end, lastStart, lastNL
}

// llamaSplitter is the Llama 3 (maxDigits 3) and Qwen2 (maxDigits 1) pattern:
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
type llamaSplitter struct{ maxDigits int }

func (p llamaSplitter) split(s string, emit func(string) bool) bool {
	for i := 0; i < len(s); {
		j := p.next(s, i)
		if !emit(s[i:j]) {
			return false
		}
		i = j
	}
	return true
}

func (p llamaSplitter) next(s string, i int) int {
	c, n := classAt(s, i)
	if s[i] == '\'' {
		if k := contraction(s, i, true); k > 0 {
			return i + k
		}
	}
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if c == clLetter {
		return letterRun(s, i+n)
	}
	if c != clNL && c != clNumber && i+n < len(s) {
		if c2, _ := classAt(s, i+n); c2 == clLetter {
			return letterRun(s, i+n)
		}
	}
	// \p{N}{1,3}
	if c == clNumber {
		j := i + n
		for d := 1; d < p.maxDigits && j < len(s); d++ {
			c2, n2 := classAt(s, j)
			if c2 != clNumber {
				break
			}
			j += n2
		}
		return j
	}
	//  ?[^\s\p{L}\p{N}]+[\r\n]*
	j := i
	if s[i] == ' ' && i+1 < len(s) {
		if c2, _ := classAt(s, i+1); c2 == clOther {
			j = i + 1
		}
	}
	if c2, _ := classAt(s, j); c2 == clOther {
		for j < len(s) {
			c3, n3 := classAt(s, j)
			if c3 != clOther {
				break
			}
			j += n3
		}
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	// whitespace: \s*[\r\n]+ | \s+(?!\S) | \s+
	end, lastStart, lastNL := spaceRun(s, i)
	if lastNL >= 0 {
		return lastNL + 1
	}
	if end == len(s) || lastStart == i {
		return end
	}
	return lastStart
}

func letterRun(s string, j int) int {
	for j < len(s) {
		if b := s[j]; b < utf8.RuneSelf {
			// ASCII inline: classAt is a call per byte.
			if asciiClass[b] != clLetter {
				break
			}
			j++
			continue
		}
		c, n := classAt(s, j)
		if c != clLetter {
			break
		}
		j += n
	}
	return j
}

// gpt2Splitter is the GPT-2 pattern:
// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
type gpt2Splitter struct{}

func (gpt2Splitter) split(s string, emit func(string) bool) bool {
	for i := 0; i < len(s); {
		j := gpt2Next(s, i)
		if !emit(s[i:j]) {
			return false
		}
		i = j
	}
	return true
}

func gpt2Next(s string, i int) int {
	if s[i] == '\'' {
		if k := contraction(s, i, false); k > 0 {
			return i + k
		}
	}
	j := i
	if s[i] == ' ' && i+1 < len(s) {
		j = i + 1
	}
	c, _ := classAt(s, j)
	if j > i || !isSpaceClass(c) {
		if c == clLetter || c == clNumber || c == clOther {
			for j < len(s) {
				c2, n2 := classAt(s, j)
				if c2 != c {
					break
				}
				j += n2
			}
			return j
		}
	}
	end, lastStart, _ := spaceRun(s, i)
	if end == len(s) || lastStart == i {
		return end
	}
	return lastStart
}

// metaspaceSplitter cuts a SentencePiece word before each "▁" that follows
// another character than "▁". Load installs it only when no vocabulary token
// has "▁" after another character, so no BPE merge can cross such a cut and the
// result equals merging the whole word: it lets long texts use the word cache.
type metaspaceSplitter struct{}

const metaspace = "\u2581"

func (metaspaceSplitter) split(s string, emit func(string) bool) bool {
	last := 0
	for i := 0; i < len(s); {
		k := strings.Index(s[i:], metaspace)
		if k < 0 {
			break
		}
		i += k
		if i > last && !strings.HasSuffix(s[last:i], metaspace) {
			if !emit(s[last:i]) {
				return false
			}
			last = i
		}
		i += len(metaspace)
	}
	return emit(s[last:])
}
