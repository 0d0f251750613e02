package prefixstate_test

import (
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// FuzzBoundID checks the rule for stored client ids: the result is short,
// an id is kept as is exactly when it is short and not shaped like a hash,
// and two distinct ids never bound to the same string. Seeds:
// testdata/fuzz/FuzzBoundID.
func FuzzBoundID(f *testing.F) {
	f.Fuzz(func(t *testing.T, a, b string) {
		ba, bb := prefixstate.BoundID(a), prefixstate.BoundID(b)
		for _, c := range [][2]string{{a, ba}, {b, bb}} {
			in, out := c[0], c[1]
			if len(out) > prefixstate.MaxIDLen {
				t.Fatalf("BoundID(%q) is %d bytes", in, len(out))
			}
			kept := len(in) <= prefixstate.MaxIDLen && !strings.HasPrefix(in, prefixstate.HashedPrefix)
			if kept != (out == in) {
				t.Fatalf("BoundID(%q) = %q: kept %v, want %v", in, out, out == in, kept)
			}
			if !kept && !strings.HasPrefix(out, prefixstate.HashedPrefix) {
				t.Fatalf("BoundID(%q) = %q: hashed without the marker", in, out)
			}
		}
		if (a == b) != (ba == bb) {
			t.Fatalf("BoundID(%q) = %q and BoundID(%q) = %q", a, ba, b, bb)
		}
		if k := prefixstate.NewKey(a, b); k.Tenant != ba || k.PrefixID != bb {
			t.Fatalf("NewKey(%q, %q) = %+v", a, b, k)
		}
	})
}
