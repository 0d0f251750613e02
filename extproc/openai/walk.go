package openai

import (
	"bytes"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
	"unsafe"

	"github.com/tidwall/gjson"
)

// The walk below replaces gjson's Result.ForEach on the parse paths. ForEach
// skips each nested value byte by byte (parseSquash), scans every string
// again (parseString) and unescapes byte by byte. The walk jumps from quote
// to quote with bytes.IndexByte (skipString), skips containers by counting
// brackets outside strings, unescapes run by run, and builds the same
// gjson.Result that ForEach would hand out: FuzzWalk compares the two, key
// and Result fields, at every level.
//
// It trusts its input: every caller's JSON has passed checkJSON (request
// bodies, ParseNVExt) or wellFormed (responses and stream events), so the
// walk does not validate. On text that is not valid JSON it stops early or
// yields garbage, but it never reads out of bounds or loops forever.

// each calls fn for each member of the object, or each element of the array,
// whose text is t.Raw, in order, until fn returns false. Keys are unescaped
// (gjson's key.Str); array elements get the key "". A t that is not an array
// or an object is handed to gjson's ForEach, which calls fn once with t.
//
// t.Raw must be (a part of) JSON text that passed checkJSON or wellFormed.
func each(t gjson.Result, fn func(key string, v gjson.Result) bool) {
	if t.Type != gjson.JSON {
		t.ForEach(func(k, v gjson.Result) bool { return fn(k.Str, v) })
		return
	}
	raw := t.Raw
	b := unsafe.Slice(unsafe.StringData(raw), len(raw)) // read only
	i := skipSpace(b, 0)
	if i >= len(b) {
		return
	}
	obj := b[i] == '{'
	i++
	for {
		i = skipSpace(b, i)
		if i >= len(b) || b[i] == '}' || b[i] == ']' {
			return
		}
		var key string
		if obj {
			end := skipString(b, i)
			if end-i < 2 {
				return
			}
			key = stringValue(raw[i:end])
			i = skipSpace(b, end)
			if i >= len(b) || b[i] != ':' {
				return
			}
			i = skipSpace(b, i+1)
		}
		v, end, ok := valueAt(raw, b, i)
		if !ok {
			return
		}
		v.Index = t.Index + i
		if !fn(key, v) {
			return
		}
		i = skipSpace(b, end)
		if i < len(b) && b[i] == ',' {
			i++
		}
	}
}

// valueAt reads the JSON value that starts at b[i] (b is raw's bytes) and
// returns it as gjson's parseAny does, with the index after it.
func valueAt(raw string, b []byte, i int) (v gjson.Result, end int, ok bool) {
	if i >= len(b) {
		return v, i, false
	}
	switch b[i] {
	case '"':
		end := skipString(b, i)
		if end-i < 2 {
			return v, end, false
		}
		v.Type, v.Raw, v.Str = gjson.String, raw[i:end], stringValue(raw[i:end])
		return v, end, true
	case '{', '[':
		end = skipContainer(b, i)
		v.Type, v.Raw = gjson.JSON, raw[i:end]
		return v, end, true
	case 't':
		v.Type, end = gjson.True, i+4
	case 'f':
		v.Type, end = gjson.False, i+5
	case 'n':
		v.Type, end = gjson.Null, i+4
	default:
		end = i + 1
		for end < len(b) && b[end] > ' ' && b[end] != ',' && b[end] != ']' && b[end] != '}' {
			end++
		}
		v.Type, v.Raw = gjson.Number, raw[i:end]
		v.Num, _ = strconv.ParseFloat(v.Raw, 64)
		return v, end, true
	}
	if end > len(b) {
		return v, i, false
	}
	v.Raw = raw[i:end]
	return v, end, true
}

// skipString returns the index after the string that starts at b[i] (a
// quote), len(b) if it is not closed. It jumps from quote to quote with
// bytes.IndexByte and counts the backslashes before each: escapes and
// non-ASCII text cost nothing extra.
func skipString(b []byte, i int) int {
	for i++; ; i++ {
		j := bytes.IndexByte(b[i:], '"')
		if j < 0 {
			return len(b)
		}
		i += j
		n := 0
		for k := i - 1; k >= 0 && b[k] == '\\'; k-- {
			n++
		}
		if n%2 == 0 {
			return i + 1
		}
	}
}

// skipContainer returns the index after the array or object that starts at
// b[i], counting brackets outside strings; len(b) if it is not closed.
func skipContainer(b []byte, i int) int {
	depth := 0
	for i < len(b) {
		switch b[i] {
		case '"':
			i = skipString(b, i)
			continue
		case '{', '[':
			depth++
		case '}', ']':
			depth--
			if depth == 0 {
				return i + 1
			}
		}
		i++
	}
	return len(b)
}

// stringValue returns the value of the JSON string raw (with its quotes), as
// gjson does: the bytes between the quotes when it has no escape, else a
// fresh unescaped string.
func stringValue(raw string) string {
	s := raw[1 : len(raw)-1]
	j := strings.IndexByte(s, '\\')
	if j < 0 {
		return s
	}
	return unescape(s, j)
}

// unescape decodes the escapes of a JSON string's contents s, the first of
// which is at j, exactly as gjson's unescape does on a valid string: a
// \uD800-\uDFFF escape followed by another \u escape is decoded as a pair,
// U+FFFD when it is not one. It copies the runs between escapes whole
// (gjson appends byte by byte) and returns the buffer without a second copy.
// On an invalid string it stops at the first bad escape.
func unescape(s string, j int) string {
	buf := make([]byte, 0, len(s))
	for j >= 0 {
		buf = append(buf, s[:j]...)
		if j+1 >= len(s) {
			return unsafe.String(unsafe.SliceData(buf), len(buf))
		}
		c, next := s[j+1], j+2
		switch c {
		case 'b':
			buf = append(buf, '\b')
		case 'f':
			buf = append(buf, '\f')
		case 'n':
			buf = append(buf, '\n')
		case 'r':
			buf = append(buf, '\r')
		case 't':
			buf = append(buf, '\t')
		case '"', '\\', '/':
			buf = append(buf, c)
		case 'u':
			if next+4 > len(s) {
				return unsafe.String(unsafe.SliceData(buf), len(buf))
			}
			r := hex4(s[next:])
			next += 4
			if utf16.IsSurrogate(r) && next+6 <= len(s) && s[next] == '\\' && s[next+1] == 'u' {
				r = utf16.DecodeRune(r, hex4(s[next+2:]))
				next += 6
			}
			buf = utf8.AppendRune(buf, r)
		default:
			return unsafe.String(unsafe.SliceData(buf), len(buf))
		}
		s = s[next:]
		j = strings.IndexByte(s, '\\')
	}
	buf = append(buf, s...)
	return unsafe.String(unsafe.SliceData(buf), len(buf))
}

// hex4 reads four hex digits; 0 if one is not, like gjson's runeit.
func hex4(s string) rune {
	var r rune
	for _, c := range []byte(s[:4]) {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c -= 'a' - 10
		case 'A' <= c && c <= 'F':
			c -= 'A' - 10
		default:
			return 0
		}
		r = r<<4 | rune(c)
	}
	return r
}

// eachField calls fn for each member of a JSON object, in order, and stops
// at the first error. Keys are unescaped; repeated keys are all visited, so
// a plain assignment in fn gives "last one wins". obj must come from JSON
// that passed checkJSON or wellFormed (see each).
func eachField(obj gjson.Result, fn func(key string, v gjson.Result) error) error {
	var err error
	each(obj, func(k string, v gjson.Result) bool {
		err = fn(k, v)
		return err == nil
	})
	return err
}

// eachElem calls fn for each element of a JSON array with its index, and
// stops at the first error. arr must come from JSON that passed checkJSON or
// wellFormed (see each).
func eachElem(arr gjson.Result, fn func(i int, v gjson.Result) error) error {
	var err error
	i := 0
	each(arr, func(_ string, v gjson.Result) bool {
		err = fn(i, v)
		i++
		return err == nil
	})
	return err
}
