package envoy

import (
	"errors"
	"strconv"
	"strings"
	"testing"
)

func TestJSONPathAt(t *testing.T) {
	const doc = `{"a":{"b":[{"c":1},{"d":"x","e":[true,{"f":null}]}]},"g":"h"}`
	tests := []struct {
		at   string // the first occurrence of this text in doc
		want string
	}{
		{`"a"`, "a"},
		{`"c"`, "a.b[0].c"},
		{`"d"`, "a.b[1].d"},
		{`"x"`, "a.b[1].d"},
		{`true`, "a.b[1].e[0]"},
		{`"f"`, "a.b[1].e[1].f"},
		{`"h"`, "g"},
	}
	for _, tc := range tests {
		off := int64(strings.Index(doc, tc.at))
		if got := jsonPathAt([]byte(doc), off); got != tc.want {
			t.Errorf("jsonPathAt(%s) = %q, want %q", tc.at, got, tc.want)
		}
	}
}

func TestDecodeErrorReadsBothProtobufSpacings(t *testing.T) {
	doc := []byte(`{"static_resources":{"clusters":[{"nmae":"x"}]}}`)
	col := strings.Index(string(doc), `"nmae"`) + 1
	for _, sp := range []string{" ", "\u00a0"} {
		msg := "proto:" + sp + "(line 1:" + strconv.Itoa(col) + "):" + sp + `unknown field "nmae"`
		err := decodeError(doc, errors.New(msg))
		if want := `static_resources.clusters[0].nmae: unknown field "nmae"`; err.Error() != want {
			t.Errorf("spacing %q: got %q, want %q", sp, err, want)
		}
		if !errors.Is(err, ErrDecode) {
			t.Errorf("spacing %q: not ErrDecode", sp)
		}
	}
	// An unexpected format keeps the message.
	if err := decodeError(doc, errors.New("proto: something else")); err.Error() != "proto: something else" {
		t.Errorf("got %q", err)
	}
}
