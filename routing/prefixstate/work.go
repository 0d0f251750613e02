package prefixstate

import (
	"math"
	"sync"
	"sync/atomic"

	"github.com/kvbandit/kvbandit/routing"
)

// dead marks a counter removed from the table; adders that meet it retry
// on the current table.
const dead = math.MinInt64

// workTable is the per-endpoint outstanding work: a copy-on-write map of
// atomic counters. Readers load the map and a counter without locking;
// a new endpoint or a prune copies the map under mu.
type workTable struct {
	mu sync.Mutex
	m  atomic.Pointer[map[routing.EndpointKey]*atomic.Int64]
}

func (w *workTable) init() {
	m := map[routing.EndpointKey]*atomic.Int64{}
	w.m.Store(&m)
}

func (w *workTable) load(ep routing.EndpointKey) int64 {
	c := (*w.m.Load())[ep]
	if c == nil {
		return 0
	}
	return max(c.Load(), 0)
}

// add adds delta (> 0) to ep's counter and returns the counter, which the
// caller later decrements directly: a counter holding a charge is never
// zero, so prune never removes it.
func (w *workTable) add(ep routing.EndpointKey, delta int64) *atomic.Int64 {
	for {
		c := (*w.m.Load())[ep]
		if c == nil {
			c = w.create(ep)
		}
		for {
			v := c.Load()
			if v == dead {
				break
			}
			if c.CompareAndSwap(v, v+delta) {
				return c
			}
		}
	}
}

func (w *workTable) create(ep routing.EndpointKey) *atomic.Int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	old := *w.m.Load()
	if c := old[ep]; c != nil {
		return c
	}
	next := make(map[routing.EndpointKey]*atomic.Int64, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	c := new(atomic.Int64)
	next[ep] = c
	w.m.Store(&next)
	return c
}

// prune drops counters that are zero, so endpoints that left the fleet do
// not stay in the table.
func (w *workTable) prune() {
	w.mu.Lock()
	defer w.mu.Unlock()
	old := *w.m.Load()
	var drop int
	for _, c := range old {
		if c.Load() == 0 {
			drop++
		}
	}
	if drop == 0 {
		return
	}
	next := make(map[routing.EndpointKey]*atomic.Int64, len(old)-drop)
	for k, c := range old {
		if c.CompareAndSwap(0, dead) {
			continue
		}
		next[k] = c
	}
	w.m.Store(&next)
}
