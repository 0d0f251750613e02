package kvindex

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func mustInsert(t testing.TB, ix *Index, w WorkerID, bs int, keys []uint64, now time.Time) {
	t.Helper()
	if err := ix.InsertApprox(w, bs, keys, now); err != nil {
		t.Fatal(err)
	}
}

func TestApproxTTL(t *testing.T) {
	const bs = 4
	keys := AppendBlockKeys(nil, prompt(20, 6*bs), bs, BaseSeed)
	other := AppendBlockKeys(nil, prompt(21, 6*bs), bs, BaseSeed)
	tests := []struct {
		name  string
		steps func(t *testing.T, ix *Index, w WorkerID, v stepper)
		want  map[WorkerID]int
		stats Stats
	}{
		{
			name: "alive at TTL",
			steps: func(t *testing.T, ix *Index, w WorkerID, v stepper) {
				mustInsert(t, ix, w, bs, keys, v.Now())
				v.Step(10 * time.Second)
			},
			want:  map[WorkerID]int{1: 6},
			stats: Stats{Entries: 6, ApproxEntries: 6, Blocks: 6},
		},
		{
			name: "gone a second later",
			steps: func(t *testing.T, ix *Index, w WorkerID, v stepper) {
				mustInsert(t, ix, w, bs, keys, v.Now())
				v.Step(11 * time.Second)
			},
			want:  map[WorkerID]int{},
			stats: Stats{Expired: 6},
		},
		{
			name: "mid-second insert still lives TTL",
			steps: func(t *testing.T, ix *Index, w WorkerID, v stepper) {
				v.Step(900 * time.Millisecond)
				mustInsert(t, ix, w, bs, keys, v.Now())
				v.Step(10*time.Second + 99*time.Millisecond) // 10.999s after the insert
			},
			want:  map[WorkerID]int{1: 6},
			stats: Stats{Entries: 6, ApproxEntries: 6, Blocks: 6},
		},
		{
			name: "re-insert refreshes",
			steps: func(t *testing.T, ix *Index, w WorkerID, v stepper) {
				mustInsert(t, ix, w, bs, keys, v.Now())
				v.Step(8 * time.Second)
				mustInsert(t, ix, w, bs, keys, v.Now())
				v.Step(5 * time.Second)
			},
			want:  map[WorkerID]int{1: 6},
			stats: Stats{Entries: 6, ApproxEntries: 6, Blocks: 6},
		},
		{
			name: "refreshed prefix outlives its tail",
			steps: func(t *testing.T, ix *Index, w WorkerID, v stepper) {
				mustInsert(t, ix, w, bs, keys, v.Now())
				v.Step(5 * time.Second)
				mustInsert(t, ix, w, bs, keys[:2], v.Now())
				v.Step(7 * time.Second)
			},
			want:  map[WorkerID]int{1: 2},
			stats: Stats{Entries: 2, ApproxEntries: 2, Blocks: 2, Expired: 4},
		},
		{
			name: "refresh then expiry",
			steps: func(t *testing.T, ix *Index, w WorkerID, v stepper) {
				mustInsert(t, ix, w, bs, keys, v.Now())
				mustInsert(t, ix, w, bs, other, v.Now())
				v.Step(8 * time.Second)
				mustInsert(t, ix, w, bs, keys, v.Now())
				v.Step(19 * time.Second)
			},
			want:  map[WorkerID]int{},
			stats: Stats{Expired: 12},
		},
		{
			name: "event-fed blocks never expire",
			steps: func(t *testing.T, ix *Index, w WorkerID, v stepper) {
				mustInsert(t, ix, w, bs, keys, v.Now())
				mustApply(t, ix, w, storedChain(prompt(20, 6*bs), bs, 0, 3, 0))
				mustInsert(t, ix, w, bs, keys, v.Now().Add(2*time.Second))
				v.Step(time.Hour)
			},
			want:  map[WorkerID]int{1: 3},
			stats: Stats{Entries: 3, Blocks: 3, Expired: 3},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix, v := newTestIndex(t, Options{TTL: 10 * time.Second})
			w := ix.Worker("a", 0)
			tt.steps(t, ix, w, v)
			if diff := cmp.Diff(tt.want, overlaps(ix, bs, keys)); diff != "" {
				t.Errorf("overlaps (-want +got):\n%s", diff)
			}
			st := ix.Stats()
			st.Workers, st.Spaces = 0, 0 // gauges checked elsewhere
			if diff := cmp.Diff(tt.stats, st); diff != "" {
				t.Errorf("stats (-want +got):\n%s", diff)
			}
			if int64(ix.Size(w)) != tt.stats.Entries {
				t.Errorf("Size = %d", ix.Size(w))
			}
		})
	}
}

type stepper interface {
	Now() time.Time
	Step(time.Duration)
}

func TestApproxPrune(t *testing.T) {
	const bs = 4
	req := func(i int) []uint64 { return AppendBlockKeys(nil, prompt(100+i, 5*bs), bs, BaseSeed) }
	ix, v := newTestIndex(t, Options{TTL: time.Hour, MaxEntries: 20, PruneTargetRatio: 0.5})
	a, b := ix.Worker("a", 0), ix.Worker("b", 0)
	mustInsert(t, ix, a, bs, req(0), v.Now()) // 5 entries, second 0
	v.Step(time.Second)
	mustInsert(t, ix, a, bs, req(1), v.Now()) // 10, second 1
	mustInsert(t, ix, b, bs, req(2), v.Now()) // 15
	v.Step(time.Second)
	mustInsert(t, ix, b, bs, req(0)[:3], v.Now()) // 18: b shares req 0's prefix
	mustInsert(t, ix, a, bs, req(3), v.Now())     // 23 > 20: prune to 10
	want := map[string]map[WorkerID]int{
		// Second 0 goes first, whole; then second 1 from its last insert
		// backwards: b's req 2 goes entirely, a's req 1 loses its tail.
		"req0": {b: 3},
		"req1": {a: 2},
		"req2": {},
		"req3": {a: 5},
	}
	for i, name := range []string{"req0", "req1", "req2", "req3"} {
		if diff := cmp.Diff(want[name], overlaps(ix, bs, req(i))); diff != "" {
			t.Errorf("%s (-want +got):\n%s", name, diff)
		}
	}
	st := ix.Stats()
	if st.ApproxEntries != 10 || st.Entries != 10 || st.Pruned != 13 || st.Expired != 0 {
		t.Errorf("stats %+v", st)
	}
	if ix.Size(a)+ix.Size(b) != 10 {
		t.Errorf("sizes %d + %d", ix.Size(a), ix.Size(b))
	}
}

func TestApproxStampsNeverGoBack(t *testing.T) {
	const bs = 4
	keys := AppendBlockKeys(nil, prompt(30, 2*bs), bs, BaseSeed)
	late := AppendBlockKeys(nil, prompt(31, 2*bs), bs, BaseSeed)
	ix, v := newTestIndex(t, Options{TTL: 10 * time.Second})
	w := ix.Worker("a", 0)
	mustInsert(t, ix, w, bs, keys, v.Now().Add(5*time.Second))
	mustInsert(t, ix, w, bs, late, v.Now()) // counts as +5s
	v.Step(15 * time.Second)
	if got := overlaps(ix, bs, late)[w]; got != 2 {
		t.Errorf("a stale now shortened the entry: overlap %d", got)
	}
	v.Step(time.Second)
	if got := ix.Stats(); got.Entries != 0 || got.Expired != 4 {
		t.Errorf("stats %+v", got)
	}
	mustInsert(t, ix, w, bs, keys, testStart.Add(-time.Hour)) // before the index existed
}

func TestApproxQueueStaysBounded(t *testing.T) {
	const bs = 4
	keys := AppendBlockKeys(nil, prompt(40, 3*bs), bs, BaseSeed)
	ix, v := newTestIndex(t, Options{TTL: 24 * time.Hour})
	ws := []WorkerID{ix.Worker("a", 0), ix.Worker("b", 0), ix.Worker("c", 0)} // spilled entries
	for range 2000 {
		for _, w := range ws {
			mustInsert(t, ix, w, bs, keys, v.Now())
		}
		v.Step(time.Second)
	}
	sp := ix.space(bs)
	ix.approx.mu.Lock()
	n := len(sp.aq.items) - sp.aq.head
	ix.approx.mu.Unlock()
	if n > 2*9+4096 {
		t.Errorf("queue holds %d items for 9 entries", n)
	}
	if diff := cmp.Diff(map[WorkerID]int{ws[0]: 3, ws[1]: 3, ws[2]: 3}, overlaps(ix, bs, keys)); diff != "" {
		t.Errorf("overlaps (-want +got):\n%s", diff)
	}
}

func TestZeroKey(t *testing.T) {
	// A chained key of 0 is a 2^-64 event, but the table keeps it aside
	// from its empty-slot marker all the same.
	ix, v := newTestIndex(t, Options{TTL: time.Second})
	a, b, c := ix.Worker("a", 0), ix.Worker("b", 0), ix.Worker("c", 0)
	mustInsert(t, ix, a, 4, []uint64{0, 7}, v.Now())
	mustInsert(t, ix, b, 4, []uint64{0}, v.Now())
	mustInsert(t, ix, c, 4, []uint64{0, 7, 8}, v.Now())
	if diff := cmp.Diff(map[WorkerID]int{a: 2, b: 1, c: 3}, overlaps(ix, 4, []uint64{0, 7, 8})); diff != "" {
		t.Errorf("overlaps (-want +got):\n%s", diff)
	}
	if got := overlaps(ix, 4, []uint64{7, 8}); len(got) != 2 || got[c] != 2 {
		t.Errorf("from key 7: %v", got)
	}
	v.Step(3 * time.Second)
	if st := ix.Stats(); st.Blocks != 0 || st.Entries != 0 || st.Expired != 6 {
		t.Errorf("stats %+v", st)
	}
}

func TestApproxSweepBatches(t *testing.T) {
	const bs = 1
	keys := AppendBlockKeys(nil, prompt(50, sweepBatch+100), bs, BaseSeed)
	ix, v := newTestIndex(t, Options{TTL: time.Second})
	w := ix.Worker("a", 0)
	mustInsert(t, ix, w, bs, keys, v.Now())
	v.Step(2 * time.Second)
	if st := ix.Stats(); st.Entries != 0 || st.Expired != uint64(len(keys)) {
		t.Errorf("stats %+v", st)
	}
}

func TestCloseStopsExpiry(t *testing.T) {
	const bs = 4
	keys := AppendBlockKeys(nil, prompt(60, 2*bs), bs, BaseSeed)
	ix, v := newTestIndex(t, Options{TTL: time.Second})
	w := ix.Worker("a", 0)
	mustInsert(t, ix, w, bs, keys, v.Now())
	if _, ok := v.NextAt(); !ok {
		t.Fatal("no sweep scheduled")
	}
	ix.Close()
	if _, ok := v.NextAt(); ok {
		t.Fatal("Close left a sweep scheduled")
	}
	mustInsert(t, ix, w, bs, keys, v.Now())
	v.Step(time.Hour)
	if got := overlaps(ix, bs, keys)[w]; got != 2 {
		t.Errorf("overlap after Close %d", got)
	}
	ix.Close() // idempotent
}

func TestRealClockCloses(t *testing.T) {
	ix, err := New(Options{TTL: time.Second}) // real clock; goleak checks the timer goroutine
	if err != nil {
		t.Fatal(err)
	}
	keys := AppendBlockKeys(nil, prompt(70, 8), 4, BaseSeed)
	w := ix.Worker("a", 0)
	if err := ix.InsertApprox(w, 4, keys, time.Now()); err != nil {
		t.Fatal(err)
	}
	ix.Close()
}
