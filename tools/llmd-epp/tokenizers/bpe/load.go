package bpe

import (
	"bytes"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"strconv"
	"strings"
	"unicode/utf8"
)

type jsonFile struct {
	AddedTokens  []addedToken    `json:"added_tokens"`
	Normalizer   json.RawMessage `json:"normalizer"`
	PreTokenizer json.RawMessage `json:"pre_tokenizer"`
	Model        *jsonModel      `json:"model"`
}

type jsonModel struct {
	Type                    string            `json:"type"`
	VocabRaw                json.RawMessage   `json:"vocab"`
	Vocab                   map[string]uint32 `json:"-"`
	Merges                  []json.RawMessage `json:"merges"`
	Dropout                 *float64          `json:"dropout"`
	UnkToken                *string           `json:"unk_token"`
	ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
	FuseUnk                 bool              `json:"fuse_unk"`
	ByteFallback            bool              `json:"byte_fallback"`
	IgnoreMerges            bool              `json:"ignore_merges"`
}

type jsonStep struct {
	Type          string            `json:"type"`
	Normalizers   []json.RawMessage `json:"normalizers"`
	Pretokenizers []json.RawMessage `json:"pretokenizers"`
	Prepend       string            `json:"prepend"`
	Content       string            `json:"content"`
	Pattern       struct {
		String *string `json:"String"`
		Regex  *string `json:"Regex"`
	} `json:"pattern"`
	Behavior       string `json:"behavior"`
	Invert         bool   `json:"invert"`
	AddPrefixSpace bool   `json:"add_prefix_space"`
	UseRegex       bool   `json:"use_regex"`
}

// Parse builds a tokenizer from the contents of tokenizer.json and, if config is
// non-empty, tokenizer_config.json.
func Parse(tokenizerJSON, config []byte) (*BPE, error) {
	return parse(tokenizerJSON, config, false)
}

func parse(data, config []byte, forceRegexp bool) (*BPE, error) {
	var f jsonFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("tokenizer: tokenizer.json: %w: %w", ErrCorrupt, err)
	}
	m, err := parseModel(f.Model)
	if err != nil {
		return nil, err
	}
	t, err := newBPE(m, len(f.AddedTokens))
	if err != nil {
		return nil, err
	}
	if err := t.parseNormalizer(f.Normalizer); err != nil {
		return nil, err
	}
	byteLevel, err := t.parsePreTokenizer(f.PreTokenizer, forceRegexp)
	if err != nil {
		return nil, err
	}
	if byteLevel {
		t.kind = kindByteLevel
		if err := t.initByteLevel(m.Vocab); err != nil {
			return nil, err
		}
	} else if err := t.initSentencePiece(m); err != nil {
		return nil, err
	}
	if err := t.parseMerges(m); err != nil {
		return nil, err
	}
	if err := renumberAdded(f.AddedTokens, m.Vocab); err != nil {
		return nil, err
	}
	t.addTokens(m.Vocab, f.AddedTokens)
	if len(config) > 0 {
		if err := t.parseConfig(config); err != nil {
			return nil, err
		}
	}
	return t, nil
}

// parseModel checks that m is a BPE model this package supports and
// decodes its vocabulary.
func parseModel(m *jsonModel) (*jsonModel, error) {
	if m == nil {
		return nil, fmt.Errorf("tokenizer: tokenizer.json has no model: %w", ErrCorrupt)
	}
	if m.Type != "BPE" {
		return nil, fmt.Errorf("tokenizer: model type %q: %w", m.Type, ErrUnsupported)
	}
	if err := json.Unmarshal(m.VocabRaw, &m.Vocab); err != nil {
		return nil, fmt.Errorf("tokenizer: BPE vocab: %w: %w", ErrCorrupt, err)
	}
	if m.Dropout != nil && *m.Dropout != 0 {
		return nil, fmt.Errorf("tokenizer: BPE dropout: %w", ErrUnsupported)
	}
	if (m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "") || (m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "") {
		return nil, fmt.Errorf("tokenizer: BPE continuing_subword_prefix/end_of_word_suffix: %w", ErrUnsupported)
	}
	if len(m.Vocab) == 0 {
		return nil, fmt.Errorf("tokenizer: empty vocab: %w", ErrCorrupt)
	}
	return m, nil
}

// newBPE returns a tokenizer holding the vocabulary and options of m, with
// room for nAdded added tokens.
func newBPE(m *jsonModel, nAdded int) (*BPE, error) {
	t := &BPE{
		vocab:        make(map[string]uint32, len(m.Vocab)+nAdded),
		ignoreMerges: m.IgnoreMerges,
		fuseUnk:      m.FuseUnk,
		byteFallback: m.ByteFallback,
		unkID:        -1,
		seed:         maphash.MakeSeed(),
		cache:        make([]cacheSlot, cacheSlots),
	}
	for i := range t.byteIDs {
		t.byteIDs[i] = -1
	}
	for s, id := range m.Vocab {
		t.vocab[s] = id
		t.vocabSize = max(t.vocabSize, int(id)+1)
	}
	if m.UnkToken != nil {
		id, ok := m.Vocab[*m.UnkToken]
		if !ok {
			return nil, fmt.Errorf("tokenizer: unk_token %q not in vocab: %w", *m.UnkToken, ErrCorrupt)
		}
		t.unkID = int32(id)
	}
	return t, nil
}

// initSentencePiece sets up a non byte-level (SentencePiece-style) model:
// single-rune pieces, the metaspace splitter when safe, and byte-fallback
// ids.
func (t *BPE) initSentencePiece(m *jsonModel) error {
	if t.split != nil || t.norm.nfc {
		return fmt.Errorf("tokenizer: non byte-level BPE with a pre-tokenizer or NFC: %w", ErrUnsupported)
	}
	t.kind = kindSentencePiece
	t.runeIDs = make(map[rune]uint32)
	for s, id := range m.Vocab {
		if r, n := utf8.DecodeRuneInString(s); n == len(s) && n > 0 {
			t.runeIDs[r] = id
		}
	}
	if metaspaceSafe(m.Vocab) {
		t.split = metaspaceSplitter{}
	}
	if m.ByteFallback {
		for b := 0; b < 256; b++ {
			if id, ok := m.Vocab[fmt.Sprintf("<0x%02X>", b)]; ok {
				t.byteIDs[b] = int32(id)
			}
		}
	}
	return nil
}

// renumberAdded gives the added tokens the ids HF does.
//
// HF ignores the ids written in added_tokens: a token already in the
// vocabulary (or added before) keeps that id, a new one gets the next id
// after the vocabulary and the previous added tokens (AddedVocabulary::
// add_tokens). For consistent files this changes nothing.
func renumberAdded(added []addedToken, vocab map[string]uint32) error {
	addedIDs := make(map[string]uint32, len(added))
	var maxAdded int64 = -1
	for i := range added {
		a := &added[i]
		if a.Content == "" {
			return fmt.Errorf("tokenizer: empty added token %d: %w", a.ID, ErrCorrupt)
		}
		if id, ok := addedIDs[a.Content]; ok {
			a.ID = id
		} else if id, ok := vocab[a.Content]; ok {
			a.ID = id
		} else if maxAdded >= int64(len(vocab)) {
			a.ID = uint32(maxAdded + 1)
		} else {
			a.ID = uint32(len(vocab))
		}
		addedIDs[a.Content] = a.ID
		maxAdded = max(maxAdded, int64(a.ID))
	}
	return nil
}

// addTokens adds the (renumbered) added tokens to the vocabulary and
// builds the pieces and the matchers of raw and normalized added tokens.
func (t *BPE) addTokens(vocab map[string]uint32, added []addedToken) {
	var raw, normed []addedToken
	for _, a := range added {
		t.vocab[a.Content] = a.ID
		t.vocabSize = max(t.vocabSize, int(a.ID)+1)
		if a.Normalized {
			// HF matches normalized added tokens, themselves normalized, on
			// the normalized text.
			a.Content = t.norm.apply(a.Content)
			normed = append(normed, a)
		} else {
			raw = append(raw, a)
		}
	}
	t.buildPieces(vocab, added)
	t.added = newAddedMatcher(raw)
	t.addedN = newAddedMatcher(normed)
}

func (t *BPE) parseNormalizer(raw json.RawMessage) error {
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil
	}
	var st jsonStep
	if err := json.Unmarshal(raw, &st); err != nil {
		return fmt.Errorf("tokenizer: normalizer: %w: %w", ErrCorrupt, err)
	}
	switch st.Type {
	case "NFC":
		if len(t.norm.steps) > 0 {
			return fmt.Errorf("tokenizer: normalizer NFC after other steps: %w", ErrUnsupported)
		}
		t.norm.nfc = true
	case "Sequence":
		for _, r := range st.Normalizers {
			if err := t.parseNormalizer(r); err != nil {
				return err
			}
		}
	case "Prepend":
		t.norm.steps = append(t.norm.steps, normStep{prepend: st.Prepend})
	case "Replace":
		if st.Pattern.String == nil || *st.Pattern.String == "" {
			return fmt.Errorf("tokenizer: normalizer Replace with a regex: %w", ErrUnsupported)
		}
		t.norm.steps = append(t.norm.steps, normStep{old: *st.Pattern.String, new: st.Content})
	default:
		return fmt.Errorf("tokenizer: normalizer type %q: %w", st.Type, ErrUnsupported)
	}
	return nil
}

// parsePreTokenizer reports whether the pre-tokenizer includes ByteLevel.
func (t *BPE) parsePreTokenizer(raw json.RawMessage, forceRegexp bool) (bool, error) {
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return false, nil
	}
	var st jsonStep
	if err := json.Unmarshal(raw, &st); err != nil {
		return false, fmt.Errorf("tokenizer: pre_tokenizer: %w: %w", ErrCorrupt, err)
	}
	var steps []jsonStep
	if st.Type == "Sequence" {
		for _, r := range st.Pretokenizers {
			var s jsonStep
			if err := json.Unmarshal(r, &s); err != nil {
				return false, fmt.Errorf("tokenizer: pre_tokenizer: %w: %w", ErrCorrupt, err)
			}
			steps = append(steps, s)
		}
	} else {
		steps = []jsonStep{st}
	}
	var seq seqSplitter
	byteLevel := false
	for _, s := range steps {
		switch s.Type {
		case "Split":
			if s.Pattern.Regex == nil || s.Behavior != "Isolated" || s.Invert {
				return false, fmt.Errorf("tokenizer: pre_tokenizer Split (behavior %q, invert %v, regex %v): %w",
					s.Behavior, s.Invert, s.Pattern.Regex != nil, ErrUnsupported)
			}
			sp, err := newSplitter(*s.Pattern.Regex, forceRegexp)
			if err != nil {
				return false, fmt.Errorf("tokenizer: pre_tokenizer %w", err)
			}
			seq = append(seq, sp)
		case "ByteLevel":
			if s.AddPrefixSpace {
				return false, fmt.Errorf("tokenizer: pre_tokenizer ByteLevel add_prefix_space: %w", ErrUnsupported)
			}
			if s.UseRegex {
				sp, _ := newSplitter(patGPT2, forceRegexp)
				seq = append(seq, sp)
			}
			byteLevel = true
		default:
			return false, fmt.Errorf("tokenizer: pre_tokenizer type %q: %w", s.Type, ErrUnsupported)
		}
	}
	switch len(seq) {
	case 0:
	case 1:
		t.split = seq[0]
	default:
		t.split = seq
	}
	return byteLevel, nil
}

// bytesToUnicode is GPT-2's reversible byte <-> printable rune table.
func bytesToUnicode() [256]rune {
	var t [256]rune
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			t[b] = rune(b)
		} else {
			t[b] = rune(256 + n)
			n++
		}
	}
	return t
}

func (t *BPE) initByteLevel(vocab map[string]uint32) error {
	b2u := bytesToUnicode()
	u2b := make(map[rune]byte, 256)
	for b, r := range b2u {
		u2b[r] = byte(b)
		if id, ok := vocab[string(r)]; ok {
			t.byteIDs[b] = int32(id)
		}
	}
	t.rawVocab = make(map[string]uint32, len(vocab))
	var buf []byte
	for s, id := range vocab {
		buf = buf[:0]
		ok := true
		for _, r := range s {
			b, found := u2b[r]
			if !found {
				ok = false
				break
			}
			buf = append(buf, b)
		}
		if ok {
			t.rawVocab[string(buf)] = id
		}
	}
	return nil
}

func (t *BPE) parseMerges(m *jsonModel) error {
	t.merges = make(map[uint64]mergeVal, len(m.Merges))
	for rank, raw := range m.Merges {
		var a, b string
		if len(raw) > 0 && raw[0] == '[' {
			var pair []string
			if err := json.Unmarshal(raw, &pair); err != nil || len(pair) != 2 {
				return fmt.Errorf("tokenizer: merge %d: %w", rank, ErrCorrupt)
			}
			a, b = pair[0], pair[1]
		} else {
			s, err := strconv.Unquote(string(raw))
			if err != nil {
				if err := json.Unmarshal(raw, &s); err != nil {
					return fmt.Errorf("tokenizer: merge %d: %w", rank, ErrCorrupt)
				}
			}
			var ok bool
			a, b, ok = strings.Cut(s, " ")
			if !ok || strings.Contains(b, " ") {
				return fmt.Errorf("tokenizer: merge %d %q: %w", rank, s, ErrCorrupt)
			}
		}
		ia, oka := m.Vocab[a]
		ib, okb := m.Vocab[b]
		ic, okc := m.Vocab[a+b]
		if !oka || !okb || !okc {
			return fmt.Errorf("tokenizer: merge %d (%q %q) uses tokens not in vocab: %w", rank, a, b, ErrCorrupt)
		}
		// HF collects merges into a map, so a repeated pair keeps its last rank.
		t.merges[pairKey(ia, ib)] = mergeVal{rank: uint32(rank), id: ic}
	}
	return nil
}

func (t *BPE) parseConfig(data []byte) error {
	var c struct {
		BOS          json.RawMessage `json:"bos_token"`
		EOS          json.RawMessage `json:"eos_token"`
		ChatTemplate json.RawMessage `json:"chat_template"`
		AddBOS       *bool           `json:"add_bos_token"`
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return fmt.Errorf("tokenizer: tokenizer_config.json: %w: %w", ErrCorrupt, err)
	}
	tokenString := func(raw json.RawMessage) string {
		var s string
		if json.Unmarshal(raw, &s) == nil {
			return s
		}
		var o struct {
			Content string `json:"content"`
		}
		if json.Unmarshal(raw, &o) == nil {
			return o.Content
		}
		return ""
	}
	t.cfg.BOSToken = tokenString(c.BOS)
	t.cfg.EOSToken = tokenString(c.EOS)
	if c.AddBOS != nil {
		t.cfg.AddBOSToken = *c.AddBOS
	}
	if len(c.ChatTemplate) > 0 {
		var s string
		if json.Unmarshal(c.ChatTemplate, &s) == nil {
			t.cfg.ChatTemplate = s
		} else {
			var list []struct {
				Name     string `json:"name"`
				Template string `json:"template"`
			}
			if json.Unmarshal(c.ChatTemplate, &list) == nil {
				for i, e := range list {
					if e.Name == "default" || i == 0 {
						t.cfg.ChatTemplate = e.Template
					}
					if e.Name == "default" {
						break
					}
				}
			}
		}
	}
	return nil
}

// metaspaceSafe reports whether no token has "▁" right after another character
// than "▁" (see metaspaceSplitter).
func metaspaceSafe(vocab map[string]uint32) bool {
	for s := range vocab {
		for i := strings.Index(s, metaspace); i >= 0; {
			if i > 0 && !strings.HasSuffix(s[:i], metaspace) {
				return false
			}
			k := strings.Index(s[i+len(metaspace):], metaspace)
			if k < 0 {
				break
			}
			i += len(metaspace) + k
		}
	}
	return true
}
