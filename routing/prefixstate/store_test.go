package prefixstate_test

import (
	"fmt"
	"math"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func newStore(t testing.TB, cfg prefixstate.Config) (*prefixstate.Store, *clock.Virtual) {
	t.Helper()
	clk := clock.NewVirtual(t0)
	s, err := prefixstate.New(cfg, clk)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s, clk
}

func TestArriveCountsTheBudgetDown(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{})
	k := prefixstate.Key{Tenant: "t", PrefixID: "wf-1"}
	for want := 9; want >= 0; want-- {
		r, _, ok := s.Arrive(k, 10, true)
		if r != want || ok {
			t.Fatalf("Arrive = %d, pinned %v; want %d, false", r, ok, want)
		}
	}
	if s.Len() != 0 {
		t.Fatalf("Len = %d after the budget is spent, want 0", s.Len())
	}
	// A new round of the same id starts over.
	if r, _, _ := s.Arrive(k, 3, true); r != 2 {
		t.Fatalf("new round: R = %d, want 2", r)
	}
}

func TestArriveTotalIsTheMaximumSeen(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{})
	k := prefixstate.Key{PrefixID: "p"}
	s.Arrive(k, 3, true) // total 3, processed 1
	if r, _, _ := s.Arrive(k, 10, true); r != 8 {
		t.Fatalf("raised total: R = %d, want 8", r)
	}
	if r, _, _ := s.Arrive(k, 2, true); r != 7 {
		t.Fatalf("lowered total is ignored: R = %d, want 7", r)
	}
}

func TestMissingAndOneShotPrefixesCostNothing(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{})
	for _, k := range []prefixstate.Key{{}, {Tenant: "t"}} {
		if r, _, ok := s.Arrive(k, 10, true); r != 0 || ok {
			t.Fatalf("empty id: R = %d ok=%v", r, ok)
		}
		s.Pin(k, prefixstate.Pin{Endpoint: "a:1", DecodeCost: 1, IATFactor: 1}, 5)
	}
	if r, _, _ := s.Arrive(prefixstate.Key{PrefixID: "one"}, 1, true); r != 0 {
		t.Fatalf("total 1: R = %d, want 0", r)
	}
	if s.Len() != 0 || s.OutstandingWork("a:1") != 0 {
		t.Fatalf("Len = %d, work = %v; want nothing stored", s.Len(), s.OutstandingWork("a:1"))
	}
}

// A session id without an announced total is assumed to continue: its
// budget is the requests seen so far, capped at MaxOpenReuse, and a total
// announced later refines it and ends it once reached.
func TestOpenSessionAssumedToContinue(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{})
	for _, total := range []int{-3, 0} {
		k := prefixstate.Key{PrefixID: "open" + strconv.Itoa(total)}
		n0 := s.Len()
		if r, _, _ := s.Arrive(k, total, false); r != 1 || s.Len() != n0 {
			t.Fatalf("total %d: peek R = %d, Len = %d; want 1, %d", total, r, s.Len(), n0)
		}
		for n := 1; n <= prefixstate.MaxOpenReuse+3; n++ {
			r, _, _ := s.Arrive(k, total, true)
			if want := min(n, prefixstate.MaxOpenReuse); r != want {
				t.Fatalf("total %d, request %d: R = %d, want %d", total, n, r, want)
			}
			s.Pin(k, prefixstate.Pin{Endpoint: "a:1"}, r)
		}
	}
	k := prefixstate.Key{PrefixID: "refined"}
	s.Arrive(k, 0, true)
	s.Arrive(k, 0, true) // processed 2
	if r, _, _ := s.Arrive(k, 4, false); r != 1 {
		t.Fatalf("peek with a total: R = %d, want 1", r)
	}
	if r, _, _ := s.Arrive(k, 4, true); r != 1 {
		t.Fatalf("announced total 4 after 2: R = %d, want 1", r)
	}
	if r, _, _ := s.Arrive(k, 0, true); r != 0 {
		t.Fatalf("announced total reached: R = %d, want 0", r)
	}
}

func TestPeekChangesNothing(t *testing.T) {
	s, clk := newStore(t, prefixstate.Config{TTL: time.Minute})
	k := prefixstate.Key{PrefixID: "p"}
	if r, _, _ := s.Arrive(k, 5, false); r != 4 || s.Len() != 0 {
		t.Fatalf("peek of a new prefix: R = %d, Len = %d; want 4, 0", r, s.Len())
	}
	s.Arrive(k, 5, true) // R = 4
	s.Pin(k, prefixstate.Pin{Endpoint: "a:1", DPRank: 2}, 4)
	for range 3 {
		r, last, ok := s.Arrive(k, 5, false)
		if r != 3 || !ok || last.Endpoint != "a:1" || last.DPRank != 2 {
			t.Fatalf("peek = %d %+v %v", r, last, ok)
		}
	}
	// Peeks do not refresh the TTL.
	clk.Step(40 * time.Second)
	s.Arrive(k, 5, false)
	clk.Step(30 * time.Second)
	if _, _, ok := s.Arrive(k, 5, false); ok {
		t.Fatal("a peek kept an entry alive")
	}
}

func TestPinChargesOutstandingWork(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{})
	a := prefixstate.Key{PrefixID: "a"}
	b := prefixstate.Key{PrefixID: "b"}
	s.Arrive(a, 5, true)
	s.Pin(a, prefixstate.Pin{Endpoint: "w1:1", DecodeCost: 2, PrefillCost: 0.5, IATFactor: 1.5}, 4) // 4·2.5·1.5 = 15
	s.Arrive(b, 3, true)
	s.Pin(b, prefixstate.Pin{Endpoint: "w1:1", DecodeCost: 1, PrefillCost: 0.25, IATFactor: 0.6}, 2) // 2·1.25·0.6 = 1.5
	if got := s.OutstandingWork("w1:1"); math.Abs(got-16.5) > 1e-9 {
		t.Fatalf("work(w1) = %v, want 16.5", got)
	}
	// Re-pinning moves the charge.
	r, last, ok := s.Arrive(a, 5, true)
	if r != 3 || !ok || last.Endpoint != "w1:1" {
		t.Fatalf("Arrive = %d %+v %v", r, last, ok)
	}
	s.Pin(a, prefixstate.Pin{Endpoint: "w2:1", DecodeCost: 2, PrefillCost: 0, IATFactor: 1.5}, r) // 3·2·1.5 = 9
	if w1, w2 := s.OutstandingWork("w1:1"), s.OutstandingWork("w2:1"); w1 != 1.5 || w2 != 9 {
		t.Fatalf("work = %v, %v; want 1.5, 9", w1, w2)
	}
	// Budget spent: the last request removes the entry and its charge.
	for range 3 {
		r, _, _ = s.Arrive(a, 5, true)
		s.Pin(a, prefixstate.Pin{Endpoint: "w2:1", DecodeCost: 2, IATFactor: 1.5}, r)
	}
	s.Pin(b, prefixstate.Pin{}, 0)
	if s.Len() != 0 || s.OutstandingWork("w1:1") != 0 || s.OutstandingWork("w2:1") != 0 {
		t.Fatalf("Len %d work %v %v, want all zero", s.Len(), s.OutstandingWork("w1:1"), s.OutstandingWork("w2:1"))
	}
}

func TestHostileCostsAreBounded(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{})
	k := prefixstate.Key{PrefixID: "x"}
	r, _, _ := s.Arrive(k, math.MaxInt, true)
	if r != prefixstate.MaxTotalRequests-1 {
		t.Fatalf("R = %d, want the cap %d", r, prefixstate.MaxTotalRequests-1)
	}
	s.Pin(k, prefixstate.Pin{Endpoint: "w:1", DecodeCost: math.Inf(1), PrefillCost: math.NaN(), IATFactor: -1}, r)
	if w := s.OutstandingWork("w:1"); w != 0 {
		t.Fatalf("work from non-finite costs = %v, want 0", w)
	}
	s.Pin(k, prefixstate.Pin{Endpoint: "w:1", DecodeCost: 1e300, IATFactor: 1e300}, r)
	if w := s.OutstandingWork("w:1"); w != 1e9 {
		t.Fatalf("work = %v, want the cap 1e9", w)
	}
}

func TestEntriesExpire(t *testing.T) {
	s, clk := newStore(t, prefixstate.Config{TTL: 10 * time.Minute, SweepInterval: time.Minute})
	k := prefixstate.Key{PrefixID: "lazy"}
	s.Arrive(k, 10, true)
	s.Pin(k, prefixstate.Pin{Endpoint: "w:1", DecodeCost: 1, IATFactor: 1}, 9)
	swept := prefixstate.Key{PrefixID: "swept"}
	s.Arrive(swept, 10, true)
	s.Pin(swept, prefixstate.Pin{Endpoint: "w:1", DecodeCost: 1, IATFactor: 1}, 9)

	clk.Step(9 * time.Minute)
	s.Arrive(k, 10, true) // refreshes k only (R = 8)
	clk.Step(2 * time.Minute)
	if st := s.Stats(); st.Entries != 1 || st.Expired != 1 {
		t.Fatalf("after the sweep: %+v, want 1 entry, 1 expired", st)
	}
	if w := s.OutstandingWork("w:1"); w != 9 {
		t.Fatalf("work = %v, want 9 (the swept pin's charge released)", w)
	}
	clk.Step(7*time.Minute + 59*time.Second) // k was last used at 9m: it expires at 19m
	if _, _, ok := s.Arrive(k, 10, false); !ok {
		t.Fatal("k expired before its TTL")
	}
	clk.Step(time.Second)
	// Lazy: the commit finds it expired and starts a new group.
	r, _, ok := s.Arrive(k, 10, true)
	if r != 9 || ok {
		t.Fatalf("after expiry: R = %d pinned=%v, want a new group (9, false)", r, ok)
	}
	if w := s.OutstandingWork("w:1"); w != 0 {
		t.Fatalf("work = %v after both expired, want 0", w)
	}
}

func TestNoExpiryKeepsEntries(t *testing.T) {
	s, clk := newStore(t, prefixstate.Config{NoExpiry: true})
	k := prefixstate.Key{PrefixID: "p"}
	s.Arrive(k, 10, true)
	if _, ok := clk.NextAt(); ok {
		t.Fatal("a sweep is scheduled with NoExpiry")
	}
	clk.Step(1000 * time.Hour)
	if r, _, _ := s.Arrive(k, 10, true); r != 8 {
		t.Fatalf("R = %d, want 8", r)
	}
}

func TestCloseStopsTheSweep(t *testing.T) {
	s, clk := newStore(t, prefixstate.Config{})
	if _, ok := clk.NextAt(); !ok {
		t.Fatal("no sweep scheduled")
	}
	s.Close()
	if _, ok := clk.NextAt(); ok {
		t.Fatal("sweep still scheduled after Close")
	}
}

func TestLRUBound(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{MaxEntries: 64, Shards: 4})
	for i := range 1000 {
		k := prefixstate.Key{PrefixID: "p" + strconv.Itoa(i)}
		s.Arrive(k, 10, true)
		s.Pin(k, prefixstate.Pin{Endpoint: "w:1", DecodeCost: 1, IATFactor: 1}, 9)
	}
	st := s.Stats()
	if st.Entries > 64 || st.Evicted != uint64(1000-st.Entries) {
		t.Fatalf("stats %+v, want at most 64 entries and the rest evicted", st)
	}
	if w := s.OutstandingWork("w:1"); w != float64(9*st.Entries) {
		t.Fatalf("work = %v, want 9 per live entry (%d)", w, 9*st.Entries)
	}
	// The most recent entry survived.
	if _, _, ok := s.Arrive(prefixstate.Key{PrefixID: "p999"}, 10, false); !ok {
		t.Fatal("most recent entry was evicted")
	}
}

func TestTenantsAreSeparate(t *testing.T) {
	s, _ := newStore(t, prefixstate.Config{})
	a := prefixstate.Key{Tenant: "a", PrefixID: "same"}
	b := prefixstate.Key{Tenant: "b", PrefixID: "same"}
	s.Arrive(a, 10, true)
	s.Pin(a, prefixstate.Pin{Endpoint: "w:1"}, 9)
	if r, _, ok := s.Arrive(b, 10, true); r != 9 || ok {
		t.Fatalf("tenant b sees tenant a's state: R = %d pinned=%v", r, ok)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []prefixstate.Config{{TTL: -1}, {MaxEntries: -1}, {SweepInterval: -1}, {Shards: -1}} {
		if _, err := prefixstate.New(c, nil); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}

func TestConcurrentUse(t *testing.T) {
	s, clk := newStore(t, prefixstate.Config{MaxEntries: 256, TTL: time.Second, SweepInterval: time.Second})
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 2000 {
				k := prefixstate.Key{Tenant: strconv.Itoa(g % 2), PrefixID: strconv.Itoa(i % 300)}
				r, _, _ := s.Arrive(k, 5, i%3 != 0)
				s.Pin(k, prefixstate.Pin{Endpoint: routing.EndpointKey(fmt.Sprintf("w%d:1", i%4)), DecodeCost: 1, IATFactor: 1}, r)
				_ = s.OutstandingWork("w1:1")
			}
		})
	}
	wg.Go(func() {
		for range 50 {
			clk.Step(100 * time.Millisecond)
		}
	})
	wg.Wait()
	// Drain: every entry expires, every charge is released exactly.
	clk.Step(time.Hour)
	for i := range 4 {
		if w := s.OutstandingWork(routing.EndpointKey(fmt.Sprintf("w%d:1", i))); w != 0 {
			t.Errorf("w%d work = %v after all entries expired, want exactly 0", i, w)
		}
	}
	if s.Len() != 0 {
		t.Errorf("Len = %d, want 0", s.Len())
	}
}

// TestMillionPrefixesStayBounded routes one million distinct one-use-left
// prefix ids through a store with the default bound and reports the heap
// the store holds.
func TestMillionPrefixesStayBounded(t *testing.T) {
	if testing.Short() {
		t.Skip("slow")
	}
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	s, _ := newStore(t, prefixstate.Config{})
	var peak uint64
	for i := range 1_000_000 {
		k := prefixstate.Key{Tenant: "tenant-a", PrefixID: "workflow-" + strconv.Itoa(i) + "-d1"}
		r, _, _ := s.Arrive(k, 10, true)
		s.Pin(k, prefixstate.Pin{Endpoint: "10.0.0.1:8000", DecodeCost: 2, PrefillCost: 0.5, IATFactor: 1}, r)
		if i%250_000 == 249_999 {
			peak = max(peak, heap()-before)
		}
	}
	after := heap() - before
	st := s.Stats()
	t.Logf("1M prefixes: entries=%d evicted=%d heap=%d bytes (%.0f B/entry), peak %d bytes", st.Entries, st.Evicted, after, float64(after)/float64(st.Entries), peak)
	if st.Entries > prefixstate.DefaultMaxEntries {
		t.Fatalf("entries = %d, over the bound %d", st.Entries, prefixstate.DefaultMaxEntries)
	}
	if after > 64<<20 {
		t.Fatalf("heap grew by %d bytes for %d entries", after, st.Entries)
	}
	if w := s.OutstandingWork("10.0.0.1:8000"); w != float64(st.Entries)*9*2.5 {
		t.Fatalf("work = %v, want %v", w, float64(st.Entries)*9*2.5)
	}
	runtime.KeepAlive(s)
}

func BenchmarkArrivePin(b *testing.B) {
	s, _ := newStore(b, prefixstate.Config{})
	keys := make([]prefixstate.Key, 4096)
	for i := range keys {
		keys[i] = prefixstate.Key{Tenant: "t", PrefixID: "wf-" + strconv.Itoa(i)}
	}
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := 0
		for pb.Next() {
			k := keys[i%len(keys)]
			i++
			r, _, _ := s.Arrive(k, 1000, true)
			s.Pin(k, prefixstate.Pin{Endpoint: "10.0.0.1:8000", DecodeCost: 2, IATFactor: 1}, r)
			_ = s.OutstandingWork("10.0.0.1:8000")
		}
	})
}
