package extproc

import (
	"math"
	"sync"
	"sync/atomic"
	"testing"
)

func TestBudget(t *testing.T) {
	b := NewBudget(100)
	if !b.Take(60) || b.Take(41) || b.Used() != 60 {
		t.Fatalf("after Take(60), Take(41): used %d", b.Used())
	}
	if !b.Take(40) || b.Used() != 100 || !b.Take(0) || b.Take(1) {
		t.Fatalf("filling to the limit: used %d", b.Used())
	}
	b.Release(100)
	if b.Used() != 0 || b.Limit() != 100 {
		t.Fatalf("used %d limit %d", b.Used(), b.Limit())
	}
	if NewBudget(0).Take(1) != true || NewBudget(0).Take(2) {
		t.Error("a budget of 0 is one byte")
	}
	if !b.Take(60) || b.Take(math.MaxInt64) || b.Used() != 60 {
		t.Errorf("a take that overflows fits: used %d", b.Used())
	}
}

// TestBudgetConcurrent: concurrent takers never hold more than the limit
// together, and what they give back is all there was.
func TestBudgetConcurrent(t *testing.T) {
	const limit = 1000
	b := NewBudget(limit)
	var held, peak atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 5000 {
				if !b.Take(7) {
					continue
				}
				if h := held.Add(7); h > peak.Load() {
					peak.Store(h)
				}
				held.Add(-7)
				b.Release(7)
			}
		})
	}
	wg.Wait()
	if b.Used() != 0 || peak.Load() > limit {
		t.Fatalf("used %d after all releases, peak %d > %d", b.Used(), peak.Load(), limit)
	}
}
