package app

import (
	"bytes"
	"cmp"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"regexp"
	"strconv"
	"strings"

	yamlv3 "go.yaml.in/yaml/v3"
	"sigs.k8s.io/yaml"
)

// MaxConfigBytes bounds a config file.
const MaxConfigBytes = 4 << 20

// ErrConfig marks a config file that cannot be used: malformed YAML, an
// unknown key, a value of the wrong type or out of range. Its message
// names the file, the line when known, and the key path:
// "config.yaml:12: router.tier_weights.gpu: unknown key".
var ErrConfig = errors.New("config")

// configError is one located problem of a config file.
type configError struct {
	file string
	line int    // 0: unknown
	path string // key path, "" when none
	msg  string
}

func (e *configError) Error() string {
	var b strings.Builder
	b.WriteString(e.file)
	if e.line > 0 {
		b.WriteString(":" + strconv.Itoa(e.line))
	}
	b.WriteString(": ")
	if e.path != "" {
		b.WriteString(e.path + ": ")
	}
	b.WriteString(e.msg)
	return b.String()
}

func (e *configError) Unwrap() error { return ErrConfig }

// decodeConfig strictly decodes YAML into c (a pointer to a struct with
// json tags, already holding the defaults). It parses the document once
// with go.yaml.in/yaml/v3 to keep line numbers, refuses every key that
// encoding/json would not map to a field (all of them are reported, with
// their lines), then decodes through sigs.k8s.io/yaml's YAML → JSON
// conversion with unknown fields disallowed, so the values mean exactly
// what they always meant. file names the source in messages.
func decodeConfig(file string, raw []byte, c any) (*yamlv3.Node, error) {
	if len(raw) > MaxConfigBytes {
		return nil, &configError{file: file, msg: fmt.Sprintf("larger than %d bytes", MaxConfigBytes)}
	}
	var doc yamlv3.Node
	if err := yamlv3.Unmarshal(raw, &doc); err != nil {
		return nil, yamlSyntaxError(file, err)
	}
	root := &doc
	if root.Kind == yamlv3.DocumentNode && len(root.Content) > 0 {
		root = root.Content[0]
	}
	if doc.Kind == 0 {
		return root, nil // empty file: the defaults
	}
	var unknown []error
	checkKeys(root, reflect.TypeOf(c).Elem(), "", func(line int, path string) {
		unknown = append(unknown, &configError{file: file, line: line, path: path, msg: "unknown key"})
	})
	if len(unknown) > 0 {
		return nil, errors.Join(unknown...)
	}
	js, err := yaml.YAMLToJSONStrict(raw)
	if err != nil {
		return nil, yamlSyntaxError(file, err)
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(c); err != nil {
		if te, ok := errors.AsType[*json.UnmarshalTypeError](err); ok && te.Field != "" {
			return nil, &configError{file: file, line: lineOf(root, te.Field), path: te.Field, msg: fmt.Sprintf("want %s, got %s", kindName(te.Type), te.Value)}
		}
		return nil, &configError{file: file, msg: strings.TrimPrefix(err.Error(), "json: ")}
	}
	return root, nil
}

// kindName names what a config value of type t looks like in YAML.
func kindName(t reflect.Type) string {
	switch t.Kind() {
	case reflect.Struct, reflect.Map:
		return "a mapping"
	case reflect.Slice, reflect.Array:
		return "a list"
	}
	return t.String()
}

var yamlLine = regexp.MustCompile(`^(?:error converting YAML to JSON: )?yaml: line (\d+): (.*)$`)

var yamlListedLine = regexp.MustCompile(`(?m)^\s*line (\d+): (.*)$`)

// yamlSyntaxError turns "yaml: line N: msg" into "file:N: msg" (and each
// line of "yaml: unmarshal errors:" into its own).
func yamlSyntaxError(file string, err error) error {
	if ms := yamlListedLine.FindAllStringSubmatch(err.Error(), -1); strings.Contains(err.Error(), "unmarshal errors:") && ms != nil {
		var errs []error
		for _, m := range ms {
			n, _ := strconv.Atoi(m[1])
			errs = append(errs, &configError{file: file, line: n, msg: m[2]})
		}
		return errors.Join(errs...)
	}
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		n, _ := strconv.Atoi(m[1])
		return &configError{file: file, line: n, msg: m[2]}
	}
	msg := strings.TrimPrefix(strings.TrimPrefix(err.Error(), "error converting YAML to JSON: "), "yaml: ")
	return &configError{file: file, msg: msg}
}

var (
	jsonUnmarshaler = reflect.TypeFor[json.Unmarshaler]()
	textUnmarshaler = reflect.TypeFor[encoding.TextUnmarshaler]()
)

// checkKeys walks n along t as encoding/json would decode it and reports
// every mapping key that matches no field (json matches names exactly,
// else ignoring case). Values of the wrong kind are left to the decoder;
// types with their own UnmarshalJSON/UnmarshalText are not entered.
func checkKeys(n *yamlv3.Node, t reflect.Type, path string, report func(line int, path string)) {
	for n.Kind == yamlv3.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if reflect.PointerTo(t).Implements(jsonUnmarshaler) || reflect.PointerTo(t).Implements(textUnmarshaler) {
		return
	}
	switch t.Kind() {
	case reflect.Struct:
		if n.Kind != yamlv3.MappingNode {
			return
		}
		fields := jsonFields(t)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if k.Value == "<<" && k.Tag == "!!merge" {
				checkKeys(v, t, path, report)
				continue
			}
			ft, ok := fields[k.Value]
			if !ok {
				for name, typ := range fields {
					if strings.EqualFold(name, k.Value) {
						ft, ok = typ, true
						break
					}
				}
			}
			if !ok {
				report(k.Line, joinPath(path, k.Value))
				continue
			}
			checkKeys(v, ft, joinPath(path, k.Value), report)
		}
	case reflect.Map:
		if n.Kind != yamlv3.MappingNode {
			return
		}
		for i := 0; i+1 < len(n.Content); i += 2 {
			checkKeys(n.Content[i+1], t.Elem(), path+"["+strconv.Quote(n.Content[i].Value)+"]", report)
		}
	case reflect.Slice, reflect.Array:
		if n.Kind != yamlv3.SequenceNode {
			return
		}
		for i, c := range n.Content {
			checkKeys(c, t.Elem(), path+"["+strconv.Itoa(i)+"]", report)
		}
	}
}

func joinPath(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// jsonFields maps the JSON names of t's fields to their types, with the
// fields of embedded structs without a name promoted, as encoding/json
// does.
func jsonFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if tag == "-" {
			continue
		}
		name, _, _ := strings.Cut(tag, ",")
		ft := f.Type
		if f.Anonymous && name == "" {
			if ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				for k, v := range jsonFields(ft) {
					if _, taken := out[k]; !taken {
						out[k] = v
					}
				}
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		out[cmp.Or(name, f.Name)] = ft
	}
	return out
}

// pathStep is one step of a key path: a key (.name or ["name"]) or an
// index ([3]).
var pathStep = regexp.MustCompile(`^(?:\.?([A-Za-z0-9_-]+)|\[("(?:[^"\\]|\\.)*")\]|\[(\d+)\])`)

// lineOf returns the line of the key (or element) at path in root; 0 when
// the file does not hold it (a default, or a value a flag set). Keys match as encoding/json
// matches them (exactly, else ignoring case).
func lineOf(root *yamlv3.Node, path string) int {
	n, line := root, 0
	for path != "" {
		m := pathStep.FindStringSubmatch(path)
		if m == nil {
			break
		}
		path = path[len(m[0]):]
		for n.Kind == yamlv3.AliasNode && n.Alias != nil {
			n = n.Alias
		}
		switch {
		case m[3] != "":
			i, _ := strconv.Atoi(m[3])
			if n.Kind != yamlv3.SequenceNode || i >= len(n.Content) {
				return 0
			}
			n = n.Content[i]
			line = n.Line
		default:
			key := m[1]
			if m[2] != "" {
				key, _ = strconv.Unquote(m[2])
			}
			if n.Kind != yamlv3.MappingNode {
				return 0
			}
			i := mappingKey(n, func(k string) bool { return k == key })
			if i < 0 {
				i = mappingKey(n, func(k string) bool { return strings.EqualFold(k, key) })
			}
			if i < 0 {
				return 0
			}
			line = n.Content[i].Line
			n = n.Content[i+1]
		}
	}
	return line
}

// mappingKey returns the index in n.Content of the first key that match
// accepts (its value follows it), or -1.
func mappingKey(n *yamlv3.Node, match func(string) bool) int {
	for i := 0; i+1 < len(n.Content); i += 2 {
		if match(n.Content[i].Value) {
			return i
		}
	}
	return -1
}

// locateSources points at whichever source key comes second in the file
// (by line), naming the first.
func locateSources(file string, root *yamlv3.Node, se *sourcesError) error {
	first, second := "", ""
	firstLine, secondLine := 0, 0
	for _, k := range se.keys {
		l := lineOf(root, k)
		switch {
		case l == 0:
			continue
		case firstLine == 0 || l < firstLine:
			first, firstLine, second, secondLine = k, l, first, firstLine
		case secondLine == 0 || l < secondLine:
			second, secondLine = k, l
		}
	}
	if secondLine == 0 {
		return &configError{file: file, msg: se.Error()}
	}
	return &configError{file: file, line: secondLine, path: second,
		msg: fmt.Sprintf("%s; %s is already set on line %d", oneSource, first, firstLine)}
}

// validationPath is the key path a validation message starts with
// ("router.block_size: must be > 0").
var validationPath = regexp.MustCompile(`^([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+|\["(?:[^"\\]|\\.)*"\]|\[\d+\])*): `)

// locate turns a validation error into a configError with the line of the
// key its message names (when it names one found in root).
func locate(file string, root *yamlv3.Node, err error) error {
	if se, ok := errors.AsType[*sourcesError](err); ok && root != nil {
		return locateSources(file, root, se)
	}
	msg := err.Error()
	if m := validationPath.FindStringSubmatch(msg); m != nil && root != nil {
		if line := lineOf(root, m[1]); line > 0 {
			return &configError{file: file, line: line, path: m[1], msg: strings.TrimPrefix(msg, m[0])}
		}
	}
	return &configError{file: file, msg: msg}
}
