package bpe

import (
	"container/list"
	"context"
	"encoding/binary"
	"hash/maphash"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
)

// PrefixCache remembers the token ids of text chunks so that a text starting
// with an already encoded text (turn N+1 of a conversation rendered by a chat
// template) only encodes what follows the last shared safe boundary.
//
// A text is cut at safe boundaries ([BPE.SafeSplit]) into chunks of at least
// chunkBytes; the boundaries are picked greedily from the start, so two texts
// with a long common prefix share all chunks up to near the end of that prefix.
// Each chunk is keyed by a hash chained over all chunks before it and its end
// offset, which makes the key stand for the whole prefix up to the chunk's end;
// the chunk text itself is compared on a hit, and its end is checked to still
// be a safe cut in the new text. Lookups follow stored chunks from the start,
// taking the longest that fits, and stop at the first miss; the rest is cut
// (greedily, chunks of at least chunkBytes) and encoded chunk by chunk and
// stored, plus one chunk up to the last safe cut of the text, so that the next
// turn of the conversation reuses all of it. By the SafeSplit property, the concatenated ids equal
// Encode(text). Entries are evicted least recently used first once the stored
// bytes (chunk text + 4 bytes per id + 8 bytes per block key + overhead)
// exceed MaxBytes.
//
// [PrefixCache.EncodeKeys] also returns the prompt's block keys
// (kvindex.AppendBlockKeys of the ids for one [KeySpec]): a stored chunk keeps
// the keys of the blocks that end in it, for the spec it was stored with, so
// the blocks of the reused leading chunks are not hashed again; only the rest
// is, the chain continuing from the last reused key (kvindex.ExtendBlockKeys).
//
// With added tokens that have lstrip, rstrip or single_word (none in Qwen3,
// Llama 3.x or Mistral 7B), stored chunks are never reused (the cache stays
// correct but only costs).
//
// A PrefixCache is safe for concurrent use. The walk over stored chunks holds a
// mutex (it compares the chunks with the text); encoding happens outside it.
type PrefixCache struct {
	tok        *BPE
	maxBytes   int64
	chunkBytes int
	seed       maphash.Seed

	mu       sync.Mutex
	lru      list.List // of *pcEntry, front = most recent
	index    map[pcKey]*list.Element
	children map[uint64][]int // parent chain hash -> ends of stored chunks
	bytes    int64

	hits, misses           atomic.Int64 // chunks
	hitBytes, missBytes    atomic.Int64 // text bytes
	keysReused, keysHashed atomic.Int64 // block keys
}

// KeySpec names the block keys [PrefixCache.EncodeKeys] computes: blocks of
// BlockSize tokens hashed with Seed (kvindex.Seed) by Extend. BlockSize <= 0
// or a nil Extend: none.
type KeySpec struct {
	BlockSize int
	Seed      uint64
	// Extend appends to keys (the chained keys of the leading blocks of ids)
	// the keys of the rest of ids' complete blocks: kvindex.ExtendBlockKeys,
	// injected by the caller so that the tokenizer does not depend on
	// routing. Every spec given to one cache must use the same function:
	// stored keys are reused for any spec of the same block size and seed.
	Extend func(keys []uint64, ids []uint32, blockSize int, seed uint64) []uint64
}

// keyID is what stored keys were computed for.
type keyID struct {
	blockSize int
	seed      uint64
}

func (s KeySpec) id() keyID { return keyID{s.BlockSize, s.Seed} }

var _ Tokenizer = (*PrefixCache)(nil)

// pcKey names a chunk by the chain hash of the text before it and its end.
type pcKey struct {
	parent uint64
	end    int
}

type pcEntry struct {
	key   pcKey
	hash  uint64  // chain hash of the text up to the chunk's end
	kind  cutKind // why the end was a safe cut
	chunk string
	ids   []uint32

	// The keys of the blocks that end in the chunk, for spec, when the
	// chunk's ids start at token start of the prompt and the block before
	// the first of them has key prev (0 if none). Reuse checks start and
	// prev, so that keys never join a chain they were not computed on.
	spec  keyID
	start int
	prev  uint64
	keys  []uint64
}

// size is what the entry counts against MaxBytes.
func (e *pcEntry) size() int64 {
	return int64(len(e.chunk) + 4*len(e.ids) + 8*len(e.keys) + pcOverhead)
}

const pcOverhead = 152 // bytes per entry besides the chunk, its ids and keys

// PrefixCacheStats are the cache counters.
type PrefixCacheStats struct {
	Hits, Misses        int64 // chunks found and not found
	HitBytes, MissBytes int64 // text bytes served from the cache and encoded
	// KeysReused and KeysHashed count the block keys EncodeKeys took from
	// stored chunks and the ones it hashed.
	KeysReused, KeysHashed int64
	Entries                int
	Bytes                  int64
}

// NewPrefixCache returns a cache over tok holding at most maxBytes. chunkBytes
// is the minimum chunk size (0: 2 KiB); smaller chunks reuse more of a prefix
// but cost more lookups.
func NewPrefixCache(tok *BPE, maxBytes int64, chunkBytes int) *PrefixCache {
	if chunkBytes <= 0 {
		chunkBytes = 2 << 10
	}
	return &PrefixCache{
		tok:        tok,
		maxBytes:   maxBytes,
		chunkBytes: chunkBytes,
		seed:       maphash.MakeSeed(),
		index:      make(map[pcKey]*list.Element),
		children:   make(map[uint64][]int),
	}
}

// Stats returns the counters.
func (c *PrefixCache) Stats() PrefixCacheStats {
	c.mu.Lock()
	n, b := c.lru.Len(), c.bytes
	c.mu.Unlock()
	return PrefixCacheStats{
		Hits: c.hits.Load(), Misses: c.misses.Load(),
		HitBytes: c.hitBytes.Load(), MissBytes: c.missBytes.Load(),
		KeysReused: c.keysReused.Load(), KeysHashed: c.keysHashed.Load(),
		Entries: n, Bytes: b,
	}
}

// Encode implements [Tokenizer]; the result equals the tokenizer's Encode.
func (c *PrefixCache) Encode(ctx context.Context, text string) ([]uint32, error) {
	ids, _, err := c.EncodeKeys(ctx, text, KeySpec{})
	return ids, err
}

// EncodeKeys is [PrefixCache.Encode] that also returns the block keys of the
// ids for spec: kvindex.AppendBlockKeys(nil, ids, spec.BlockSize, spec.Seed),
// nil when spec.BlockSize <= 0 or spec.Extend is nil. The keys of the complete blocks of the
// leading chunks served from the cache are taken from them when they were
// stored for the same spec; the rest are hashed. Both slices belong to the
// caller.
func (c *PrefixCache) EncodeKeys(ctx context.Context, text string, spec KeySpec) ([]uint32, []uint64, error) {
	out := make([]uint32, 0, len(text)/2+16)
	var (
		cur    uint64 // chain hash of text[:prev]
		prev   int
		keys   []uint64
		hitBuf [32]pcHit
		hits   = hitBuf[:0]
	)
	withKeys := spec.BlockSize > 0 && spec.Extend != nil
	// Walk stored chunks under the lock: each step compares the chunk with the
	// text and checks that its end is still a safe cut (BPE.stillCut looks
	// only at the bytes around it), taking the longest child that fits.
	c.mu.Lock()
	for {
		var best *list.Element
		bestEnd := -1
		for _, e := range c.children[cur] {
			if e <= bestEnd || e > len(text) {
				continue
			}
			el, ok := c.index[pcKey{parent: cur, end: e}]
			if !ok {
				continue
			}
			ent := el.Value.(*pcEntry)
			if ent.chunk == text[prev:e] && c.tok.stillCut(text, e, ent.kind) {
				best, bestEnd = el, e
			}
		}
		if best == nil {
			break
		}
		ent := best.Value.(*pcEntry)
		c.lru.MoveToFront(best)
		if withKeys {
			hits = append(hits, pcHit{ent: ent, at: len(out)})
		}
		out = append(out, ent.ids...)
		c.hits.Add(1)
		c.hitBytes.Add(int64(bestEnd - prev))
		cur, prev = ent.hash, bestEnd
	}
	c.mu.Unlock()

	if withKeys {
		// Room for the cached part's blocks and those of the rest at 2
		// bytes or more per token (append grows it otherwise). Entries
		// never change once stored: their keys are read without the lock.
		keys = make([]uint64, 0, (len(out)+(len(text)-prev)/2)/spec.BlockSize+1)
		for _, h := range hits {
			keys = c.reuseKeys(keys, out, h, spec)
		}
	}

	var (
		next     = prev + c.chunkBytes
		lastCut  int
		lastKind cutKind
		err      error
	)
	encodeChunk := func(b int, k cutKind) bool {
		if err = ctx.Err(); err != nil {
			return false
		}
		chunk := text[prev:b]
		start := len(out)
		out = c.tok.EncodeAppend(out, chunk)
		c.misses.Add(1)
		c.missBytes.Add(int64(len(chunk)))
		e := &pcEntry{key: pcKey{parent: cur, end: b}, kind: k, chunk: chunk, ids: out[start:]}
		cur = c.chainHash(cur, chunk)
		e.hash = cur
		if withKeys {
			keys = c.extendKeys(keys, out, spec)
			first := start / spec.BlockSize
			e.spec, e.start, e.keys = spec.id(), start, keys[first:]
			if first > 0 {
				e.prev = keys[first-1]
			}
		}
		c.store(e)
		prev, next = b, b+c.chunkBytes
		return true
	}
	c.tok.cuts(text, prev, len(text), func(b int, k cutKind) bool {
		lastCut, lastKind = b, k
		if b < next {
			return true
		}
		return encodeChunk(b, k)
	})
	if err != nil {
		return nil, nil, err
	}
	// Store up to the last safe cut, so that a text extending this one can
	// reuse everything before it.
	if lastCut > prev && !encodeChunk(lastCut, lastKind) {
		return nil, nil, err
	}
	if prev < len(text) {
		out = c.tok.EncodeAppend(out, text[prev:])
		c.missBytes.Add(int64(len(text) - prev))
	}
	if withKeys {
		keys = c.extendKeys(keys, out, spec)
	}
	return out, keys, nil
}

// pcHit is a stored chunk the walk reused, its ids at out[at:].
type pcHit struct {
	ent *pcEntry
	at  int
}

// reuseKeys appends the keys stored with h's chunk to keys, the keys of
// the blocks before it (hashed first where earlier chunks had none), when
// they were computed for spec, at the same token offset and on the same
// chain; otherwise it returns keys as they are (ExtendBlockKeys hashes the
// chunk's blocks later).
func (c *PrefixCache) reuseKeys(keys []uint64, out []uint32, h pcHit, spec KeySpec) []uint64 {
	e := h.ent
	if e.spec != spec.id() || e.start != h.at || len(e.keys) == 0 {
		return keys
	}
	keys = c.extendKeys(keys, out[:h.at], spec)
	var prev uint64
	if n := len(keys); n > 0 {
		prev = keys[n-1]
	}
	if prev != e.prev {
		return keys
	}
	c.keysReused.Add(int64(len(e.keys)))
	return append(keys, e.keys...)
}

// extendKeys is spec.Extend (kvindex.ExtendBlockKeys), counted.
func (c *PrefixCache) extendKeys(keys []uint64, ids []uint32, spec KeySpec) []uint64 {
	n := len(keys)
	keys = spec.Extend(keys, ids, spec.BlockSize, spec.Seed)
	if d := len(keys) - n; d > 0 {
		c.keysHashed.Add(int64(d))
	}
	return keys
}

func (c *PrefixCache) chainHash(parent uint64, chunk string) uint64 {
	var h maphash.Hash
	h.SetSeed(c.seed)
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], parent)
	h.Write(b[:])
	h.WriteString(chunk)
	return h.Sum64()
}

// store adds e, copying its chunk, ids and keys, unless it alone exceeds
// MaxBytes, then evicts down to MaxBytes.
func (c *PrefixCache) store(e *pcEntry) {
	size := e.size()
	if size > c.maxBytes {
		return
	}
	e.chunk, e.ids, e.keys = strings.Clone(e.chunk), slices.Clone(e.ids), slices.Clone(e.keys)
	key := e.key
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.index[key]; ok {
		c.lru.MoveToFront(el)
		return
	}
	c.index[key] = c.lru.PushFront(e)
	c.children[key.parent] = append(c.children[key.parent], key.end)
	c.bytes += size
	for c.bytes > c.maxBytes {
		el := c.lru.Back()
		old := el.Value.(*pcEntry)
		c.lru.Remove(el)
		delete(c.index, old.key)
		ends := slices.DeleteFunc(c.children[old.key.parent], func(e int) bool { return e == old.key.end })
		if len(ends) == 0 {
			delete(c.children, old.key.parent)
		} else {
			c.children[old.key.parent] = ends
		}
		c.bytes -= old.size()
	}
}
