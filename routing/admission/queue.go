package admission

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
)

// Errors returned by [Queue.Admit]. Each wraps [ErrRejected]; the engine
// wraps them with routing.ErrOverloaded (HTTP 429).
var (
	// ErrRejected is the common cause of every admission rejection.
	ErrRejected = errors.New("admission rejected")
	// ErrShed: the request is sheddable (priority < 0) and the system is
	// saturated, so it is rejected instead of queued.
	ErrShed = fmt.Errorf("%w: sheddable request shed while saturated", ErrRejected)
	// ErrQueueFull: the system is saturated and MaxQueued requests are
	// already waiting.
	ErrQueueFull = fmt.Errorf("%w: admission queue full", ErrRejected)
	// ErrWaitExceeded: the request waited MaxWait without being admitted.
	ErrWaitExceeded = fmt.Errorf("%w: admission queue wait exceeded", ErrRejected)
)

// Saturation reports whether every candidate endpoint is saturated, in
// which case new work should wait. Saturated is called on admission and on
// every admission attempt during [Queue.Wake], possibly from many
// goroutines at once and sometimes under the queue's lock: it must be
// quick, must not block and must not call the Queue.
type Saturation interface {
	Saturated() bool
}

// SaturationFunc adapts a function to [Saturation].
type SaturationFunc func() bool

var _ Saturation = SaturationFunc(nil)

// Saturated implements [Saturation].
func (f SaturationFunc) Saturated() bool { return f() }

// Item is what the queue needs to know about one request. It carries plain
// values so that this package does not depend on routing; the engine fills
// it from routing.Request and routing.Hints.
type Item struct {
	// Priority: higher is more urgent; below 0 the request is sheddable
	// (routing.Hints.Sheddable: Priority < 0 when a priority was given, so
	// pass 0 when none was).
	Priority int
	// HeadStart is Dynamo's priority_jump (routing.Hints.HeadStart):
	// max(priority, 0) seconds, or latency_sensitivity seconds when no
	// priority was given. Negative values count as 0. It moves the
	// request's effective arrival earlier (fcfs) and raises its weight to
	// 1 + HeadStart in seconds (wspt).
	HeadStart time.Duration
	// Cost is the expected processing cost for wspt: the prompt tokens the
	// request is expected to prefill (ISL minus expected cached tokens).
	// Values below 1 (and NaN) count as 1. Ignored by fcfs.
	Cost float64
	// Arrival is when the request reached kvbandit; the zero value means
	// the queue clock's Now at Admit.
	Arrival time.Time
	// Deadline is when the request's TTFT objective runs out (arrival +
	// objective); the zero value means no objective. It breaks ties of
	// the policy's key: the earlier deadline first, then requests without
	// one. Priority (the head start) stays the ordering key, so an
	// objective never lets a request overtake a more urgent one.
	Deadline time.Time
	// OnAdmit, when set, runs exactly once if and only if Admit is about
	// to return nil, at the moment of admission and before the queue tests
	// saturation for anyone else. Book the request's load here (Dynamo
	// books it before the next busy check) so a Wake does not admit more
	// than the endpoints can take. It may run in another request's
	// goroutine, under the queue's lock, and concurrently with the OnAdmit
	// of a request admitted on the lock-free path: it must be safe for
	// concurrent use, quick, and must not block, panic or call the Queue.
	OnAdmit func()
}

// Stats is a snapshot of the queue's counters, for metrics.
type Stats struct {
	// Depth is the number of requests waiting now.
	Depth int
	// AdmittedImmediately counts requests admitted without waiting,
	// including every request while the queue is disabled.
	AdmittedImmediately uint64
	// AdmittedAfterWait counts requests admitted after waiting.
	AdmittedAfterWait uint64
	// Shed counts ErrShed rejections.
	Shed uint64
	// Full counts ErrQueueFull rejections.
	Full uint64
	// TimedOut counts ErrWaitExceeded rejections.
	TimedOut uint64
	// Cancelled counts requests whose context ended before they were
	// admitted (while waiting, or before they could be queued).
	Cancelled uint64
}

// Queue is the admission queue. Create it with [New]; it is safe for
// concurrent use.
type Queue struct {
	cfg Config
	clk clock.Clock
	sat Saturation

	// depth mirrors len(waiting) so the fast paths need no lock.
	depth atomic.Int64

	mu      sync.Mutex
	waiting waitHeap
	seq     uint64

	admittedNow  atomic.Uint64
	admittedWait atomic.Uint64
	shed         atomic.Uint64
	full         atomic.Uint64
	timedOut     atomic.Uint64
	cancelled    atomic.Uint64
}

// New returns a queue for cfg (defaults applied) on clk (nil: the real
// clock), asking sat whether the system is saturated. sat may be nil only
// when cfg disables the queue.
func New(cfg Config, clk clock.Clock, sat Saturation) (*Queue, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("admission: %w", err)
	}
	if cfg.Enabled() && sat == nil {
		return nil, errors.New("admission: a Saturation is required when the queue is enabled")
	}
	q := &Queue{cfg: cfg.WithDefaults(), clk: clock.Or(clk), sat: sat}
	q.waiting.wspt = q.cfg.Policy == PolicyWSPT
	return q, nil
}

// Config returns the queue's configuration with defaults applied.
func (q *Queue) Config() Config { return q.cfg }

// Admit decides whether the request described by it may proceed to routing
// now, waiting in the queue if needed. It returns:
//
//   - nil, at once, when the queue is disabled, or when the system is not
//     saturated and nobody is queued (see the package doc on fairness);
//   - nil after waiting, once [Queue.Wake] (or another Admit) admits it;
//   - [ErrShed] at once when the system is saturated and it.Priority < 0;
//   - [ErrQueueFull] at once when the system is saturated and MaxQueued
//     requests are waiting;
//   - [ErrWaitExceeded] when it waited MaxWait on the queue's clock;
//   - ctx.Err() when ctx ends while it waits; the waiter is removed.
//
// A request admitted at the same instant its context ends gets nil (its
// OnAdmit has run); the caller then notices the context itself.
func (q *Queue) Admit(ctx context.Context, it Item) error {
	if !q.cfg.Enabled() {
		return q.admitNow(&it)
	}
	// Fast path without the lock: nobody queued and room now.
	if q.depth.Load() == 0 && !q.sat.Saturated() {
		return q.admitNow(&it)
	}

	q.mu.Lock()
	// Admit earlier waiters first (a Wake may be due); if the queue then
	// drains and there is room, the newcomer goes through.
	if !q.drainLocked() && !q.sat.Saturated() {
		q.mu.Unlock()
		return q.admitNow(&it)
	}
	// Saturated (the drain stopped on saturation, or the check above).
	if it.Priority < 0 {
		q.mu.Unlock()
		q.shed.Add(1)
		return ErrShed
	}
	if len(q.waiting.items) >= q.cfg.MaxQueued {
		q.mu.Unlock()
		q.full.Add(1)
		return ErrQueueFull
	}
	if err := ctx.Err(); err != nil { // gave up before waiting
		q.mu.Unlock()
		q.cancelled.Add(1)
		return err
	}
	w := q.enqueueLocked(&it)
	q.mu.Unlock()

	var err error
	select {
	case <-w.done:
		err = w.err
	case <-ctx.Done():
		q.mu.Lock()
		if w.index >= 0 { // still queued: we remove it
			heap.Remove(&q.waiting, w.index)
			q.depth.Add(-1)
			w.timer.Stop()
			w.left = q.clk.Now()
			w.err = ctx.Err()
			q.cancelled.Add(1)
		}
		// Otherwise it was admitted or timed out first; keep that result.
		err = w.err
		q.mu.Unlock()
	}
	if q.cfg.OnWait != nil {
		q.cfg.OnWait(w.left.Sub(w.queued))
	}
	return err
}

// Wake admits queued requests, in policy order, while the system is not
// saturated. Call it whenever saturation may have eased: a prefill
// completed, a decision's Done ran, the endpoint set or scraped load
// changed. It never blocks on waiters and is cheap when nobody is queued.
func (q *Queue) Wake() {
	if q.depth.Load() == 0 {
		return
	}
	q.mu.Lock()
	q.drainLocked()
	q.mu.Unlock()
}

// Stats returns a snapshot of the counters.
func (q *Queue) Stats() Stats {
	return Stats{
		Depth:               int(q.depth.Load()),
		AdmittedImmediately: q.admittedNow.Load(),
		AdmittedAfterWait:   q.admittedWait.Load(),
		Shed:                q.shed.Load(),
		Full:                q.full.Load(),
		TimedOut:            q.timedOut.Load(),
		Cancelled:           q.cancelled.Load(),
	}
}

func (q *Queue) admitNow(it *Item) error {
	if it.OnAdmit != nil {
		it.OnAdmit()
	}
	q.admittedNow.Add(1)
	return nil
}

// drainLocked admits waiters in order while not saturated. It reports
// whether anyone is still waiting (which implies saturation was observed).
func (q *Queue) drainLocked() bool {
	for len(q.waiting.items) > 0 {
		if q.sat.Saturated() {
			return true
		}
		w := heap.Pop(&q.waiting).(*waiter)
		q.depth.Add(-1)
		w.timer.Stop()
		w.left = q.clk.Now()
		if w.onAdmit != nil {
			w.onAdmit()
		}
		q.admittedWait.Add(1)
		close(w.done)
	}
	return false
}

func (q *Queue) enqueueLocked(it *Item) *waiter {
	now := q.clk.Now()
	arrival := it.Arrival
	if arrival.IsZero() {
		arrival = now
	}
	head := max(it.HeadStart, 0)
	q.seq++
	w := &waiter{
		effective: arrival.Add(-head),
		deadline:  it.Deadline,
		seq:       q.seq,
		onAdmit:   it.OnAdmit,
		queued:    now,
		done:      make(chan struct{}),
		index:     -1,
	}
	if q.waiting.wspt {
		cost := it.Cost
		if !(cost >= 1) { // also catches NaN
			cost = 1
		}
		w.wsptKey = (1 + head.Seconds()) / cost
	}
	heap.Push(&q.waiting, w)
	q.depth.Add(1)
	// The clock must not run the callback synchronously inside AfterFunc
	// (neither clock.Real nor clock.Virtual does): q.mu is held.
	w.timer = q.clk.AfterFunc(q.cfg.MaxWait, func() { q.expire(w) })
	return w
}

func (q *Queue) expire(w *waiter) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if w.index < 0 { // admitted or cancelled already
		return
	}
	heap.Remove(&q.waiting, w.index)
	q.depth.Add(-1)
	w.left = q.clk.Now()
	w.err = ErrWaitExceeded
	q.timedOut.Add(1)
	close(w.done)
}

// waiter is one queued request. Fields after index are written under q.mu
// before done is closed.
type waiter struct {
	effective time.Time // arrival − head start
	wsptKey   float64   // (1 + head start s) / max(1, cost); wspt only
	deadline  time.Time // zero: no objective
	seq       uint64    // enqueue order, the final tie-break
	onAdmit   func()
	queued    time.Time
	done      chan struct{}
	index     int // position in the heap; -1 once removed
	timer     clock.Timer
	left      time.Time
	err       error
}

// waitHeap orders waiters so that the next one to admit is at the root.
type waitHeap struct {
	items []*waiter
	wspt  bool
}

func (h *waitHeap) Len() int { return len(h.items) }

func (h *waitHeap) Less(i, j int) bool {
	a, b := h.items[i], h.items[j]
	if h.wspt && a.wsptKey != b.wsptKey {
		return a.wsptKey > b.wsptKey
	}
	if !a.effective.Equal(b.effective) {
		return a.effective.Before(b.effective)
	}
	if !a.deadline.Equal(b.deadline) {
		if a.deadline.IsZero() || b.deadline.IsZero() {
			return b.deadline.IsZero()
		}
		return a.deadline.Before(b.deadline)
	}
	return a.seq < b.seq
}

func (h *waitHeap) Swap(i, j int) {
	h.items[i], h.items[j] = h.items[j], h.items[i]
	h.items[i].index = i
	h.items[j].index = j
}

func (h *waitHeap) Push(x any) {
	w := x.(*waiter)
	w.index = len(h.items)
	h.items = append(h.items, w)
}

func (h *waitHeap) Pop() any {
	n := len(h.items)
	w := h.items[n-1]
	h.items[n-1] = nil
	h.items = h.items[:n-1]
	w.index = -1
	return w
}
