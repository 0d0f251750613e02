package hints_test

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
)

func TestSessionHeaders(t *testing.T) {
	if got, err := hints.SessionHeaders(nil); err != nil || !slices.Equal(got, []string{"x-prefix-id"}) {
		t.Fatalf("default: %v %v", got, err)
	}
	if got, err := hints.SessionHeaders([]string{"X-Session-Id", "x-prefix-id", "session_id"}); err != nil || !slices.Equal(got, []string{"x-session-id", "x-prefix-id", "session_id"}) {
		t.Fatalf("valid: %v %v", got, err)
	}
	for _, bad := range [][]string{
		{""},
		{"x session"},
		{" x-session"},
		{":path"},
		{"x-séance"},
		{strings.Repeat("x", hints.MaxSessionHeaderNameLen+1)},
		{"x-a", "X-A"},
		{"x-prefix-total-requests"},
		{"x-request-priority"},
		slices.Repeat([]string{"x"}, hints.MaxSessionHeaders+1),
	} {
		if _, err := hints.SessionHeaders(bad); !errors.Is(err, hints.ErrSessionHeader) {
			t.Errorf("%q: err = %v, want ErrSessionHeader", bad, err)
		}
	}
}

// The first configured session header present gives the prefix id; the
// default name is then not read, other hints are.
func TestWithSessionHeaders(t *testing.T) {
	hdr := map[string]string{"x-prefix-id": "p", "x-b": "b", "x-c": "c", "x-prefix-total-requests": "4"}
	g := func(name string) (string, bool) { v, ok := hdr[name]; return v, ok }
	for _, tc := range []struct {
		names []string
		want  string
	}{
		{nil, "p"},
		{[]string{"x-a", "x-c", "x-b"}, "c"},
		{[]string{"x-b", "x-prefix-id"}, "b"},
		{[]string{"x-a"}, ""},
	} {
		h, _ := hints.Parse(hints.WithSessionHeaders(g, tc.names), openai.NVExt{})
		if h.PrefixID != tc.want || h.TotalRequests != 4 {
			t.Errorf("%v: prefix id %q total %d, want %q 4", tc.names, h.PrefixID, h.TotalRequests, tc.want)
		}
	}
}
