package envoy

import (
	"bytes"
	"encoding/json"
	"errors"
	"regexp"
	"strconv"
	"strings"

	"google.golang.org/protobuf/reflect/protoreflect"
)

// This file turns the positions in third-party errors into config paths: protojson reports a
// line and column of the intermediate JSON (one long line), and protoc-gen-validate reports a
// chain of Go field names. Both become paths like static_resources.clusters[0].connect_timeout.

// protojsonPos matches the position protojson puts in its errors. protobuf-go varies the
// spaces in its error texts between builds (a space or U+00A0) to discourage exact matching,
// hence [\s\x{a0}]; if the format changes further, errors keep their text without a path.
var protojsonPos = regexp.MustCompile(`^proto:[\s\x{a0}]*\(line (\d+):(\d+)\):[\s\x{a0}]*`)

// decodeError describes a protojson error by the path of the JSON key or value it points at.
func decodeError(jsonBytes []byte, err error) error {
	msg := err.Error()
	m := protojsonPos.FindStringSubmatch(msg)
	if m == nil {
		return &problem{rule: ErrDecode, detail: msg}
	}
	line, _ := strconv.Atoi(m[1])
	col, _ := strconv.Atoi(m[2])
	detail := msg[len(m[0]):]
	off, ok := byteOffset(jsonBytes, line, col)
	if !ok {
		return &problem{rule: ErrDecode, detail: detail}
	}
	return &problem{rule: ErrDecode, path: jsonPathAt(jsonBytes, off), detail: detail}
}

// byteOffset converts protojson's 1-based line and rune column into a byte offset.
func byteOffset(b []byte, line, col int) (int64, bool) {
	start := 0
	for range line - 1 {
		i := bytes.IndexByte(b[start:], '\n')
		if i < 0 {
			return 0, false
		}
		start += i + 1
	}
	runes := []rune(string(b[start:]))
	if col < 1 || col-1 > len(runes) {
		return 0, false
	}
	return int64(start + len(string(runes[:col-1]))), true
}

// jsonPathAt returns the path ("a.b[2].c") of the JSON token that contains byte offset off,
// which must be valid JSON up to that token.
func jsonPathAt(data []byte, off int64) string {
	type frame struct {
		object  bool
		key     string // object: the current key
		wantKey bool   // object: the next string is a key
		index   int    // array: the current element
	}
	var stack []*frame
	// valueStarts updates the enclosing container when a value (scalar or container) begins.
	valueStarts := func() {
		if len(stack) == 0 {
			return
		}
		top := stack[len(stack)-1]
		if top.object {
			top.wantKey = true // after this value, a key comes next
		} else {
			top.index++
		}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	for {
		tok, err := dec.Token()
		if err != nil {
			break
		}
		switch t := tok.(type) {
		case json.Delim:
			switch t {
			case '{', '[':
				valueStarts()
				stack = append(stack, &frame{object: t == '{', wantKey: t == '{', index: -1})
			case '}', ']':
				if len(stack) > 0 {
					stack = stack[:len(stack)-1]
				}
			}
		case string:
			if n := len(stack); n > 0 && stack[n-1].object && stack[n-1].wantKey {
				stack[n-1].key = t
				stack[n-1].wantKey = false
			} else {
				valueStarts()
			}
		default:
			valueStarts()
		}
		if dec.InputOffset() > off {
			break
		}
	}
	var b strings.Builder
	for _, f := range stack {
		switch {
		case f.object && f.key != "":
			if b.Len() > 0 {
				b.WriteByte('.')
			}
			b.WriteString(f.key)
		case !f.object && f.index >= 0:
			b.WriteString("[" + strconv.Itoa(f.index) + "]")
		}
	}
	return b.String()
}

// The methods every protoc-gen-validate error type and multi-error type has.
type (
	pgvError interface {
		Field() string
		Reason() string
		Cause() error
		Key() bool
	}
	pgvMultiError interface{ AllErrors() []error }
)

const pgvEmbedded = "embedded message failed validation"

// constraintErrors flattens the error of ValidateAll on message m, found at path, into one
// problem per broken rule, each at the path of its field.
func constraintErrors(err error, m protoreflect.Message, path string) []error {
	var multi pgvMultiError
	if errors.As(err, &multi) {
		var out []error
		for _, e := range multi.AllErrors() {
			out = append(out, constraintErrors(e, m, path)...)
		}
		return out
	}
	var ve pgvError
	if !errors.As(err, &ve) {
		return []error{&problem{rule: ErrConstraint, path: path, detail: err.Error()}}
	}
	fieldPath, child := pgvField(m, path, ve.Field())
	cause := ve.Cause()
	if ve.Reason() == pgvEmbedded && cause != nil && child.IsValid() {
		return constraintErrors(cause, child, fieldPath)
	}
	detail := ve.Reason()
	if ve.Key() {
		detail = "key: " + detail
	}
	if cause != nil {
		detail += ": " + cause.Error()
	}
	return []error{&problem{rule: ErrConstraint, path: fieldPath, detail: detail}}
}

// pgvField resolves a protoc-gen-validate field name ("Clusters[0]", "MessageTimeout",
// "TypedConfig[key]") in message m. It returns the config path of the field and, when the
// field holds a message, that message (invalid otherwise).
func pgvField(m protoreflect.Message, path, field string) (string, protoreflect.Message) {
	name, sub, indexed := field, "", false
	if i := strings.IndexByte(field, '['); i >= 0 && strings.HasSuffix(field, "]") {
		name, sub, indexed = field[:i], field[i+1:len(field)-1], true
	}
	var none protoreflect.Message
	fd := fieldByGoName(m.Descriptor(), name)
	if fd == nil {
		return joinPath(path, field), none
	}
	p := joinPath(path, fd.TextName())
	switch {
	case fd.IsList() && indexed:
		p += "[" + sub + "]"
		i, err := strconv.Atoi(sub)
		if fd.Message() == nil || err != nil || i < 0 || i >= m.Get(fd).List().Len() {
			return p, none
		}
		el := m.Get(fd).List().Get(i).Message()
		return p + nameSuffix(el.Interface()), el
	case fd.IsMap() && indexed:
		p += "[" + strconv.Quote(sub) + "]"
		if fd.MapKey().Kind() != protoreflect.StringKind || fd.MapValue().Message() == nil {
			return p, none
		}
		v := m.Get(fd).Map().Get(protoreflect.ValueOfString(sub).MapKey())
		if !v.IsValid() {
			return p, none
		}
		return p, v.Message()
	case fd.Message() != nil && !fd.IsList() && !fd.IsMap() && m.Has(fd):
		return p, m.Get(fd).Message()
	}
	return p, none
}

// fieldByGoName finds the field whose generated Go name is goName ("ConnectTimeout" for
// connect_timeout), oneof members included.
func fieldByGoName(md protoreflect.MessageDescriptor, goName string) protoreflect.FieldDescriptor {
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if strings.EqualFold(strings.ReplaceAll(string(fd.Name()), "_", ""), goName) {
			return fd
		}
	}
	return nil
}

func joinPath(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}
