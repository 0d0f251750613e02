package kv

import (
	"math"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

func cand(overlap int, prefill, blocks int64, newBlocks, tree int) routing.Candidate {
	return routing.Candidate{State: &routing.EndpointState{}, DPRank: -1, Overlap: overlap, ActivePrefillTokens: prefill, ActiveBlocks: blocks, NewBlocks: newBlocks, TreeSize: tree}
}

// TestDynamoDocExample reproduces the router guide's table (weight 1,
// B=16): W1 cached 2 → prefill 8 + decode 10 = 18; W2 cached 5 → 5+5 = 10;
// W3 cached 8 → 2+9 = 11. W2 is chosen.
func TestDynamoDocExample(t *testing.T) {
	const B, isl = 16, 10 * 16
	cs := []routing.Candidate{
		cand(2, 0, 2, 8, 0), // prefill (160-32)/16 = 8; decode 2+8 = 10
		cand(5, 0, 0, 5, 0), // prefill 5; decode 5
		cand(8, 0, 7, 2, 0), // prefill 2; decode 9
	}
	p, _ := New(DefaultConfig())
	ch, err := p.Choose(&routing.Scoring{BlockSize: B, ISL: isl, Candidates: cs, Rand: routing.NewRand(1), WantRanked: true}, true)
	if err != nil {
		t.Fatal(err)
	}
	want := []float64{18, 10, 11}
	for i := range want {
		if ch.Scores[i] != want[i] {
			t.Fatalf("cost[%d] = %v, want %v", i, ch.Scores[i], want[i])
		}
	}
	if ch.Index != 1 || ch.Ranked[0] != 1 || ch.Ranked[1] != 2 || ch.Ranked[2] != 0 {
		t.Fatalf("chose %d ranked %v", ch.Index, ch.Ranked)
	}
}

func TestCostWithActivePrefillAndWeight(t *testing.T) {
	c := cand(3, 100, 4, 2, 0)
	// w=2: 2·(100 + (100 − 48))/16 + 4 + 2 = 2·152/16 + 6 = 25
	if got := Cost(2, 100, 16, &c); got != 25 {
		t.Fatalf("cost = %v", got)
	}
	// Overlap larger than the prompt never gives negative prefill.
	c = cand(50, 0, 0, 0, 0)
	if got := Cost(1, 100, 16, &c); got != 0 {
		t.Fatalf("cost = %v", got)
	}
}

func TestTiesBreakByTreeSizeThenRandomly(t *testing.T) {
	cs := []routing.Candidate{cand(0, 0, 0, 4, 50), cand(0, 0, 0, 4, 10), cand(0, 0, 0, 4, 10), cand(0, 0, 0, 9, 0)}
	p, _ := New(DefaultConfig())
	seen := map[int]int{}
	rnd := routing.NewRand(7)
	for range 400 {
		ch, _ := p.Choose(&routing.Scoring{BlockSize: 16, ISL: 64, Candidates: cs, Rand: rnd}, true)
		seen[ch.Index]++
	}
	if seen[0] != 0 || seen[3] != 0 || seen[1] < 150 || seen[2] < 150 {
		t.Fatalf("tie-breaks: %v", seen)
	}
}

func TestTemperatureSoftmax(t *testing.T) {
	cs := []routing.Candidate{cand(0, 0, 0, 0, 0), cand(0, 0, 0, 10, 0)}
	// costs 4 and 14 (ISL 64, B 16): normalised gap 1, T = 1 → p0/p1 = e.
	p, _ := New(Config{OverlapScoreWeight: 1, Temperature: 1})
	rnd := routing.NewRand(3)
	n0 := 0
	const n = 20000
	for range n {
		ch, _ := p.Choose(&routing.Scoring{BlockSize: 16, ISL: 64, Candidates: cs, Rand: rnd}, true)
		if ch.Index == 0 {
			n0++
		}
	}
	want := math.E / (1 + math.E)
	if got := float64(n0) / n; math.Abs(got-want) > 0.015 {
		t.Fatalf("P(best) = %.3f, want %.3f", got, want)
	}
}

func TestValidate(t *testing.T) {
	for _, c := range []Config{{OverlapScoreWeight: -1}, {OverlapScoreWeight: math.NaN()}, {Temperature: -0.1}, {Temperature: math.Inf(1)}} {
		if _, err := New(c); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}

// A CPU hit is cheaper than a miss and dearer than a GPU hit: 4 blocks in
// host memory at weight 0.8 save 0.8 of their prefill.
func TestCostCountsLowerTiers(t *testing.T) {
	gpu := cand(4, 0, 0, 0, 0)
	cpu := cand(0, 0, 0, 0, 0)
	cpu.OverlapCPU = 4
	miss := cand(0, 0, 0, 0, 0)
	w := routing.TierWeights{GPU: 1, CPU: 0.8, Disk: 0.25}
	g, c, m := TieredCost(1, 128, 16, &gpu, w), TieredCost(1, 128, 16, &cpu, w), TieredCost(1, 128, 16, &miss, w)
	if g != 4 || math.Abs(c-4.8) > 1e-12 || m != 8 {
		t.Fatalf("gpu %v cpu %v miss %v, want 4, 4.8, 8", g, c, m)
	}
	if d := Cost(1, 128, 16, &cpu); d != c {
		t.Fatalf("Cost uses the default weights: %v, want %v", d, c)
	}
	p, _ := New(DefaultConfig())
	ch, _ := p.Choose(&routing.Scoring{BlockSize: 16, ISL: 128, Candidates: []routing.Candidate{miss, cpu}, Rand: routing.NewRand(1), TierWeights: w}, true)
	if ch.Index != 1 {
		t.Fatalf("chose %d, want the CPU hit", ch.Index)
	}
}
