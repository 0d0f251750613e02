package decisionlog_test

import (
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/decisionlog"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// Issue 11 (audit): a record's tenant and prefix id come from clients, and
// up to Options.Buffer records wait in memory for the writer. While the
// writer is stuck, 1,500 records with 64 KiB tenants and prefix ids (190 MB
// if kept whole) must hold under 8 MB, and the log must show each id as the
// prefix state stores it (prefixstate.BoundID).
func TestMemoryBudgetLongClientIDs(t *testing.T) {
	const (
		n      = 1500
		size   = 64 << 10
		budget = 8 << 20
	)
	long := func(c string, i int) string {
		s := strconv.Itoa(i)
		return strings.Repeat(c, size-len(s)) + s
	}
	vc := clock.NewVirtual(t0)
	w := &blockingWriter{entered: make(chan struct{}), release: make(chan struct{})}
	l, err := decisionlog.New(w, decisionlog.JSONL, decisionlog.Options{FlushInterval: time.Second, Clock: vc})
	if err != nil {
		t.Fatal(err)
	}
	released := false
	release := func() {
		if !released {
			released = true
			close(w.release)
			if err := l.Close(); err != nil {
				t.Error(err)
			}
		}
	}
	t.Cleanup(release)
	l.Record(decisionlog.Record{DecisionID: "first"})
	waitFor(t, "the first record", func() bool { return l.Stats().Written == 1 })
	vc.Step(time.Second) // flush: the writer goroutine blocks in Write
	<-w.entered

	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	for i := range n {
		l.Record(decisionlog.Record{DecisionID: strconv.Itoa(i), Tenant: long("t", i), PrefixID: long("p", i), Policy: "thompson"})
	}
	after := heap()
	if d := l.Dropped(); d != 0 {
		t.Fatalf("%d records dropped, want 0 (buffer %d)", d, decisionlog.DefaultBuffer)
	}
	growth := int64(after) - int64(before)
	t.Logf("heap growth %.1f MB for %d queued records", float64(growth)/(1<<20), n)
	if growth > budget {
		t.Fatalf("heap grew by %.1f MB for %d queued records with long ids, budget %d MB", float64(growth)/(1<<20), n, budget>>20)
	}

	release()
	recs := parseJSONL(t, w.buf.String())
	if len(recs) != n+1 {
		t.Fatalf("%d records written, want %d", len(recs), n+1)
	}
	for i, r := range recs[1:] {
		if r.Tenant != prefixstate.BoundID(long("t", i)) || r.PrefixID != prefixstate.BoundID(long("p", i)) {
			t.Fatalf("record %d: tenant %.80q prefix id %.80q, want the bounded ids", i, r.Tenant, r.PrefixID)
		}
	}
}

func TestShortIDsAreLoggedAsGiven(t *testing.T) {
	var buf syncBuffer
	l, err := decisionlog.New(&buf, decisionlog.JSONL, decisionlog.Options{})
	if err != nil {
		t.Fatal(err)
	}
	l.Record(decisionlog.Record{Tenant: "acme", PrefixID: "sess-1"})
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if r := parseJSONL(t, buf.String()); len(r) != 1 || r[0].Tenant != "acme" || r[0].PrefixID != "sess-1" {
		t.Fatalf("records %+v", r)
	}
}
