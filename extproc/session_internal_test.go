package extproc

import (
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"

	"github.com/kvbandit/kvbandit/extproc/hints"
)

// The first configured session header present wins, whatever the order
// of the request's headers; x-prefix-id is not read unless configured.
func TestSessionHeaderOrder(t *testing.T) {
	hm := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: "x-prefix-id", RawValue: []byte("p")},
		{Key: "x-c", RawValue: []byte("c")},
		{Key: "x-b", RawValue: []byte("b1")},
		{Key: "x-b", RawValue: []byte("b2")},
	}}
	for _, tc := range []struct {
		names []string
		want  string
		ok    bool
	}{
		{hints.DefaultSessionHeaders(), "p", true},
		{[]string{"x-a", "x-b", "x-c"}, "b1", true},
		{[]string{"x-c", "x-b"}, "c", true},
		{[]string{"x-a"}, "", false},
	} {
		p := &processor{s: &Server{cfg: Config{SessionHeaders: tc.names}}}
		if err := p.readRequestHeaders(hm); err != nil {
			t.Fatal(err)
		}
		if v, ok := p.header(hints.HeaderPrefixID); v != tc.want || ok != tc.ok {
			t.Errorf("%v: %q %v, want %q %v", tc.names, v, ok, tc.want, tc.ok)
		}
	}
}
