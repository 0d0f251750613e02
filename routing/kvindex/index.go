package kvindex

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
)

// WorkerID is the index's compact name for one (endpoint, data-parallel
// rank) pair; see [Index.Worker]. The zero WorkerID names no worker. IDs are
// never reused, so a stale ID cannot alias a newer worker.
type WorkerID uint32

// Match is one worker's overlap with a request.
type Match struct {
	Worker WorkerID
	// Blocks is the number of leading request blocks the worker holds,
	// counted from the first and stopping at the first it lacks (>= 1).
	Blocks int
}

// Defaults for [Options].
const (
	DefaultTTL              = 120 * time.Second
	DefaultMaxEntries       = 1 << 20
	DefaultPruneTargetRatio = 0.8
	// DefaultMaxEventEntries is one worker's cap on event-fed blocks: the
	// approximate index's cap (Dynamo's --router-max-tree-size default),
	// above what one GPU's KV cache holds (vLLM's largest are a few
	// hundred thousand blocks; 2^20 blocks of 16 tokens are 16M tokens).
	DefaultMaxEventEntries = 1 << 20
	// DefaultMaxBlockSizes caps the key spaces alive at once. A fleet uses
	// one or two block sizes.
	DefaultMaxBlockSizes = 8
	// WorkerBlockSizes is how many block sizes one worker's events may use
	// at once. An engine reports one (vLLM's main KV cache group, SGLang's
	// page size); the second leaves room for a reconfigured worker whose
	// restart went unnoticed.
	WorkerBlockSizes = 2
)

// Options configure an [Index]. The zero value gives Dynamo's defaults.
type Options struct {
	// Clock drives approximate-mode expiry; nil means the real clock.
	Clock clock.Clock
	// TTL is how long an approximate entry lives after its last insert,
	// rounded up to whole seconds (0: DefaultTTL). An entry goes between
	// TTL and TTL+1s after it, as stamps have one-second resolution.
	TTL time.Duration
	// MaxEntries caps approximate (block, worker) entries over all block
	// sizes, the unit Dynamo's pruner keeps one timer for (0:
	// DefaultMaxEntries). Event-fed entries have their own cap,
	// MaxEventEntries.
	MaxEntries int
	// MaxEventEntries caps one worker's event-fed blocks (the engine block
	// hashes indexed for it, over all block sizes; each is at most one
	// entry) (0: DefaultMaxEventEntries). A Stored event is applied up to
	// the first block that would go over it and then rejected with
	// ErrWorkerFull: the worker's view is incomplete from then on, and
	// frees room only as the engine removes blocks. An engine holds what
	// its KV cache holds, so only a hostile or broken peer gets there.
	MaxEventEntries int
	// MaxBlockSizes caps the key spaces (distinct block sizes) alive at
	// once (0: DefaultMaxBlockSizes). A space no worker's events use and
	// no entry is left in is reclaimed when a new block size needs room;
	// when none is, the new block size is rejected with
	// ErrTooManyBlockSizes. Each worker's events may also use at most
	// WorkerBlockSizes of them.
	MaxBlockSizes int
	// PruneTargetRatio is the fraction of MaxEntries kept when the cap is
	// exceeded, dropping least recently inserted entries first (0:
	// DefaultPruneTargetRatio). It must be in (0, 1].
	PruneTargetRatio float64
}

// Errors returned by the index. They are wrapped with context; match them
// with errors.Is.
var (
	// ErrUnknownWorker: the WorkerID was never handed out or its endpoint
	// was removed.
	ErrUnknownWorker = errors.New("kvindex: unknown worker")
	// ErrUnknownParent: a Stored event's parent is not indexed for that
	// worker; the whole event was rejected.
	ErrUnknownParent = errors.New("kvindex: unknown parent block")
	// ErrUnknownBlock: some hashes of a Removed event were not indexed for
	// that worker; the others were removed.
	ErrUnknownBlock = errors.New("kvindex: unknown block")
	// ErrBlockSize: a block's token count differs from the event's block
	// size, or the block size is not positive; the event was rejected.
	ErrBlockSize = errors.New("kvindex: block size mismatch")
	// ErrInvalidEvent: an unknown event kind or an engine hash repeated in
	// one Stored event; the event was rejected.
	ErrInvalidEvent = errors.New("kvindex: invalid event")
	// ErrWorkerFull: a Stored event would take the worker over
	// MaxEventEntries; the blocks before the first that did not fit were
	// applied, the others were not. The worker's view is incomplete.
	ErrWorkerFull = errors.New("kvindex: worker's event-fed blocks at their cap")
	// ErrTooManyBlockSizes: a block size new to the worker (or to the
	// index) would go over WorkerBlockSizes (or MaxBlockSizes); the event
	// or approximate insert was rejected.
	ErrTooManyBlockSizes = errors.New("kvindex: too many block sizes")
	// ErrTierFull: a lower-tier (CPU, disk) Stored event would take the
	// worker's blocks of that medium over MaxEventEntries, or its block
	// sizes on that medium over WorkerBlockSizes; the blocks before the
	// first that did not fit were applied. The GPU view is unaffected.
	ErrTierFull = errors.New("kvindex: worker's lower-tier blocks at their cap")
)

// Index maps chained block keys (see [AppendBlockKeys]) to the workers whose
// KV cache holds them. Each block size has its own key space, created on
// first write; all methods take the block size. It is safe for concurrent
// use; see the package documentation for what may run in parallel.
type Index struct {
	clk             clock.Clock
	epoch           time.Time
	ttl             uint32 // seconds
	maxEntries      int64
	pruneTarget     int64
	maxEventEntries int
	maxBlockSizes   int
	seed            uint64

	mu      sync.Mutex // guards byName, nextID, space.users and the copy-on-write publication of workers and spaces
	byName  map[workerName]WorkerID
	nextID  WorkerID
	workers atomic.Pointer[[]*worker] // indexed by WorkerID; append-only
	spaces  atomic.Pointer[[]*space]

	entries        atomic.Int64
	approxEntries  atomic.Int64
	unknownParent  atomic.Uint64
	unknownRemoved atomic.Uint64
	rejected       atomic.Uint64
	expired        atomic.Uint64
	pruned         atomic.Uint64
	overCapacity   atomic.Uint64
	blockSizes     atomic.Uint64
	tierEntries    [numMedia]atomic.Int64 // lower-tier engine hashes per medium

	approx approxState
}

type workerName struct {
	endpoint string
	rank     int
}

type worker struct {
	id       WorkerID
	endpoint string
	rank     int
	removed  atomic.Bool
	size     atomic.Int64 // entries held
	approx   atomic.Int64 // of which approximate

	mu sync.Mutex // serialises Apply and purges of this worker
	// engine maps, per block size, the engine's opaque block hash to our
	// key. A map is never empty: the last removal deletes it. Each map
	// holds a reference to its block size's space (space.users).
	engine map[int]map[uint64]uint64
	hashes int // engine hashes over all of engine's maps, <= maxEventEntries

	// The lower tiers (host memory, disk): written under mu and tmu, read
	// by TierOverlap under tmu's read lock. tierSize counts their engine
	// hashes per medium, for a lock-free "none" on the hot path.
	tmu      sync.RWMutex
	tiers    tierState
	tierSize [numMedia]atomic.Int64
}

// space is the key space of one block size. A space is made on first
// write and lives until it is reclaimed for another block size (see
// Index.spaceLocked), which needs it unused and empty.
type space struct {
	blockSize int
	seed      uint64
	users     int // workers whose events use it (an engine map); guarded by Index.mu
	shards    [numShards]shard
	aq        approxQueue // guarded by Index.approx.mu
}

// New returns an empty index. Call Close when done with it to stop the
// approximate-mode expiry timer.
func New(opts Options) (*Index, error) {
	if opts.TTL < 0 {
		return nil, fmt.Errorf("kvindex: TTL %v is negative", opts.TTL)
	}
	if opts.MaxEntries < 0 {
		return nil, fmt.Errorf("kvindex: MaxEntries %d is negative", opts.MaxEntries)
	}
	if opts.MaxEventEntries < 0 {
		return nil, fmt.Errorf("kvindex: MaxEventEntries %d is negative", opts.MaxEventEntries)
	}
	if opts.MaxBlockSizes < 0 {
		return nil, fmt.Errorf("kvindex: MaxBlockSizes %d is negative", opts.MaxBlockSizes)
	}
	if r := opts.PruneTargetRatio; r < 0 || r > 1 || math.IsNaN(r) {
		return nil, fmt.Errorf("kvindex: PruneTargetRatio %v is outside (0, 1]", r)
	}
	if opts.TTL == 0 {
		opts.TTL = DefaultTTL
	}
	if opts.MaxEntries == 0 {
		opts.MaxEntries = DefaultMaxEntries
	}
	if opts.PruneTargetRatio == 0 {
		opts.PruneTargetRatio = DefaultPruneTargetRatio
	}
	if opts.MaxEventEntries == 0 {
		opts.MaxEventEntries = DefaultMaxEventEntries
	}
	if opts.MaxBlockSizes == 0 {
		opts.MaxBlockSizes = DefaultMaxBlockSizes
	}
	ttl := (opts.TTL + time.Second - 1) / time.Second
	if ttl > math.MaxUint32/2 {
		ttl = math.MaxUint32 / 2
	}
	clk := clock.Or(opts.Clock)
	ix := &Index{
		clk:             clk,
		epoch:           clk.Now(),
		ttl:             uint32(ttl),
		maxEntries:      int64(opts.MaxEntries),
		pruneTarget:     int64(float64(opts.MaxEntries) * opts.PruneTargetRatio),
		maxEventEntries: opts.MaxEventEntries,
		maxBlockSizes:   opts.MaxBlockSizes,
		// The table seed keeps crafted prompts from piling keys into one
		// probe run; it never changes a result.
		seed:   rand.Uint64(),
		byName: make(map[workerName]WorkerID),
		nextID: 1,
	}
	ix.workers.Store(&[]*worker{nil})
	ix.spaces.Store(&[]*space{})
	return ix, nil
}

// Close stops the approximate-mode expiry timer and waits for a running
// sweep. The index stays usable, but approximate entries no longer expire
// (the cap still applies).
func (ix *Index) Close() { ix.approx.close() }

// Worker returns the ID of (endpoint, rank), registering it on first use.
func (ix *Index) Worker(endpoint string, rank int) WorkerID {
	name := workerName{endpoint, rank}
	ix.mu.Lock()
	defer ix.mu.Unlock()
	if id, ok := ix.byName[name]; ok {
		return id
	}
	id := ix.nextID
	if id == spillTag {
		panic("kvindex: worker ids exhausted")
	}
	ix.nextID++
	ix.byName[name] = id
	// Readers only index below their snapshot's length, so appending in
	// place (when capacity allows) and publishing the longer header is safe.
	ws := append(*ix.workers.Load(), &worker{id: id, endpoint: endpoint, rank: rank})
	ix.workers.Store(&ws)
	return id
}

// Lookup returns the endpoint and rank of w; ok is false for an unknown or
// removed worker.
func (ix *Index) Lookup(w WorkerID) (endpoint string, rank int, ok bool) {
	wk := ix.worker(w)
	if wk == nil || wk.removed.Load() {
		return "", 0, false
	}
	return wk.endpoint, wk.rank, true
}

// RemoveEndpoint forgets every rank of endpoint: their entries are purged
// and their IDs become unknown. A later Worker call for the endpoint gets a
// new ID. It returns how many workers were removed.
func (ix *Index) RemoveEndpoint(endpoint string) int {
	var gone []*worker
	ix.mu.Lock()
	ws := *ix.workers.Load()
	for name, id := range ix.byName {
		if name.endpoint == endpoint {
			delete(ix.byName, name)
			gone = append(gone, ws[id])
		}
	}
	ix.mu.Unlock()
	for _, wk := range gone {
		wk.mu.Lock()
		wk.removed.Store(true)
		ix.clear(wk)
		wk.mu.Unlock()
	}
	return len(gone)
}

// Size returns the number of blocks w holds over all block sizes (its
// entries), the tie-break Dynamo calls tree size; 0 for an unknown or
// removed worker. It does not lock.
func (ix *Index) Size(w WorkerID) int {
	if wk := ix.worker(w); wk != nil {
		return int(wk.size.Load())
	}
	return 0
}

func (ix *Index) worker(w WorkerID) *worker {
	ws := *ix.workers.Load()
	if w == 0 || int(w) >= len(ws) {
		return nil
	}
	return ws[w]
}

func (ix *Index) space(blockSize int) *space {
	for _, sp := range *ix.spaces.Load() {
		if sp.blockSize == blockSize {
			return sp
		}
	}
	return nil
}

// spaceLocked returns the key space of blockSize, making it when there is
// none; event takes a reference for a worker's new engine map (see
// releaseSpace). At MaxBlockSizes spaces it reclaims the first that no
// worker's events use and that holds no entry, else it fails with
// ErrTooManyBlockSizes. The caller holds approx.mu: with it, and users at
// 0, nobody can add an entry to a space, so an empty one stays empty.
func (ix *Index) spaceLocked(blockSize int, event bool) (*space, error) {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	sps := *ix.spaces.Load()
	for _, sp := range sps {
		if sp.blockSize == blockSize {
			if event {
				sp.users++
			}
			return sp, nil
		}
	}
	next := make([]*space, 0, min(len(sps)+1, ix.maxBlockSizes))
	if len(sps) < ix.maxBlockSizes {
		next = append(next, sps...)
	} else {
		victim := slices.IndexFunc(sps, (*space).unused)
		if victim < 0 {
			return nil, fmt.Errorf("%w: block size %d: %d block sizes in use, limit %d",
				ErrTooManyBlockSizes, blockSize, len(sps), ix.maxBlockSizes)
		}
		next = append(append(next, sps[:victim]...), sps[victim+1:]...)
	}
	sp := &space{blockSize: blockSize, seed: ix.seed ^ uint64(blockSize)*0x9e3779b97f4a7c15}
	for i := range sp.shards {
		sp.shards[i].tab.seed = sp.seed
	}
	if event {
		sp.users = 1
	}
	next = append(next, sp)
	ix.spaces.Store(&next)
	return sp, nil
}

// unused reports whether no worker's events use sp and it holds no entry.
// The caller holds Index.mu and approx.mu.
func (sp *space) unused() bool {
	if sp.users > 0 {
		return false
	}
	for i := range sp.shards {
		sh := &sp.shards[i]
		sh.mu.RLock()
		n := sh.tab.n
		sh.mu.RUnlock()
		if n > 0 {
			return false
		}
	}
	return true
}

// releaseSpace drops a reference spaceLocked took, once the worker's
// engine map for its block size is gone.
func (ix *Index) releaseSpace(sp *space) {
	ix.mu.Lock()
	sp.users--
	ix.mu.Unlock()
}

func (sp *space) locate(k uint64) (uint64, *shard) {
	h := mix(k ^ sp.seed)
	return h, &sp.shards[h>>(64-shardBits)]
}

// Overlaps appends to dst one Match per worker holding keys[0], in
// ascending WorkerID order, and returns the extended slice. keys are the
// request's chained block keys for blockSize. A worker's Blocks is the
// length of the run of keys it holds starting at keys[0]; a worker holding
// only later keys is left out, like one holding none. It allocates only
// when dst lacks capacity.
//
// Overlaps reads without locking in the common case (see the package
// documentation) and runs beside writers; a Stored event applied meanwhile
// may be seen in part.
func (ix *Index) Overlaps(blockSize int, keys []uint64, dst []Match) []Match {
	if len(keys) == 0 {
		return dst
	}
	sp := ix.space(blockSize)
	if sp == nil {
		return dst
	}
	base := len(dst)
	h, sh := sp.locate(keys[0])
	sh.mu.RLock()
	e, ok := sh.tab.get(keys[0], h)
	if !ok {
		sh.mu.RUnlock()
		return dst
	}
	ids, sum := sh.members(&e)
	for _, id := range ids {
		dst = append(dst, Match{Worker: id})
	}
	sh.mu.RUnlock()
	// The active workers are those of ms with Blocks still 0: active counts
	// them and sum adds their fingerprints. A key whose workers have the
	// same sum changes nothing, which is the common case, decided from a
	// lock-free peek: a spilled entry stores its sum, and an inline one
	// equal to the last inline entry that matched the active set (same) is
	// recognised by one compare. Only a change takes the shard's read lock.
	ms := dst[base:]
	active := len(ms)
	last, _ := pack(e)
	same := e.ids[0] != spillTag
	i := 1
	for ; i < len(keys) && active > 0; i++ {
		h, sh := sp.locate(keys[i])
		if ids, stamps, found, ok := sh.peek(keys[i], h); ok {
			if !found {
				break
			}
			inline := !spilledWord(ids)
			if inline && same && ids == last {
				continue
			}
			var esum uint64
			if inline {
				esum = inlineSumWord(ids)
			} else {
				esum = spillSumWords(ids, stamps)
			}
			if esum == sum {
				last, same = ids, inline
				continue
			}
			if dropOne(ms, sum-esum, i) {
				active, sum = active-1, esum
				last, same = ids, inline
				continue
			}
		}
		sh.mu.RLock()
		e, found := sh.tab.get(keys[i], h)
		if !found {
			sh.mu.RUnlock()
			break
		}
		ids, _ := pack(e)
		inline := e.ids[0] != spillTag
		esum := e.spillSum()
		if inline {
			esum = inlineSum(&e)
		}
		if esum != sum {
			active, sum = retain(sh, &e, ms, esum, i, active, sum)
		}
		sh.mu.RUnlock()
		last, same = ids, inline && esum == sum
	}
	for j := range ms {
		if ms[j].Blocks == 0 {
			ms[j].Blocks = i
		}
	}
	return dst
}

func inlineSum(e *entry) uint64 {
	ids, _ := pack(*e)
	return inlineSumWord(ids)
}

// dropOne ends, at depth, the run of the active match whose fingerprint is
// diff, if there is one: when the active set's sum exceeds a key's by
// exactly one active worker's fingerprint, that worker is the only one
// missing from the key (see fingerprint).
func dropOne(ms []Match, diff uint64, depth int) bool {
	w, ok := fingerprintOwner(diff)
	if !ok {
		return false
	}
	lo, hi := 0, len(ms) // ms is sorted by worker
	for lo < hi {
		if mid := int(uint(lo+hi) >> 1); ms[mid].Worker < w {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo < len(ms) && ms[lo].Worker == w && ms[lo].Blocks == 0 {
		ms[lo].Blocks = depth
		return true
	}
	return false
}

// retain ends, at depth, the run of every active match whose worker does
// not hold e (sum esum), and returns the new active count and sum. The
// caller holds sh's read lock.
func retain(sh *shard, e *entry, ms []Match, esum uint64, depth, active int, sum uint64) (int, uint64) {
	if dropOne(ms, sum-esum, depth) {
		return active - 1, esum
	}
	ids, _ := sh.members(e)
	p := 0
	for j := range ms {
		if ms[j].Blocks != 0 {
			continue
		}
		w := ms[j].Worker
		for p < len(ids) && ids[p] < w {
			p++
		}
		if p < len(ids) && ids[p] == w {
			continue
		}
		ms[j].Blocks = depth
		active--
		sum -= fingerprint(w)
	}
	return active, sum
}

// Stats is a snapshot of the index's size and counters, for metrics.
type Stats struct {
	Workers        int    // registered, not removed
	Entries        int64  // (block, worker) pairs over all block sizes
	ApproxEntries  int64  // of which approximate
	Blocks         int64  // distinct keys over all block sizes
	UnknownParent  uint64 // Stored events rejected for an unknown parent
	UnknownRemoved uint64 // hashes in Removed events that were not indexed
	Rejected       uint64 // events rejected for block size or shape
	Expired        uint64 // approximate entries dropped by TTL
	Pruned         uint64 // approximate entries dropped by the cap
	OverCapacity   uint64 // Stored events cut short by MaxEventEntries
	// TooManyBlockSizes counts events and approximate inserts rejected
	// for a block size over WorkerBlockSizes or MaxBlockSizes.
	TooManyBlockSizes uint64
	Spaces            int // key spaces (block sizes) alive
	// CPUBlocks and DiskBlocks are the lower-tier blocks (engine hashes)
	// over all workers, from events with a CPU or disk medium.
	CPUBlocks, DiskBlocks int64
}

// Stats returns current sizes and counters. Blocks is summed shard by
// shard, so it is not an atomic snapshot under concurrent writes.
func (ix *Index) Stats() Stats {
	ix.mu.Lock()
	workers := len(ix.byName)
	ix.mu.Unlock()
	st := Stats{
		Workers:           workers,
		Entries:           ix.entries.Load(),
		ApproxEntries:     ix.approxEntries.Load(),
		UnknownParent:     ix.unknownParent.Load(),
		UnknownRemoved:    ix.unknownRemoved.Load(),
		Rejected:          ix.rejected.Load(),
		Expired:           ix.expired.Load(),
		Pruned:            ix.pruned.Load(),
		OverCapacity:      ix.overCapacity.Load(),
		TooManyBlockSizes: ix.blockSizes.Load(),
		CPUBlocks:         ix.tierEntries[MediumCPU].Load(),
		DiskBlocks:        ix.tierEntries[MediumDisk].Load(),
	}
	sps := *ix.spaces.Load()
	st.Spaces = len(sps)
	for _, sp := range sps {
		for i := range sp.shards {
			sh := &sp.shards[i]
			sh.mu.RLock()
			st.Blocks += int64(sh.tab.n)
			sh.mu.RUnlock()
		}
	}
	return st
}

// store makes wk hold key k as an event-fed entry.
func (ix *Index) store(sp *space, wk *worker, k uint64) {
	h, sh := sp.locate(k)
	sh.lock()
	defer sh.unlock() // counters move with the entry, so they never go negative
	added, old := sh.put(k, h, wk.id, eventStamp)
	switch {
	case added:
		ix.entries.Add(1)
		wk.size.Add(1)
	case old != 0: // an approximate entry becomes event-fed
		ix.approxEntries.Add(-1)
		wk.approx.Add(-1)
	}
}

func eventStamp(uint32, bool) uint32 { return 0 }

// unhold removes wk from key k if keep(stamp) is false; it reports whether
// it did.
func (ix *Index) unhold(sp *space, wk *worker, k uint64, keep func(uint32) bool) bool {
	h, sh := sp.locate(k)
	sh.lock()
	defer sh.unlock()
	removed, stamp := sh.drop(k, h, wk.id, keep)
	if removed {
		ix.entries.Add(-1)
		wk.size.Add(-1)
		if stamp != 0 {
			ix.approxEntries.Add(-1)
			wk.approx.Add(-1)
		}
	}
	return removed
}

func keepNone(uint32) bool { return false }

// clear drops every entry of wk. The caller holds wk.mu.
func (ix *Index) clear(wk *worker) {
	for bs, m := range wk.engine {
		sp := ix.space(bs) // alive: m holds a reference
		for _, k := range m {
			ix.unhold(sp, wk, k, keepNone)
		}
		ix.releaseSpace(sp)
	}
	wk.engine, wk.hashes = nil, 0
	ix.clearTiers(wk)
	ix.purgeApprox(wk)
}
