package chat

import (
	"errors"
	"strings"
	"unicode"

	"github.com/nikolalohinski/gonja/v2/builtins"
	"github.com/nikolalohinski/gonja/v2/exec"
)

// newEnvironment builds a fresh engine environment per template: gonja's
// builtins plus what transformers registers, with the fixes below. Nothing
// in gonja's package-level sets is modified.
func newEnvironment() *exec.Environment {
	filters := exec.NewFilterSet(map[string]exec.FilterFunction{}).Update(builtins.Filters)
	_ = filters.Replace("tojson", filterToJSON)
	ctx := exec.EmptyContext().Update(builtins.GlobalFunctions).Update(builtins.GlobalVariables)
	ctx.Set("raise_exception", raiseException)
	ctx.Set(getitemName, getItem)
	methods := builtins.Methods
	methods.Str = strMethods()
	methods.Dict = dictMethods()
	return &exec.Environment{
		Context:           ctx,
		Filters:           filters,
		Tests:             builtins.Tests,
		ControlStructures: builtins.ControlStructures,
		Methods:           methods,
	}
}

// Names of gonja's built-in methods, copied into our sets (gonja's sets
// cannot be listed).
var (
	gonjaStrMethods = []string{"capitalize", "capwords", "casefold", "center", "count", "encode",
		"endswith", "expandtabs", "find", "format", "isalnum", "isalpha", "isascii", "isdecimal",
		"isdigit", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper", "join",
		"ljust", "lower", "partition", "removeprefix", "removesuffix", "replace", "rfind", "rjust",
		"rpartition", "rsplit", "split", "splitlines", "startswith", "swapcase", "title", "upper", "zfill"}
	gonjaDictMethods = []string{"pop", "setdefault", "update", "copy", "clear"}
)

func strMethods() *exec.MethodSet[string] {
	m := map[string]exec.Method[string]{}
	for _, name := range gonjaStrMethods {
		if f, ok := builtins.Methods.Str.Get(name); ok {
			m[name] = f
		}
	}
	// Python's strip family: no argument (or None) strips whitespace, a
	// string argument strips any of its characters. gonja's default is a
	// rune and fails when called without an argument.
	m["strip"] = stripMethod(strings.TrimFunc, strings.Trim)
	m["lstrip"] = stripMethod(strings.TrimLeftFunc, strings.TrimLeft)
	m["rstrip"] = stripMethod(strings.TrimRightFunc, strings.TrimRight)
	m["replace"] = replaceMethod
	m["split"] = splitMethod
	return exec.NewMethodSet(m)
}

func stripMethod(byFunc func(string, func(rune) bool) string, byChars func(string, string) string) exec.Method[string] {
	return func(self string, _ *exec.Value, args *exec.VarArgs) (any, error) {
		if len(args.KwArgs) > 0 || len(args.Args) > 1 {
			return nil, exec.ErrInvalidCall(errors.New("takes at most one positional argument"))
		}
		if len(args.Args) == 0 || args.Args[0].IsNil() {
			return byFunc(self, unicode.IsSpace), nil
		}
		if !args.Args[0].IsString() {
			return nil, exec.ErrInvalidCall(errors.New("argument must be a string or None"))
		}
		return byChars(self, args.Args[0].String()), nil
	}
}

// replaceMethod is Python's str.replace(old, new, count=-1); gonja requires
// count.
func replaceMethod(self string, _ *exec.Value, args *exec.VarArgs) (any, error) {
	if len(args.KwArgs) > 0 || len(args.Args) < 2 || len(args.Args) > 3 ||
		!args.Args[0].IsString() || !args.Args[1].IsString() {
		return nil, exec.ErrInvalidCall(errors.New("replace(old, new[, count]) takes strings"))
	}
	n := -1
	if len(args.Args) == 3 {
		if !args.Args[2].IsInteger() {
			return nil, exec.ErrInvalidCall(errors.New("replace count must be an integer"))
		}
		n = args.Args[2].Integer()
	}
	return strings.Replace(self, args.Args[0].String(), args.Args[1].String(), n), nil
}

// splitMethod is Python's str.split(sep=None, maxsplit=-1). It returns a
// [pyList], so x.split(s)[-1] is right when s is absent (see subscript.go).
func splitMethod(self string, _ *exec.Value, args *exec.VarArgs) (any, error) {
	sep, max := exec.AsValue(nil), -1
	if len(args.Args) > 2 {
		return nil, exec.ErrInvalidCall(errors.New("split takes at most two arguments"))
	}
	if len(args.Args) > 0 {
		sep = args.Args[0]
	}
	if v, ok := args.KwArgs["sep"]; ok {
		sep = v
	}
	maxv := exec.AsValue(-1)
	if len(args.Args) > 1 {
		maxv = args.Args[1]
	}
	if v, ok := args.KwArgs["maxsplit"]; ok {
		maxv = v
	}
	if !maxv.IsInteger() {
		return nil, exec.ErrInvalidCall(errors.New("maxsplit must be an integer"))
	}
	max = maxv.Integer()
	var parts []string
	switch {
	case sep.IsNil():
		if max < 0 {
			parts = strings.Fields(self)
		} else {
			rest := strings.TrimLeftFunc(self, unicode.IsSpace)
			for len(parts) < max && rest != "" {
				i := strings.IndexFunc(rest, unicode.IsSpace)
				if i < 0 {
					break
				}
				parts = append(parts, rest[:i])
				rest = strings.TrimLeftFunc(rest[i:], unicode.IsSpace)
			}
			if rest != "" {
				parts = append(parts, rest)
			}
		}
	case !sep.IsString() || sep.String() == "":
		return nil, exec.ErrInvalidCall(errors.New("split separator must be a non-empty string"))
	case max < 0:
		parts = strings.Split(self, sep.String())
	default:
		parts = strings.SplitN(self, sep.String(), max+1)
	}
	out := make(pyList, len(parts))
	for i, p := range parts {
		out[i] = p
	}
	return out, nil
}

// dictMethods keeps key order for our ordered dicts (gonja converts a dict to
// a Go map, sorted, before calling a method) and returns their values
// unconverted.
func dictMethods() *exec.MethodSet[map[string]any] {
	m := map[string]exec.Method[map[string]any]{}
	for _, name := range gonjaDictMethods {
		if f, ok := builtins.Methods.Dict.Get(name); ok {
			m[name] = f
		}
	}
	fallback := func(name string) exec.Method[map[string]any] {
		f, _ := builtins.Methods.Dict.Get(name)
		return f
	}
	ordered := func(name string, fn func(d *exec.Dict) any) exec.Method[map[string]any] {
		orig := fallback(name)
		return func(self map[string]any, sv *exec.Value, args *exec.VarArgs) (any, error) {
			d, ok := sv.Interface().(*exec.Dict)
			if !ok || orig == nil {
				if orig == nil {
					return nil, errors.New("unknown method " + name)
				}
				return orig(self, sv, args)
			}
			if len(args.Args) > 0 || len(args.KwArgs) > 0 {
				return nil, exec.ErrInvalidCall(errors.New(name + "() takes no arguments"))
			}
			return fn(d), nil
		}
	}
	m["keys"] = ordered("keys", func(d *exec.Dict) any {
		out := make([]any, len(d.Pairs))
		for i, p := range d.Pairs {
			out[i] = p.Key.Interface()
		}
		return out
	})
	m["values"] = ordered("values", func(d *exec.Dict) any {
		out := make([]any, len(d.Pairs))
		for i, p := range d.Pairs {
			out[i] = p.Value.Interface()
		}
		return out
	})
	m["items"] = ordered("items", func(d *exec.Dict) any {
		out := make([]any, len(d.Pairs))
		for i, p := range d.Pairs {
			out[i] = []any{p.Key.Interface(), p.Value.Interface()}
		}
		return out
	})
	getOrig := fallback("get")
	m["get"] = func(self map[string]any, sv *exec.Value, args *exec.VarArgs) (any, error) {
		d, ok := sv.Interface().(*exec.Dict)
		if !ok {
			return getOrig(self, sv, args)
		}
		if len(args.Args) < 1 || len(args.Args) > 2 || len(args.KwArgs) > 0 {
			return nil, exec.ErrInvalidCall(errors.New("get() takes 1 or 2 positional arguments"))
		}
		for _, p := range d.Pairs {
			if p.Key.EqualValueTo(args.Args[0]) {
				return p.Value.Interface(), nil
			}
		}
		if len(args.Args) == 2 {
			return args.Args[1].Interface(), nil
		}
		return nil, nil
	}
	return exec.NewMethodSet(m)
}

// lstripBlocks applies Jinja's lstrip_blocks to the source: spaces and tabs
// between the start of a line and a block or comment tag are removed. gonja's
// own option also strips them when the tag is not at the start of a line
// ("{{ x }} {% endif %}" loses its space), which Jinja does not.
func lstripBlocks(src string) string {
	var b strings.Builder
	b.Grow(len(src))
	seg := 0 // start of the current text segment in src
	for pos := 0; pos < len(src); {
		i := strings.Index(src[pos:], "{")
		if i < 0 {
			break
		}
		at := pos + i
		if at+1 >= len(src) {
			break
		}
		kind := src[at+1]
		if kind != '{' && kind != '%' && kind != '#' {
			pos = at + 1
			continue
		}
		text := src[seg:at]
		if kind != '{' && (at+2 >= len(src) || (src[at+2] != '+' && src[at+2] != '-')) {
			l := strings.LastIndexByte(text, '\n') + 1
			lineStart := l > 0 || seg == 0 || src[seg-1] == '\n'
			if lineStart && strings.Trim(text[l:], " \t") == "" {
				text = text[:l]
			}
		}
		b.WriteString(text)
		end := tagEnd(src, at, kind)
		if kind == '%' && isRaw(src[at:end]) {
			// Copy {% raw %}...{% endraw %} verbatim.
			if j := strings.Index(src[end:], "endraw"); j >= 0 {
				if k := strings.Index(src[end+j:], "%}"); k >= 0 {
					end = end + j + k + 2
				}
			}
		}
		b.WriteString(src[at:end])
		if end < len(src) && kind != '{' && src[end] == '\n' {
			// trim_blocks removes this newline; the next text starts a line.
			b.WriteByte('\n')
			end++
		}
		seg, pos = end, end
	}
	b.WriteString(src[seg:])
	return b.String()
}

func isRaw(tag string) bool {
	s := strings.Trim(tag, "{%}+- \t\r\n")
	return s == "raw"
}

// tagEnd returns the index just past the tag opened at src[at], skipping
// string literals inside expressions.
func tagEnd(src string, at int, kind byte) int {
	closer := "}}"
	switch kind {
	case '%':
		closer = "%}"
	case '#':
		if j := strings.Index(src[at+2:], "#}"); j >= 0 {
			return at + 2 + j + 2
		}
		return len(src)
	}
	var quote byte
	for i := at + 2; i < len(src); i++ {
		c := src[i]
		switch {
		case quote != 0:
			if c == '\\' {
				i++
			} else if c == quote {
				quote = 0
			}
		case c == '\'' || c == '"':
			quote = c
		case strings.HasPrefix(src[i:], closer):
			return i + 2
		}
	}
	return len(src)
}
