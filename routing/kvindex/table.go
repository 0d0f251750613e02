package kvindex

import (
	"slices"
	"sync"
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
type table struct {
	slots   []slot
	mask    uint64
	n       int // keys held, the zero key included
	seed    uint64
	hasZero bool
	zero    entry
}

type slot struct {
	key uint64 // 0: empty
	e   entry
}

// shard is one lock's worth of a space: a table plus the spill records of
// its entries. Readers take mu.RLock for one key at a time.
type shard struct {
	mu     sync.RWMutex
	tab    table
	spills []spill
	free   []uint32
	_      [48]byte // pads a shard to 192 bytes: whole cache lines, no lock shared with a neighbour
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

func (t *table) get(k, h uint64) (entry, bool) {
	if k == 0 {
		return t.zero, t.hasZero
	}
	for i := h & t.mask; int(i) < len(t.slots); i = (i + 1) & t.mask {
		sl := &t.slots[i]
		switch sl.key {
		case k:
			return sl.e, true
		case 0:
			return entry{}, false
		}
	}
	return entry{}, false // no slots yet
}

// ref returns the entry of k, or nil. The pointer is valid until the next
// upsert or remove.
func (t *table) ref(k, h uint64) *entry {
	if k == 0 {
		if t.hasZero {
			return &t.zero
		}
		return nil
	}
	for i := h & t.mask; int(i) < len(t.slots); i = (i + 1) & t.mask {
		sl := &t.slots[i]
		switch sl.key {
		case k:
			return &sl.e
		case 0:
			return nil
		}
	}
	return nil
}

// upsert returns the entry of k, creating an empty one if needed.
func (t *table) upsert(k, h uint64) *entry {
	if k == 0 {
		if !t.hasZero {
			t.hasZero, t.zero = true, entry{}
			t.n++
		}
		return &t.zero
	}
	if t.slots == nil {
		t.resize(minTableCap)
	} else if 4*(t.n+1) > 3*len(t.slots) {
		t.resize(2 * len(t.slots))
	}
	for i := h & t.mask; ; i = (i + 1) & t.mask {
		sl := &t.slots[i]
		switch sl.key {
		case k:
			return &sl.e
		case 0:
			*sl = slot{key: k}
			t.n++
			return &sl.e
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
	i := h & t.mask
	for t.slots[i].key != k {
		i = (i + 1) & t.mask
	}
	// Backward shift: pull later members of the probe run into the hole
	// when the hole lies between their home slot and where they sit.
	for j := i; ; {
		j = (j + 1) & t.mask
		kj := t.slots[j].key
		if kj == 0 {
			break
		}
		home := mix(kj^t.seed) & t.mask
		if (j-home)&t.mask >= (j-i)&t.mask {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = slot{}
	if len(t.slots) > minTableCap && 8*t.n < len(t.slots) {
		t.resize(len(t.slots) / 2)
	}
}

func (t *table) resize(capacity int) {
	old := t.slots
	t.slots = make([]slot, capacity)
	t.mask = uint64(capacity - 1)
	for _, sl := range old {
		if sl.key == 0 {
			continue
		}
		j := mix(sl.key^t.seed) & t.mask
		for t.slots[j].key != 0 {
			j = (j + 1) & t.mask
		}
		t.slots[j] = sl
	}
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
func (s *shard) put(k, h uint64, w WorkerID, merge func(old uint32, present bool) uint32) (added bool, old uint32) {
	e := s.tab.upsert(k, h)
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
func (s *shard) drop(k, h uint64, w WorkerID, keep func(stamp uint32) bool) (removed bool, stamp uint32) {
	e := s.tab.ref(k, h)
	if e == nil {
		return false, 0
	}
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
