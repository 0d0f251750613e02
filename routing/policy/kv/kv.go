// Package kv implements the kv policy: NVIDIA Dynamo's KV-aware router cost
// model. Each candidate's cost is the prefill work it would have (its active
// prefill tokens plus this request's uncached tokens, in blocks, weighted)
// plus the decode blocks it would hold (its active blocks plus this
// request's blocks not already held by an in-flight request there). The
// lowest cost wins; with a temperature > 0 the choice is sampled from a
// softmax over range-normalised costs.
package kv

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/kvbandit/kvbandit/routing"
)

// Name is the --policy value.
const Name = "kv"

// Config holds the policy's parameters (Dynamo's --router-* names).
type Config struct {
	// OverlapScoreWeight weighs prefill work against decode blocks
	// (--router-kv-overlap-score-weight, default 1).
	OverlapScoreWeight float64 `json:"overlap_score_weight"`
	// Temperature: 0 picks the lowest cost; > 0 samples from a softmax over
	// range-normalised costs (--router-temperature, default 0).
	Temperature float64 `json:"temperature"`
}

// DefaultConfig returns Dynamo's defaults.
func DefaultConfig() Config { return Config{OverlapScoreWeight: 1} }

// Validate checks the parameters.
func (c Config) Validate() error {
	var errs []error
	if !(c.OverlapScoreWeight >= 0) || math.IsInf(c.OverlapScoreWeight, 0) {
		errs = append(errs, fmt.Errorf("kv.overlap_score_weight: must be a finite number >= 0, got %v", c.OverlapScoreWeight))
	}
	if !(c.Temperature >= 0) || math.IsInf(c.Temperature, 0) {
		errs = append(errs, fmt.Errorf("kv.temperature: must be a finite number >= 0, got %v", c.Temperature))
	}
	return errors.Join(errs...)
}

// Policy is the kv policy.
type Policy struct {
	cfg Config
}

var (
	_ routing.Policy         = (*Policy)(nil)
	_ routing.PrefillChooser = (*Policy)(nil)
)

// New returns the policy; cfg must be valid.
func New(cfg Config) (*Policy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Policy{cfg: cfg}, nil
}

// Name implements [routing.Policy].
func (*Policy) Name() string { return Name }

// Cost is Dynamo's cost for one candidate (lower is better):
// w·(active_prefill_tokens + max(ISL − overlap·B, 0))/B + active_blocks + new_blocks,
// with lower-tier blocks at the default tier weights (see TieredCost).
func Cost(w float64, isl, blockSize int, c *routing.Candidate) float64 {
	return TieredCost(w, isl, blockSize, c, routing.TierWeights{})
}

// TieredCost is Cost where overlap is the candidate's effective overlap at
// tiers: GPU blocks, plus CPU and disk blocks at their weights (the GPU
// overlap when no lower tier is known, at a GPU weight of 1).
func TieredCost(w float64, isl, blockSize int, c *routing.Candidate, tiers routing.TierWeights) float64 {
	b := float64(max(blockSize, 1))
	prefill := float64(c.ActivePrefillTokens) + max(float64(isl)-c.EffectiveOverlap(tiers)*float64(blockSize), 0)
	return w*prefill/b + float64(c.ActiveBlocks) + float64(c.NewBlocks)
}

// Choose implements [routing.Policy]. Scores are the costs (lower is
// better).
func (p *Policy) Choose(s *routing.Scoring, _ bool) (routing.Choice, error) {
	costs := make([]float64, len(s.Candidates))
	for i := range s.Candidates {
		costs[i] = TieredCost(p.cfg.OverlapScoreWeight, s.ISL, s.BlockSize, &s.Candidates[i], s.TierWeights)
	}
	idx := Select(costs, s.Candidates, p.cfg.Temperature, s.Rand)
	ch := routing.Choice{Index: idx, Scores: costs}
	if s.WantRanked {
		ch.Ranked = Rank(costs, idx)
	}
	return ch, nil
}

// ChoosePrefill implements [routing.PrefillChooser]: the prefill half of
// the cost, w·(active_prefill_tokens + max(ISL − overlap·B, 0))/B (a
// prefill worker hands its blocks over after the first token, so held
// blocks do not count). Scores are the costs.
func (p *Policy) ChoosePrefill(s *routing.Scoring, _ bool) (routing.Choice, error) {
	costs := make([]float64, len(s.Candidates))
	b := float64(max(s.BlockSize, 1))
	for i := range s.Candidates {
		c := &s.Candidates[i]
		costs[i] = p.cfg.OverlapScoreWeight * (float64(c.ActivePrefillTokens) + max(float64(s.ISL)-c.EffectiveOverlap(s.TierWeights)*float64(s.BlockSize), 0)) / b
	}
	return routing.Choice{Index: Select(costs, s.Candidates, p.cfg.Temperature, s.Rand), Scores: costs}, nil
}

// Select picks the index of the lowest cost. At temperature 0, exact ties
// are broken by the smaller indexed tree size, then uniformly at random
// (never by list position, which herds). At temperature > 0 it samples
// p_i ∝ exp(−(cost_i − lo)/((hi − lo)·T)), uniform when all costs are equal.
func Select(costs []float64, cands []routing.Candidate, temperature float64, rnd *routing.Rand) int {
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, c := range costs {
		lo, hi = min(lo, c), max(hi, c)
	}
	if temperature > 0 {
		if hi == lo {
			return rnd.IntN(len(costs))
		}
		weights := make([]float64, len(costs))
		sum := 0.0
		for i, c := range costs {
			weights[i] = math.Exp(-(c - lo) / ((hi - lo) * temperature))
			sum += weights[i]
		}
		u := rnd.Float64() * sum
		for i, w := range weights {
			if u < w {
				return i
			}
			u -= w
		}
		return len(costs) - 1
	}
	best, ties, bestTree := -1, 0, 0
	for i, c := range costs {
		if c != lo {
			continue
		}
		tree := cands[i].TreeSize
		switch {
		case best < 0 || tree < bestTree:
			best, ties, bestTree = i, 1, tree
		case tree == bestTree:
			ties++
			if rnd.IntN(ties) == 0 {
				best = i
			}
		}
	}
	if best < 0 { // every cost was NaN
		return rnd.IntN(len(costs))
	}
	return best
}

// Rank orders the candidates by ascending cost with the chosen one first.
func Rank(costs []float64, chosen int) []int {
	ranked := make([]int, len(costs))
	for i := range ranked {
		ranked[i] = i
	}
	slices.SortStableFunc(ranked, func(a, b int) int {
		switch {
		case a == chosen:
			return -1
		case b == chosen:
			return 1
		case costs[a] < costs[b]:
			return -1
		case costs[a] > costs[b]:
			return 1
		}
		return 0
	})
	return ranked
}

// Done implements [routing.Policy]; the cost model learns nothing.
func (*Policy) Done(*routing.Decision, routing.Outcome) {}

// NeedsOutcomes implements [routing.OutcomeAware]: active prefill tokens and
// blocks are released by outcomes.
func (*Policy) NeedsOutcomes() bool { return true }
