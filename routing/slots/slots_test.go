package slots

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
)

// chain returns n chained-style keys: a shared family prefix of length
// shared, then keys unique to branch.
func chain(n, shared int, branch uint64) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		if i < shared {
			out[i] = uint64(i) + 1
		} else {
			out[i] = (branch+1)<<40 | uint64(shared)<<20 | uint64(i)
		}
	}
	return out
}

func TestSharedBlocksCountOnce(t *testing.T) {
	a, b := &Slot{}, &Slot{}
	// Two requests of one prefix on a: 4 shared blocks, then 2 and 3 own.
	e1 := a.Add(chain(6, 4, 1), 6*16, 0, 16)
	e2 := a.Add(chain(7, 4, 2), 7*16+5, 2, 16)
	if got := a.Blocks(); got != 4+2+3 {
		t.Fatalf("blocks = %d, want 9", got)
	}
	if got := a.PrefillTokens(); got != 6*16+(7*16+5-2*16) {
		t.Fatalf("prefill = %d", got)
	}
	e3 := b.Add(chain(2, 2, 0), 40, 0, 16)
	req := chain(5, 4, 9)
	if got := a.ActivePrefix(req); got != 4 {
		t.Fatalf("a active prefix = %d", got)
	}
	if got := b.ActivePrefix(req); got != 2 {
		t.Fatalf("b active prefix = %d", got)
	}
	e1.Prefilled()
	e1.Prefilled()
	if got := a.PrefillTokens(); got != 7*16+5-2*16 {
		t.Fatalf("prefill after prefilled = %d", got)
	}
	e1.Free()
	e1.Free()
	if got := a.Blocks(); got != 4+3 {
		t.Fatalf("blocks after free = %d, want 7", got)
	}
	e2.Free()
	e3.Free()
	if a.Blocks() != 0 || a.PrefillTokens() != 0 || a.Requests() != 0 || b.Blocks() != 0 {
		t.Fatalf("not released: a=%d/%d/%d b=%d", a.Blocks(), a.PrefillTokens(), a.Requests(), b.Blocks())
	}
	if a.ActivePrefix(nil) != 0 || a.ActivePrefix(req) != 0 {
		t.Fatal("empty slot reports an active prefix")
	}
}

// TestMatchesNaiveUnion compares the counters with a direct union of the
// in-flight requests' blocks over random add/free sequences of chains.
func TestMatchesNaiveUnion(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 300 {
		s := &Slot{}
		var live []*Entry
		for step := range 40 {
			if len(live) > 0 && rng.IntN(3) == 0 {
				i := rng.IntN(len(live))
				live[i].Free()
				live = append(live[:i], live[i+1:]...)
			} else {
				k := chain(rng.IntN(30), rng.IntN(20), uint64(rng.IntN(4)))
				live = append(live, s.Add(k, 0, 0, 16))
			}
			union := map[uint64]bool{}
			for _, e := range live {
				for _, k := range e.keys {
					union[k] = true
				}
			}
			if int(s.Blocks()) != len(union) {
				t.Fatalf("round %d step %d: blocks %d, union %d", round, step, s.Blocks(), len(union))
			}
			req := chain(rng.IntN(30), rng.IntN(20), uint64(rng.IntN(5)))
			want := 0
			for want < len(req) && union[req[want]] {
				want++
			}
			if got := s.ActivePrefix(req); got != want {
				t.Fatalf("round %d step %d: active prefix %d, want %d", round, step, got, want)
			}
		}
	}
}

func TestConcurrentAddFree(t *testing.T) {
	ss := []*Slot{{}, {}, {}}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 500 {
				s := ss[(g+i)%3]
				k := chain(1+i%40, i%17, uint64(i%5))
				e := s.Add(k, len(k)*16, 0, 16)
				s.ActivePrefix(k)
				e.Prefilled()
				e.Free()
			}
		}()
	}
	wg.Wait()
	for _, s := range ss {
		if s.Blocks() != 0 || s.PrefillTokens() != 0 || s.Requests() != 0 {
			t.Fatalf("leak: %d %d %d", s.Blocks(), s.PrefillTokens(), s.Requests())
		}
	}
}

// BenchmarkAddActiveFree: one slot with 8 in-flight requests of the same
// family; a 512-block request is checked, added and freed.
func BenchmarkAddActiveFree(b *testing.B) {
	for _, inflight := range []int{8, 64} {
		b.Run(fmt.Sprintf("inflight=%d/keys=512", inflight), func(b *testing.B) {
			s := &Slot{}
			for i := range inflight {
				s.Add(chain(512, 64*(i%8), uint64(i)), 0, 0, 16)
			}
			req := chain(512, 300, 99)
			b.ReportAllocs()
			for b.Loop() {
				_ = s.ActivePrefix(req)
				s.Add(req, 8192, 0, 16).Free()
			}
		})
	}
}
