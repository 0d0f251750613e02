package sim

import (
	"time"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// DefaultCPUReloadTokensPerSec is the reload bandwidth of a simulated CPU
// tier when WorkerConfig.CPUReloadTokensPerSec is 0: 200,000 tokens/s, a
// PCIe 4.0 x16 link's ~25 GB/s of host-to-device copies at 128 KiB of KV
// per token (Llama-3-8B in fp16: 2 × 32 layers × 8 KV heads × 128 × 2 B).
// The mocker prefills about 48,000 tokens/s in 8,192-token steps, so a
// reload costs about a quarter of a recompute.
const DefaultCPUReloadTokensPerSec = 200_000

// cpuCache is a worker's host-memory KV tier, as vLLM's OffloadingConnector
// with its LRU manager: blocks the GPU evicts are kept here, least recently
// used first out, and a request whose next blocks are here loads them back
// instead of recomputing them.
type cpuCache struct {
	capacity int
	index    map[uint64]int32
	ents     []cpuEntry
	spare    []int32
	head     int32 // least recently used
	tail     int32
}

type cpuEntry struct {
	hash       uint64
	prev, next int32
}

func newCPUCache(capacity int) *cpuCache {
	return &cpuCache{capacity: capacity, index: make(map[uint64]int32), head: -1, tail: -1}
}

// prefix returns how many leading keys are held.
func (c *cpuCache) prefix(keys []uint64) int {
	for i, k := range keys {
		if _, ok := c.index[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// touch makes k the most recently used; it reports whether k is held.
func (c *cpuCache) touch(k uint64) bool {
	s, ok := c.index[k]
	if ok {
		c.unlink(s)
		c.push(s)
	}
	return ok
}

// put stores k as the most recently used (touching it when held) and
// returns the hashes evicted to make room, appended to evicted; stored
// reports whether k is new.
func (c *cpuCache) put(k uint64, evicted []uint64) (_ []uint64, stored bool) {
	if c.touch(k) {
		return evicted, false
	}
	for len(c.index) >= c.capacity && c.head >= 0 {
		s := c.head
		c.unlink(s)
		delete(c.index, c.ents[s].hash)
		evicted = append(evicted, c.ents[s].hash)
		c.spare = append(c.spare, s)
	}
	var s int32
	if n := len(c.spare); n > 0 {
		s, c.spare = c.spare[n-1], c.spare[:n-1]
	} else {
		s = int32(len(c.ents))
		c.ents = append(c.ents, cpuEntry{})
	}
	c.ents[s] = cpuEntry{hash: k, prev: -1, next: -1}
	c.index[k] = s
	c.push(s)
	return evicted, true
}

func (c *cpuCache) push(s int32) {
	e := &c.ents[s]
	e.prev, e.next = c.tail, -1
	if c.tail >= 0 {
		c.ents[c.tail].next = s
	} else {
		c.head = s
	}
	c.tail = s
}

func (c *cpuCache) unlink(s int32) {
	e := &c.ents[s]
	if e.prev >= 0 {
		c.ents[e.prev].next = e.next
	} else {
		c.head = e.next
	}
	if e.next >= 0 {
		c.ents[e.next].prev = e.prev
	} else {
		c.tail = e.prev
	}
	e.prev, e.next = -1, -1
}

// offload moves the blocks the GPU just evicted to the CPU tier and
// publishes what vLLM's offloading publishes: BlockStored with medium CPU
// for the blocks new to it (location only: the GPU's block hashes, no
// tokens, sent while the GPU's still name them), the GPU's BlockRemoved,
// then BlockRemoved with medium CPU for what the CPU tier evicted.
func (w *worker) offload(evicted []uint64) {
	// The events go out stores first, removals last, so they carry the
	// batch's net effect: a block taken and dropped within it is stored
	// then removed, one dropped and taken back is not announced at all.
	before := make(map[uint64]bool, len(evicted)) // held when the batch began
	var puts, drops []uint64
	for _, h := range evicted {
		if _, ok := before[h]; !ok {
			_, before[h] = w.cpu.index[h]
		}
		n := len(drops)
		var isNew bool
		if drops, isNew = w.cpu.put(h, drops); isNew {
			puts = append(puts, h)
		}
		for _, x := range drops[n:] {
			if _, ok := before[x]; !ok {
				before[x] = true
			}
		}
	}
	stored := w.cpuStored[:0]
	dropped := w.cpuDropped[:0]
	for _, h := range puts {
		if _, held := w.cpu.index[h]; held && !before[h] {
			before[h] = true // announced once
			stored = append(stored, kvindex.StoredBlock{EngineHash: h})
		}
	}
	for _, x := range drops {
		if _, held := w.cpu.index[x]; !held && before[x] {
			before[x] = false // announced once
			dropped = append(dropped, x)
		}
	}
	if w.onEvent != nil {
		if len(stored) > 0 {
			w.onEvent(kvindex.Event{Kind: kvindex.Stored, BlockSize: w.cfg.BlockSize, Medium: kvindex.MediumCPU, Blocks: stored})
		}
		w.onEvent(kvindex.Event{Kind: kvindex.Removed, BlockSize: w.cfg.BlockSize, RemovedHashes: evicted})
		if len(dropped) > 0 {
			w.onEvent(kvindex.Event{Kind: kvindex.Removed, BlockSize: w.cfg.BlockSize, Medium: kvindex.MediumCPU, RemovedHashes: dropped})
		}
	}
	w.cpuStored, w.cpuDropped = stored[:0], dropped[:0]
}

// reloadTime is how long loading tokens from the CPU tier takes.
func (w *worker) reloadTime(tokens int) time.Duration {
	return time.Duration(float64(tokens) / w.cfg.CPUReloadTokensPerSec * float64(time.Second))
}

// cpuHits returns how many of a's blocks after its first hit GPU blocks the
// CPU tier can give, at most limit, and makes them the most recently used.
func (w *worker) cpuHits(a *active, hit, limit int) int {
	if w.cpu == nil || limit <= hit {
		return 0
	}
	n := w.cpu.prefix(a.keys[hit:limit])
	for _, k := range a.keys[hit : hit+n] {
		w.cpu.touch(k)
	}
	return n
}

// reloaded registers a's blocks [from, to), just loaded from the CPU tier,
// in the GPU cache, and publishes them as stored (with their tokens, like
// any block the GPU caches). The caller allocated them as private blocks.
func (w *worker) reloaded(a *active, from, to int) {
	bs := w.cfg.BlockSize
	var blocks []kvindex.StoredBlock
	first := -1
	flush := func() {
		if first >= 0 && w.onEvent != nil {
			ev := kvindex.Event{Kind: kvindex.Stored, BlockSize: bs, Blocks: blocks}
			if first > 0 {
				ev.HasParent, ev.Parent = true, a.keys[first-1]
			}
			w.onEvent(ev)
		}
		blocks, first = nil, -1
	}
	for i := from; i < to; i++ {
		slot, fresh := w.cache.register(a.keys[i])
		a.slots = append(a.slots, slot)
		a.anon--
		if !fresh {
			flush()
			continue
		}
		if first < 0 {
			first = i
		}
		blocks = append(blocks, kvindex.StoredBlock{EngineHash: a.keys[i], Tokens: a.req.Tokens[i*bs : (i+1)*bs]})
	}
	flush()
}
