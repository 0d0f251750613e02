// Package leastloaded implements the least_loaded policy: the candidate
// with the fewest in-flight requests, ties broken at random. In-flight
// requests are the fleet's as far as the engine knows: this replica's
// and, with active-active replicas, its peers' (routing.Live.FleetInFlight).
package leastloaded

import (
	"slices"

	"github.com/kvbandit/kvbandit/routing"
)

// Name is the --policy value.
const Name = "least_loaded"

// Policy picks the candidate with the fewest in-flight decisions. Ties are
// broken at random, never by list position, so that replicas of kvbandit
// that see the same counts do not herd onto the first endpoint.
type Policy struct {
	rnd *routing.Rand
}

var _ routing.Policy = (*Policy)(nil)

// New returns the policy drawing tie-breaks from rnd.
func New(rnd *routing.Rand) *Policy { return &Policy{rnd: rnd} }

// Name implements [routing.Policy].
func (*Policy) Name() string { return Name }

// Choose implements [routing.Policy]. Scores are the negated in-flight
// counts (higher is better).
func (p *Policy) Choose(s *routing.Scoring, _ bool) (routing.Choice, error) {
	cands := s.Candidates
	scores := make([]float64, len(cands))
	best, ties := int64(-1), 0
	choice := 0
	for i := range cands {
		n := cands[i].State.FleetInFlight()
		scores[i] = -float64(n)
		switch {
		case best < 0 || n < best:
			best, ties, choice = n, 1, i
		case n == best:
			// Reservoir sampling over the tied candidates.
			ties++
			if p.rnd.IntN(ties) == 0 {
				choice = i
			}
		}
	}
	ranked := make([]int, len(cands))
	for i := range ranked {
		ranked[i] = i
	}
	slices.SortStableFunc(ranked, func(a, b int) int {
		switch {
		case a == choice:
			return -1
		case b == choice:
			return 1
		case scores[a] > scores[b]:
			return -1
		case scores[a] < scores[b]:
			return 1
		}
		return 0
	})
	return routing.Choice{Index: choice, Ranked: ranked, Scores: scores, HigherIsBetter: true}, nil
}

// Done implements [routing.Policy]; the engine already released the
// in-flight count.
func (*Policy) Done(*routing.Decision, routing.Outcome) {}

// NeedsOutcomes implements [routing.OutcomeAware]: in-flight counts only
// fall when outcomes are reported.
func (*Policy) NeedsOutcomes() bool { return true }
