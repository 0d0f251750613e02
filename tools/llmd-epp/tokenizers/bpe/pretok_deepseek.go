package bpe

import (
	"unicode"
	"unicode/utf8"
)

// The three Split patterns of DeepSeek-V3's pre-tokenizer Sequence.
const (
	patDeepSeekDigits = `\p{N}{1,3}`
	patDeepSeekCJK    = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
	patDeepSeekWords  = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|" +
		"[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)

// isolated splits s like a regex Split with behavior Isolated: match(s, i)
// returns the end of the match at i, or -1 if the pattern does not match
// there; unmatched runs between matches are pre-tokens too.
func isolated(s string, emit func(string) bool, match func(s string, i int) int) bool {
	gap := 0
	for i := 0; i < len(s); {
		j := match(s, i)
		if j <= i {
			_, n := utf8.DecodeRuneInString(s[i:])
			i += n
			continue
		}
		if gap < i && !emit(s[gap:i]) {
			return false
		}
		if !emit(s[i:j]) {
			return false
		}
		i, gap = j, j
	}
	if gap < len(s) {
		return emit(s[gap:])
	}
	return true
}

// runSplitter is `\p{N}{1,max}` (in(r) = unicode.IsNumber) or a `[set]+` run
// (max 0: unbounded).
type runSplitter struct {
	in  func(r rune) bool
	max int
}

func (p runSplitter) split(s string, emit func(string) bool) bool {
	return isolated(s, emit, func(s string, i int) int {
		j, k := i, 0
		for j < len(s) && (p.max == 0 || k < p.max) {
			r, n := utf8.DecodeRuneInString(s[j:])
			if !p.in(r) {
				break
			}
			j += n
			k++
		}
		if j == i {
			return -1
		}
		return j
	})
}

func isDeepSeekCJK(r rune) bool {
	return r >= 0x4e00 && r <= 0x9fa5 || r >= 0x3040 && r <= 0x309f || r >= 0x30a0 && r <= 0x30ff
}

// deepSeekWords is patDeepSeekWords.
type deepSeekWords struct{}

func (deepSeekWords) split(s string, emit func(string) bool) bool {
	return isolated(s, emit, deepSeekMatch)
}

func isASCIIPunct(c byte) bool {
	return c >= '!' && c <= '/' || c >= ':' && c <= '@' || c >= '[' && c <= '`' || c >= '{' && c <= '~'
}

func isASCIILetter(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }

func isLM(r rune) bool { return unicode.IsLetter(r) || unicode.IsMark(r) }
func isPS(r rune) bool { return unicode.IsPunct(r) || unicode.IsSymbol(r) }
func isNL(r rune) bool { return r == '\r' || r == '\n' }
func isWS(r rune) bool { return unicode.IsSpace(r) }
func runeAt(s string, i int) (rune, int) {
	if i >= len(s) {
		return -1, 0
	}
	if s[i] < utf8.RuneSelf {
		return rune(s[i]), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

func deepSeekMatch(s string, i int) int {
	// [punct][A-Za-z]+
	if isASCIIPunct(s[i]) && i+1 < len(s) && isASCIILetter(s[i+1]) {
		j := i + 1
		for j < len(s) && isASCIILetter(s[j]) {
			j++
		}
		return j
	}
	r, n := runeAt(s, i)
	lmRun := func(j int) int {
		for {
			r, n := runeAt(s, j)
			if n == 0 || !isLM(r) {
				return j
			}
			j += n
		}
	}
	// [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
	if !isNL(r) && !unicode.IsLetter(r) && !isPS(r) {
		if r2, n2 := runeAt(s, i+n); n2 > 0 && isLM(r2) {
			return lmRun(i + n)
		}
	}
	if isLM(r) {
		return lmRun(i)
	}
	//  ?[\p{P}\p{S}]+[\r\n]*
	j := i
	if r == ' ' {
		if r2, n2 := runeAt(s, i+1); n2 > 0 && isPS(r2) {
			j = i + 1
		}
	}
	if r2, _ := runeAt(s, j); j < len(s) && isPS(r2) {
		for {
			r3, n3 := runeAt(s, j)
			if n3 == 0 || !isPS(r3) {
				break
			}
			j += n3
		}
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	if !isWS(r) {
		return -1
	}
	// \s*[\r\n]+|\s+(?!\S)|\s+
	end, lastStart, lastNL := spaceRun(s, i)
	if lastNL >= 0 {
		return lastNL + 1
	}
	if end == len(s) || lastStart == i {
		return end
	}
	return lastStart
}
