package kvindex

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// model is a naive event-fed index: the specification the Index is checked
// against.
type model struct {
	engine map[WorkerID]map[int]map[uint64]uint64   // worker → block size → engine hash → key
	holds  map[int]map[uint64]map[WorkerID]struct{} // block size → key → workers
	// spaces are the key spaces in the index's order: made at the end,
	// the first unused one reclaimed when there are maxSpaces.
	spaces               []int
	maxHashes, maxSpaces int
}

func newModel(opts Options) *model {
	m := &model{engine: map[WorkerID]map[int]map[uint64]uint64{}, holds: map[int]map[uint64]map[WorkerID]struct{}{},
		maxHashes: opts.MaxEventEntries, maxSpaces: opts.MaxBlockSizes}
	if m.maxHashes == 0 {
		m.maxHashes = DefaultMaxEventEntries
	}
	if m.maxSpaces == 0 {
		m.maxSpaces = DefaultMaxBlockSizes
	}
	return m
}

func (m *model) hashes(w WorkerID) int {
	n := 0
	for _, eng := range m.engine[w] {
		n += len(eng)
	}
	return n
}

// space makes room for block size bs as the index does; the model holds
// only event-fed entries, so a space is unused when no engine map of its
// block size is left.
func (m *model) space(bs int) bool {
	if slices.Contains(m.spaces, bs) {
		return true
	}
	if len(m.spaces) >= m.maxSpaces {
		i := slices.IndexFunc(m.spaces, func(s int) bool {
			for _, byBS := range m.engine {
				if len(byBS[s]) > 0 {
					return false
				}
			}
			return true
		})
		if i < 0 {
			return false
		}
		m.spaces = slices.Delete(m.spaces, i, i+1)
	}
	m.spaces = append(m.spaces, bs)
	return true
}

func (m *model) hold(bs int, k uint64, w WorkerID) {
	if m.holds[bs] == nil {
		m.holds[bs] = map[uint64]map[WorkerID]struct{}{}
	}
	if m.holds[bs][k] == nil {
		m.holds[bs][k] = map[WorkerID]struct{}{}
	}
	m.holds[bs][k][w] = struct{}{}
}

func (m *model) unhold(bs int, k uint64, w WorkerID) {
	delete(m.holds[bs][k], w)
	if len(m.holds[bs][k]) == 0 {
		delete(m.holds[bs], k)
	}
}

func (m *model) apply(w WorkerID, ev Event) error {
	switch ev.Kind {
	case Stored:
		if ev.BlockSize <= 0 {
			return ErrBlockSize
		}
		seen := map[uint64]bool{}
		if ev.HasParent {
			seen[ev.Parent] = true
		}
		for _, b := range ev.Blocks {
			if len(b.Tokens) != ev.BlockSize {
				return ErrBlockSize
			}
		}
		for _, b := range ev.Blocks {
			if seen[b.EngineHash] {
				return ErrInvalidEvent
			}
			seen[b.EngineHash] = true
		}
		eng := m.engine[w][ev.BlockSize]
		var key uint64
		if ev.HasParent {
			var ok bool
			if key, ok = eng[ev.Parent]; !ok {
				return ErrUnknownParent
			}
		}
		if len(ev.Blocks) == 0 {
			return nil
		}
		if eng == nil {
			switch {
			case m.hashes(w) >= m.maxHashes:
				return ErrWorkerFull
			case len(m.engine[w]) >= WorkerBlockSizes, !m.space(ev.BlockSize):
				return ErrTooManyBlockSizes
			}
			if m.engine[w] == nil {
				m.engine[w] = map[int]map[uint64]uint64{}
			}
			eng = map[uint64]uint64{}
			m.engine[w][ev.BlockSize] = eng
		}
		for i, b := range ev.Blocks {
			if _, ok := eng[b.EngineHash]; !ok && m.hashes(w) >= m.maxHashes {
				return ErrWorkerFull
			}
			local := LocalHash(b.Tokens, Seed(ev.LoRA, ev.Namespace))
			if i == 0 && !ev.HasParent {
				key = local
			} else {
				key = ChainHash(key, local)
			}
			if old, ok := eng[b.EngineHash]; ok && old != key {
				m.unhold(ev.BlockSize, old, w)
			}
			eng[b.EngineHash] = key
			m.hold(ev.BlockSize, key, w)
		}
		return nil
	case Removed:
		unknown := false
		for _, h := range ev.RemovedHashes {
			found := false
			for bs, eng := range m.engine[w] {
				if ev.BlockSize > 0 && bs != ev.BlockSize {
					continue
				}
				if k, ok := eng[h]; ok {
					delete(eng, h)
					m.unhold(bs, k, w)
					found = true
					if len(eng) == 0 {
						delete(m.engine[w], bs)
					}
				}
			}
			unknown = unknown || !found
		}
		if unknown {
			return ErrUnknownBlock
		}
		return nil
	case Cleared:
		m.clear(w)
		return nil
	}
	return ErrInvalidEvent
}

func (m *model) clear(w WorkerID) {
	for bs, keys := range m.holds {
		for k := range keys {
			m.unhold(bs, k, w)
		}
	}
	delete(m.engine, w)
}

func (m *model) size(w WorkerID) int {
	n := 0
	for _, keys := range m.holds {
		for _, ws := range keys {
			if _, ok := ws[w]; ok {
				n++
			}
		}
	}
	return n
}

func (m *model) overlaps(bs int, keys []uint64) map[WorkerID]int {
	out := map[WorkerID]int{}
	if len(keys) == 0 {
		return out
	}
	for w := range m.holds[bs][keys[0]] {
		n := 0
		for _, k := range keys {
			if _, ok := m.holds[bs][k][w]; !ok {
				break
			}
			n++
		}
		out[w] = n
	}
	return out
}

// opReader turns fuzz bytes into small choices.
type opReader struct{ b []byte }

func (r *opReader) next(n int) int {
	if len(r.b) == 0 {
		return 0
	}
	v := int(r.b[0]) % n
	r.b = r.b[1:]
	return v
}

func (r *opReader) more() bool { return len(r.b) > 0 }

// eventGen builds events from fuzz bytes. Tokens come from a 2-letter
// alphabet so workers and requests meet on the same blocks; parents and
// removals mostly name hashes it stored before, sometimes unknown ones, and
// stored hashes are sometimes reused.
type eventGen struct {
	r      *opReader
	hashes map[int][]uint64 // by block size
	roots  []root           // accepted Stored events without a parent
	next   uint64
}

type root struct {
	bs     int
	seed   uint64
	tokens []uint32
}

func (g *eventGen) known(bs int) uint64 {
	hs := g.hashes[bs]
	if len(hs) == 0 || g.r.next(10) == 0 {
		return 1<<40 + uint64(g.r.next(4))
	}
	return hs[len(hs)-1-g.r.next(min(len(hs), 16))]
}

func (g *eventGen) fresh() uint64 {
	g.next++
	return g.next
}

// record remembers the hashes of a Stored event the index accepted.
func (g *eventGen) record(ev Event) {
	var toks []uint32
	for _, b := range ev.Blocks {
		g.hashes[ev.BlockSize] = append(g.hashes[ev.BlockSize], b.EngineHash)
		toks = append(toks, b.Tokens...)
	}
	if !ev.HasParent && len(toks) > 0 {
		g.roots = append(g.roots, root{ev.BlockSize, Seed(ev.LoRA, ev.Namespace), toks})
	}
}

// blockSize is mostly 2, so that events and requests meet, and sometimes
// one of three others, so that workers go over WorkerBlockSizes.
func (g *eventGen) blockSize() int {
	if g.r.next(3) == 0 {
		return []int{1, 3, 4}[g.r.next(3)]
	}
	return 2
}

func (g *eventGen) tokens(n int) []uint32 {
	toks := make([]uint32, n)
	for i := range toks {
		toks[i] = uint32(g.r.next(2))
	}
	return toks
}

func (g *eventGen) event() Event {
	r := g.r
	if g.hashes == nil {
		g.hashes = map[int][]uint64{}
	}
	switch r.next(8) {
	case 0, 1, 2, 3:
		ev := Event{Kind: Stored, BlockSize: g.blockSize()}
		if r.next(4) > 0 {
			ev.HasParent, ev.Parent = true, g.known(ev.BlockSize)
		}
		if r.next(8) == 0 {
			ev.LoRA = "l"
		}
		for range r.next(5) {
			n := ev.BlockSize
			if r.next(30) == 0 {
				n++ // a malformed block
			}
			h := g.known(ev.BlockSize)
			if r.next(12) != 0 {
				g.next++
				h = g.next
			}
			ev.Blocks = append(ev.Blocks, StoredBlock{EngineHash: h, Tokens: g.tokens(n)})
		}
		return ev
	case 4, 5:
		ev := Event{Kind: Removed, BlockSize: g.blockSize()}
		for range 1 + r.next(3) {
			ev.RemovedHashes = append(ev.RemovedHashes, g.known(ev.BlockSize))
		}
		if r.next(2) == 0 {
			ev.BlockSize = 0 // any block size
		}
		return ev
	case 6:
		if r.next(3) == 0 {
			return Event{Kind: Cleared}
		}
		return Event{Kind: EventKind(r.next(5) + 3)}
	}
	return Event{Kind: Stored, BlockSize: 2, HasParent: true, Parent: g.known(2),
		Blocks: []StoredBlock{{EngineHash: g.fresh(), Tokens: g.tokens(2)}}}
}

// request builds request keys: mostly a stored root sequence, cut or
// extended, otherwise tokens from the same alphabet.
func (g *eventGen) request() (int, []uint64) {
	if n := len(g.roots); n > 0 && g.r.next(3) > 0 {
		rt := g.roots[n-1-g.r.next(min(n, 8))]
		toks := slices.Clone(rt.tokens[:g.r.next(len(rt.tokens)+1)])
		toks = append(toks, g.tokens(g.r.next(3)*rt.bs)...)
		return rt.bs, AppendBlockKeys(nil, toks, rt.bs, rt.seed)
	}
	bs := g.blockSize()
	toks := g.tokens(g.r.next(7) * bs)
	seed := BaseSeed
	if g.r.next(8) == 0 {
		seed = Seed("l", "")
	}
	return bs, AppendBlockKeys(nil, toks, bs, seed)
}

// runModel plays ops from data on an index and the model, comparing every
// result. Workers are four endpoints; one op removes an endpoint, after
// which the model treats its next ID as a fresh worker.
func runModel(t *testing.T, data []byte) {
	// Defaults, then caps small enough for a few events to reach: six
	// blocks per worker, two key spaces for four block sizes.
	runModelWith(t, data, Options{})
	runModelWith(t, data, Options{MaxEventEntries: 6, MaxBlockSizes: 2})
}

func runModelWith(t *testing.T, data []byte, opts Options) {
	ix, _ := newTestIndex(t, opts)
	m := newModel(opts)
	r := &opReader{b: data}
	g := &eventGen{r: r}
	names := []string{"a", "b", "c", "d"}
	ids := make([]WorkerID, len(names))
	for i, n := range names {
		ids[i] = ix.Worker(n, 0)
	}
	check := func(step int) {
		bs, keys := g.request()
		got := map[WorkerID]int{}
		for _, mt := range ix.Overlaps(bs, keys, nil) {
			if mt.Blocks < 1 || mt.Blocks > len(keys) {
				t.Fatalf("step %d: %d blocks of %d keys", step, mt.Blocks, len(keys))
			}
			got[mt.Worker] = mt.Blocks
		}
		if diff := cmp.Diff(m.overlaps(bs, keys), got); diff != "" {
			t.Fatalf("step %d: overlaps (-model +index):\n%s", step, diff)
		}
		var total int64
		for _, w := range ids {
			if ix.Size(w) < 0 || ix.Size(w) != m.size(w) {
				t.Fatalf("step %d: Size(%d) = %d, model %d", step, w, ix.Size(w), m.size(w))
			}
			total += int64(ix.Size(w))
		}
		st := ix.Stats()
		if st.Entries != total || st.ApproxEntries != 0 {
			t.Fatalf("step %d: stats %+v, sizes sum %d", step, st, total)
		}
		blocks := 0
		for _, keys := range m.holds {
			blocks += len(keys)
		}
		if st.Blocks != int64(blocks) {
			t.Fatalf("step %d: Blocks %d, model %d", step, st.Blocks, blocks)
		}
	}
	for step := 0; r.more(); step++ {
		i := r.next(len(ids))
		switch r.next(10) {
		case 0:
			check(step)
		case 1:
			if r.next(4) == 0 {
				ix.RemoveEndpoint(names[i])
				m.clear(ids[i])
				ids[i] = ix.Worker(names[i], 0)
			}
		default:
			ev := g.event()
			want := m.apply(ids[i], ev)
			got := ix.Apply(ids[i], ev)
			if !errors.Is(got, want) || (want == nil) != (got == nil) {
				t.Fatalf("step %d: Apply(%+v) = %v, model %v", step, ev, got, want)
			}
			if got == nil && ev.Kind == Stored {
				g.record(ev)
			}
		}
	}
	check(-1)
}

func TestModelRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 200 {
		data := make([]byte, 400)
		for j := range data {
			data[j] = byte(rng.Uint32())
		}
		t.Run(fmt.Sprint(i), func(t *testing.T) { runModel(t, data) })
	}
}

// FuzzApply plays event sequences on an index and on a naive model: no
// panic, results equal to the model's, overlaps within the request and
// sizes never negative.
func FuzzApply(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{2, 0, 0, 1, 1, 2, 0, 1, 2, 1, 1, 0, 0, 0, 1, 2, 1, 3, 0, 0, 1, 2, 2})
	f.Add([]byte("the quick brown fox jumps over the lazy dog, twice: the quick brown fox"))
	f.Add([]byte{0, 2, 1, 0, 0, 3, 1, 4, 1, 1, 0, 0, 0, 0, 0, 1, 9, 3, 2, 6, 1, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 4096 {
			data = data[:4096]
		}
		runModel(t, data)
	})
}

// TestConcurrentReadersAndWriters runs one event writer per worker, an
// approximate-mode writer, expiry, endpoint churn and readers at once,
// then checks the event-fed state against per-worker models. Run with
// -race.
func TestConcurrentReadersAndWriters(t *testing.T) {
	const (
		bs      = 4
		writers = 6
		events  = 400
	)
	ix, v := newTestIndex(t, Options{TTL: 2 * time.Second, MaxEntries: 300})
	// A shared pool of prompts so that workers, approximate entries and
	// readers meet on the same keys.
	pool := make([][]uint32, 16)
	for i := range pool {
		pool[i] = prompt(i%5, (8+i)*bs)
		pool[i][len(pool[i])-1] = uint32(i)
	}
	ids := make([]WorkerID, writers)
	models := make([]*model, writers)
	for i := range ids {
		ids[i] = ix.Worker(fmt.Sprintf("pod-%d", i), i%2)
		models[i] = newModel(Options{})
	}
	approxW := ix.Worker("approx", 0)

	var wg sync.WaitGroup
	stop := make(chan struct{})
	for i := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 7))
			salt := uint64(i) << 40
			stored := map[int]int{} // prompt → blocks stored
			for range events {
				p := rng.IntN(len(pool))
				var ev Event
				switch n := stored[p]; {
				case rng.IntN(30) == 0:
					ev = Event{Kind: Cleared}
					clear(stored)
				case n > 0 && rng.IntN(3) == 0:
					ev = removeBlocks(salt+uint64(p)<<20, n-1)
					stored[p] = n - 1
				case n < len(pool[p])/bs:
					ev = storedChain(pool[p], bs, n, min(n+1+rng.IntN(4), len(pool[p])/bs), salt+uint64(p)<<20)
					stored[p] = int(ev.Blocks[len(ev.Blocks)-1].EngineHash-salt-uint64(p)<<20) + 1
				default:
					continue
				}
				want := models[i].apply(ids[i], ev)
				if err := ix.Apply(ids[i], ev); !errors.Is(err, want) || (err == nil) != (want == nil) {
					t.Errorf("worker %d: Apply = %v, model %v", i, err, want)
					return
				}
			}
		}()
	}
	var bg sync.WaitGroup
	bg.Add(3)
	go func() { // approximate mode, expiry and endpoint churn
		defer bg.Done()
		rng := rand.New(rand.NewPCG(9, 9))
		for j := 0; ; j++ {
			select {
			case <-stop:
				return
			default:
			}
			p := pool[rng.IntN(len(pool))]
			if err := ix.InsertApprox(approxW, bs, AppendBlockKeys(nil, p, bs, BaseSeed), v.Now()); err != nil {
				t.Error(err)
				return
			}
			churn := ix.Worker("churn", 0)
			_ = ix.InsertApprox(churn, bs, AppendBlockKeys(nil, p[:2*bs], bs, BaseSeed), v.Now())
			if j%7 == 0 {
				ix.RemoveEndpoint("churn")
			}
			v.Step(300 * time.Millisecond)
		}
	}()
	for range 2 {
		go func() {
			defer bg.Done()
			rng := rand.New(rand.NewPCG(3, 3))
			var dst []Match
			for {
				select {
				case <-stop:
					return
				default:
				}
				p := pool[rng.IntN(len(pool))]
				keys := AppendBlockKeys(nil, p, bs, BaseSeed)
				dst = ix.Overlaps(bs, keys, dst[:0])
				for _, mt := range dst {
					if mt.Blocks < 1 || mt.Blocks > len(keys) || ix.Size(mt.Worker) < 0 {
						t.Errorf("match %+v of %d keys, size %d", mt, len(keys), ix.Size(mt.Worker))
					}
				}
				_ = ix.Stats()
			}
		}()
	}
	wg.Wait()
	close(stop)
	bg.Wait()

	for i, w := range ids {
		if got, want := ix.Size(w), models[i].size(w); got != want {
			t.Errorf("worker %d: Size %d, model %d", i, got, want)
		}
	}
	for _, p := range pool {
		keys := AppendBlockKeys(nil, p, bs, BaseSeed)
		want := map[WorkerID]int{}
		for i := range ids {
			maps.Copy(want, models[i].overlaps(bs, keys))
		}
		got := overlaps(ix, bs, keys)
		delete(got, approxW)
		for w := range got {
			if !slices.Contains(ids, w) {
				delete(got, w) // the churn endpoint's latest worker
				if _, _, ok := ix.Lookup(w); !ok {
					t.Errorf("removed worker %d still indexed, size %d", w, ix.Size(w))
				}
			}
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("final overlaps (-model +index):\n%s", diff)
		}
	}
	for w := WorkerID(1); ix.worker(w) != nil; w++ {
		if _, _, ok := ix.Lookup(w); !ok && ix.Size(w) != 0 {
			t.Errorf("removed worker %d has size %d", w, ix.Size(w))
		}
	}
	st := ix.Stats()
	if st.ApproxEntries > 300+int64(len(pool[len(pool)-1])) {
		t.Errorf("approximate entries %d above the cap", st.ApproxEntries)
	}
}

// TestOverlapsStableUnderWrites checks that lock-free reads never see a
// torn entry: a worker holding a whole chain must score it fully while
// other workers join and leave the same keys (entries spill and shrink
// back) and unrelated keys grow and shrink the tables. Run with -race.
func TestOverlapsStableUnderWrites(t *testing.T) {
	const bs, n = 2, 64
	tokens := prompt(80, n*bs)
	keys := AppendBlockKeys(nil, tokens, bs, BaseSeed)
	ix, _ := newTestIndex(t, Options{})
	anchor := ix.Worker("anchor", 0)
	mustApply(t, ix, anchor, storedChain(tokens, bs, 0, n, 0))

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := ix.Worker(fmt.Sprintf("churn-%d", i), 0)
			for j := 0; ; j++ {
				select {
				case <-stop:
					return
				default:
				}
				if err := ix.Apply(w, storedChain(tokens, bs, 0, 1+j%n, 0)); err != nil {
					t.Error(err)
					return
				}
				_ = ix.Apply(w, Event{Kind: Cleared})
			}
		}()
	}
	wg.Add(1)
	go func() { // grow and shrink every shard's table
		defer wg.Done()
		w := ix.Worker("filler", 0)
		filler := prompt(81, 4096*bs)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := ix.Apply(w, storedChain(filler, bs, 0, 4096, 1<<40)); err != nil {
				t.Error(err)
				return
			}
			_ = ix.Apply(w, Event{Kind: Cleared})
		}
	}()
	var dst []Match
	for range 3000 {
		dst = ix.Overlaps(bs, keys, dst[:0])
		found := false
		for _, m := range dst {
			if m.Blocks < 1 || m.Blocks > n {
				t.Fatalf("match %+v", m)
			}
			if m.Worker == anchor {
				found = true
				if m.Blocks != n {
					t.Fatalf("anchor scored %d of %d", m.Blocks, n)
				}
			}
		}
		if !found {
			t.Fatal("anchor missing")
		}
	}
	close(stop)
	wg.Wait()
}
