package weighted

import (
	"math"
	"slices"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fresh is a candidate with a good scrape.
func fresh(overlap int, waiting, kv float64) routing.Candidate {
	return routing.Candidate{State: &routing.EndpointState{}, DPRank: -1, Overlap: overlap,
		Load: routing.Load{Waiting: waiting, KVUsage: kv, Known: true}}
}

// unscraped is a candidate with no scrape and n in-flight decisions.
func unscraped(overlap int, n int64) routing.Candidate {
	live := &routing.Live{}
	live.InFlight.Store(n)
	return routing.Candidate{State: &routing.EndpointState{Live: live}, DPRank: -1, Overlap: overlap}
}

func scoring(blocks int, seed int64, cs ...routing.Candidate) *routing.Scoring {
	return &routing.Scoring{BlockSize: 16, Blocks: make([]uint64, blocks), ISL: 16 * blocks, Candidates: cs,
		Rand: routing.NewRand(seed), WantRanked: true}
}

func choose(t *testing.T, cfg Config, s *routing.Scoring) routing.Choice {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := p.Choose(s, true)
	if err != nil {
		t.Fatal(err)
	}
	return ch
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-12 }

func TestDefaults(t *testing.T) {
	if c := DefaultConfig(); c != (Config{PrefixWeight: 3, QueueWeight: 2, KVCacheWeight: 2}) {
		t.Fatalf("defaults %+v, want GIE's 3/2/2", c)
	}
	p, err := New(DefaultConfig())
	if err != nil || p.Name() != Name || !p.NeedsOutcomes() {
		t.Fatalf("New: %v, %v", p, err)
	}
}

// TestPrefixDominatesWhenLoadsEqual: equal scraped loads make the queue and
// KV terms equal, so the longest prefix match wins.
func TestPrefixDominatesWhenLoadsEqual(t *testing.T) {
	s := scoring(10, 1, fresh(2, 3, 0.4), fresh(8, 3, 0.4), fresh(0, 3, 0.4), fresh(5, 3, 0.4))
	ch := choose(t, DefaultConfig(), s)
	if ch.Index != 1 {
		t.Fatalf("chose %d, want 1 (8/10 blocks cached); scores %v", ch.Index, ch.Scores)
	}
	// 3·0.8 + 2·1 + 2·0.6 = 5.6
	if !near(ch.Scores[1], 5.6) || !near(ch.Scores[2], 3.2) {
		t.Fatalf("scores %v, want [1] = 5.6, [2] = 3.2", ch.Scores)
	}
	if want := []int{1, 3, 0, 2}; !slices.Equal(ch.Ranked, want) {
		t.Fatalf("ranked %v, want %v", ch.Ranked, want)
	}
}

// TestQueuedEndpointLosesSmallPrefixAdvantage: the queue score is min-max
// normalised, so the most queued candidate loses the whole queue weight (2),
// more than a small prefix advantage earns (3·0.2); a full prefix advantage
// over an empty prompt cache (3·1) still beats it, as in GIE.
func TestQueuedEndpointLosesSmallPrefixAdvantage(t *testing.T) {
	s := scoring(10, 1, fresh(10, 40, 0.5), fresh(8, 0, 0.5), fresh(0, 20, 0.5))
	ch := choose(t, DefaultConfig(), s)
	if ch.Index != 1 {
		t.Fatalf("chose %d, want 1: scores %v", ch.Index, ch.Scores)
	}
	sig := Signals(s)
	if !near(sig[0].Queue, 0) || !near(sig[1].Queue, 1) || !near(sig[2].Queue, 0.5) {
		t.Fatalf("queue scores %+v, want 0, 1, 0.5", sig)
	}
	s = scoring(10, 1, fresh(10, 40, 0.5), fresh(0, 0, 0.5))
	if ch := choose(t, DefaultConfig(), s); ch.Index != 0 {
		t.Fatalf("chose %d, want 0 (3·1 > 2·1): scores %v", ch.Index, ch.Scores)
	}
}

func TestKVUtilizationBreaksLoadTie(t *testing.T) {
	s := scoring(10, 1, fresh(0, 2, 0.9), fresh(0, 2, 0.1))
	ch := choose(t, DefaultConfig(), s)
	if ch.Index != 1 || !near(ch.Scores[0], 2.2) || !near(ch.Scores[1], 3.8) {
		t.Fatalf("chose %d scores %v, want 1 with 2.2 vs 3.8", ch.Index, ch.Scores)
	}
}

func TestWeightsConfigurable(t *testing.T) {
	cs := []routing.Candidate{fresh(10, 40, 0.9), fresh(0, 0, 0.2), fresh(2, 10, 0.0)}
	for _, tc := range []struct {
		cfg  Config
		want int
	}{
		{Config{PrefixWeight: 1}, 0},
		{Config{QueueWeight: 1}, 1},
		{Config{KVCacheWeight: 1}, 2},
		{Config{PrefixWeight: 1, QueueWeight: 10}, 1},
		{Config{PrefixWeight: 10, QueueWeight: 1, KVCacheWeight: 1}, 0},
	} {
		if ch := choose(t, tc.cfg, scoring(10, 1, cs...)); ch.Index != tc.want {
			t.Errorf("%+v chose %d, want %d (scores %v)", tc.cfg, ch.Index, tc.want, ch.Scores)
		}
	}
}

// TestTiesRandomButSeeded: exact ties are spread uniformly, never by list
// position, and the same seed repeats the same sequence.
func TestTiesRandomButSeeded(t *testing.T) {
	cs := []routing.Candidate{fresh(4, 1, 0.5), fresh(4, 1, 0.5), fresh(0, 1, 0.5), fresh(4, 1, 0.5)}
	p, _ := New(DefaultConfig())
	run := func(seed int64) []int {
		s := scoring(8, seed, cs...)
		var out []int
		for range 600 {
			ch, _ := p.Choose(s, false)
			out = append(out, ch.Index)
		}
		return out
	}
	a := run(42)
	seen := map[int]int{}
	for _, i := range a {
		seen[i]++
	}
	if seen[2] != 0 || seen[0] < 150 || seen[1] < 150 || seen[3] < 150 {
		t.Fatalf("tie-breaks %v: want 0, 1, 3 about 200 each, never 2", seen)
	}
	if !slices.Equal(a, run(42)) {
		t.Fatal("same seed, different picks")
	}
	if slices.Equal(a, run(43)) {
		t.Fatal("different seeds, same 600 picks")
	}
}

func TestQueueAllEqualScoresOne(t *testing.T) {
	for _, sig := range Signals(scoring(4, 1, fresh(0, 7, 0), fresh(0, 7, 0))) {
		if sig.Queue != 1 || sig.InFlight || sig.Saturated {
			t.Fatalf("%+v, want queue 1 from scraped load", sig)
		}
	}
}

// TestInFlightFallback: without a scrape (or with one endpoint not scraped
// yet) the queue signal is the engine's in-flight count for every candidate.
func TestInFlightFallback(t *testing.T) {
	s := scoring(10, 1, unscraped(0, 6), unscraped(0, 0), unscraped(0, 3))
	sig := Signals(s)
	for i, want := range []float64{0, 1, 0.5} {
		if !sig[i].InFlight || !near(sig[i].Queue, want) || sig[i].KVCache != 1 {
			t.Fatalf("signal %d = %+v, want in-flight queue %v, kv 1", i, sig[i], want)
		}
	}
	if ch := choose(t, DefaultConfig(), s); ch.Index != 1 {
		t.Fatalf("chose %d, want the idle endpoint", ch.Index)
	}
	// One scraped endpoint does not mix units: all use in-flight counts.
	known := unscraped(0, 9)
	known.Load = routing.Load{Waiting: 0, KVUsage: 0.5, Known: true}
	sig = Signals(scoring(10, 1, known, unscraped(0, 1)))
	if !sig[0].InFlight || sig[0].Queue != 0 || sig[1].Queue != 1 || !near(sig[0].KVCache, 0.5) {
		t.Fatalf("mixed: %+v", sig)
	}
}

// TestStaleIsSaturated: a stale endpoint scores 0 on queue and KV unless
// every endpoint is stale; then load is unknown, the queue signal is
// in-flight and the KV term is the same for all.
func TestStaleIsSaturated(t *testing.T) {
	stale := fresh(0, 0, 0)
	stale.Load.Stale = true
	s := scoring(10, 1, stale, fresh(0, 30, 0.9))
	sig := Signals(s)
	if !sig[0].Saturated || sig[0].Queue != 0 || sig[0].KVCache != 0 || sig[1].Saturated || sig[1].Queue != 1 {
		t.Fatalf("signals %+v", sig)
	}
	if ch := choose(t, DefaultConfig(), s); ch.Index != 1 {
		t.Fatalf("chose the stale endpoint: %v", ch.Scores)
	}
	// All stale: old values are ignored; in-flight counts decide.
	a, b := unscraped(0, 5), unscraped(0, 1)
	a.Load = routing.Load{Waiting: 0, KVUsage: 0, Known: true, Stale: true}
	b.Load = routing.Load{Waiting: 50, KVUsage: 0.95, Known: true, Stale: true}
	sig = Signals(scoring(10, 1, a, b))
	if sig[0].Saturated || !sig[0].InFlight || sig[0].Queue != 0 || sig[1].Queue != 1 || sig[0].KVCache != 1 || sig[1].KVCache != 1 {
		t.Fatalf("all stale: %+v", sig)
	}
}

func TestPrefixEdgeCases(t *testing.T) {
	// No complete block: prefix 0 for all (GIE: total == 0 → 0).
	sig := Signals(scoring(0, 1, fresh(0, 0, 0), fresh(3, 0, 0)))
	if sig[0].Prefix != 0 || sig[1].Prefix != 0 {
		t.Fatalf("%+v", sig)
	}
	// An overlap beyond the prompt (another block size) is clamped to 1.
	sig = Signals(scoring(4, 1, fresh(9, 0, 0)))
	if sig[0].Prefix != 1 {
		t.Fatalf("%+v", sig)
	}
	// Bad scraped values do not poison the sum.
	sig = Signals(scoring(4, 1, fresh(1, math.NaN(), math.NaN()), fresh(0, 2, 1.5)))
	for _, g := range sig {
		if math.IsNaN(g.Queue) || math.IsNaN(g.KVCache) || g.KVCache < 0 {
			t.Fatalf("%+v", sig)
		}
	}
}

func TestRankedOnlyWhenWanted(t *testing.T) {
	s := scoring(4, 1, fresh(0, 0, 0), fresh(4, 0, 0))
	s.WantRanked = false
	if ch := choose(t, DefaultConfig(), s); ch.Ranked != nil || ch.Index != 1 || len(ch.Scores) != 2 {
		t.Fatalf("%+v", ch)
	}
}

func TestValidate(t *testing.T) {
	for _, c := range []Config{
		{PrefixWeight: -1, QueueWeight: 2, KVCacheWeight: 2},
		{PrefixWeight: 3, QueueWeight: math.NaN(), KVCacheWeight: 2},
		{PrefixWeight: 3, QueueWeight: 2, KVCacheWeight: math.Inf(1)},
		{},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%+v accepted", c)
		}
		if _, err := New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
	if err := (Config{KVCacheWeight: 0.5}).Validate(); err != nil {
		t.Fatalf("one positive weight refused: %v", err)
	}
}

// TestPrefixCountsLowerTiers: the prefix signal is the effective overlap,
// so 8 CPU blocks at weight 0.8 score as 6.4 GPU blocks, and 8 disk blocks
// at 0.25 as 2.
func TestPrefixCountsLowerTiers(t *testing.T) {
	cpu, disk := fresh(0, 3, 0.4), fresh(2, 3, 0.4)
	cpu.OverlapCPU = 8
	disk.OverlapDisk = 8
	s := scoring(10, 1, fresh(5, 3, 0.4), cpu, disk)
	sig := Signals(s)
	if !near(sig[1].Prefix, 0.64) || !near(sig[2].Prefix, 0.4) || !near(sig[0].Prefix, 0.5) {
		t.Fatalf("prefix signals %v %v %v, want 0.5 0.64 0.4", sig[0].Prefix, sig[1].Prefix, sig[2].Prefix)
	}
	if ch := choose(t, DefaultConfig(), s); ch.Index != 1 {
		t.Fatalf("chose %d, want the CPU hit", ch.Index)
	}
	s.TierWeights = routing.TierWeights{GPU: 1, CPU: 0.5, Disk: 0.25}
	if ch := choose(t, DefaultConfig(), s); ch.Index != 0 {
		t.Fatalf("with cpu weight 0.5 chose %d, want the 5 GPU blocks", ch.Index)
	}
}
