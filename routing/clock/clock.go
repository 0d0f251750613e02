// Package clock provides the time source and scheduler that every timer,
// TTL and sweeper in kvbandit runs on, so that the same engine can run in
// real time (serve) or in virtual time (the benchmark and tests).
package clock

import (
	"container/heap"
	"sync"
	"time"
)

// Clock tells the time and schedules callbacks. Implementations are safe for
// concurrent use.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// AfterFunc runs f in its own goroutine (real clock) or synchronously
	// inside Advance (virtual clock) once d has elapsed.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a scheduled callback.
type Timer interface {
	// Stop cancels the callback; it reports whether the call stopped it.
	Stop() bool
}

// Real is the wall clock.
type Real struct{}

var _ Clock = Real{}

// Now implements [Clock].
func (Real) Now() time.Time { return time.Now() }

// AfterFunc implements [Clock].
func (Real) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }

// Or returns c, or the real clock when c is nil.
func Or(c Clock) Clock {
	if c == nil {
		return Real{}
	}
	return c
}

// Virtual is a clock that moves only when Advance is called. Callbacks due
// at or before the new time run synchronously, in time order (ties in
// scheduling order), inside Advance. It is safe for concurrent use.
type Virtual struct {
	mu    sync.Mutex
	now   time.Time
	seq   uint64
	queue timerHeap
}

var _ Clock = (*Virtual)(nil)

// NewVirtual returns a virtual clock set to start.
func NewVirtual(start time.Time) *Virtual { return &Virtual{now: start} }

// Now implements [Clock].
func (v *Virtual) Now() time.Time {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.now
}

// AfterFunc implements [Clock].
func (v *Virtual) AfterFunc(d time.Duration, f func()) Timer {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.seq++
	t := &virtualTimer{v: v, at: v.now.Add(d), seq: v.seq, f: f, index: -1}
	heap.Push(&v.queue, t)
	return t
}

// Advance moves the clock to t (never backwards), running every callback
// due by then. Callbacks may schedule further callbacks; those due by t run
// too.
func (v *Virtual) Advance(t time.Time) {
	for {
		v.mu.Lock()
		if len(v.queue) == 0 || v.queue[0].at.After(t) {
			if t.After(v.now) {
				v.now = t
			}
			v.mu.Unlock()
			return
		}
		next := heap.Pop(&v.queue).(*virtualTimer)
		if next.at.After(v.now) {
			v.now = next.at
		}
		v.mu.Unlock()
		next.f()
	}
}

// Step advances the clock by d.
func (v *Virtual) Step(d time.Duration) { v.Advance(v.Now().Add(d)) }

// NextAt returns the time of the earliest pending callback.
func (v *Virtual) NextAt() (time.Time, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.queue) == 0 {
		return time.Time{}, false
	}
	return v.queue[0].at, true
}

type virtualTimer struct {
	v     *Virtual
	at    time.Time
	seq   uint64
	f     func()
	index int
}

func (t *virtualTimer) Stop() bool {
	t.v.mu.Lock()
	defer t.v.mu.Unlock()
	if t.index < 0 {
		return false
	}
	heap.Remove(&t.v.queue, t.index)
	return true
}

type timerHeap []*virtualTimer

func (h timerHeap) Len() int { return len(h) }
func (h timerHeap) Less(i, j int) bool {
	if h[i].at.Equal(h[j].at) {
		return h[i].seq < h[j].seq
	}
	return h[i].at.Before(h[j].at)
}
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index, h[j].index = i, j
}
func (h *timerHeap) Push(x any) {
	t := x.(*virtualTimer)
	t.index = len(*h)
	*h = append(*h, t)
}
func (h *timerHeap) Pop() any {
	old := *h
	n := len(old)
	t := old[n-1]
	old[n-1] = nil
	t.index = -1
	*h = old[:n-1]
	return t
}
