package kvbandit

import (
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// FromStore adapts the shared prefix store to [Prefixes]: sessions are keyed
// by (tenant, prefix id), and a session's announced work is charged to its
// pinned endpoint as the store's outstanding work.
func FromStore(s *prefixstate.Store, clk clock.Clock) Prefixes {
	return storePrefixes{s: s, clk: clock.Or(clk)}
}

type storePrefixes struct {
	s   *prefixstate.Store
	clk clock.Clock
}

// key is the request's session key, bounded (prefixstate.NewKey).
func key(r *routing.Request) prefixstate.Key {
	return prefixstate.NewKey(r.Tenant, r.Hints.PrefixID)
}

// Arrive implements [Prefixes].
func (p storePrefixes) Arrive(r *routing.Request, commit bool) (Session, bool) {
	if r.Hints.PrefixID == "" {
		return Session{}, false
	}
	reuse, last, pinned := p.s.Arrive(key(r), r.Hints.TotalRequests, commit)
	sess := Session{Reuse: reuse, LastRank: -1, Open: r.Hints.TotalRequests < 1}
	if pinned {
		sess.Last, sess.LastRank = last.Endpoint, last.DPRank
		if !last.At.IsZero() {
			sess.Since = max(p.clk.Now().Sub(last.At), 0)
		}
	}
	return sess, true
}

// Pin implements [Prefixes]. The store charges reuse·(decode+prefill)·iat
// per pin; with decode = work/reuse and iat = 1 that is the work itself.
func (p storePrefixes) Pin(r *routing.Request, ep routing.EndpointKey, rank, reuse int, work float64) {
	pin := prefixstate.Pin{Endpoint: ep, DPRank: rank, IATFactor: 1, At: p.clk.Now()}
	if reuse > 0 {
		pin.DecodeCost = work / float64(reuse)
	}
	p.s.Pin(key(r), pin, reuse)
}

// Outstanding implements [Prefixes].
func (p storePrefixes) Outstanding(ep routing.EndpointKey) float64 { return p.s.OutstandingWork(ep) }
