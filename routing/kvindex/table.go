package kvindex

import (
	"slices"
	"sync"
	"sync/atomic"
)

const (
	shardBits = 6
	numShards = 1 << shardBits
	// inlineIDs is how many workers an entry holds before spilling to a
	// shard-owned record. Two keep a slot at 24 bytes.
	inlineIDs = 2
	// spillTag in ids[0] marks a spilled entry; stamps[0] is then the index
	// of its record in shard.spills. It is never handed out as a WorkerID.
	spillTag    WorkerID = ^WorkerID(0)
	minTableCap          = 16
)

// entry lists the workers holding one key, ascending, unused slots zero,
// with a stamp per worker: 0 for an event-fed entry, else the approximate
// entry's last use (see Index.stamp). A spilled entry (ids[0] == spillTag)
// keeps its record's index in stamps[0] and the fingerprint sum of its
// workers in ids[1] (low half) and stamps[1] (high half), so Overlaps can
// tell an unchanged set without touching the record.
type entry struct {
	ids    [inlineIDs]WorkerID
	stamps [inlineIDs]uint32
}

func (e *entry) spillSum() uint64 { return uint64(e.ids[1]) | uint64(e.stamps[1])<<32 }

func (e *entry) setSpillSum(sum uint64) { e.ids[1], e.stamps[1] = WorkerID(sum), uint32(sum>>32) }

// spill holds the workers of a key with more than inlineIDs of them.
type spill struct {
	ids    []WorkerID // ascending
	stamps []uint32
}

// table is an open-addressing hash table (linear probing, backward-shift
// deletion, no tombstones) from a non-zero key to an entry. Key 0 lives
// beside the slots. A slot holds its key and entry together, so a lookup
// touches one cache line. Slots are found by h = mix(key ^ seed); callers
// pass h so it is computed once per key.
//
// Writers hold the shard's mutex. They read slots plainly but store every
// word of a published array atomically, and replace the array (on resize)
// through pub, so that peek can read without the lock.
type table struct {
	cur     *slotArray // nil until the first insert
	pub     atomic.Pointer[slotArray]
	n       int // keys held, the zero key included
	seed    uint64
	hasZero bool
	zero    entry
}

// slotArray is a table's slots with their mask. The header never changes
// once published; the slots' words do, atomically.
type slotArray struct {
	mask  uint64
	slots []slot
}

// slot is a key (0: empty) and its entry packed in two words: ids[0] |
// ids[1]<<32 and stamps[0] | stamps[1]<<32.
type slot struct {
	key, ids, stamps uint64
}

func pack(e entry) (ids, stamps uint64) {
	return uint64(e.ids[0]) | uint64(e.ids[1])<<32, uint64(e.stamps[0]) | uint64(e.stamps[1])<<32
}

func unpack(ids, stamps uint64) entry {
	return entry{
		ids:    [inlineIDs]WorkerID{WorkerID(ids), WorkerID(ids >> 32)},
		stamps: [inlineIDs]uint32{uint32(stamps), uint32(stamps >> 32)},
	}
}

// shard is one lock's worth of a space: a table plus the spill records of
// its entries. Writers lock mu and keep seq odd while they write (see
// lock); Overlaps reads a key optimistically with peek and falls back to
// mu.RLock when a writer was active or the entry's spill record is needed.
type shard struct {
	mu     sync.RWMutex
	seq    atomic.Uint64
	tab    table
	spills []spill
	free   []uint32
	_      [56]byte // pads a shard to 192 bytes: whole cache lines, no lock shared with a neighbour
}

func (s *shard) lock() {
	s.mu.Lock()
	s.seq.Add(1)
}

func (s *shard) unlock() {
	s.seq.Add(1)
	s.mu.Unlock()
}

// peek looks k up without locking and returns its entry's packed words
// (see slot). ok is false when a writer was active meanwhile (the caller
// then locks); otherwise the words and found are a consistent reading.
// Words, not an entry, keep the hot path free of store-forwarding stalls.
func (s *shard) peek(k, h uint64) (ids, stamps uint64, found, ok bool) {
	s1 := s.seq.Load()
	if s1&1 != 0 || k == 0 {
		return 0, 0, false, false
	}
	if a := s.tab.pub.Load(); a != nil {
		// The array always has empty slots (load <= 3/4), so the probe
		// ends even on a torn reading, which the seq check then rejects.
		for i := h & a.mask; ; i = (i + 1) & a.mask {
			sl := &a.slots[i]
			kk := atomic.LoadUint64(&sl.key)
			if kk == k {
				ids, stamps, found = atomic.LoadUint64(&sl.ids), atomic.LoadUint64(&sl.stamps), true
				break
			}
			if kk == 0 {
				break
			}
		}
	}
	return ids, stamps, found, s.seq.Load() == s1
}

// Packed-word views of an entry, for peek's callers.
func spilledWord(ids uint64) bool { return WorkerID(ids) == spillTag }

func spillSumWords(ids, stamps uint64) uint64 { return ids>>32 | stamps&^0xffffffff }

func inlineSumWord(ids uint64) uint64 {
	sum := fingerprint(WorkerID(ids))
	if w := WorkerID(ids >> 32); w != 0 {
		sum += fingerprint(w)
	}
	return sum
}

// mix is the splitmix64 finalizer, a bijection with full avalanche.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// unmix inverts mix.
func unmix(x uint64) uint64 {
	x ^= x>>31 ^ x>>62
	x *= 0x319642b2d24d8ec3
	x ^= x>>27 ^ x>>54
	x *= 0x96de1b173f119089
	x ^= x>>30 ^ x>>60
	return x
}

const fingerprintOffset = 0x9e3779b97f4a7c15

// fingerprint is the per-worker term of an entry's set sum. Two sets of the
// same size with the same sum are taken as equal (a 2^-64 event for ids we
// hand out ourselves): Overlaps uses it to skip comparing unchanged sets,
// and, when one worker dropped out, to name it with fingerprintOwner.
func fingerprint(w WorkerID) uint64 { return mix(uint64(w) + fingerprintOffset) }

// fingerprintOwner inverts fingerprint; ok is false if f is no worker's.
func fingerprintOwner(f uint64) (WorkerID, bool) {
	w := unmix(f) - fingerprintOffset
	return WorkerID(w), w != 0 && w < uint64(spillTag)
}

// get returns the entry of k. The caller holds the shard's lock (read or
// write).
func (t *table) get(k, h uint64) (entry, bool) {
	if i, ok := t.find(k, h); ok {
		return t.at(i), true
	}
	return entry{}, false
}

// find returns the slot of k, or -1 for the zero key.
func (t *table) find(k, h uint64) (int, bool) {
	if k == 0 {
		return -1, t.hasZero
	}
	a := t.cur
	if a == nil {
		return 0, false
	}
	for i := h & a.mask; ; i = (i + 1) & a.mask {
		switch a.slots[i].key {
		case k:
			return int(i), true
		case 0:
			return 0, false
		}
	}
}

func (t *table) at(i int) entry {
	if i < 0 {
		return t.zero
	}
	sl := &t.cur.slots[i]
	return unpack(sl.ids, sl.stamps)
}

// set stores e in slot i (from find or upsert).
func (t *table) set(i int, e entry) {
	if i < 0 {
		t.zero = e
		return
	}
	ids, stamps := pack(e)
	sl := &t.cur.slots[i]
	atomic.StoreUint64(&sl.ids, ids)
	atomic.StoreUint64(&sl.stamps, stamps)
}

// upsert returns the slot of k, adding k with an empty entry if needed.
func (t *table) upsert(k, h uint64) int {
	if k == 0 {
		if !t.hasZero {
			t.hasZero, t.zero = true, entry{}
			t.n++
		}
		return -1
	}
	if t.cur == nil {
		t.resize(minTableCap)
	} else if 4*(t.n+1) > 3*len(t.cur.slots) {
		t.resize(2 * len(t.cur.slots))
	}
	a := t.cur
	for i := h & a.mask; ; i = (i + 1) & a.mask {
		switch a.slots[i].key {
		case k:
			return int(i)
		case 0:
			// Empty slots have zero entries, so storing the key suffices.
			atomic.StoreUint64(&a.slots[i].key, k)
			t.n++
			return int(i)
		}
	}
}

// remove deletes k, which must be present.
func (t *table) remove(k, h uint64) {
	t.n--
	if k == 0 {
		t.hasZero, t.zero = false, entry{}
		return
	}
	a := t.cur
	i := h & a.mask
	for a.slots[i].key != k {
		i = (i + 1) & a.mask
	}
	// Backward shift: pull later members of the probe run into the hole
	// when the hole lies between their home slot and where they sit.
	for j := i; ; {
		j = (j + 1) & a.mask
		kj := a.slots[j].key
		if kj == 0 {
			break
		}
		home := mix(kj^t.seed) & a.mask
		if (j-home)&a.mask >= (j-i)&a.mask {
			storeSlot(&a.slots[i], a.slots[j])
			i = j
		}
	}
	storeSlot(&a.slots[i], slot{})
	if len(a.slots) > minTableCap && 8*t.n < len(a.slots) {
		t.resize(len(a.slots) / 2)
	}
}

func storeSlot(dst *slot, src slot) {
	atomic.StoreUint64(&dst.key, src.key)
	atomic.StoreUint64(&dst.ids, src.ids)
	atomic.StoreUint64(&dst.stamps, src.stamps)
}

// resize moves the keys to a new array, filled before it is published, so
// that readers of the old array see it unchanged.
func (t *table) resize(capacity int) {
	na := &slotArray{mask: uint64(capacity - 1), slots: make([]slot, capacity)}
	if t.cur != nil {
		for _, sl := range t.cur.slots {
			if sl.key == 0 {
				continue
			}
			j := mix(sl.key^t.seed) & na.mask
			for na.slots[j].key != 0 {
				j = (j + 1) & na.mask
			}
			na.slots[j] = sl
		}
	}
	t.cur = na
	t.pub.Store(na)
}

// members returns the workers of e, ascending, and the sum of their
// fingerprints. The slices alias shard memory: use them under the lock.
func (s *shard) members(e *entry) ([]WorkerID, uint64) {
	if e.ids[0] == spillTag {
		sp := &s.spills[e.stamps[0]]
		return sp.ids, e.spillSum()
	}
	switch {
	case e.ids[0] == 0:
		return nil, 0
	case e.ids[1] == 0:
		return e.ids[:1], fingerprint(e.ids[0])
	default:
		return e.ids[:2], fingerprint(e.ids[0]) + fingerprint(e.ids[1])
	}
}

// stampOf returns the stamp of w in e and whether w holds e.
func (s *shard) stampOf(e *entry, w WorkerID) (uint32, bool) {
	if e.ids[0] == spillTag {
		sp := &s.spills[e.stamps[0]]
		if i, ok := slices.BinarySearch(sp.ids, w); ok {
			return sp.stamps[i], true
		}
		return 0, false
	}
	for i, id := range e.ids {
		if id == w {
			return e.stamps[i], true
		}
	}
	return 0, false
}

// put makes w hold key k with the stamp chosen by merge(old, present), and
// reports whether w was added and its stamp before (0 when added).
// The caller holds s.lock.
func (s *shard) put(k, h uint64, w WorkerID, merge func(old uint32, present bool) uint32) (added bool, old uint32) {
	si := s.tab.upsert(k, h)
	ev := s.tab.at(si)
	e := &ev
	defer func() { s.tab.set(si, ev) }()
	if e.ids[0] == spillTag {
		sp := &s.spills[e.stamps[0]]
		i, ok := slices.BinarySearch(sp.ids, w)
		if ok {
			old = sp.stamps[i]
			sp.stamps[i] = merge(old, true)
			return false, old
		}
		sp.ids = slices.Insert(sp.ids, i, w)
		sp.stamps = slices.Insert(sp.stamps, i, merge(0, false))
		e.setSpillSum(e.spillSum() + fingerprint(w))
		return true, 0
	}
	n := 0
	for i, id := range e.ids {
		if id == w {
			old = e.stamps[i]
			e.stamps[i] = merge(old, true)
			return false, old
		}
		if id != 0 {
			n++
		}
	}
	stamp := merge(0, false)
	if n < inlineIDs {
		i := n
		for i > 0 && e.ids[i-1] > w {
			e.ids[i], e.stamps[i] = e.ids[i-1], e.stamps[i-1]
			i--
		}
		e.ids[i], e.stamps[i] = w, stamp
		return true, 0
	}
	idx := s.newSpill()
	sp := &s.spills[idx]
	sp.ids = append(sp.ids, e.ids[:]...)
	sp.stamps = append(sp.stamps, e.stamps[:]...)
	i, _ := slices.BinarySearch(sp.ids, w)
	sp.ids = slices.Insert(sp.ids, i, w)
	sp.stamps = slices.Insert(sp.stamps, i, stamp)
	var sum uint64
	for _, id := range sp.ids {
		sum += fingerprint(id)
	}
	*e = entry{ids: [inlineIDs]WorkerID{spillTag}, stamps: [inlineIDs]uint32{idx}}
	e.setSpillSum(sum)
	return true, 0
}

// drop removes w from key k if keep(stamp) is false, and reports whether it
// did and w's stamp. The key goes when its last worker does.
// The caller holds s.lock.
func (s *shard) drop(k, h uint64, w WorkerID, keep func(stamp uint32) bool) (removed bool, stamp uint32) {
	si, ok := s.tab.find(k, h)
	if !ok {
		return false, 0
	}
	ev := s.tab.at(si)
	e := &ev
	if e.ids[0] == spillTag {
		idx := e.stamps[0]
		sp := &s.spills[idx]
		i, ok := slices.BinarySearch(sp.ids, w)
		if !ok || keep(sp.stamps[i]) {
			return false, 0
		}
		stamp = sp.stamps[i]
		sp.ids = slices.Delete(sp.ids, i, i+1)
		sp.stamps = slices.Delete(sp.stamps, i, i+1)
		e.setSpillSum(e.spillSum() - fingerprint(w))
		if len(sp.ids) <= inlineIDs {
			var in entry
			copy(in.ids[:], sp.ids)
			copy(in.stamps[:], sp.stamps)
			*e = in
			s.freeSpill(idx)
		}
		s.tab.set(si, ev)
		return true, stamp
	}
	for i, id := range e.ids {
		if id != w {
			continue
		}
		if keep(e.stamps[i]) {
			return false, 0
		}
		stamp = e.stamps[i]
		copy(e.ids[i:], e.ids[i+1:])
		copy(e.stamps[i:], e.stamps[i+1:])
		e.ids[inlineIDs-1], e.stamps[inlineIDs-1] = 0, 0
		if e.ids[0] == 0 {
			s.tab.remove(k, h)
		} else {
			s.tab.set(si, ev)
		}
		return true, stamp
	}
	return false, 0
}

func (s *shard) newSpill() uint32 {
	if n := len(s.free); n > 0 {
		idx := s.free[n-1]
		s.free = s.free[:n-1]
		return idx
	}
	s.spills = append(s.spills, spill{})
	return uint32(len(s.spills) - 1)
}

func (s *shard) freeSpill(idx uint32) {
	sp := &s.spills[idx]
	if cap(sp.ids) > 16 {
		*sp = spill{} // do not pin a large record's memory
	} else {
		*sp = spill{ids: sp.ids[:0], stamps: sp.stamps[:0]}
	}
	s.free = append(s.free, idx)
}
