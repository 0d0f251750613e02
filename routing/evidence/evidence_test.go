package evidence

import (
	"math"
	"math/rand/v2"
	"sync"
	"testing"
)

// close reports whether a and b agree to rel relative error (or both are
// tiny).
func near(a, b, rel float64) bool {
	return math.Abs(a-b) <= rel*max(math.Abs(a), math.Abs(b), 1e-300)
}

// TestSetSumIsSingleAccumulator: over random sequences of observations
// from random sources, each discounting everything by a random factor,
// the sum of a Set's parts is the single accumulator fed the same
// sequence; and removing one source leaves the accumulator in which that
// source's observations carried no weight (their discounting stays).
func TestSetSumIsSingleAccumulator(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 200 {
		var s Set
		var all Part               // one accumulator of everything
		without := make([]Part, 4) // ... without source i's weight
		s.Add(Local, 5, 5*0.3, 0)  // a prior
		all = Part{W: 5, S: 1.5}
		for i := range without {
			without[i] = all
		}
		n := 1 + rng.IntN(3000) // long enough to renormalise the scale
		for range n {
			src := Source(rng.IntN(4))
			k := 0.5 + 0.5*rng.Float64()
			if rng.IntN(10) == 0 {
				k = 1e-3 // a harsh discount now and then
			}
			w, x := rng.Float64()*3, rng.NormFloat64()
			s.Scale(k)
			s.Add(src, w, w*x, 1)
			all = Part{W: k*all.W + w, S: k*all.S + w*x, N: all.N + 1}
			for i := range without {
				without[i].W *= k
				without[i].S *= k
				if Source(i) != src {
					without[i].W += w
					without[i].S += w * x
				}
			}
		}
		tot := s.Total()
		if !near(tot.W, all.W, 1e-9) || !near(tot.Mean(), all.Mean(), 1e-9) || tot.N != all.N {
			t.Fatalf("trial %d (%d obs): total %+v mean %v, single accumulator %+v mean %v", trial, n, tot, tot.Mean(), all, all.Mean())
		}
		drop := Source(1 + rng.IntN(3))
		if _, ok := s.Remove(drop); !ok && s.Peers() == 3 {
			t.Fatalf("trial %d: source %d had no part", trial, drop)
		}
		got, want := s.Total(), without[drop]
		// A dropped (negligible) part may be missing from want's weight
		// only at the rounding level: compare the weight and mean.
		if !near(got.W, want.W, 1e-9) || !near(got.Mean(), want.Mean(), 1e-9) {
			t.Fatalf("trial %d: after removing %d: %+v (mean %v), want %+v (mean %v)", trial, drop, got, got.Mean(), want, want.Mean())
		}
	}
}

// TestSetDropsNegligiblePeers: a peer that stopped teaching while others
// go on is dropped once its weight is under the sum's rounding, so a
// set's parts stay those of the peers that still count.
func TestSetDropsNegligiblePeers(t *testing.T) {
	var s Set
	s.Add(7, 1, 1, 1)
	for range 5000 {
		s.Scale(0.9)
		s.Add(Local, 1, 0, 1)
	}
	if s.Peers() != 0 {
		t.Fatalf("peers %d after 5000 discounts by 0.9 (weight 0.9^5000), want the part dropped", s.Peers())
	}
	if tot := s.Total(); !near(tot.W, 10, 1e-9) {
		t.Fatalf("total weight %v, want 10 (the steady state 1/(1-0.9))", tot.W)
	}
}

func TestSetRemoveLocal(t *testing.T) {
	var s Set
	s.Add(Local, 2, 4, 1)
	if _, ok := s.Remove(Local); ok {
		t.Fatal("removed the local part")
	}
	if p := s.Part(Local); p.W != 2 || p.S != 4 || p.Mean() != 2 {
		t.Fatalf("local part %+v", p)
	}
	if _, ok := s.Remove(3); ok {
		t.Fatal("removed a part that does not exist")
	}
}

func TestSourcesInternAndForget(t *testing.T) {
	s := NewSources(2)
	var forgotten []Source
	forget := func(src Source) { forgotten = append(forgotten, src) }
	var a, b, c Source
	s.Use("a", forget, func(src Source) { a = src })
	s.Use("b", forget, func(src Source) { b = src })
	if a == Local || b == Local || a == b {
		t.Fatalf("sources a %d, b %d", a, b)
	}
	s.Use("a", forget, func(src Source) {
		if src != a {
			t.Fatalf("a interned again as %d (was %d)", src, a)
		}
	})
	// Full: c evicts the least recently used, b.
	s.Use("c", forget, func(src Source) { c = src })
	if len(forgotten) != 1 || forgotten[0] != b || s.Len() != 2 {
		t.Fatalf("forgotten %v, len %d; want b (%d) evicted", forgotten, s.Len(), b)
	}
	if c == a || c == b {
		t.Fatalf("source %d reused", c)
	}
	if !s.Forget("a", forget) || s.Forget("a", forget) || s.Forget("b", forget) {
		t.Fatal("Forget: want true once for an interned peer, false otherwise")
	}
	if len(forgotten) != 2 || forgotten[1] != a {
		t.Fatalf("forgotten %v", forgotten)
	}
	s.Use("a", forget, func(src Source) {
		if src == a {
			t.Fatalf("a came back with its old source %d", src)
		}
	})
}

// TestSourcesUseForgetRace: recording and forgetting one peer from many
// goroutines never leaves a part recorded for a Source after it was
// forgotten (run with -race).
func TestSourcesUseForgetRace(t *testing.T) {
	s := NewSources(4)
	var mu sync.Mutex
	live := map[Source]int{} // parts recorded per source not forgotten
	dead := map[Source]bool{}
	forget := func(src Source) {
		mu.Lock()
		delete(live, src)
		dead[src] = true
		mu.Unlock()
	}
	record := func(src Source) {
		mu.Lock()
		if dead[src] {
			t.Errorf("recorded for forgotten source %d", src)
		}
		live[src]++
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 2000 {
				peer := string(rune('a' + (g+i)%6))
				if i%7 == 0 {
					s.Forget(peer, forget)
				} else {
					s.Use(peer, forget, record)
				}
			}
		})
	}
	wg.Wait()
	if s.Len() > 4 {
		t.Fatalf("%d peers interned, max 4", s.Len())
	}
}
