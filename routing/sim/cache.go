package sim

// kvCache is one worker's paged KV cache with prefix caching: blocks are
// either private to a request (anonymous: being filled, or holding output
// tokens) or cached under the chained hash of a full prompt block. Cached
// blocks with no request referencing them stay cached and are evicted in
// LRU order when a request needs room.
type kvCache struct {
	capacity int
	// anon counts allocated blocks without a cache entry.
	anon int
	// pinned counts cache entries referenced by a request.
	pinned int
	index  map[uint64]int32
	ents   []entry
	spare  []int32 // free entry slots
	// lru lists unreferenced entries, oldest (next evicted) first.
	lruHead, lruTail int32
	lruLen           int
	// evicted collects the hashes evicted since the caller last drained it.
	evicted []uint64
}

type entry struct {
	hash       uint64
	refs       int32
	prev, next int32
}

func newKVCache(capacity int) *kvCache {
	return &kvCache{capacity: capacity, index: make(map[uint64]int32), lruHead: -1, lruTail: -1}
}

// free is the number of never-used (or released private) blocks.
func (c *kvCache) free() int { return c.capacity - c.anon - len(c.index) }

// used is the number of blocks held by requests (vLLM's KV usage counts
// these; cached but unreferenced blocks are reclaimable).
func (c *kvCache) used() int { return c.anon + c.pinned }

// prefix returns how many leading keys are cached.
func (c *kvCache) prefix(keys []uint64) int {
	for i, k := range keys {
		if _, ok := c.index[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// canAllocate reports whether n new blocks fit once the entries of hits
// are referenced (an unreferenced hit stops being evictable).
func (c *kvCache) canAllocate(hits []uint64, n int) bool {
	avail := c.free() + c.lruLen
	for _, k := range hits {
		if c.ents[c.index[k]].refs == 0 {
			avail--
		}
	}
	return avail >= n
}

// acquire references the cached block k and returns its slot.
func (c *kvCache) acquire(k uint64) int32 {
	s := c.index[k]
	e := &c.ents[s]
	if e.refs == 0 {
		c.lruRemove(s)
		c.pinned++
	}
	e.refs++
	return s
}

// release drops a reference; an unreferenced block joins the LRU tail.
func (c *kvCache) release(s int32) {
	e := &c.ents[s]
	e.refs--
	if e.refs == 0 {
		c.pinned--
		c.lruPush(s)
	}
}

// allocate takes n private blocks, evicting LRU entries as needed. The
// caller checked canAllocate.
func (c *kvCache) allocate(n int) {
	for c.free() < n && c.lruHead >= 0 {
		s := c.lruHead
		c.lruRemove(s)
		h := c.ents[s].hash
		delete(c.index, h)
		c.spare = append(c.spare, s)
		c.evicted = append(c.evicted, h)
	}
	c.anon += n
}

// register turns one private block, now full of computed prompt tokens,
// into the cache entry for hash k, referenced once. If k is cached already
// (another request computed it meanwhile, or vLLM's last-token recompute),
// the private block is released and the existing entry referenced instead;
// fresh reports whether a new entry was made.
func (c *kvCache) register(k uint64) (slot int32, fresh bool) {
	c.anon--
	if _, ok := c.index[k]; ok {
		return c.acquire(k), false
	}
	if n := len(c.spare); n > 0 {
		slot = c.spare[n-1]
		c.spare = c.spare[:n-1]
	} else {
		slot = int32(len(c.ents))
		c.ents = append(c.ents, entry{})
	}
	c.ents[slot] = entry{hash: k, refs: 1, prev: -1, next: -1}
	c.index[k] = slot
	c.pinned++
	return slot, true
}

func (c *kvCache) lruPush(s int32) {
	e := &c.ents[s]
	e.prev, e.next = c.lruTail, -1
	if c.lruTail >= 0 {
		c.ents[c.lruTail].next = s
	} else {
		c.lruHead = s
	}
	c.lruTail = s
	c.lruLen++
}

func (c *kvCache) lruRemove(s int32) {
	e := &c.ents[s]
	if e.prev >= 0 {
		c.ents[e.prev].next = e.next
	} else {
		c.lruHead = e.next
	}
	if e.next >= 0 {
		c.ents[e.next].prev = e.prev
	} else {
		c.lruTail = e.prev
	}
	e.prev, e.next = -1, -1
	c.lruLen--
}
