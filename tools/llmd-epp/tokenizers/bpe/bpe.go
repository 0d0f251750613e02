package bpe

import (
	"context"
	"hash/maphash"
	"sync/atomic"
	"unicode/utf8"
)

type mergeVal struct {
	rank uint32
	id   uint32
}

func pairKey(a, b uint32) uint64 { return uint64(a)<<32 | uint64(b) }

// symbol is one node of the doubly linked list a word is merged on.
type symbol struct {
	id         uint32
	prev, next int32
	dead       bool
}

// mergeItem is a candidate merge of the pair starting at symbol pos.
type mergeItem struct {
	rank        uint32
	pos         int32
	left, right uint32
	id          uint32
}

func (a mergeItem) less(b mergeItem) bool {
	return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos)
}

// scratch holds per-call buffers, reused through a sync.Pool so that encoding
// does not allocate per byte or per word.
type scratch struct {
	syms []symbol
	heap []mergeItem
	out  []uint32
	ctx  context.Context
	err  error
	n    int
}

func (t *BPE) getScratch() *scratch {
	if sc, ok := t.pool.Get().(*scratch); ok {
		return sc
	}
	return &scratch{}
}

const (
	cacheSlots   = 1 << 15 // word cache entries (direct mapped)
	cacheMaxWord = 64      // longer words are not cached
)

type cacheEntry struct {
	word string
	ids  []uint32
}

type cacheSlot struct{ p atomic.Pointer[cacheEntry] }

// word appends the BPE encoding of one pre-token.
func (t *BPE) word(sc *scratch, w string) {
	if len(w) <= cacheMaxWord {
		slot := &t.cache[maphash.String(t.seed, w)&(cacheSlots-1)]
		if e := slot.p.Load(); e != nil && e.word == w {
			sc.out = append(sc.out, e.ids...)
			return
		}
		start := len(sc.out)
		t.merge(sc, w)
		if sc.err != nil {
			return
		}
		ids := make([]uint32, len(sc.out)-start)
		copy(ids, sc.out[start:])
		slot.p.Store(&cacheEntry{word: w, ids: ids})
		return
	}
	t.merge(sc, w)
}

// merge runs the BPE merges on one word and appends the resulting ids to sc.out.
// It uses a min-heap of candidate pairs ordered by (rank, position), exactly
// the order Hugging Face's Word::merge_all applies them in, so it is O(n log n)
// even for a 10 MB word.
func (t *BPE) merge(sc *scratch, w string) {
	if t.ignoreMerges {
		if id, ok := t.rawVocab[w]; ok {
			sc.out = append(sc.out, id)
			return
		}
	}
	syms := t.initialSymbols(sc.syms[:0], w)
	sc.syms = syms
	if len(syms) == 0 {
		return
	}
	if len(syms) == 1 {
		sc.out = append(sc.out, syms[0].id)
		return
	}
	if len(syms) <= smallWord {
		t.mergeSmall(sc, syms)
		return
	}
	h := sc.heap[:0]
	for i := 0; i+1 < len(syms); i++ {
		if i%(1<<16) == 1<<16-1 && sc.ctx != nil && sc.ctx.Err() != nil {
			sc.err = sc.ctx.Err()
			return
		}
		if m, ok := t.merges[pairKey(syms[i].id, syms[i+1].id)]; ok {
			h = append(h, mergeItem{rank: m.rank, pos: int32(i), left: syms[i].id, right: syms[i+1].id, id: m.id})
		}
	}
	for i := len(h)/2 - 1; i >= 0; i-- {
		siftDown(h, i)
	}
	for steps := 1; len(h) > 0; steps++ {
		if steps%(1<<16) == 0 && sc.ctx != nil && sc.ctx.Err() != nil {
			// A huge word (a 10 MB run of one character takes seconds):
			// give up, Encode returns the error and drops the output.
			sc.err = sc.ctx.Err()
			break
		}
		var top mergeItem
		top, h = heapPop(h)
		l := &syms[top.pos]
		if l.dead || l.id != top.left || l.next < 0 {
			continue
		}
		r := &syms[l.next]
		if r.id != top.right {
			continue
		}
		// merge r into l
		l.id = top.id
		r.dead = true
		l.next = r.next
		if r.next >= 0 {
			syms[r.next].prev = top.pos
		}
		if l.prev >= 0 {
			p := &syms[l.prev]
			if m, ok := t.merges[pairKey(p.id, l.id)]; ok {
				h = heapPush(h, mergeItem{rank: m.rank, pos: l.prev, left: p.id, right: l.id, id: m.id})
			}
		}
		if l.next >= 0 {
			n := &syms[l.next]
			if m, ok := t.merges[pairKey(l.id, n.id)]; ok {
				h = heapPush(h, mergeItem{rank: m.rank, pos: top.pos, left: l.id, right: n.id, id: m.id})
			}
		}
	}
	sc.heap = h
	for i := int32(0); i >= 0; i = syms[i].next {
		sc.out = append(sc.out, syms[i].id)
	}
}

// smallWord is the symbol count up to which mergeSmall is used.
const smallWord = 48

// mergeSmall is merge for short words: it keeps the rank of each adjacent pair
// in an array and scans it for the lowest (leftmost on ties), which is the same
// order as the heap but cheaper for a few dozen symbols.
func (t *BPE) mergeSmall(sc *scratch, syms []symbol) {
	var idsBuf [smallWord]uint32
	var ranksBuf [smallWord]uint32
	var newBuf [smallWord]uint32
	n := len(syms)
	ids, ranks, news := idsBuf[:n], ranksBuf[:n], newBuf[:n]
	for i := range syms {
		ids[i] = syms[i].id
	}
	const none = ^uint32(0)
	rank := func(i int) {
		if m, ok := t.merges[pairKey(ids[i], ids[i+1])]; ok {
			ranks[i], news[i] = m.rank, m.id
		} else {
			ranks[i] = none
		}
	}
	for i := 0; i+1 < n; i++ {
		rank(i)
	}
	for n > 1 {
		best, bi := none, -1
		for i := 0; i+1 < n; i++ {
			if ranks[i] < best {
				best, bi = ranks[i], i
			}
		}
		if bi < 0 {
			break
		}
		ids[bi] = news[bi]
		copy(ids[bi+1:n], ids[bi+2:n])
		copy(ranks[bi+1:n], ranks[bi+2:n])
		copy(news[bi+1:n], news[bi+2:n])
		n--
		if bi+1 < n {
			rank(bi)
		}
		if bi > 0 {
			rank(bi - 1)
		}
	}
	sc.out = append(sc.out, ids[:n]...)
}

func (t *BPE) initialSymbols(syms []symbol, w string) []symbol {
	if cap(syms) < len(w) {
		syms = make([]symbol, 0, len(w))
	}
	push := func(id uint32) {
		n := int32(len(syms))
		syms = append(syms, symbol{id: id, prev: n - 1, next: n + 1})
	}
	if t.kind == kindByteLevel {
		for i := 0; i < len(w); i++ {
			if id := t.byteIDs[w[i]]; id >= 0 {
				push(uint32(id))
			}
		}
	} else {
		lastUnk := false
		for i := 0; i < len(w); {
			r, n := utf8.DecodeRuneInString(w[i:])
			if id, ok := t.runeIDs[r]; ok {
				push(id)
				lastUnk = false
			} else if t.byteFallback && t.allBytes(w[i:i+n]) {
				for j := i; j < i+n; j++ {
					push(uint32(t.byteIDs[w[j]]))
				}
				lastUnk = false
			} else if t.unkID >= 0 {
				if !(t.fuseUnk && lastUnk) {
					push(uint32(t.unkID))
				}
				lastUnk = true
			}
			i += n
		}
	}
	if len(syms) > 0 {
		syms[len(syms)-1].next = -1
	}
	return syms
}

func (t *BPE) allBytes(s string) bool {
	for i := 0; i < len(s); i++ {
		if t.byteIDs[s[i]] < 0 {
			return false
		}
	}
	return true
}

func heapPush(h []mergeItem, x mergeItem) []mergeItem {
	h = append(h, x)
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !h[i].less(h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	return h
}

func heapPop(h []mergeItem) (mergeItem, []mergeItem) {
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h = h[:n]
	siftDown(h, 0)
	return top, h
}

func siftDown(h []mergeItem, i int) {
	n := len(h)
	for {
		l := 2*i + 1
		if l >= n {
			break
		}
		m := l
		if r := l + 1; r < n && h[r].less(h[l]) {
			m = r
		}
		if !h[m].less(h[i]) {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
}

// clearCache empties the per-word cache (benchmarks measure the uncached path).
func (t *BPE) clearCache() {
	for i := range t.cache {
		t.cache[i].p.Store(nil)
	}
}
