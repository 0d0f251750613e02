// Package roundrobin implements the round_robin policy: candidates in turn,
// ignoring load and cache contents.
package roundrobin

import (
	"sync/atomic"

	"github.com/kvbandit/kvbandit/routing"
)

// Name is the --policy value.
const Name = "round_robin"

// Policy cycles through the candidates. The counter is shared by all
// requests, so with a changing candidate list the rotation is approximate.
type Policy struct {
	next atomic.Uint64
	// nextPrefill is the prefill role's own rotation (P/D).
	nextPrefill atomic.Uint64
}

var (
	_ routing.Policy         = (*Policy)(nil)
	_ routing.PrefillChooser = (*Policy)(nil)
)

// New returns a round-robin policy.
func New() *Policy { return &Policy{} }

// Name implements [routing.Policy].
func (*Policy) Name() string { return Name }

// Choose implements [routing.Policy].
func (p *Policy) Choose(s *routing.Scoring, commit bool) (routing.Choice, error) {
	return turn(&p.next, s, commit), nil
}

// ChoosePrefill implements [routing.PrefillChooser]: the prefill
// candidates in turn, with a rotation of their own.
func (p *Policy) ChoosePrefill(s *routing.Scoring, commit bool) (routing.Choice, error) {
	return turn(&p.nextPrefill, s, commit), nil
}

// turn takes the next candidate of the rotation next (advancing it when
// commit).
func turn(next *atomic.Uint64, s *routing.Scoring, commit bool) routing.Choice {
	cands := s.Candidates
	var n uint64
	if commit {
		n = next.Add(1) - 1
	} else {
		n = next.Load()
	}
	i := int(n % uint64(len(cands)))
	ranked := make([]int, len(cands))
	for k := range ranked {
		ranked[k] = (i + k) % len(cands)
	}
	return routing.Choice{Index: i, Ranked: ranked}
}

// Done implements [routing.Policy]; round robin learns nothing.
func (*Policy) Done(*routing.Decision, routing.Outcome) {}
