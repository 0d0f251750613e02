package chat

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/nikolalohinski/gonja/v2/exec"
)

// prepareMessages turns messages into template values the way vLLM's
// parse_chat_messages does: content becomes a string (text parts joined with
// "\n") or a list of parts depending on format, nil content becomes "" or [],
// and a tool call's JSON-string arguments become an object.
func prepareMessages(in []Message, format ContentFormat) (pyList, error) {
	out := make(pyList, 0, len(in))
	for i, m := range in {
		if m.Role == "" {
			return nil, fmt.Errorf("%w: message %d has no role", ErrInvalidInput, i)
		}
		parts, err := contentParts(m.Content)
		if err != nil {
			return nil, fmt.Errorf("%w: message %d content: %v", ErrInvalidInput, i, err)
		}
		d := exec.NewDict()
		set(d, "role", m.Role)
		if format == FormatOpenAI {
			list := make(pyList, 0, len(parts))
			for _, p := range parts {
				list = append(list, p)
			}
			set(d, "content", list)
		} else {
			set(d, "content", joinText(parts))
		}
		if m.Role == "assistant" && m.ToolCalls != nil {
			calls, err := toolCalls(m.ToolCalls)
			if err != nil {
				return nil, fmt.Errorf("%w: message %d tool_calls: %v", ErrInvalidInput, i, err)
			}
			set(d, "tool_calls", calls)
		}
		if m.Role == "assistant" && m.ReasoningContent != nil {
			set(d, "reasoning", *m.ReasoningContent)
			set(d, "reasoning_content", *m.ReasoningContent)
		}
		if m.Role == "tool" && m.ToolCallID != "" {
			set(d, "tool_call_id", m.ToolCallID)
		}
		if m.Name != "" {
			set(d, "name", m.Name)
		}
		for _, k := range sortedKeys(m.Extra) {
			v, err := convert(m.Extra[k], 1)
			if err != nil {
				return nil, fmt.Errorf("%w: message %d %q: %v", ErrInvalidInput, i, k, err)
			}
			if d.Get(exec.AsValue(k)).IsNil() {
				set(d, k, v) // never overrides the keys above
			}
		}
		out = append(out, d)
	}
	return out, nil
}

// contentParts normalises content to a list of part objects.
func contentParts(c any) ([]*exec.Dict, error) {
	switch c := c.(type) {
	case nil:
		return nil, nil
	case string:
		return []*exec.Dict{textPart(c)}, nil
	case []Part:
		out := make([]*exec.Dict, 0, len(c))
		for _, p := range c {
			d := exec.NewDict()
			set(d, "type", p.Type)
			set(d, "text", p.Text)
			out = append(out, d)
		}
		return out, nil
	case json.RawMessage:
		v, err := decodeOrdered(c)
		if err != nil {
			return nil, err
		}
		return contentParts(v)
	case pyList:
		return contentParts([]any(c))
	case []any:
		out := make([]*exec.Dict, 0, len(c))
		for i, p := range c {
			v, err := convert(p, 1)
			if err != nil {
				return nil, fmt.Errorf("part %d: %v", i, err)
			}
			d, ok := v.(*exec.Dict)
			if !ok {
				return nil, fmt.Errorf("part %d is %T, want an object", i, p)
			}
			t := d.Get(exec.AsValue("type"))
			if !t.IsString() {
				return nil, fmt.Errorf("part %d has no type", i)
			}
			if t.String() == "text" && !d.Get(exec.AsValue("text")).IsString() {
				return nil, fmt.Errorf("text part %d has no text", i)
			}
			out = append(out, d)
		}
		return out, nil
	}
	return nil, fmt.Errorf("unexpected type %T (want string or parts)", c)
}

// joinText is a string-format message's content: its text parts joined
// with "\n", other parts dropped.
func joinText(parts []*exec.Dict) string {
	var texts []string
	for _, p := range parts {
		if p.Get(exec.AsValue("type")).String() == "text" {
			texts = append(texts, p.Get(exec.AsValue("text")).String())
		}
	}
	return strings.Join(texts, "\n")
}

func textPart(s string) *exec.Dict {
	d := exec.NewDict()
	set(d, "type", "text")
	set(d, "text", s)
	return d
}

func toolCalls(calls []any) (pyList, error) {
	list, err := toList(calls, 1)
	if err != nil {
		return nil, err
	}
	for i, c := range list {
		d, ok := c.(*exec.Dict)
		if !ok {
			return nil, fmt.Errorf("tool call %d is not an object", i)
		}
		fv := d.Get(exec.AsValue("function"))
		fn, ok := fv.Interface().(*exec.Dict)
		if !ok {
			return nil, fmt.Errorf("tool call %d has no function object", i)
		}
		args := fn.Get(exec.AsValue("arguments"))
		switch {
		case args.IsString() && args.String() != "":
			v, err := decodeOrdered([]byte(args.String()))
			if err != nil {
				return nil, fmt.Errorf("tool call %d arguments: %v", i, err)
			}
			set(fn, "arguments", v)
		case args.IsNil() || (args.IsString() && args.String() == ""):
			set(fn, "arguments", exec.NewDict())
		}
	}
	return list, nil
}

func set(d *exec.Dict, k string, v any) {
	for _, p := range d.Pairs {
		if p.Key.String() == k {
			p.Value = exec.AsValue(v)
			return
		}
	}
	d.Pairs = append(d.Pairs, &exec.Pair{Key: exec.AsValue(k), Value: exec.AsValue(v)})
}

func toList(in []any, depth int) (pyList, error) {
	if in == nil {
		return nil, nil
	}
	out := make(pyList, 0, len(in))
	for _, v := range in {
		cv, err := convert(v, depth+1)
		if err != nil {
			return nil, err
		}
		out = append(out, cv)
	}
	return out, nil
}

var errTooDeep = fmt.Errorf("nested deeper than %d", MaxDepth)

// convert turns a Go or JSON value into template values: objects become
// *exec.Dict (ordered; Go maps in sorted key order), arrays pyList, numbers
// int or float64.
func convert(v any, depth int) (any, error) {
	if depth > MaxDepth {
		return nil, errTooDeep
	}
	switch v := v.(type) {
	case nil, string, bool, int, int64, float64, *exec.Dict, pyList:
		return v, nil
	case json.RawMessage:
		return decodeOrderedDepth(v, depth)
	case json.Number:
		return number(string(v))
	case []any:
		return toList(v, depth)
	case map[string]any:
		d := exec.NewDict()
		for _, k := range sortedKeys(v) {
			cv, err := convert(v[k], depth+1)
			if err != nil {
				return nil, err
			}
			set(d, k, cv)
		}
		return d, nil
	case []Part:
		parts, err := contentParts(v)
		if err != nil {
			return nil, err
		}
		out := make(pyList, len(parts))
		for i, p := range parts {
			out[i] = p
		}
		return out, nil
	}
	// Anything else (structs, typed slices): through JSON, keeping order.
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("unsupported value %T: %v", v, err)
	}
	return decodeOrderedDepth(b, depth)
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func number(s string) (any, error) {
	if i, err := strconv.ParseInt(s, 10, 64); err == nil {
		return int(i), nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return nil, err
	}
	return f, nil
}

func decodeOrdered(b []byte) (any, error) { return decodeOrderedDepth(b, 0) }

// decodeOrderedDepth decodes JSON keeping object key order.
func decodeOrderedDepth(b []byte, depth int) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	v, err := decodeValue(dec, depth)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err == nil {
		return nil, errors.New("trailing data after JSON value")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder, depth int) (any, error) {
	if depth > MaxDepth {
		return nil, errTooDeep
	}
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch t := tok.(type) {
	case json.Delim:
		switch t {
		case '{':
			d := exec.NewDict()
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				k, _ := kt.(string)
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return nil, err
				}
				set(d, k, v)
			}
			_, err := dec.Token()
			return d, err
		case '[':
			list := pyList{}
			for dec.More() {
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return nil, err
				}
				list = append(list, v)
			}
			_, err := dec.Token()
			return list, err
		}
		return nil, fmt.Errorf("unexpected %v", t)
	case json.Number:
		return number(string(t))
	default:
		return t, nil // string, bool, nil
	}
}

// templateError carries raise_exception's message.
type templateError struct{ msg string }

const raisedPrefix = "raise_exception: "

func (e *templateError) Error() string { return raisedPrefix + e.msg }

// raiseException is HF's raise_exception global.
func raiseException(_ *exec.Evaluator, params *exec.VarArgs) *exec.Value {
	msg := ""
	if len(params.Args) > 0 {
		msg = params.Args[0].String()
	}
	return exec.AsValue(&templateError{msg: msg})
}

// strftimeNow is HF's strftime_now global, for the formats templates use.
func strftimeNow(now func() time.Time) func(*exec.Evaluator, *exec.VarArgs) *exec.Value {
	return func(_ *exec.Evaluator, params *exec.VarArgs) *exec.Value {
		if len(params.Args) != 1 || !params.Args[0].IsString() {
			return exec.AsValue(errors.New("strftime_now expects one format string"))
		}
		return exec.AsValue(strftime(now(), params.Args[0].String()))
	}
}

func strftime(t time.Time, f string) string {
	var b strings.Builder
	for i := 0; i < len(f); i++ {
		if f[i] != '%' || i+1 == len(f) {
			b.WriteByte(f[i])
			continue
		}
		i++
		switch f[i] {
		case 'd':
			fmt.Fprintf(&b, "%02d", t.Day())
		case 'm':
			fmt.Fprintf(&b, "%02d", int(t.Month()))
		case 'Y':
			fmt.Fprintf(&b, "%04d", t.Year())
		case 'y':
			fmt.Fprintf(&b, "%02d", t.Year()%100)
		case 'b':
			b.WriteString(t.Format("Jan"))
		case 'B':
			b.WriteString(t.Format("January"))
		case 'a':
			b.WriteString(t.Format("Mon"))
		case 'A':
			b.WriteString(t.Format("Monday"))
		case 'H':
			fmt.Fprintf(&b, "%02d", t.Hour())
		case 'M':
			fmt.Fprintf(&b, "%02d", t.Minute())
		case 'S':
			fmt.Fprintf(&b, "%02d", t.Second())
		case 'j':
			fmt.Fprintf(&b, "%03d", t.YearDay())
		case '%':
			b.WriteByte('%')
		default:
			b.WriteByte('%')
			b.WriteByte(f[i])
		}
	}
	return b.String()
}

// filterToJSON is transformers' tojson: json.dumps(x, ensure_ascii=False,
// indent=indent, separators=separators, sort_keys=sort_keys). Objects keep
// their key order, as Python dicts do.
func filterToJSON(_ *exec.Evaluator, in *exec.Value, params *exec.VarArgs) *exec.Value {
	if in.IsError() {
		return in
	}
	indent := -1
	sortKeys := false
	itemSep, keySep := ", ", ": "
	for k, v := range params.KwArgs {
		switch k {
		case "indent":
			if !v.IsNil() {
				if !v.IsInteger() {
					return exec.AsValue(errors.New("tojson: indent must be an integer"))
				}
				indent = v.Integer()
				itemSep = ","
			}
		case "sort_keys":
			sortKeys = v.IsTrue()
		case "ensure_ascii":
			if v.IsTrue() {
				return exec.AsValue(errors.New("tojson: ensure_ascii=True not supported"))
			}
		case "separators":
			if !v.IsList() || v.Len() != 2 {
				return exec.AsValue(errors.New("tojson: separators must be a pair"))
			}
			itemSep, _ = v.Index(0).Interface().(string)
			keySep, _ = v.Index(1).Interface().(string)
		default:
			return exec.AsValue(fmt.Errorf("tojson: unexpected argument %q", k))
		}
	}
	if len(params.Args) > 0 {
		if !params.Args[0].IsInteger() {
			return exec.AsValue(errors.New("tojson: indent must be an integer"))
		}
		indent = params.Args[0].Integer()
		if len(params.KwArgs) == 0 || params.KwArgs["separators"] == nil {
			itemSep = ","
		}
	}
	e := pyJSON{indent: indent, itemSep: itemSep, keySep: keySep, sortKeys: sortKeys}
	if err := e.value(in, 0); err != nil {
		return exec.AsValue(err)
	}
	return exec.AsSafeValue(e.b.String())
}

type pyJSON struct {
	b               strings.Builder
	indent          int
	itemSep, keySep string
	sortKeys        bool
}

func (e *pyJSON) newline(level int) {
	if e.indent < 0 {
		return
	}
	e.b.WriteByte('\n')
	e.b.WriteString(strings.Repeat(" ", e.indent*level))
}

func (e *pyJSON) value(v *exec.Value, level int) error {
	if level > MaxDepth {
		return errTooDeep
	}
	if v == nil || v.IsNil() {
		e.b.WriteString("null")
		return nil
	}
	switch x := v.Interface().(type) {
	case *exec.Dict:
		return e.dict(x.Pairs, level)
	case exec.Dict:
		return e.dict(x.Pairs, level)
	case string:
		pyString(&e.b, x)
		return nil
	case bool:
		if x {
			e.b.WriteString("true")
		} else {
			e.b.WriteString("false")
		}
		return nil
	}
	switch {
	case v.IsInteger():
		e.b.WriteString(strconv.Itoa(v.Integer()))
	case v.IsFloat():
		e.b.WriteString(pyFloat(v.Float()))
	case v.IsString():
		pyString(&e.b, v.String())
	case v.IsList():
		n := v.Len()
		if n == 0 {
			e.b.WriteString("[]")
			return nil
		}
		e.b.WriteByte('[')
		for i := 0; i < n; i++ {
			if i > 0 {
				e.b.WriteString(e.itemSep)
			}
			e.newline(level + 1)
			if err := e.value(v.Index(i), level+1); err != nil {
				return err
			}
		}
		e.newline(level)
		e.b.WriteByte(']')
	case v.IsDict():
		// A Go map (e.g. from namespace()): sorted keys.
		var pairs []*exec.Pair
		for _, k := range v.Keys() {
			item, _ := v.GetItem(k.Interface())
			pairs = append(pairs, &exec.Pair{Key: k, Value: item})
		}
		sort.SliceStable(pairs, func(i, j int) bool { return pairs[i].Key.String() < pairs[j].Key.String() })
		return e.dict(pairs, level)
	default:
		return fmt.Errorf("tojson: cannot encode %s", reflect.TypeOf(v.Interface()))
	}
	return nil
}

func (e *pyJSON) dict(pairs []*exec.Pair, level int) error {
	if len(pairs) == 0 {
		e.b.WriteString("{}")
		return nil
	}
	if e.sortKeys {
		pairs = append([]*exec.Pair(nil), pairs...)
		sort.SliceStable(pairs, func(i, j int) bool { return pairs[i].Key.String() < pairs[j].Key.String() })
	}
	e.b.WriteByte('{')
	for i, p := range pairs {
		if i > 0 {
			e.b.WriteString(e.itemSep)
		}
		e.newline(level + 1)
		pyString(&e.b, p.Key.String())
		e.b.WriteString(e.keySep)
		if err := e.value(p.Value, level+1); err != nil {
			return err
		}
	}
	e.newline(level)
	e.b.WriteByte('}')
	return nil
}

// pyString writes s as json.dumps(ensure_ascii=False) does.
func pyString(b *strings.Builder, s string) {
	b.WriteByte('"')
	for i := 0; i < len(s); {
		r, size := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == '"':
			b.WriteString(`\"`)
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == '\b':
			b.WriteString(`\b`)
		case r == '\f':
			b.WriteString(`\f`)
		case r < 0x20:
			fmt.Fprintf(b, `\u%04x`, r)
		default:
			b.WriteString(s[i : i+size])
		}
		i += size
	}
	b.WriteByte('"')
}

// pyFloat formats f as Python's float repr.
func pyFloat(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	case math.IsNaN(f):
		return "NaN"
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if math.Abs(f) >= 1e16 || (f != 0 && math.Abs(f) < 1e-4) {
		s = strconv.FormatFloat(f, 'e', -1, 64)
		mant, exp, _ := strings.Cut(s, "e")
		if !strings.Contains(mant, ".") {
			mant += ".0"
		}
		sign := exp[0]
		exp = strings.TrimLeft(exp[1:], "0")
		if len(exp) < 2 {
			exp = fmt.Sprintf("%02s", exp)
		}
		return mant + "e" + string(sign) + exp
	}
	if !strings.ContainsAny(s, ".e") {
		s += ".0"
	}
	return s
}

// Content-format detection (vLLM's _detect_content_format), on the template
// text: vLLM walks Jinja's AST, the engine here does not expose assignments,
// so the same rules are applied to the statements' source.
var (
	reSetFrom = regexp.MustCompile(`\{%-?\s*set\s+(\w+)\s*=\s*(\w+)\b`)
	reFor     = regexp.MustCompile(`\{%-?\s*for\s+(\w+)\s+in\s+([^%]*?)-?%\}`)
)

func detectContentFormat(src string) ContentFormat {
	// Names bound to messages or its elements/slices (BFS as vLLM does).
	names := map[string]bool{"messages": true}
	for changed := true; changed; {
		changed = false
		for _, m := range reSetFrom.FindAllStringSubmatch(src, -1) {
			if names[m[2]] && !names[m[1]] {
				names[m[1]], changed = true, true
			}
		}
	}
	fors := reFor.FindAllStringSubmatch(src, -1)
	msgVars := map[string]bool{}
	for _, m := range fors {
		if base, rest := splitAccess(m[2]); names[base] && isElemsAccess(rest, "") {
			msgVars[m[1]] = true
		}
	}
	for _, m := range fors {
		if base, rest := splitAccess(m[2]); msgVars[base] && isElemsAccess(rest, "content") {
			return FormatOpenAI
		}
	}
	return FormatString
}

var reIdent = regexp.MustCompile(`^\s*(\w+)(.*)$`)

func splitAccess(expr string) (string, string) {
	m := reIdent.FindStringSubmatch(expr)
	if m == nil {
		return "", ""
	}
	return m[1], strings.TrimSpace(m[2])
}

var (
	reKey    = regexp.MustCompile(`^(?:\.(\w+)|\[\s*['"](\w+)['"]\s*\])`)
	reSlice  = regexp.MustCompile(`^\[[^\]]*:[^\]]*\]`)
	reFilter = regexp.MustCompile(`^(?:\|\s*\w+(?:\([^)]*\))?|\bif\b.*|is\s+.*)`)
)

// isElemsAccess reports whether rest (what follows the variable) is, as in
// vLLM's _is_var_or_elems_access, an optional ['key'] / .key, then slices,
// filters or tests.
func isElemsAccess(rest, key string) bool {
	if key != "" {
		m := reKey.FindStringSubmatch(rest)
		if m == nil || (m[1] != key && m[2] != key) {
			return false
		}
		rest = strings.TrimSpace(rest[len(m[0]):])
	}
	for rest != "" {
		if m := reSlice.FindString(rest); m != "" {
			rest = strings.TrimSpace(rest[len(m):])
			continue
		}
		if m := reFilter.FindString(rest); m != "" {
			rest = strings.TrimSpace(rest[len(m):])
			continue
		}
		return false
	}
	return true
}
