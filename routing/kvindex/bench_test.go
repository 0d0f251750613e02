package kvindex

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"
	"unsafe"

	"github.com/kvbandit/kvbandit/routing/clock"
)

// Benchmarks. Collect numbers with
//
//	go test -run '^$' -bench . -benchmem -count 6 ./routing/kvindex/ > new.txt
//	benchstat old.txt new.txt

// BenchmarkOverlaps scores a 512-block request (8192 tokens in blocks of
// 16) against workers holding prefixes of varying length: worker j of n
// holds the first (j+1)·512/n blocks (budget: 5µs at 64 workers).
func BenchmarkOverlaps(b *testing.B) {
	const bs, blocks = 16, 512
	for _, workers := range []int{1, 8, 64} {
		for _, background := range []int{0, 1 << 20} {
			b.Run(fmt.Sprintf("keys=%d/workers=%d/background=%d", blocks, workers, background), func(b *testing.B) {
				ix, v := newTestIndex(b, Options{TTL: time.Hour, MaxEntries: 1 << 30})
				keys := AppendBlockKeys(nil, prompt(1, blocks*bs), bs, BaseSeed)
				for j := range workers {
					w := ix.Worker(fmt.Sprintf("pod-%d", j), 0)
					mustInsert(b, ix, w, bs, keys[:(j+1)*blocks/workers], v.Now())
				}
				fillBackground(b, ix, background)
				if got := ix.Overlaps(bs, keys, nil); len(got) != workers {
					b.Fatalf("%d matches", len(got))
				}
				dst := make([]Match, 0, workers)
				b.ReportAllocs()
				for b.Loop() {
					dst = ix.Overlaps(bs, keys, dst[:0])
				}
			})
		}
	}
}

// fillBackground indexes n other blocks (block size 16, chains of 512,
// spread over 8 workers) so that tables are large and probes miss cache.
func fillBackground(b *testing.B, ix *Index, n int) {
	b.Helper()
	const bs, chain = 16, 512
	keys := make([]uint64, chain)
	now := time.Now()
	for i := 0; i*chain < n; i++ {
		for j := range keys {
			keys[j] = mix(uint64(i)<<32 | uint64(j) + 0xabcdef)
		}
		if err := ix.InsertApprox(ix.Worker(fmt.Sprintf("bg-%d", i%8), 0), bs, keys, now); err != nil {
			b.Fatal(err)
		}
	}
}

// applyWorkload replays realistic KV events: 8 workers each store prompts
// as Stored events of 32 blocks of 16 tokens, chained by parent, drawn from
// a shared pool so workers share prefixes; once a worker holds 4096 blocks
// each new event is preceded by a Removed event for its oldest one.
type applyWorkload struct {
	ix      *Index
	pool    [][]uint32 // prompts of 128 blocks
	workers []WorkerID
	state   []applyWorker
	rng     *rand.Rand
	blocks  int // stored so far
}

type applyWorker struct {
	prompt, chunk int
	parent        uint64
	next          uint64
	held          [][]uint64 // engine hashes per event, oldest first
}

const (
	applyBS     = 16
	applyEvent  = 32
	applyPrompt = 4 * applyEvent
)

func newApplyWorkload(b *testing.B, ix *Index, workers, prompts int) *applyWorkload {
	rng := rand.New(rand.NewPCG(1, 1))
	wl := &applyWorkload{ix: ix, rng: rng}
	for i := range prompts {
		p := make([]uint32, applyPrompt*applyBS)
		for j := range p {
			p[j] = uint32(rng.IntN(150_000))
		}
		if i > 0 && i%4 != 0 { // a quarter of prompts share a 32-block system prompt
			copy(p[:applyEvent*applyBS], wl.pool[i-i%4][:applyEvent*applyBS])
		}
		wl.pool = append(wl.pool, p)
	}
	for i := range workers {
		wl.workers = append(wl.workers, ix.Worker(fmt.Sprintf("pod-%d", i), 0))
		wl.state = append(wl.state, applyWorker{next: uint64(i) << 48})
	}
	return wl
}

// step applies one Stored event (and maybe one Removed) for worker i.
// held is a FIFO; st.held[1:] leaks the array's head, which is fine for a
// benchmark (the slice header is 24 bytes per event).
func (wl *applyWorkload) step(b *testing.B, i int, limit int) {
	st := &wl.state[i]
	if st.chunk == 0 {
		st.prompt = wl.rng.IntN(len(wl.pool))
	}
	ev := Event{Kind: Stored, BlockSize: applyBS, HasParent: st.chunk > 0, Parent: st.parent}
	var blocks [applyEvent]StoredBlock
	var hashes []uint64
	if len(st.held)*applyEvent >= limit { // recycle the oldest event's slice once it is removed
		hashes = st.held[0]
		if err := wl.ix.Apply(wl.workers[i], Event{Kind: Removed, BlockSize: applyBS, RemovedHashes: hashes}); err != nil {
			b.Fatal(err)
		}
		st.held = st.held[1:]
	} else {
		hashes = make([]uint64, applyEvent)
	}
	toks := wl.pool[st.prompt][st.chunk*applyEvent*applyBS:]
	for j := range blocks {
		st.next++
		blocks[j] = StoredBlock{EngineHash: st.next, Tokens: toks[j*applyBS : (j+1)*applyBS]}
		hashes[j] = st.next
	}
	ev.Blocks = blocks[:]
	if err := wl.ix.Apply(wl.workers[i], ev); err != nil {
		b.Fatal(err)
	}
	wl.blocks += applyEvent
	st.parent = st.next
	st.chunk = (st.chunk + 1) % (applyPrompt / applyEvent)
	st.held = append(st.held, hashes)
}

// BenchmarkIndexApply measures KV event ingestion on one goroutine
// (budget: 1M blocks/s). Each op is one Stored event of 32 blocks, plus a
// Removed event of 32 once the worker is full (always, after warm-up).
func BenchmarkIndexApply(b *testing.B) {
	ix, _ := newTestIndex(b, Options{})
	wl := newApplyWorkload(b, ix, 8, 256)
	for i := range 8 * 4096 / applyEvent { // warm: every worker full
		wl.step(b, i%8, 4096)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		wl.step(b, i%8, 4096)
		i++
	}
	b.ReportMetric(float64(applyEvent*b.N)/b.Elapsed().Seconds(), "blocks/s")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(applyEvent*b.N), "ns/block")
}

// BenchmarkIndexMemory indexes 10^5, 10^6 and 10^7 distinct blocks (one
// worker each, from KV events and from approximate inserts; two and four
// workers at 10^6) and reports live heap bytes per (block, worker) entry
// (budget: 100) and per block, the hash tables' share of them
// (table-B/block: 24-byte slots, grown by doubling at 3/4 load) and their
// load (keys per slot), and the build's time per block. At -benchtime=1x
// the 10^7 cases hold about 1 GB and take seconds each to build.
func BenchmarkIndexMemory(b *testing.B) {
	type memCase struct {
		name     string
		blocks   int
		replicas int // workers holding each block
		approx   bool
	}
	var cases []memCase
	for _, blocks := range []int{100_000, 1_000_000, 10_000_000} {
		cases = append(cases,
			memCase{"events/replicas=1", blocks, 1, false},
			memCase{"approx/replicas=1", blocks, 1, true})
	}
	cases = append(cases,
		memCase{"events/replicas=2", 1_000_000, 2, false},
		memCase{"events/replicas=4", 1_000_000, 4, false})
	for _, tc := range cases {
		b.Run(fmt.Sprintf("%s/blocks=%d", tc.name, tc.blocks), func(b *testing.B) {
			b.ReportAllocs()
			var perEntry, perBlock, tablePerBlock, load, build float64
			for range b.N {
				runtime.GC()
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				start := time.Now()
				ix := buildIndex(b, tc.blocks, tc.replicas, tc.approx)
				build = float64(time.Since(start).Nanoseconds()) / float64(tc.blocks*tc.replicas)
				runtime.GC()
				runtime.ReadMemStats(&after)
				st := ix.Stats()
				if st.Blocks != int64(tc.blocks) || st.Entries != int64(tc.blocks*tc.replicas) {
					b.Fatalf("stats %+v", st)
				}
				live := float64(after.HeapAlloc) - float64(before.HeapAlloc)
				perEntry, perBlock = live/float64(st.Entries), live/float64(st.Blocks)
				slots := tableSlots(ix)
				tablePerBlock = float64(slots*int(unsafe.Sizeof(slot{}))) / float64(st.Blocks)
				load = float64(st.Blocks) / float64(slots)
				runtime.KeepAlive(ix)
				ix.Close()
			}
			b.ReportMetric(perEntry, "B/entry")
			b.ReportMetric(perBlock, "B/block")
			b.ReportMetric(tablePerBlock, "table-B/block")
			b.ReportMetric(load, "load")
			b.ReportMetric(build, "build-ns/entry")
		})
	}
}

// tableSlots counts the slots of every shard's table over all key spaces.
func tableSlots(ix *Index) int {
	n := 0
	for _, sp := range *ix.spaces.Load() {
		for i := range sp.shards {
			sh := &sp.shards[i]
			sh.mu.RLock()
			if a := sh.tab.cur; a != nil {
				n += len(a.slots)
			}
			sh.mu.RUnlock()
		}
	}
	return n
}

// buildIndex indexes blocks distinct blocks, each held by replicas of 8
// workers, in chains of 32 blocks of 16 tokens.
func buildIndex(b *testing.B, blocks, replicas int, approx bool) *Index {
	const bs, chain, workers = 16, 32, 8
	// A virtual clock: a stopped runtime timer may pin a closed index until
	// the runtime sweeps its timer heap, which would skew the next run.
	v := clock.NewVirtual(time.Now())
	ix, err := New(Options{Clock: v, TTL: time.Hour, MaxEntries: 1 << 30, MaxEventEntries: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	ids := make([]WorkerID, workers)
	for i := range ids {
		ids[i] = ix.Worker(fmt.Sprintf("pod-%d", i), 0)
	}
	toks := make([]uint32, chain*bs)
	var keys []uint64
	ev := Event{Kind: Stored, BlockSize: bs, Blocks: make([]StoredBlock, chain)}
	now := v.Now()
	for c := 0; c*chain < blocks; c++ {
		for j := range toks {
			toks[j] = uint32(c)*7919 + uint32(j)
		}
		for r := range replicas {
			w := ids[(c+r)%workers]
			if approx {
				keys = AppendBlockKeys(keys[:0], toks, bs, BaseSeed)
				if err := ix.InsertApprox(w, bs, keys, now); err != nil {
					b.Fatal(err)
				}
				continue
			}
			for j := range ev.Blocks {
				ev.Blocks[j] = StoredBlock{EngineHash: uint64(c*chain + j), Tokens: toks[j*bs : (j+1)*bs]}
			}
			if err := ix.Apply(w, ev); err != nil {
				b.Fatal(err)
			}
		}
	}
	return ix
}
