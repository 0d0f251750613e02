package prefixstate_test

import (
	"math"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// TestExportImportSessions: a peer's sessions, exported and imported into
// a new store, keep their budget, pin, outstanding work and ages; a
// session already held here is left alone, an expired one is not taken,
// and the imported ones expire on this store's clock as they would have
// on the peer's.
func TestExportImportSessions(t *testing.T) {
	src, clk := newStore(t, prefixstate.Config{TTL: time.Minute})
	k := prefixstate.NewKey("t", "wf-1")
	src.Arrive(k, 5, true)
	src.Pin(k, prefixstate.Pin{Endpoint: "10.0.0.1:8000", DPRank: -1, DecodeCost: 2, PrefillCost: 1, IATFactor: 1, At: clk.Now()}, 4)
	idle := prefixstate.NewKey("t", "idle")
	src.Arrive(idle, 3, true)
	clk.Step(10 * time.Second)
	out := src.Export(0)
	if len(out) != 2 {
		t.Fatalf("exported %d sessions, want 2", len(out))
	}

	dst, dclk := newStore(t, prefixstate.Config{TTL: time.Minute})
	mine := prefixstate.NewKey("t", "idle")
	dst.Arrive(mine, 9, true) // already known here: stays as is
	imported, skipped, malformed := dst.Import(out)
	if imported != 1 || skipped != 1 || malformed != 0 {
		t.Fatalf("import: %d, %d skipped, %d malformed; want 1, 1, 0", imported, skipped, malformed)
	}
	if w := dst.OutstandingWork("10.0.0.1:8000"); w != src.OutstandingWork("10.0.0.1:8000") || w != 12 {
		t.Errorf("outstanding work %v, the peer's %v, want 12", w, src.OutstandingWork("10.0.0.1:8000"))
	}
	reuse, pin, ok := dst.Arrive(k, 0, false)
	if !ok || reuse != 3 || pin.Endpoint != "10.0.0.1:8000" || pin.DPRank != -1 || dclk.Now().Sub(pin.At) != 10*time.Second {
		t.Errorf("imported session: reuse %d pin %+v (age %v), ok %v", reuse, pin, dclk.Now().Sub(pin.At), ok)
	}
	if r, _, _ := dst.Arrive(mine, 0, false); r != 7 {
		t.Errorf("the local session's budget %d, want 7 (untouched)", r)
	}
	// Last used 10 s before the import: gone 50 s later, as on the peer.
	dclk.Step(49 * time.Second)
	if _, _, ok := dst.Arrive(k, 0, false); !ok {
		t.Error("imported session expired early")
	}
	dclk.Step(2 * time.Second)
	dst.Sweep()
	if _, _, ok := dst.Arrive(k, 0, false); ok || dst.OutstandingWork("10.0.0.1:8000") != 0 {
		t.Error("imported session outlived its TTL")
	}
	// An expired session is not imported.
	old := []warmstate.Session{{PrefixID: "old", Total: 2, IdleMillis: uint32(2 * time.Minute / time.Millisecond)}}
	if n, s, _ := dst.Import(old); n != 0 || s != 1 {
		t.Errorf("expired session: imported %d skipped %d", n, s)
	}
}

// TestImportSessionsChecked: out-of-range sessions are refused and
// counted; the store's bound holds.
func TestImportSessionsChecked(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{MaxEntries: 4, Shards: 1})
	long := string(make([]byte, prefixstate.MaxIDLen+1))
	bad := []warmstate.Session{
		{PrefixID: ""}, {PrefixID: long}, {Tenant: long, PrefixID: "a"},
		{PrefixID: "a", Total: -1}, {PrefixID: "a", Total: prefixstate.MaxTotalRequests + 1},
		{PrefixID: "a", Total: 2, Processed: 3},
		{PrefixID: "a", Total: 2, Pinned: true},
		{PrefixID: "a", Total: 2, Pinned: true, Endpoint: "e", Rank: -2},
		{PrefixID: "a", Total: 2, Pinned: true, Endpoint: "e", DecodeCost: math.NaN()},
		{PrefixID: "a", Total: 2, Pinned: true, Endpoint: "e", PrefillCost: -1},
		{PrefixID: "a", Total: 2, Pinned: true, Endpoint: "e", IATFactor: math.Inf(1)},
	}
	if n, _, m := s.Import(bad); n != 0 || m != len(bad) || s.Len() != 0 {
		t.Fatalf("imported %d, malformed %d of %d", n, m, len(bad))
	}
	var many []warmstate.Session
	for i := range 10 {
		many = append(many, warmstate.Session{PrefixID: string(rune('a' + i)), Total: 3, Pinned: true, Endpoint: "e", DecodeCost: 1, IATFactor: 1})
	}
	n, skipped, _ := s.Import(many)
	if n != 4 || skipped != 6 || s.Len() != 4 {
		t.Errorf("imported %d skipped %d into a store of 4 (len %d)", n, skipped, s.Len())
	}
	if w := s.OutstandingWork(routing.EndpointKey("e")); w != 12 {
		t.Errorf("outstanding %v, want 4 × 3", w)
	}
}

// FuzzImportSessions: any session, valid or not, imports without a
// panic; the store stays within its bound and its outstanding work is
// never negative, and a session is refused as malformed exactly when it
// is out of range. Seeds: testdata/fuzz/FuzzImportSessions.
func FuzzImportSessions(f *testing.F) {
	f.Add("t", "p", int32(3), int32(1), true, "e", int32(0), 1.0, 1.0, 1.0, uint32(5), uint32(5))
	f.Add("", "", int32(-1), int32(2), false, "", int32(-3), math.NaN(), -1.0, math.Inf(1), uint32(math.MaxUint32), uint32(math.MaxUint32))
	f.Fuzz(func(t *testing.T, tenant, prefix string, total, processed int32, pinned bool, ep string, rank int32, dc, pc, iat float64, pinAge, idle uint32) {
		s, err := prefixstate.New(prefixstate.Config{MaxEntries: 2, Shards: 1}, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		ws := warmstate.Session{Tenant: tenant, PrefixID: prefix, Total: total, Processed: processed, Pinned: pinned,
			Endpoint: ep, Rank: rank, DecodeCost: dc, PrefillCost: pc, IATFactor: iat, PinAgeMillis: pinAge, IdleMillis: idle}
		n, _, m := s.Import([]warmstate.Session{ws, ws, ws})
		if s.Len() > 2 || n > 1 || s.OutstandingWork(routing.EndpointKey(ep)) < 0 {
			t.Fatalf("imported %d (len %d), work %v", n, s.Len(), s.OutstandingWork(routing.EndpointKey(ep)))
		}
		if m != 0 && m != 3 {
			t.Fatalf("malformed %d of 3 equal sessions", m)
		}
		if m == 0 {
			s.Export(0)
		}
	})
}
