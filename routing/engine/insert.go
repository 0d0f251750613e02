package engine

import (
	"github.com/kvbandit/kvbandit/routing"

	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/slots"
)

// This file holds the approximate index's inserts: what a committed
// decision (or a peer's) adds to the KV index for ranks without trusted
// KV events, bounded per prompt, per rank and engine-wide, and applied off
// the request path by the index goroutine.

// insert is one approximate index insert queued off the request path.
type insert struct {
	worker kvindex.WorkerID
	bs     int
	keys   []uint64
	at     time.Time
}

// insertQueue bounds the approximate inserts waiting for the index
// goroutine; beyond it inserts are dropped and counted.
const insertQueue = 4096

// bucket is a token bucket of units (blocks engine-wide, tokens per rank)
// per second with a burst of one second's worth; rate <= 0 is unbounded.
// Its owner serialises it.
type bucket struct {
	rate   float64 // units per second
	blocks float64 // units available, at most rate
	at     time.Time
}

// avail refills the bucket to now and returns the whole units it holds
// (or want when unbounded), at most want.
func (b *bucket) avail(want int, now time.Time) int {
	if b.rate <= 0 {
		return want
	}
	if dt := now.Sub(b.at); dt > 0 || b.at.IsZero() {
		b.blocks = min(b.rate, b.blocks+b.rate*dt.Seconds())
		if b.at.IsZero() {
			b.blocks = b.rate
		}
		b.at = now
	}
	return min(want, int(b.blocks))
}

// spend takes n units that avail granted.
func (b *bucket) spend(n int) {
	if b.rate > 0 {
		b.blocks -= float64(n)
	}
}

// insertBudget is the engine-wide bucket of InsertBlocksPerSecond.
type insertBudget struct {
	mu      sync.Mutex
	b       bucket
	limited atomic.Int64 // blocks not inserted for want of budget
}

// take returns how many of want blocks may be inserted at now (a prefix of
// them), at most allow (the rank's own budget), spends them, and counts the
// rest as limited.
func (b *insertBudget) take(want, allow int, now time.Time) int {
	b.mu.Lock()
	got := b.b.avail(allow, now)
	b.b.spend(got)
	b.mu.Unlock()
	if got < want {
		b.limited.Add(int64(want - got))
	}
	return got
}

// rankState is the engine's state of one data-parallel rank of an
// endpoint: its slot (the same as its routing.Rank's) and index worker.
type rankState struct {
	slot   *slots.Slot
	worker kvindex.WorkerID
	// eventFed is set when the rank's KV events keep the index exact; it
	// then gets no approximate inserts.
	eventFed atomic.Bool

	// recent remembers the last chains inserted into the approximate index
	// for this rank, so that a prompt extending one of them (an agent's
	// next turn, a shared system prompt) only inserts its new blocks: the
	// index stamps entries to the second, so a refresh within the same
	// second changes nothing.
	recentMu sync.Mutex
	recent   [4]recentChain
	recentAt int
	// budget is the rank's InsertTokensPerRank bucket, in tokens (under
	// recentMu).
	budget bucket
}

type recentChain struct {
	keys []uint64
	at   time.Time
}

// fresh returns the keys not inserted for this rank within the last
// second (those after the longest prefix shared with a recent chain), cut
// to the count the rank's budget (blocks of bs tokens) and b allow, and
// records what it returns as inserted at now.
func (r *rankState) fresh(keys []uint64, bs int, now time.Time, b *insertBudget) []uint64 {
	r.recentMu.Lock()
	defer r.recentMu.Unlock()
	skip := 0
	for i := range r.recent {
		c := &r.recent[i]
		if c.keys == nil || now.Sub(c.at) >= time.Second || now.Before(c.at) {
			continue
		}
		skip = max(skip, slots.CommonPrefix(keys, c.keys))
	}
	if skip == len(keys) {
		r.record(keys, now)
		return nil
	}
	want := len(keys) - skip
	got := b.take(want, r.budget.avail(want*bs, now)/bs, now)
	r.budget.spend(got * bs)
	if skip+got > 0 {
		r.record(keys[:skip+got], now)
	}
	return keys[skip : skip+got]
}

func (r *rankState) record(keys []uint64, now time.Time) {
	r.recent[r.recentAt] = recentChain{keys: keys, at: now}
	r.recentAt = (r.recentAt + 1) % len(r.recent)
}

// insertApprox records, for a rank without trusted KV events, that its
// worker now caches keys (approximate mode): a committed decision's prompt
// ([Engine.Pick]) or a peer replica's ([Engine.StartRemote]). Keys already
// inserted for the rank within the last second are skipped, and the rest
// are bounded by Options.MaxInsertBlocks, InsertTokensPerRank and
// InsertBlocksPerSecond. keys is retained.
func (e *Engine) insertApprox(rs *rankState, bs int, keys []uint64, now time.Time) {
	if rs.eventFed.Load() || len(keys) == 0 {
		return
	}
	if m := e.opts.MaxInsertBlocks; m > 0 && len(keys) > m {
		e.budget.limited.Add(int64(len(keys) - m))
		keys = keys[:m]
	}
	fresh := rs.fresh(keys, bs, now, &e.budget)
	if len(fresh) == 0 {
		return
	}
	if e.inserts == nil {
		_ = e.index.InsertApprox(rs.worker, bs, fresh, now)
		return
	}
	select {
	case e.inserts <- insert{rs.worker, bs, fresh, now}:
	default:
		e.insertsDrop.Add(1)
	}
}

// applyInserts is the index goroutine: it applies approximate inserts in
// decision order.
func (e *Engine) applyInserts() {
	defer close(e.insertsDone)
	for in := range e.inserts {
		_ = e.index.InsertApprox(in.worker, in.bs, in.keys, in.at)
	}
}

// ApplyKVEvent feeds one KV event of an endpoint's rank (-1 for a
// single-rank endpoint) into the index. Whether the endpoint's events are
// complete (so approximate inserts stop) is said with TrustKVEvents. Events
// of one rank must be applied in order (the caller's
// per-endpoint consumer does that). Errors are the index's (unknown parent,
// block size mismatch, unknown endpoint).
func (e *Engine) ApplyKVEvent(ep routing.EndpointKey, rank int, ev kvindex.Event) error {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return fmt.Errorf("%w: %s", kvindex.ErrUnknownWorker, ep)
	}
	i := max(rank, 0)
	if i >= len(st.ranks) {
		return fmt.Errorf("%w: %s rank %d of %d", kvindex.ErrUnknownWorker, ep, rank, len(st.ranks))
	}
	return e.index.Apply(st.ranks[i].worker, ev)
}

// TrustKVEvents says whether an endpoint's KV events can be trusted to
// describe its whole cache (no gap since a known state). A trusted endpoint
// gets no approximate inserts; an untrusted one is indexed approximately
// again, on top of what its events said, until it is trusted again.
func (e *Engine) TrustKVEvents(ep routing.EndpointKey, trusted bool) {
	if st, ok := e.snap.Load().byKey[ep]; ok {
		for _, rs := range st.ranks {
			rs.eventFed.Store(trusted)
		}
	}
}

// InsertBlocksLimited counts the blocks approximate inserts left out
// for Options.MaxInsertBlocks or InsertBlocksPerSecond.
func (e *Engine) InsertBlocksLimited() int64 { return e.budget.limited.Load() }

// DroppedInserts counts approximate inserts dropped because the index
// goroutine fell behind.
func (e *Engine) DroppedInserts() int64 { return e.insertsDrop.Load() }
