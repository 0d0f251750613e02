package openai

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"
	"unsafe"

	"github.com/tidwall/gjson"
)

// MaxDepth is the deepest nesting of arrays and objects accepted in a body
// or a response event. gjson's parser recurses once per level, and a
// 16 MiB body of "[" would overflow the goroutine stack and kill the
// process, so depth is checked first, without recursion (validJSON).
// Python's json module, behind vLLM and SGLang, stops near the same depth.
const MaxDepth = 1000

// MaxItems bounds the messages, content parts and prompts (strings or token
// arrays) of one request, counted together. A few bytes of JSON such as
// "{}," would otherwise cost tens of bytes each once parsed; no model has a
// context that such a request would fit in.
const MaxItems = 100_000

// maxCount caps counts read from JSON (max_tokens, usage): far above any
// context length, and it keeps arithmetic on them safe.
const maxCount = math.MaxInt32

// checkJSON validates a complete JSON text: nesting depth, syntax and UTF-8,
// reported in that order when several are wrong. It reads b once, without
// recursion (validJSON); only a body it rejects is scanned again, by
// tooDeep, to tell a too-deep one from a malformed one.
func checkJSON(b []byte) error {
	syntax, deep, text := validJSON(b, MaxDepth)
	switch {
	case deep || !syntax && tooDeep(b, MaxDepth):
		return fmt.Errorf("%w: nested deeper than %d levels", ErrInvalidJSON, MaxDepth)
	case !syntax:
		return fmt.Errorf("%w: malformed or truncated", ErrInvalidJSON)
	case !text:
		return ErrInvalidUTF8
	}
	return nil
}

// CheckJSON validates a complete JSON text as checkJSON does (depth first,
// without recursion, then syntax and UTF-8), for callers reading JSON from
// a client or a worker before handing it to gjson, whose own validator
// recurses once per level: a 1 MiB answer nested half a million levels
// deep would cost gigabytes of goroutine stack.
func CheckJSON(b []byte) error { return checkJSON(b) }

// wellFormed reports whether b is one JSON value nested at most MaxDepth
// deep, UTF-8 aside: what response events and bodies must be.
func wellFormed(b []byte) bool {
	syntax, _, _ := validJSON(b, MaxDepth)
	return syntax
}

// validJSON checks that b is one JSON value (RFC 8259, surrounding
// whitespace allowed) in one pass with an explicit stack. syntax reports the
// grammar; deep that more than max arrays and objects were open at once
// (the scan stops there); text that strings are valid UTF-8 (outside them
// the grammar allows ASCII only). It accepts what encoding/json.Valid
// accepts.
func validJSON(b []byte, max int) (syntax, deep, text bool) {
	var objects [MaxDepth/64 + 1]uint64 // bit d: level d is an object
	if max > MaxDepth {
		max = MaxDepth
	}
	text = true
	depth, i := 0, 0
	for {
		// A value starts at i.
		i = skipSpace(b, i)
		if i >= len(b) {
			return false, false, text
		}
		switch c := b[i]; c {
		case '{', '[':
			if depth == max {
				return false, true, text
			}
			bit := uint64(1) << (depth % 64)
			if c == '{' {
				objects[depth/64] |= bit
			} else {
				objects[depth/64] &^= bit
			}
			depth++
			i = skipSpace(b, i+1)
			if i < len(b) && (c == '{' && b[i] == '}' || c == '[' && b[i] == ']') {
				depth--
				i++
				break
			}
			if c == '{' {
				var ok bool
				if i, ok = objectKey(b, i, &text); !ok {
					return false, false, text
				}
			}
			continue
		case '"':
			var ok bool
			if i, ok = jsonString(b, i, &text); !ok {
				return false, false, text
			}
		case 't':
			if !bytes.HasPrefix(b[i:], []byte("true")) {
				return false, false, text
			}
			i += 4
		case 'f':
			if !bytes.HasPrefix(b[i:], []byte("false")) {
				return false, false, text
			}
			i += 5
		case 'n':
			if !bytes.HasPrefix(b[i:], []byte("null")) {
				return false, false, text
			}
			i += 4
		default:
			var ok bool
			if i, ok = jsonNumber(b, i); !ok {
				return false, false, text
			}
		}
		// A value ended before i: close containers, or find the next value.
		for {
			i = skipSpace(b, i)
			if depth == 0 {
				return i == len(b), false, text
			}
			if i >= len(b) {
				return false, false, text
			}
			object := objects[(depth-1)/64]&(1<<((depth-1)%64)) != 0
			if c := b[i]; c == ',' {
				i++
				if object {
					var ok bool
					if i, ok = objectKey(b, skipSpace(b, i), &text); !ok {
						return false, false, text
					}
				}
				break
			} else if object && c == '}' || !object && c == ']' {
				depth--
				i++
				continue
			}
			return false, false, text
		}
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// objectKey reads `"key" :` at i and returns the index after the colon.
func objectKey(b []byte, i int, text *bool) (int, bool) {
	if i >= len(b) || b[i] != '"' {
		return i, false
	}
	i, ok := jsonString(b, i, text)
	if !ok {
		return i, false
	}
	i = skipSpace(b, i)
	if i >= len(b) || b[i] != ':' {
		return i, false
	}
	return i + 1, true
}

// SWAR constants: one in every byte, and the high bit of every byte.
const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// jsonString reads the string whose opening quote is at i and returns the
// index after its closing quote. Invalid UTF-8 clears *text but is not a
// syntax error.
func jsonString(b []byte, i int, text *bool) (int, bool) {
	i++
	for {
		// Eight plain bytes at a time: no quote, backslash, control or
		// non-ASCII byte (a false alarm only sends a word to the slow path).
		for i+8 <= len(b) {
			v := binary.LittleEndian.Uint64(b[i:])
			q, bs := v^('"'*lsb), v^('\\'*lsb)
			if ((v-0x20*lsb)&^v|(q-lsb)&^q|(bs-lsb)&^bs|v)&msb == 0 {
				i += 8
				continue
			}
			break
		}
		if i >= len(b) {
			return i, false
		}
		switch c := b[i]; {
		case c == '"':
			return i + 1, true
		case c == '\\':
			if i+1 >= len(b) {
				return i, false
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if i+6 > len(b) {
					return i, false
				}
				for _, h := range b[i+2 : i+6] {
					if !('0' <= h && h <= '9' || 'a' <= h && h <= 'f' || 'A' <= h && h <= 'F') {
						return i, false
					}
				}
				i += 6
			default:
				return i, false
			}
		case c < 0x20:
			return i, false
		case c < utf8.RuneSelf:
			i++
		default:
			r, n := utf8.DecodeRune(b[i:])
			if r == utf8.RuneError && n == 1 {
				*text = false
			}
			i += n
		}
	}
}

// jsonNumber reads the number at i: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
func jsonNumber(b []byte, i int) (int, bool) {
	digits := func(i int) (int, bool) {
		j := i
		for j < len(b) && '0' <= b[j] && b[j] <= '9' {
			j++
		}
		return j, j > i
	}
	if i < len(b) && b[i] == '-' {
		i++
	}
	if i >= len(b) {
		return i, false
	}
	if b[i] == '0' {
		i++
	} else if '1' <= b[i] && b[i] <= '9' {
		i, _ = digits(i)
	} else {
		return i, false
	}
	var ok bool
	if i < len(b) && b[i] == '.' {
		if i, ok = digits(i + 1); !ok {
			return i, false
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i, ok = digits(i); !ok {
			return i, false
		}
	}
	return i, true
}

// tooDeep reports whether b opens more than max arrays or objects at once,
// ignoring brackets inside strings. It is a lexical scan that agrees with
// the gjson validator on every prefix of the input that the validator
// accepts, so it bounds the validator's recursion. It does not recurse.
func tooDeep(b []byte, max int) bool {
	depth := 0
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case '"':
			for {
				j := bytes.IndexByte(b[i+1:], '"')
				if j < 0 {
					return false // unterminated string: invalid anyway
				}
				i += 1 + j
				n := 0
				for k := i - 1; b[k] == '\\'; k-- {
					n++
				}
				if n%2 == 0 {
					break
				}
			}
		case '[', '{':
			depth++
			if depth > max {
				return true
			}
		case ']', '}':
			depth--
		}
	}
	return false
}

// firstByte returns the first byte of b that is not JSON whitespace, or 0.
func firstByte[T string | []byte](b T) byte {
	for i := 0; i < len(b); i++ {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			continue
		}
		return b[i]
	}
	return 0
}

// view returns b as a string without copying. The result must not outlive
// b's contents: strings taken from it are copied with owner.keep.
func view(b []byte) string {
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// owner copies strings that alias the body being parsed, so that a Request
// never refers to the caller's buffer. gjson returns substrings of its input
// for strings without escapes and fresh strings for those with escapes; only
// the former need a copy.
type owner struct {
	lo, hi uintptr
	// items counts messages, parts and prompts against MaxItems.
	items int
}

func newOwner(b []byte) owner {
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	return owner{lo: lo, hi: lo + uintptr(len(b))}
}

func (o *owner) keep(s string) string {
	if s == "" {
		return ""
	}
	if p := uintptr(unsafe.Pointer(unsafe.StringData(s))); p >= o.lo && p < o.hi {
		return strings.Clone(s)
	}
	return s
}

// count charges n items against MaxItems.
func (o *owner) count(field string, n int) error {
	o.items += n
	if o.items > MaxItems {
		return invalid(field, fmt.Sprintf("more than %d messages, content parts and prompts in one request", MaxItems))
	}
	return nil
}

// intern returns a constant for common short values (roles, part types), so
// they cost no allocation, and a copy of anything else.
func (o *owner) intern(s string) string {
	switch s {
	case "system":
		return "system"
	case "user":
		return "user"
	case "assistant":
		return "assistant"
	case "tool":
		return "tool"
	case "developer":
		return "developer"
	case "function":
		return "function"
	case "text":
		return "text"
	case "image_url":
		return "image_url"
	case "input_audio":
		return "input_audio"
	}
	return o.keep(s)
}

// typeName names a JSON value's type for error messages.
func typeName(v gjson.Result) string {
	switch v.Type {
	case gjson.Null:
		return "null"
	case gjson.False, gjson.True:
		return "boolean"
	case gjson.Number:
		return "number"
	case gjson.String:
		return "string"
	}
	if v.IsArray() {
		return "array"
	}
	return "object"
}

// nonNegInt reads a JSON number with an integral value >= 0 ("12", "12.0"
// and "1.2e1" all give 12). Values above limit are clamped to limit.
func nonNegInt(v gjson.Result, limit int) (int, bool) {
	if v.Type != gjson.Number {
		return 0, false
	}
	raw := v.Raw
	if n, ok := digits(raw, limit); ok {
		return n, true
	}
	f, err := strconv.ParseFloat(raw, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return 0, false
	}
	if f < 0 || f != math.Trunc(f) || math.IsNaN(f) {
		return 0, false
	}
	if f >= float64(limit) {
		return limit, true
	}
	return int(f), true
}

// digits parses a non-empty run of ASCII digits, clamping at limit.
func digits(s string, limit int) (int, bool) {
	if s == "" {
		return 0, false
	}
	n := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		if n < limit {
			n = n*10 + int(c-'0')
			if n > limit {
				n = limit
			}
		}
	}
	return n, true
}

// tokenArray parses a JSON array of token ids (integers in [0, 2^32-1])
// from its raw text, which must be valid JSON starting with '['. It scans
// the text directly: a 100k-token prompt is read without a gjson Result and
// a float conversion per element. On failure it returns the index of the
// offending element.
func tokenArray(raw string) ([]uint32, int, bool) {
	body := raw[1:]
	n := 1 + strings.Count(body, ",")
	var ids []uint32
	idx := 0
	i := 0
	skip := func() {
		for i < len(body) && (body[i] == ' ' || body[i] == '\t' || body[i] == '\n' || body[i] == '\r') {
			i++
		}
	}
	skip()
	if i < len(body) && body[i] == ']' {
		return []uint32{}, 0, true
	}
	ids = make([]uint32, 0, n)
	for {
		skip()
		start := i
		var v uint64
		for i < len(body) && body[i] >= '0' && body[i] <= '9' {
			v = v*10 + uint64(body[i]-'0')
			if v > math.MaxUint32 {
				return nil, idx, false
			}
			i++
		}
		if i == start || i-start > 1 && body[start] == '0' {
			return nil, idx, false // not an unsigned integer (sign, fraction, string, ...)
		}
		skip()
		if i >= len(body) {
			return nil, idx, false
		}
		switch body[i] {
		case ',':
			ids = append(ids, uint32(v))
			idx++
			i++
		case ']':
			return append(ids, uint32(v)), 0, true
		default:
			return nil, idx, false
		}
	}
}
