package prefixstate_test

import (
	"crypto/sha256"
	"encoding/hex"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

func sha(s string) string {
	sum := sha256.Sum256([]byte(s))
	return prefixstate.HashedPrefix + hex.EncodeToString(sum[:])
}

func TestBoundID(t *testing.T) {
	long := strings.Repeat("x", prefixstate.MaxIDLen+1)
	atLimit := strings.Repeat("y", prefixstate.MaxIDLen)
	for _, tc := range []struct{ name, in, want string }{
		{"empty", "", ""},
		{"short", "acme", "acme"},
		{"at the limit", atLimit, atLimit},
		{"one byte over", long, sha(long)},
		{"marker alone", prefixstate.HashedPrefix, sha(prefixstate.HashedPrefix)},
		// A short id shaped like a hash is hashed too, so it can never
		// equal the hash of a long id.
		{"looks hashed", sha(long), sha(sha(long))},
		{"marker elsewhere", "x" + prefixstate.HashedPrefix, "x" + prefixstate.HashedPrefix},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := prefixstate.BoundID(tc.in)
			if got != tc.want {
				t.Fatalf("BoundID(%.40q…) = %q, want %q", tc.in, got, tc.want)
			}
			if len(got) > prefixstate.MaxIDLen {
				t.Fatalf("BoundID returned %d bytes", len(got))
			}
		})
	}
}

func TestBoundIDDoesNotCopyLongIDs(t *testing.T) {
	id := strings.Repeat("z", 1<<20)
	_ = prefixstate.BoundID(id) // warm up
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_ = prefixstate.BoundID(id)
	runtime.ReadMemStats(&after)
	if n := after.TotalAlloc - before.TotalAlloc; n > 4<<10 {
		t.Fatalf("BoundID of a 1 MiB id allocated %d bytes", n)
	}
}

func TestNewKeyIsBoundedOnce(t *testing.T) {
	long := strings.Repeat("t", 10_000)
	k := prefixstate.NewKey(long, "p")
	if k.Tenant != sha(long) || k.PrefixID != "p" {
		t.Fatalf("NewKey = %+v", k)
	}
	// The store accepts keys built either way and finds the same entry:
	// a NewKey key is not hashed again, a literal is bounded on the way in.
	s, _ := newStore(t, prefixstate.Config{})
	s.Arrive(prefixstate.Key{Tenant: long, PrefixID: "p"}, 10, true)
	if r, _, _ := s.Arrive(k, 10, true); r != 8 {
		t.Fatalf("NewKey and literal keys of one session: R = %d, want 8", r)
	}
	if s.Len() != 1 {
		t.Fatalf("Len = %d, want 1", s.Len())
	}
}

// Tenants and prefix ids longer than MaxIDLen are stored as their hash:
// two that differ only past the threshold get separate state, and a short
// tenant equal to a long tenant's hash does not share its state either.
func TestLongIDsStaySeparate(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{})
	base := strings.Repeat("a", 4*prefixstate.MaxIDLen)
	keys := []prefixstate.Key{
		{Tenant: base + "1", PrefixID: "same"},
		{Tenant: base + "2", PrefixID: "same"},
		{Tenant: sha(base + "1"), PrefixID: "same"},
		{Tenant: "t", PrefixID: base + "1"},
		{Tenant: "t", PrefixID: base + "2"},
		{Tenant: "t", PrefixID: sha(base + "1")},
	}
	for i, k := range keys {
		s.Arrive(k, 10, true)
		s.Pin(k, prefixstate.Pin{Endpoint: routing.EndpointKey("w:" + strconv.Itoa(i))}, 9)
	}
	if s.Len() != len(keys) {
		t.Fatalf("Len = %d, want %d (distinct ids merged)", s.Len(), len(keys))
	}
	for i, k := range keys {
		r, pin, ok := s.Arrive(k, 10, false)
		if r != 8 || !ok || pin.Endpoint != routing.EndpointKey("w:"+strconv.Itoa(i)) {
			t.Fatalf("key %d: R = %d, pin %v (%v); want 8 on w:%d", i, r, pin.Endpoint, ok, i)
		}
	}
}

// The store's bytes per entry are bounded whatever the ids' sizes: 1,000
// entries with 32 KiB tenants and prefix ids (64 MB if stored whole) stay
// under 8 MB (about 0.5 MB in fact).
func TestMemoryBudgetLongKeys(t *testing.T) {
	const (
		n      = 1000
		size   = 32 << 10
		budget = 8 << 20
	)
	s, _ := newStore(t, prefixstate.Config{})
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	for i := range n {
		suffix := strconv.Itoa(i)
		k := prefixstate.Key{Tenant: strings.Repeat("t", size) + suffix, PrefixID: strings.Repeat("p", size) + suffix}
		s.Arrive(k, 10, true)
		s.Pin(k, prefixstate.Pin{Endpoint: "w:1", DecodeCost: 1, IATFactor: 1}, 9)
	}
	after := heap()
	if s.Len() != n {
		t.Fatalf("Len = %d, want %d", s.Len(), n)
	}
	if growth := int64(after) - int64(before); growth > budget {
		t.Fatalf("heap grew by %.1f MB for %d entries, budget %d MB", float64(growth)/(1<<20), n, budget>>20)
	}
	runtime.KeepAlive(s)
}
