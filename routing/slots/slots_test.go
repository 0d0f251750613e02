package slots

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
)

func keys(n int, base uint64) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = base + uint64(i)
	}
	return out
}

func TestSharedBlocksCountOnce(t *testing.T) {
	tr := New()
	a, b := &Slot{}, &Slot{}
	// Two requests of one prefix on a: 4 shared blocks, then 2 and 3 own.
	e1 := tr.Add(a, append(keys(4, 100), 900, 901), 6*16, 0, 16)
	e2 := tr.Add(a, append(keys(4, 100), 800, 801, 802), 7*16+5, 2, 16)
	if got := a.Blocks(); got != 4+2+3 {
		t.Fatalf("blocks = %d, want 9", got)
	}
	if got := a.PrefillTokens(); got != 6*16+(7*16+5-2*16) {
		t.Fatalf("prefill = %d", got)
	}
	e3 := tr.Add(b, keys(2, 100), 40, 0, 16)
	m := tr.ActivePrefix(append(keys(4, 100), 777), nil)
	got := map[*Slot]int{}
	for _, x := range m {
		got[x.Slot] = x.N
	}
	if got[a] != 4 || got[b] != 2 || len(got) != 2 {
		t.Fatalf("active prefix = %v", got)
	}
	e1.Prefilled()
	e1.Prefilled()
	if got := a.PrefillTokens(); got != 7*16+5-2*16 {
		t.Fatalf("prefill after prefilled = %d", got)
	}
	tr.Free(e1)
	tr.Free(e1)
	if got := a.Blocks(); got != 4+3 {
		t.Fatalf("blocks after free = %d, want 7", got)
	}
	tr.Free(e2)
	tr.Free(e3)
	if a.Blocks() != 0 || a.PrefillTokens() != 0 || a.Requests() != 0 || b.Blocks() != 0 || tr.Len() != 0 {
		t.Fatalf("not released: a=%d/%d/%d b=%d len=%d", a.Blocks(), a.PrefillTokens(), a.Requests(), b.Blocks(), tr.Len())
	}
	if m := tr.ActivePrefix(nil, nil); len(m) != 0 {
		t.Fatal("empty keys")
	}
}

func TestConcurrentAddFree(t *testing.T) {
	tr := New()
	ss := []*Slot{{}, {}, {}}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var buf []Match
			for i := range 500 {
				s := ss[(g+i)%3]
				k := keys(1+i%40, uint64(i%5)*1000)
				e := tr.Add(s, k, len(k)*16, 0, 16)
				buf = tr.ActivePrefix(k, buf)
				e.Prefilled()
				tr.Free(e)
			}
		}()
	}
	wg.Wait()
	for _, s := range ss {
		if s.Blocks() != 0 || s.PrefillTokens() != 0 || s.Requests() != 0 {
			t.Fatalf("leak: %d %d %d", s.Blocks(), s.PrefillTokens(), s.Requests())
		}
	}
	if tr.Len() != 0 {
		t.Fatal("table not empty")
	}
}

// BenchmarkActivePrefix: 64 slots, a 512-block request. distinct=64: every
// slot holds a different prefix length (the worst case); distinct=4: slots
// share four prefix lengths (a system prompt, a few conversations).
func BenchmarkActivePrefix(b *testing.B) {
	for _, distinct := range []int{4, 64} {
		b.Run(fmt.Sprintf("slots=64/keys=512/distinct=%d", distinct), func(b *testing.B) {
			tr := New()
			for i := range 64 {
				tr.Add(&Slot{}, keys(1+(i%distinct)*(500/distinct), 7), 0, 0, 16)
			}
			req := keys(512, 7)
			var buf []Match
			b.ReportAllocs()
			for b.Loop() {
				buf = tr.ActivePrefix(req, buf)
			}
		})
	}
}

// TestActivePrefixMatchesNaive compares the galloping walk with a direct
// count on random fleets of requests.
func TestActivePrefixMatchesNaive(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for round := range 200 {
		tr := New()
		ss := make([]*Slot, 1+rng.IntN(10))
		for i := range ss {
			ss[i] = &Slot{}
		}
		held := map[*Slot]map[uint64]bool{}
		for range rng.IntN(20) {
			s := ss[rng.IntN(len(ss))]
			k := keys(rng.IntN(60), uint64(rng.IntN(2))*10000)
			tr.Add(s, k, 0, 0, 16)
			if held[s] == nil {
				held[s] = map[uint64]bool{}
			}
			for _, x := range k {
				held[s][x] = true
			}
		}
		req := keys(rng.IntN(70), 0)
		got := map[*Slot]int{}
		for _, m := range tr.ActivePrefix(req, nil) {
			got[m.Slot] = m.N
		}
		for _, s := range ss {
			want := 0
			for want < len(req) && held[s][req[want]] {
				want++
			}
			if got[s] != want {
				t.Fatalf("round %d: slot prefix %d, want %d", round, got[s], want)
			}
		}
	}
}
