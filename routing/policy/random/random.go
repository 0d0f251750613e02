// Package random implements the random policy: a uniformly random candidate.
package random

import "github.com/kvbandit/kvbandit/routing"

// Name is the --policy value.
const Name = "random"

// Policy picks uniformly at random from a seeded source.
type Policy struct {
	rnd *routing.Rand
}

var _ routing.Policy = (*Policy)(nil)

// New returns the policy drawing from rnd.
func New(rnd *routing.Rand) *Policy { return &Policy{rnd: rnd} }

// Name implements [routing.Policy].
func (*Policy) Name() string { return Name }

// Choose implements [routing.Policy].
func (p *Policy) Choose(s *routing.Scoring, _ bool) (routing.Choice, error) {
	cands := s.Candidates
	i := p.rnd.IntN(len(cands))
	ranked := make([]int, 0, len(cands))
	ranked = append(ranked, i)
	for k := range cands {
		if k != i {
			ranked = append(ranked, k)
		}
	}
	return routing.Choice{Index: i, Ranked: ranked}, nil
}

// Done implements [routing.Policy].
func (*Policy) Done(*routing.Decision, routing.Outcome) {}
