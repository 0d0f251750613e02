package chat

import (
	"math"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/nikolalohinski/gonja/v2/exec"
)

// pyList is the list type this package hands to templates (messages, content
// parts, tools, tool calls, JSON arrays, str.split results). gonja treats any
// slice as a list; this one also indexes and prints as Python does:
//   - GetItem (gonja's exec.ItemGetter hook): a negative index counts from the
//     end, down to -len (gonja stops at -len+1, see subscript.go);
//   - String (gonja prints any fmt.Stringer with it): Python's str(list),
//     items in repr(). Kimi-K2's template prints an assistant's content
//     parts with {{ message['content'] }}, so "I'll" must print as "I'll" in
//     double quotes and a newline as \n, as in vLLM.
type pyList []any

// GetItem implements gonja's exec.ItemGetter: integer keys count from the end
// when negative; anything out of range, or not an integer, is not found.
func (l pyList) GetItem(key any) (*exec.Value, bool) {
	i, ok := key.(int)
	if !ok {
		return exec.AsValue(nil), false
	}
	if i < 0 {
		i += len(l)
	}
	if i < 0 || i >= len(l) {
		return exec.AsValue(nil), false
	}
	return exec.AsValue(l[i]), true
}

// String is Python's str(list).
func (l pyList) String() string {
	var b strings.Builder
	pyRepr(&b, l, 0)
	return b.String()
}

// pyRepr writes Python's repr(v) for the values templates hold. Dicts keep
// their order. What Python cannot hold (a Go map from gonja's namespace(),
// say) is printed as gonja prints it.
func pyRepr(b *strings.Builder, v any, depth int) {
	if depth > MaxDepth {
		b.WriteString("[...]")
		return
	}
	switch x := v.(type) {
	case nil:
		b.WriteString("None")
	case *exec.Value:
		if x == nil || x.IsNil() {
			b.WriteString("None")
			return
		}
		pyRepr(b, x.Interface(), depth)
	case string:
		pyStrRepr(b, x)
	case bool:
		if x {
			b.WriteString("True")
		} else {
			b.WriteString("False")
		}
	case int:
		b.WriteString(strconv.Itoa(x))
	case int64:
		b.WriteString(strconv.FormatInt(x, 10))
	case float64:
		switch {
		case math.IsInf(x, 1):
			b.WriteString("inf")
		case math.IsInf(x, -1):
			b.WriteString("-inf")
		case math.IsNaN(x):
			b.WriteString("nan")
		default:
			b.WriteString(pyFloat(x))
		}
	case pyList:
		pyListRepr(b, x, depth)
	case []any:
		pyListRepr(b, x, depth)
	case *exec.Dict:
		b.WriteByte('{')
		for i, p := range x.Pairs {
			if i > 0 {
				b.WriteString(", ")
			}
			pyRepr(b, p.Key, depth+1)
			b.WriteString(": ")
			pyRepr(b, p.Value, depth+1)
		}
		b.WriteByte('}')
	default:
		b.WriteString(exec.AsValue(x).String())
	}
}

func pyListRepr(b *strings.Builder, l []any, depth int) {
	b.WriteByte('[')
	for i, item := range l {
		if i > 0 {
			b.WriteString(", ")
		}
		pyRepr(b, item, depth+1)
	}
	b.WriteByte(']')
}

// pyStrRepr writes Python's repr(s): single quotes unless s holds a single
// quote and no double quote; backslash, the quote, \t, \n and \r escaped;
// other non-printable characters as \xhh, \uhhhh or \Uhhhhhhhh.
func pyStrRepr(b *strings.Builder, s string) {
	quote := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		quote = '"'
	}
	const hex = "0123456789abcdef"
	b.WriteByte(quote)
	for _, r := range s {
		switch {
		case r == rune(quote) || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r < ' ' || r == 0x7f:
			b.WriteString(`\x`)
			b.WriteByte(hex[r>>4])
			b.WriteByte(hex[r&0xf])
		case r < utf8.RuneSelf || unicode.IsPrint(r):
			// Python's str.isprintable and Go's unicode.IsPrint agree:
			// letters, marks, numbers, punctuation, symbols and the
			// ASCII space.
			b.WriteRune(r)
		default:
			var w int
			switch {
			case r <= 0xff:
				b.WriteString(`\x`)
				w = 2
			case r <= 0xffff:
				b.WriteString(`\u`)
				w = 4
			default:
				b.WriteString(`\U`)
				w = 8
			}
			for shift := 4 * (w - 1); shift >= 0; shift -= 4 {
				b.WriteByte(hex[(r>>shift)&0xf])
			}
		}
	}
	b.WriteByte(quote)
}
