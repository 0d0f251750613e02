package bpe

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// addedToken is an entry of tokenizer.json "added_tokens".
type addedToken struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// addedMatcher finds added tokens in text the way HF's AddedVocabulary does:
// non-overlapping leftmost-longest matches (aho-corasick LeftmostLongest),
// then the single_word, lstrip and rstrip rules.
type addedMatcher struct {
	trans  []int32 // dense trie: trans[node*256+byte] = child node, 0 = none
	tok    []int32 // per node: index into toks, -1 if none
	first  [256]bool
	only   int // the single possible first byte, or -1
	toks   []addedToken
	maxLen int
	flags  bool // some token has single_word, lstrip or rstrip
}

func newAddedMatcher(toks []addedToken) *addedMatcher {
	if len(toks) == 0 {
		return nil
	}
	m := &addedMatcher{trans: make([]int32, 256), tok: []int32{-1}}
	for _, t := range toks {
		if t.Content == "" {
			continue
		}
		n := int32(0)
		for i := 0; i < len(t.Content); i++ {
			c := int32(t.Content[i])
			nx := m.trans[n*256+c]
			if nx == 0 {
				nx = int32(len(m.tok))
				m.trans[n*256+c] = nx
				m.trans = append(m.trans, make([]int32, 256)...)
				m.tok = append(m.tok, -1)
			}
			n = nx
		}
		if m.tok[n] < 0 { // first definition wins
			m.tok[n] = int32(len(m.toks))
			m.toks = append(m.toks, t)
		}
		m.first[t.Content[0]] = true
		m.flags = m.flags || t.SingleWord || t.LStrip || t.RStrip
		m.maxLen = max(m.maxLen, len(t.Content))
	}
	m.only = -1
	for c, ok := range m.first {
		if ok {
			if m.only == -1 {
				m.only = c
			} else {
				m.only = -2
			}
		}
	}
	return m
}

// longestAt returns the index of the longest token that s[i:] starts with.
func (m *addedMatcher) longestAt(s string, i int) (tok int32, end int) {
	tok, n := int32(-1), int32(0)
	for j := i; j < len(s); j++ {
		n = m.trans[n*256+int32(s[j])]
		if n == 0 {
			break
		}
		if t := m.tok[n]; t >= 0 {
			tok, end = t, j+1
		}
	}
	return tok, end
}

type span struct {
	start, end int
	tok        int32
}

// find calls fn for each match, in order; fn returns false to stop.
func (m *addedMatcher) find(s string, from int, fn func(span) bool) {
	prevEnd := from
	for i := from; i < len(s); {
		if !m.first[s[i]] {
			var k int
			if m.only >= 0 {
				k = strings.IndexByte(s[i+1:], byte(m.only))
			} else {
				k = indexFirst(s[i+1:], &m.first)
			}
			if k < 0 {
				return
			}
			i += 1 + k
			continue
		}
		tok, end := m.longestAt(s, i)
		if tok < 0 {
			i++
			continue
		}
		start, stop := i, end
		i = end
		t := &m.toks[tok]
		if t.SingleWord {
			if (start > 0 && endsWithWord(s[:start])) || (stop < len(s) && startsWithWord(s[stop:])) {
				continue
			}
		}
		if t.LStrip {
			ns := len(strings.TrimRightFunc(s[:start], unicode.IsSpace))
			start = max(ns, prevEnd)
		}
		if t.RStrip {
			stop = len(s) - len(strings.TrimLeftFunc(s[stop:], unicode.IsSpace))
			i = max(i, stop)
		}
		prevEnd = stop
		if !fn(span{start, stop, tok}) {
			return
		}
	}
}

func indexFirst(s string, set *[256]bool) int {
	for i := 0; i < len(s); i++ {
		if set[s[i]] {
			return i
		}
	}
	return -1
}

func isWordRune(r rune) bool { return r == '_' || unicode.IsLetter(r) || unicode.IsNumber(r) }

func endsWithWord(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return isWordRune(r)
}

func startsWithWord(s string) bool {
	r, _ := utf8.DecodeRuneInString(s)
	return isWordRune(r)
}

// each splits s into text segments (id -1) and added tokens (their id) and
// calls fn for each, in order. A nil matcher yields s whole.
func (m *addedMatcher) each(s string, fn func(seg string, id int32) bool) {
	if m == nil {
		if s != "" {
			fn(s, -1)
		}
		return
	}
	last := 0
	ok := true
	m.find(s, 0, func(sp span) bool {
		if sp.start > last {
			if ok = fn(s[last:sp.start], -1); !ok {
				return false
			}
		}
		if ok = fn(s[sp.start:sp.end], int32(m.toks[sp.tok].ID)); !ok {
			return false
		}
		last = sp.end
		return true
	})
	if ok && last < len(s) {
		fn(s[last:], -1)
	}
}
