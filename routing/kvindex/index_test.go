package kvindex

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/kvbandit/kvbandit/routing/clock"
)

var testStart = time.Unix(1_700_000_000, 0)

func newTestIndex(t testing.TB, opts Options) (*Index, *clock.Virtual) {
	t.Helper()
	v := clock.NewVirtual(testStart)
	if opts.Clock == nil {
		opts.Clock = v
	}
	ix, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ix.Close)
	return ix, v
}

// prompt returns n tokens that differ from those of every other stream.
func prompt(stream, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(stream)*1_000_003 + uint32(i)
	}
	return out
}

// storedChain is a Stored event for blocks [from, to) of tokens, chained to
// block from-1; engine hashes are salt+block index.
func storedChain(tokens []uint32, bs, from, to int, salt uint64) Event {
	ev := Event{Kind: Stored, BlockSize: bs}
	if from > 0 {
		ev.HasParent, ev.Parent = true, salt+uint64(from-1)
	}
	for b := from; b < to; b++ {
		ev.Blocks = append(ev.Blocks, StoredBlock{EngineHash: salt + uint64(b), Tokens: tokens[b*bs : (b+1)*bs]})
	}
	return ev
}

func removeBlocks(salt uint64, blocks ...int) Event {
	ev := Event{Kind: Removed}
	for _, b := range blocks {
		ev.RemovedHashes = append(ev.RemovedHashes, salt+uint64(b))
	}
	return ev
}

func mustApply(t testing.TB, ix *Index, w WorkerID, ev Event) {
	t.Helper()
	if err := ix.Apply(w, ev); err != nil {
		t.Fatalf("Apply(%d, %v): %v", w, ev.Kind, err)
	}
}

func overlaps(ix *Index, bs int, keys []uint64) map[WorkerID]int {
	out := map[WorkerID]int{}
	for _, m := range ix.Overlaps(bs, keys, nil) {
		out[m.Worker] = m.Blocks
	}
	return out
}

func TestOverlapsCraftedHoldings(t *testing.T) {
	const bs = 4
	tokens := prompt(1, 8*bs+3)
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	if len(keys) != 8 {
		t.Fatalf("%d keys", len(keys))
	}
	ix, _ := newTestIndex(t, Options{})
	ws := map[string]WorkerID{}
	for _, name := range []string{"all", "three", "hole0", "only5", "hole3", "other"} {
		ws[name] = ix.Worker("10.0.0.1:"+name, 0)
	}
	const salt = 1000
	for name, w := range ws {
		if name != "other" {
			mustApply(t, ix, w, storedChain(tokens, bs, 0, 8, salt))
		}
	}
	mustApply(t, ix, ws["three"], removeBlocks(salt, 3, 4, 5, 6, 7))
	mustApply(t, ix, ws["hole0"], removeBlocks(salt, 0))
	mustApply(t, ix, ws["only5"], removeBlocks(salt, 0, 1, 2, 3, 4, 6, 7))
	mustApply(t, ix, ws["hole3"], removeBlocks(salt, 3))
	mustApply(t, ix, ws["other"], storedChain(prompt(2, 8*bs), bs, 0, 8, salt))

	tests := []struct {
		name string
		keys []uint64
		want map[WorkerID]int
	}{
		{"whole prompt", keys, map[WorkerID]int{ws["all"]: 8, ws["three"]: 3, ws["hole3"]: 3}},
		{"first two blocks", keys[:2], map[WorkerID]int{ws["all"]: 2, ws["three"]: 2, ws["hole3"]: 2}},
		{"first block", keys[:1], map[WorkerID]int{ws["all"]: 1, ws["three"]: 1, ws["hole3"]: 1}},
		{"longer request", append(slices.Clone(keys), 99, 100), map[WorkerID]int{ws["all"]: 8, ws["three"]: 3, ws["hole3"]: 3}},
		{"starting mid-chain", keys[5:], map[WorkerID]int{ws["all"]: 3, ws["hole0"]: 3, ws["hole3"]: 3, ws["only5"]: 1}},
		{"no keys", nil, map[WorkerID]int{}},
		{"unknown first key", []uint64{42, keys[1]}, map[WorkerID]int{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, overlaps(ix, bs, tt.keys)); diff != "" {
				t.Errorf("overlaps (-want +got):\n%s", diff)
			}
		})
	}
	if got := ix.Size(ws["only5"]); got != 1 {
		t.Errorf("Size(only5) = %d, want 1", got)
	}
	if got := ix.Size(ws["hole3"]); got != 7 {
		t.Errorf("Size(hole3) = %d, want 7", got)
	}
}

func TestOverlapsAppendsSortedAndReusesDst(t *testing.T) {
	const bs = 2
	tokens := prompt(3, 10*bs)
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	ix, _ := newTestIndex(t, Options{})
	var ids []WorkerID
	for i := range 9 { // more than inlineIDs: entries spill and shrink back
		w := ix.Worker(fmt.Sprintf("w%d", 8-i), 0)
		ids = append(ids, w)
		mustApply(t, ix, w, storedChain(tokens, bs, 0, 10-i, uint64(i)<<32))
	}
	dst := []Match{{Worker: 77, Blocks: 5}}
	got := ix.Overlaps(bs, keys, dst)
	if got[0] != (Match{77, 5}) {
		t.Fatalf("prefix of dst changed: %v", got[0])
	}
	got = got[1:]
	if !slices.IsSortedFunc(got, func(a, b Match) int { return int(a.Worker) - int(b.Worker) }) {
		t.Errorf("not sorted by worker: %v", got)
	}
	for i, w := range ids {
		if n := overlaps(ix, bs, keys)[w]; n != 10-i {
			t.Errorf("worker %d: %d blocks, want %d", w, n, 10-i)
		}
	}
	// Shrink the spilled entries back under the inline limit.
	for i, w := range ids[2:] {
		mustApply(t, ix, w, removeBlocks(uint64(i+2)<<32, 0))
	}
	if diff := cmp.Diff(map[WorkerID]int{ids[0]: 10, ids[1]: 9}, overlaps(ix, bs, keys)); diff != "" {
		t.Errorf("after removals (-want +got):\n%s", diff)
	}
	buf := make([]Match, 0, 16)
	if allocs := testing.AllocsPerRun(50, func() { buf = ix.Overlaps(bs, keys, buf[:0]) }); allocs != 0 {
		t.Errorf("Overlaps with a reused dst allocated %.0f times", allocs)
	}
}

func TestApplyStored(t *testing.T) {
	const bs = 16
	tokens := prompt(4, 100) // 6 blocks and a partial one
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	tests := []struct {
		name   string
		events []Event
		want   int
	}{
		{"one event", []Event{storedChain(tokens, bs, 0, 6, 0)}, 6},
		{"chained by parent", []Event{storedChain(tokens, bs, 0, 2, 0), storedChain(tokens, bs, 2, 6, 0)}, 6},
		{"parent stored twice", []Event{storedChain(tokens, bs, 0, 3, 0), storedChain(tokens, bs, 0, 3, 0), storedChain(tokens, bs, 3, 5, 0)}, 5},
		{"empty stored", []Event{{Kind: Stored, BlockSize: bs}}, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix, _ := newTestIndex(t, Options{})
			w := ix.Worker("a", 0)
			for _, ev := range tt.events {
				mustApply(t, ix, w, ev)
			}
			if got := overlaps(ix, bs, keys)[w]; got != tt.want {
				t.Errorf("overlap %d, want %d", got, tt.want)
			}
			if got := ix.Size(w); got != tt.want {
				t.Errorf("Size %d, want %d", got, tt.want)
			}
		})
	}
}

func TestApplyRejects(t *testing.T) {
	const bs = 4
	tokens := prompt(5, 4*bs)
	good := storedChain(tokens, bs, 0, 4, 0)
	short := storedChain(tokens, bs, 0, 4, 0)
	short.Blocks[2].Tokens = short.Blocks[2].Tokens[:3]
	orphan := storedChain(tokens, bs, 2, 4, 0)
	dup := storedChain(tokens, bs, 0, 4, 0)
	dup.Blocks[3].EngineHash = dup.Blocks[1].EngineHash
	long := prompt(50, 100*bs)
	longDup := storedChain(long, bs, 0, 100, 0)
	longDup.Blocks[99].EngineHash = longDup.Blocks[7].EngineHash
	selfParent := storedChain(tokens, bs, 1, 3, 0)
	selfParent.Parent = selfParent.Blocks[1].EngineHash
	tests := []struct {
		name  string
		ev    Event
		want  error
		stats Stats
	}{
		{"short block", short, ErrBlockSize, Stats{Rejected: 1}},
		{"zero block size", Event{Kind: Stored, Blocks: good.Blocks}, ErrBlockSize, Stats{Rejected: 1}},
		{"wrong block size", Event{Kind: Stored, BlockSize: 8, Blocks: good.Blocks}, ErrBlockSize, Stats{Rejected: 1}},
		{"unknown parent", orphan, ErrUnknownParent, Stats{UnknownParent: 1}},
		{"repeated engine hash", dup, ErrInvalidEvent, Stats{Rejected: 1}},
		{"own parent", selfParent, ErrInvalidEvent, Stats{Rejected: 1}},
		{"repeated engine hash in a long event", longDup, ErrInvalidEvent, Stats{Rejected: 1}},
		{"unknown kind", Event{Kind: 9}, ErrInvalidEvent, Stats{Rejected: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix, _ := newTestIndex(t, Options{})
			w := ix.Worker("a", 0)
			err := ix.Apply(w, tt.ev)
			if !errors.Is(err, tt.want) {
				t.Fatalf("Apply = %v, want %v", err, tt.want)
			}
			st := ix.Stats()
			st.Workers = 0
			if diff := cmp.Diff(tt.stats, st); diff != "" {
				t.Errorf("stats (-want +got):\n%s", diff)
			}
			if ix.Size(w) != 0 {
				t.Errorf("a rejected event indexed %d blocks", ix.Size(w))
			}
		})
	}
	ix, _ := newTestIndex(t, Options{})
	if err := ix.Apply(ix.Worker("long", 0), storedChain(long, bs, 0, 100, 0)); err != nil {
		t.Errorf("a long event of distinct hashes: %v", err)
	}
	if err := ix.Apply(ix.Worker("long", 0), Event{Kind: 7}); err == nil || !strings.Contains(err.Error(), "EventKind(7)") {
		t.Errorf("unknown kind error %v", err)
	}
	if err := ix.Apply(0, good); !errors.Is(err, ErrUnknownWorker) {
		t.Errorf("Apply(0) = %v", err)
	}
	if err := ix.Apply(5, good); !errors.Is(err, ErrUnknownWorker) {
		t.Errorf("Apply(5) = %v", err)
	}
}

func TestApplyRemovedAndCleared(t *testing.T) {
	const bs = 4
	tokens := prompt(6, 6*bs)
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	ix, _ := newTestIndex(t, Options{})
	a, b := ix.Worker("a", 0), ix.Worker("b", 0)
	mustApply(t, ix, a, storedChain(tokens, bs, 0, 6, 0))
	mustApply(t, ix, b, storedChain(tokens, bs, 0, 6, 100))

	err := ix.Apply(a, removeBlocks(0, 4, 77, 78))
	if !errors.Is(err, ErrUnknownBlock) {
		t.Fatalf("Removed with unknown hashes = %v", err)
	}
	if got := ix.Stats().UnknownRemoved; got != 2 {
		t.Errorf("UnknownRemoved = %d, want 2", got)
	}
	if diff := cmp.Diff(map[WorkerID]int{a: 4, b: 6}, overlaps(ix, bs, keys)); diff != "" {
		t.Errorf("after Removed (-want +got):\n%s", diff)
	}
	if ix.Size(a) != 5 {
		t.Errorf("Size(a) = %d, want 5", ix.Size(a))
	}
	// The removed hash is gone: removing it again is unknown, and storing
	// a child under it is an unknown parent.
	if err := ix.Apply(a, removeBlocks(0, 4)); !errors.Is(err, ErrUnknownBlock) {
		t.Errorf("second removal = %v", err)
	}
	if err := ix.Apply(a, storedChain(tokens, bs, 5, 6, 0)); !errors.Is(err, ErrUnknownParent) {
		t.Errorf("child of a removed block = %v", err)
	}

	mustApply(t, ix, a, Event{Kind: Cleared})
	if diff := cmp.Diff(map[WorkerID]int{b: 6}, overlaps(ix, bs, keys)); diff != "" {
		t.Errorf("after Cleared (-want +got):\n%s", diff)
	}
	if ep, _, ok := ix.Lookup(a); !ok || ep != "a" || ix.Size(a) != 0 {
		t.Errorf("after Cleared: Lookup = %q %v, Size = %d", ep, ok, ix.Size(a))
	}
	mustApply(t, ix, a, storedChain(tokens, bs, 0, 2, 0))
	if got := overlaps(ix, bs, keys)[a]; got != 2 {
		t.Errorf("store after Cleared: overlap %d", got)
	}
	st := ix.Stats()
	if st.Entries != 8 || st.Blocks != 6 || st.Workers != 2 {
		t.Errorf("stats %+v", st)
	}
}

func TestEngineHashReusedForOtherTokens(t *testing.T) {
	const bs = 4
	first, second := prompt(7, bs), prompt(8, bs)
	ix, _ := newTestIndex(t, Options{})
	w := ix.Worker("a", 0)
	mustApply(t, ix, w, Event{Kind: Stored, BlockSize: bs, Blocks: []StoredBlock{{EngineHash: 1, Tokens: first}}})
	mustApply(t, ix, w, Event{Kind: Stored, BlockSize: bs, Blocks: []StoredBlock{{EngineHash: 1, Tokens: second}}})
	if n := overlaps(ix, bs, AppendBlockKeys(nil, first, bs, BaseSeed))[w]; n != 0 {
		t.Errorf("old content still indexed: %d", n)
	}
	if n := overlaps(ix, bs, AppendBlockKeys(nil, second, bs, BaseSeed))[w]; n != 1 {
		t.Errorf("new content: %d", n)
	}
	if ix.Size(w) != 1 {
		t.Errorf("Size = %d", ix.Size(w))
	}
}

func TestRemoveEndpoint(t *testing.T) {
	const bs = 4
	tokens := prompt(9, 4*bs)
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	ix, v := newTestIndex(t, Options{})
	r0, r1, other := ix.Worker("pod-a", 0), ix.Worker("pod-a", 1), ix.Worker("pod-b", 0)
	if r0 == r1 || ix.Worker("pod-a", 1) != r1 {
		t.Fatalf("ids: %d %d", r0, r1)
	}
	mustApply(t, ix, r0, storedChain(tokens, bs, 0, 4, 0))
	if err := ix.InsertApprox(r1, bs, keys[:3], v.Now()); err != nil {
		t.Fatal(err)
	}
	mustApply(t, ix, other, storedChain(tokens, bs, 0, 2, 0))

	if n := ix.RemoveEndpoint("pod-a"); n != 2 {
		t.Fatalf("RemoveEndpoint = %d, want 2", n)
	}
	if diff := cmp.Diff(map[WorkerID]int{other: 2}, overlaps(ix, bs, keys)); diff != "" {
		t.Errorf("after RemoveEndpoint (-want +got):\n%s", diff)
	}
	for _, w := range []WorkerID{r0, r1} {
		if _, _, ok := ix.Lookup(w); ok {
			t.Errorf("Lookup(%d) still ok", w)
		}
		if ix.Size(w) != 0 {
			t.Errorf("Size(%d) = %d", w, ix.Size(w))
		}
		if err := ix.Apply(w, storedChain(tokens, bs, 0, 1, 0)); !errors.Is(err, ErrUnknownWorker) {
			t.Errorf("Apply to removed worker = %v", err)
		}
		if err := ix.InsertApprox(w, bs, keys, v.Now()); !errors.Is(err, ErrUnknownWorker) {
			t.Errorf("InsertApprox to removed worker = %v", err)
		}
	}
	st := ix.Stats()
	if st.Entries != 2 || st.ApproxEntries != 0 || st.Blocks != 2 || st.Workers != 1 {
		t.Errorf("stats %+v", st)
	}
	if again := ix.Worker("pod-a", 0); again == r0 || again == r1 {
		t.Errorf("removed id %d reused", again)
	}
	if ix.RemoveEndpoint("pod-zzz") != 0 {
		t.Error("removed an unknown endpoint")
	}
	v.Step(time.Hour) // the removed approximate entries' queue items expire harmlessly
	if ix.Stats().Expired != 0 {
		t.Errorf("expired %d", ix.Stats().Expired)
	}
}

func TestBlockSizesNeverMix(t *testing.T) {
	tokens := prompt(10, 64)
	ix, v := newTestIndex(t, Options{})
	w := ix.Worker("a", 0)
	k16 := AppendBlockKeys(nil, tokens, 16, BaseSeed)
	mustApply(t, ix, w, storedChain(tokens, 16, 0, 4, 0))
	if got := ix.Overlaps(32, k16, nil); len(got) != 0 {
		t.Errorf("block size 32 sees block size 16 keys: %v", got)
	}
	if err := ix.InsertApprox(w, 8, k16, v.Now()); err != nil { // the same key values, another space
		t.Fatal(err)
	}
	if got := overlaps(ix, 16, k16)[w]; got != 4 {
		t.Errorf("block size 16: %d", got)
	}
	// The hash exists under block size 16 only, so it is unknown here.
	if err := ix.Apply(w, Event{Kind: Removed, BlockSize: 8, RemovedHashes: []uint64{0}}); !errors.Is(err, ErrUnknownBlock) {
		t.Errorf("Removed under another block size = %v", err)
	}
	if got := ix.Stats().UnknownRemoved; got != 1 {
		t.Errorf("UnknownRemoved = %d", got)
	}
	if got := overlaps(ix, 8, k16)[w]; got != 4 {
		t.Errorf("block size 8: %d", got)
	}
	if ix.Size(w) != 8 || ix.Stats().Blocks != 8 {
		t.Errorf("Size %d, stats %+v", ix.Size(w), ix.Stats())
	}
	if err := ix.InsertApprox(w, 0, k16, v.Now()); !errors.Is(err, ErrBlockSize) {
		t.Errorf("InsertApprox block size 0 = %v", err)
	}
}

func TestSaltsSeparateKeys(t *testing.T) {
	const bs = 4
	tokens := prompt(11, 3*bs)
	tests := []struct{ lora, ns string }{{"", ""}, {"adapter-a", ""}, {"", "tenant-a"}, {"adapter-a", "tenant-a"}}
	ix, _ := newTestIndex(t, Options{})
	ws := make([]WorkerID, len(tests))
	for i, tt := range tests {
		ws[i] = ix.Worker(fmt.Sprintf("w%d", i), 0)
		ev := storedChain(tokens, bs, 0, 3, 0)
		ev.LoRA, ev.Namespace = tt.lora, tt.ns
		mustApply(t, ix, ws[i], ev)
	}
	for i, tt := range tests {
		keys := AppendBlockKeys(nil, tokens, bs, Seed(tt.lora, tt.ns))
		if diff := cmp.Diff(map[WorkerID]int{ws[i]: 3}, overlaps(ix, bs, keys)); diff != "" {
			t.Errorf("lora %q ns %q (-want +got):\n%s", tt.lora, tt.ns, diff)
		}
	}
}

func TestPromptLengths(t *testing.T) {
	const bs = 16
	tests := []struct {
		name   string
		tokens int
		blocks int
	}{
		{"empty", 0, 0},
		{"under one block", 15, 0},
		{"not a multiple", 100, 6},
		{"500k tokens", 500_000, 31_250},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ix, v := newTestIndex(t, Options{})
			w := ix.Worker("a", 0)
			keys := AppendBlockKeys(nil, prompt(12, tt.tokens), bs, BaseSeed)
			if len(keys) != tt.blocks {
				t.Fatalf("%d keys, want %d", len(keys), tt.blocks)
			}
			if err := ix.InsertApprox(w, bs, keys, v.Now()); err != nil {
				t.Fatal(err)
			}
			want := map[WorkerID]int{}
			if tt.blocks > 0 {
				want[w] = tt.blocks
			}
			if diff := cmp.Diff(want, overlaps(ix, bs, keys)); diff != "" {
				t.Errorf("(-want +got):\n%s", diff)
			}
			if ix.Size(w) != tt.blocks {
				t.Errorf("Size = %d", ix.Size(w))
			}
		})
	}
}

func TestNewValidates(t *testing.T) {
	tests := []struct {
		name string
		opts Options
	}{
		{"negative ttl", Options{TTL: -time.Second}},
		{"negative cap", Options{MaxEntries: -1}},
		{"ratio above one", Options{PruneTargetRatio: 1.5}},
		{"negative ratio", Options{PruneTargetRatio: -0.1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := New(tt.opts); err == nil {
				t.Fatal("New accepted invalid options")
			}
		})
	}
	ix, err := New(Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	if ix.ttl != 120 || ix.maxEntries != 1<<20 || ix.pruneTarget != 838860 {
		t.Errorf("defaults: ttl %d max %d target %d", ix.ttl, ix.maxEntries, ix.pruneTarget)
	}
}
