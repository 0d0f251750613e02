// Package weighted implements the weighted policy: the Gateway API
// Inference Extension (GIE) / llm-d endpoint picker's default scheduling
// profile, reproduced as a baseline. Three scorers each give a candidate a
// score in [0, 1]:
//
//   - prefix-cache-scorer: matched prefix blocks / the prompt's blocks;
//   - queue-scorer: (max − waiting)/(max − min) over the candidates, 1 when
//     every candidate has the same queue;
//   - kv-cache-utilization-scorer: 1 − KV cache usage;
//
// and the max-score picker takes the highest weighted sum
// (3·prefix + 2·queue + 2·kv by default), ties broken at random.
//
// Where kvbandit knows less than an EPP or knows it differently, the policy
// says so: when scraped load is missing it falls back to the engine's
// in-flight counts for the queue signal, and endpoints whose scraped load
// is stale count as saturated unless every endpoint is stale (see
// [Signals]).
package weighted

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/kvbandit/kvbandit/routing"
)

// Name is the --policy value.
const Name = "weighted"

// Config holds the scorer weights (YAML `weighted.*`). The total is
// Σ weight·score, not normalised, as in GIE's scheduling profile.
type Config struct {
	// PrefixWeight weighs the prefix-cache score (default 3).
	PrefixWeight float64 `json:"prefix_weight"`
	// QueueWeight weighs the queue score (default 2).
	QueueWeight float64 `json:"queue_weight"`
	// KVCacheWeight weighs the KV-cache utilization score (default 2).
	KVCacheWeight float64 `json:"kv_cache_weight"`
}

// DefaultConfig returns the weights of GIE's last Helm default profile and
// of llm-d's former ("legacy blend") default: prefix-cache-scorer 3,
// queue-scorer 2, kv-cache-utilization-scorer 2.
func DefaultConfig() Config { return Config{PrefixWeight: 3, QueueWeight: 2, KVCacheWeight: 2} }

// Validate checks the weights: each a finite number >= 0, not all zero.
func (c Config) Validate() error {
	var errs []error
	for _, w := range []struct {
		key string
		v   float64
	}{{"prefix_weight", c.PrefixWeight}, {"queue_weight", c.QueueWeight}, {"kv_cache_weight", c.KVCacheWeight}} {
		if !(w.v >= 0) || math.IsInf(w.v, 0) {
			errs = append(errs, fmt.Errorf("weighted.%s: must be a finite number >= 0, got %v", w.key, w.v))
		}
	}
	if len(errs) == 0 && c.PrefixWeight+c.QueueWeight+c.KVCacheWeight == 0 {
		errs = append(errs, errors.New("weighted: at least one of prefix_weight, queue_weight, kv_cache_weight must be > 0"))
	}
	return errors.Join(errs...)
}

// Policy is the weighted policy. It keeps no state: it is safe for
// concurrent use and Choose has no side effects beyond drawing tie-breaks
// from the engine's random source.
type Policy struct {
	cfg Config
}

var (
	_ routing.Policy       = (*Policy)(nil)
	_ routing.OutcomeAware = (*Policy)(nil)
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

// Signal is one candidate's three scorer outputs, each in [0, 1].
type Signal struct {
	Prefix, Queue, KVCache float64
	// Saturated is set when the candidate's scraped load is stale (and
	// some other candidate's is not): Queue and KVCache are then 0.
	Saturated bool
	// InFlight is set when Queue came from the engine's in-flight counts
	// rather than scraped queue lengths.
	InFlight bool
}

// Signals computes every candidate's scorer outputs for one request.
//
//   - Prefix = Overlap / len(s.Blocks), clamped to [0, 1]; 0 when the
//     prompt has no complete block (GIE's prefix-cache-scorer with its
//     default matchLengthWeight 0, over the KV index's consecutive
//     prefix match).
//   - Queue = (max − q)/(max − min) over the non-saturated candidates, 1
//     when they are all equal (GIE's queue-scorer). q is the scraped
//     waiting-queue length when every non-stale candidate has a scrape;
//     otherwise (no scraper, a new endpoint not scraped yet, or every
//     scrape stale) q is the engine's in-flight decision count for every
//     candidate, so that one normalisation never mixes the two units.
//   - KVCache = 1 − KVUsage (GIE's kv-cache-utilization-scorer). An
//     endpoint never scraped has usage 0 (score 1), as GIE's zero-valued
//     metrics before a first scrape; when every scrape is stale, usage
//     is unknown and every candidate gets 1, which cannot change the pick.
//   - A stale candidate, when some other one is fresh, is saturated:
//     Queue = KVCache = 0 (the engine's admission rule treats it so too).
func Signals(s *routing.Scoring) []Signal {
	cands := s.Candidates
	out := make([]Signal, len(cands))
	allStale, scraped := true, true
	for i := range cands {
		if ld := cands[i].Load; !ld.Stale {
			allStale = false
			if !ld.Known {
				scraped = false
			}
		}
	}
	if allStale {
		scraped = false
	}
	queue := make([]float64, len(cands))
	lo, hi := math.Inf(1), math.Inf(-1)
	for i := range cands {
		c := &cands[i]
		if c.Load.Stale && !allStale {
			out[i].Saturated = true
			continue
		}
		q := c.Load.Waiting
		if !scraped {
			q = float64(inFlight(c))
			out[i].InFlight = true
		}
		if !(q >= 0) { // NaN or negative from a bad scrape
			q = 0
		}
		queue[i] = q
		lo, hi = min(lo, q), max(hi, q)
	}
	total := len(s.Blocks)
	for i := range cands {
		c, sig := &cands[i], &out[i]
		if total > 0 {
			sig.Prefix = min(1, max(c.EffectiveOverlap(s.TierWeights), 0)/float64(total))
		}
		if sig.Saturated {
			continue
		}
		sig.Queue = 1
		if hi > lo {
			sig.Queue = (hi - queue[i]) / (hi - lo)
		}
		usage := c.Load.KVUsage
		if allStale || !(usage >= 0) {
			usage = 0
		}
		sig.KVCache = 1 - min(usage, 1)
	}
	return out
}

// inFlight is the candidate's endpoint's in-flight decisions (shared by
// the data-parallel ranks of one endpoint; the engine counts per endpoint):
// this replica's and its peers' (routing.Live.FleetInFlight).
func inFlight(c *routing.Candidate) int64 {
	if c.State == nil || c.State.Live == nil {
		return 0
	}
	return c.State.FleetInFlight()
}

// Total is the weighted sum of a candidate's signals.
func (c Config) Total(sig Signal) float64 {
	return c.PrefixWeight*sig.Prefix + c.QueueWeight*sig.Queue + c.KVCacheWeight*sig.KVCache
}

// Choose implements [routing.Policy]. Scores are the weighted totals
// (higher is better); the highest wins, exact ties uniformly at random
// from s.Rand (GIE's max-score-picker shuffles before sorting, to the same
// effect). Ranked, when wanted, is by descending total, the chosen first.
func (p *Policy) Choose(s *routing.Scoring, _ bool) (routing.Choice, error) {
	sigs := Signals(s)
	scores := make([]float64, len(sigs))
	best, ties := -1, 0
	for i, sig := range sigs {
		scores[i] = p.cfg.Total(sig)
		switch {
		case best < 0 || scores[i] > scores[best]:
			best, ties = i, 1
		case scores[i] == scores[best]:
			ties++ // reservoir sampling over the tied candidates
			if s.Rand != nil && s.Rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	ch := routing.Choice{Index: best, Scores: scores, HigherIsBetter: true}
	if s.WantRanked {
		ch.Ranked = rank(scores, best)
	}
	return ch, nil
}

// rank orders the candidates by descending score with the chosen one first.
func rank(scores []float64, chosen int) []int {
	ranked := make([]int, len(scores))
	for i := range ranked {
		ranked[i] = i
	}
	slices.SortStableFunc(ranked, func(a, b int) int {
		switch {
		case a == chosen:
			return -1
		case b == chosen:
			return 1
		case scores[a] > scores[b]:
			return -1
		case scores[a] < scores[b]:
			return 1
		}
		return 0
	})
	return ranked
}

// Done implements [routing.Policy]; the scorers learn nothing.
func (*Policy) Done(*routing.Decision, routing.Outcome) {}

// NeedsOutcomes implements [routing.OutcomeAware]: the in-flight fallback
// of the queue score only falls when outcomes are reported.
func (*Policy) NeedsOutcomes() bool { return true }
