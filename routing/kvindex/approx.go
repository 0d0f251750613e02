package kvindex

import (
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
)

// sweepBatch bounds the entries one expiry sweep drops while holding the
// approximate-mode lock; the rest go in an immediate follow-up sweep.
const sweepBatch = 1 << 16

// approxState is the bookkeeping of approximate mode, shared by all block
// sizes. mu guards it and every space's approxQueue, and no space is
// reclaimed without it; lock order is worker.mu, then approxState.mu, then
// Index.mu, then a shard's mu.
type approxState struct {
	mu     sync.Mutex
	last   uint32 // the latest stamp queued: queues never go back in time
	timer  clock.Timer
	closed bool
	wg     sync.WaitGroup // a scheduled or running sweep
}

// qitem records that worker took key at stamp. It is stale once the
// worker's stamp for the key differs (refreshed, removed); stamp 0 marks
// an item already consumed.
type qitem struct {
	key    uint64
	worker WorkerID
	stamp  uint32
}

// approxQueue lists one space's approximate inserts in stamp order, oldest
// at head; stale items are skipped when met (lazy deletion).
type approxQueue struct {
	items []qitem
	head  int
}

// stamp converts t to whole seconds since the index was made, plus one, so
// that no approximate entry has the event-fed stamp 0.
func (ix *Index) stamp(t time.Time) uint32 {
	d := t.Sub(ix.epoch)
	if d < 0 {
		return 1
	}
	s := uint64(d/time.Second) + 1
	if limit := uint64(math.MaxUint32 - ix.ttl - 1); s > limit {
		s = limit
	}
	return uint32(s)
}

// InsertApprox records that worker w will hold the blocks keys (chained
// keys for blockSize, from the first block of a request) because the
// router sent the request there: Dynamo's approximate mode, for workers
// that publish no KV events. Each (key, w) entry expires TTL after the
// latest insert that named it (to the second), and when approximate
// entries exceed MaxEntries the least recently inserted are pruned, deeper
// blocks first, down to PruneTargetRatio of it.
//
// now should come from the index's clock. Stamps never go backwards: a now
// earlier than that of a previous insert is taken as that insert's time.
// Keys w already holds from KV events stay event-fed. A block size that
// would go over MaxBlockSizes is rejected with ErrTooManyBlockSizes.
// InsertApprox is safe to call concurrently; inserts are serialised
// internally.
func (ix *Index) InsertApprox(w WorkerID, blockSize int, keys []uint64, now time.Time) error {
	wk := ix.worker(w)
	if wk == nil {
		return fmt.Errorf("%w: %d", ErrUnknownWorker, w)
	}
	if blockSize <= 0 {
		return fmt.Errorf("%w: block size %d", ErrBlockSize, blockSize)
	}
	if len(keys) == 0 {
		return nil
	}
	st := ix.stamp(now)
	a := &ix.approx
	a.mu.Lock()
	defer a.mu.Unlock()
	if wk.removed.Load() {
		return fmt.Errorf("%w: %d (endpoint %s removed)", ErrUnknownWorker, w, wk.endpoint)
	}
	// Under approx.mu no space can be reclaimed, so one found without
	// Index.mu stays valid.
	sp := ix.space(blockSize)
	if sp == nil {
		var err error
		if sp, err = ix.spaceLocked(blockSize, false); err != nil {
			ix.blockSizes.Add(1)
			return err
		}
	}
	if st < a.last {
		st = a.last
	}
	a.last = st
	merge := func(old uint32, present bool) uint32 {
		if present && old == 0 {
			return 0 // event-fed stays event-fed
		}
		return st
	}
	for _, k := range keys {
		h, sh := sp.locate(k)
		sh.lock()
		isNew, old := sh.put(k, h, w, merge)
		if isNew {
			// Count under the shard lock, before an Apply of w can turn
			// the entry event-fed and uncount it.
			ix.entries.Add(1)
			ix.approxEntries.Add(1)
			wk.size.Add(1)
			wk.approx.Add(1)
		}
		sh.unlock()
		if !isNew && (old == 0 || old == st) {
			continue // event-fed, or already queued at st
		}
		sp.aq.items = append(sp.aq.items, qitem{key: k, worker: w, stamp: st})
	}
	ix.compactLocked(sp)
	ix.pruneLocked()
	ix.scheduleLocked()
	return nil
}

// dropItem removes the item's entry if the worker's stamp for the key is still
// it.stamp, and consumes the item. The caller holds approx.mu.
func (ix *Index) dropItem(sp *space, it *qitem) bool {
	st := it.stamp
	it.stamp = 0
	wk := ix.worker(it.worker)
	if wk == nil || st == 0 {
		return false
	}
	return ix.unhold(sp, wk, it.key, func(s uint32) bool { return s != st })
}

// oldestLocked returns the space whose queue starts with the oldest live
// item, after skipping consumed items at every head.
func (ix *Index) oldestLocked() (*space, uint32, bool) {
	var best *space
	var bestStamp uint32
	for _, sp := range *ix.spaces.Load() {
		q := &sp.aq
		for q.head < len(q.items) && q.items[q.head].stamp == 0 {
			q.head++
		}
		q.reclaim()
		if q.head < len(q.items) {
			if s := q.items[q.head].stamp; best == nil || s < bestStamp {
				best, bestStamp = sp, s
			}
		}
	}
	return best, bestStamp, best != nil
}

// reclaim drops the consumed prefix of the queue once it is most of it.
func (q *approxQueue) reclaim() {
	if q.head == len(q.items) {
		q.items, q.head = q.items[:0], 0
		return
	}
	if q.head >= 4096 && 2*q.head >= len(q.items) {
		n := copy(q.items, q.items[q.head:])
		q.items, q.head = q.items[:n], 0
	}
}

// pruneLocked enforces MaxEntries: it drops the least recently inserted
// approximate entries, and within one second the later-queued (deeper)
// ones first, until PruneTargetRatio of the cap remain.
func (ix *Index) pruneLocked() {
	if ix.approxEntries.Load() <= ix.maxEntries {
		return
	}
	for ix.approxEntries.Load() > ix.pruneTarget {
		sp, st, ok := ix.oldestLocked()
		if !ok {
			return
		}
		q := &sp.aq
		end := q.head
		for end < len(q.items) && (q.items[end].stamp == st || q.items[end].stamp == 0) {
			end++
		}
		for j := end - 1; j >= q.head && ix.approxEntries.Load() > ix.pruneTarget; j-- {
			if q.items[j].stamp != 0 && ix.dropItem(sp, &q.items[j]) {
				ix.pruned.Add(1)
			}
		}
	}
}

// compactLocked rebuilds a queue without stale items once they outnumber
// live entries, so refreshing hot prefixes cannot grow it without bound.
func (ix *Index) compactLocked(sp *space) {
	q := &sp.aq
	if len(q.items)-q.head <= 2*int(ix.approxEntries.Load())+4096 {
		return
	}
	out := q.items[:0]
	for _, it := range q.items[q.head:] {
		if it.stamp == 0 {
			continue
		}
		h, sh := sp.locate(it.key)
		sh.mu.RLock()
		var st uint32
		var ok bool
		if e, found := sh.tab.get(it.key, h); found {
			st, ok = sh.stampOf(&e, it.worker)
		}
		sh.mu.RUnlock()
		if ok && st == it.stamp {
			out = append(out, it)
		}
	}
	if cap(out) > 4*len(out)+4096 {
		out = append([]qitem(nil), out...)
	}
	q.items, q.head = out, 0
}

// scheduleLocked arms the expiry timer for the oldest live item, unless a
// sweep is already pending or the index is closed.
func (ix *Index) scheduleLocked() {
	a := &ix.approx
	if a.closed || a.timer != nil {
		return
	}
	_, st, ok := ix.oldestLocked()
	if !ok {
		return
	}
	// An item of stamp st is due once stamp(now) > st+ttl, i.e. at
	// epoch + (st+ttl) seconds: between TTL and TTL+1s after the insert.
	due := ix.epoch.Add(time.Duration(uint64(st)+uint64(ix.ttl)) * time.Second)
	d := max(due.Sub(ix.clk.Now()), 0)
	a.wg.Add(1)
	a.timer = ix.clk.AfterFunc(d, ix.sweep)
}

// sweep is the expiry timer's callback: it drops approximate entries whose
// TTL has passed and re-arms the timer.
func (ix *Index) sweep() {
	a := &ix.approx
	defer a.wg.Done()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.timer = nil
	if a.closed {
		return
	}
	now := uint64(ix.stamp(ix.clk.Now()))
	budget := sweepBatch
	for budget > 0 {
		sp, st, ok := ix.oldestLocked()
		if !ok || uint64(st)+uint64(ix.ttl) >= now {
			break
		}
		q := &sp.aq
		for q.head < len(q.items) && budget > 0 {
			it := &q.items[q.head]
			if it.stamp != 0 {
				if uint64(it.stamp)+uint64(ix.ttl) >= now {
					break
				}
				if ix.dropItem(sp, it) {
					ix.expired.Add(1)
				}
				budget--
			}
			q.head++
		}
	}
	for _, sp := range *ix.spaces.Load() {
		ix.compactLocked(sp)
	}
	ix.scheduleLocked()
}

// purgeApprox drops every approximate entry of wk.
func (ix *Index) purgeApprox(wk *worker) {
	a := &ix.approx
	a.mu.Lock()
	defer a.mu.Unlock()
	if wk.approx.Load() == 0 {
		return
	}
	for _, sp := range *ix.spaces.Load() {
		q := &sp.aq
		for j := q.head; j < len(q.items); j++ {
			it := &q.items[j]
			if it.worker != wk.id || it.stamp == 0 {
				continue
			}
			it.stamp = 0
			ix.unhold(sp, wk, it.key, isEventFed)
		}
	}
}

func isEventFed(stamp uint32) bool { return stamp == 0 }

func (a *approxState) close() {
	a.mu.Lock()
	a.closed = true
	if a.timer != nil && a.timer.Stop() {
		a.wg.Done()
	}
	a.timer = nil
	a.mu.Unlock()
	a.wg.Wait()
}
