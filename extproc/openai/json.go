package openai

import (
	"bytes"
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
// or a response event. gjson's validator recurses once per level, and a
// 16 MiB body of "[" would overflow the goroutine stack and kill the
// process, so depth is checked first by an iterative scan. Python's json
// module, behind vLLM and SGLang, stops near the same depth.
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
// in that order.
func checkJSON(b []byte) error {
	if tooDeep(b, MaxDepth) {
		return fmt.Errorf("%w: nested deeper than %d levels", ErrInvalidJSON, MaxDepth)
	}
	if !gjson.ValidBytes(b) {
		return fmt.Errorf("%w: malformed or truncated", ErrInvalidJSON)
	}
	if !utf8.Valid(b) {
		return ErrInvalidUTF8
	}
	return nil
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

// eachField calls fn for each member of a JSON object, in order, and stops
// at the first error. Keys are unescaped; repeated keys are all visited, so
// a plain assignment in fn gives "last one wins".
func eachField(obj gjson.Result, fn func(key string, v gjson.Result) error) error {
	var err error
	obj.ForEach(func(k, v gjson.Result) bool {
		err = fn(k.Str, v)
		return err == nil
	})
	return err
}

// eachElem calls fn for each element of a JSON array with its index.
func eachElem(arr gjson.Result, fn func(i int, v gjson.Result) error) error {
	var err error
	i := 0
	arr.ForEach(func(_, v gjson.Result) bool {
		err = fn(i, v)
		i++
		return err == nil
	})
	return err
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
