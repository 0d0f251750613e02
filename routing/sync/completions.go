package sync

import (
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// This file vouches for peers' outcomes with the workers' own count of
// the requests they finished (issue 22). A decision that opens and closes
// between two scrapes is one no gauge ever saw, so vouching for outcomes
// with running + waiting (vouch.go) drops the honest outcomes of every
// request shorter than about a scrape interval: about 70% of them in the
// e2e runs, and all of them for tool calls and classification. The
// workers also count what they finish: vllm:request_success_total (every
// finish reason), sglang:num_requests_total (routing/scrape,
// routing.Load.Finished). Between two fresh scrapes of an endpoint its
// increase is how many requests the worker finished, sent by every
// replica together; this replica knows how many were its own (OnDone
// counts them by the time they ended), and the rest is what its peers'
// outcomes there may add up to:
//
//	budget = increase - own outcomes ended by the scrape + carry
//
// A decrease of the counter is a worker restart: the increase is then the
// new count (counted since the restart). carry is what the last check
// left unused (outcomes still in transit then) or took too much (own
// outcomes ended after the worker counted them), at most
// SlackRequests + SlackFraction × increase either way: a budget nobody
// uses cannot pile up for a rogue to spend later.
//
// So a peer's successful outcome on an endpoint that exports the counter
// and was freshly scraped is held in a pending queue (per endpoint,
// oldest first, bounded in count, bytes and age) until the next fresh
// scrape's check, which learns the pending outcomes that arrived by the
// scrape as far as the budget goes, shared out max-min fairly among the
// peers (fairLoss, as the claims are), oldest first within a peer. The
// rest is dropped (outcome_unvouched), but for outcomes that arrived less
// than Claims.Slack before the scrape: those may be the next scrape's,
// and wait for it. The peer that loses the most outcomes in a check, more
// than the slack, gets a strike (QuarantineAt of them at once quarantine
// it), as for refuted claims. An outcome is learnt up to a scrape
// interval (and a sweep) late.
//
// Outcomes of other kinds (errors, cancellations: the counters do not
// count them all), and endpoints that do not export the counter keep the
// rule of vouch.go (a scrape counted the decision while it was open);
// endpoints without fresh load, only the caps.

// Defaults of the pending queue (ClaimCheck's zero fields).
const (
	DefaultPendingOutcomes      = 2048
	DefaultPendingOutcomesTotal = 16384
	DefaultPendingOutcomeBytes  = 8 << 20
)

// ownCap bounds the own outcomes kept per endpoint between two checks
// (the oldest half goes past it); they are kept at most ownKeep ×
// Claims.MaxLoadAge.
const (
	ownCap  = 1 << 16
	ownKeep = 4
)

// pendingOutcome is a peer's outcome waiting for a scrape's count.
type pendingOutcome struct {
	p       *peer
	at      time.Time // arrival, this replica's clock
	o       routing.RemoteOutcome
	vouched bool // a scrape counted its decision open (vouch.go)
	size    int
}

// ledger is one endpoint's count of finished requests, as far as the
// checks have seen it, and the peers' outcomes waiting for it.
type ledger struct {
	known    bool // finished and at are a baseline
	finished float64
	at       time.Time
	carry    int
	pending  []pendingOutcome // arrival order
	byPeer   map[*peer]int    // pending outcomes per peer
}

// completions is the state of the outcome check (s.rmu).
type completions struct {
	ledgers map[routing.EndpointKey]*ledger
	n       int // pending outcomes, all endpoints
	bytes   int
}

// vouchMode is how a peer's outcome is vouched for.
type vouchMode int

const (
	vouchNone    vouchMode = iota // no fresh load: only the caps
	vouchScrape                   // a scrape saw its decision open
	vouchCounter                  // the worker's count of finished requests
)

// recordOwnLocked counts one of this replica's own outcomes (s.lmu held): a
// success on the endpoint that served it.
func (s *Syncer) recordOwnLocked(ep routing.EndpointKey, at time.Time) {
	if s.own == nil {
		s.own = make(map[routing.EndpointKey][]int64)
	}
	l := s.own[ep]
	if len(l) >= ownCap {
		l = append(l[:0], l[len(l)/2:]...)
	}
	s.own[ep] = append(l, at.UnixNano())
}

// takeOwnLocked returns how many own outcomes on ep ended by at, and
// forgets them (s.lmu held).
func (s *Syncer) takeOwnLocked(ep routing.EndpointKey, at time.Time) int {
	l := s.own[ep]
	cut := at.UnixNano()
	n := 0
	for n < len(l) && l[n] <= cut {
		n++
	}
	if n > 0 {
		s.own[ep] = append(l[:0], l[n:]...)
	}
	return n
}

// trimOwnLocked forgets own outcomes too old for any check (s.lmu held).
func (s *Syncer) trimOwnLocked(now time.Time) {
	old := now.Add(-ownKeep * s.cfg.Claims.MaxLoadAge).UnixNano()
	for ep, l := range s.own {
		n := 0
		for n < len(l) && l[n] < old {
			n++
		}
		if n == len(l) {
			delete(s.own, ep)
		} else if n > 0 {
			s.own[ep] = append(l[:0], l[n:]...)
		}
	}
}

// fresh reports whether sl is a load the checks use now.
func (s *Syncer) fresh(sl engine.ScrapedLoad, now time.Time) bool {
	return sl.Load.Known && !sl.Load.Stale && !sl.At.IsZero() && now.Sub(sl.At) <= s.cfg.Claims.MaxLoadAge
}

// vouchModeOf says how ro is vouched for, and on which endpoint's count
// (the one that served it).
func (s *Syncer) vouchModeOf(ro *routing.RemoteOutcome, now time.Time) (vouchMode, routing.EndpointKey) {
	lr, ok := s.eng.(LoadReader)
	if s.cfg.Claims.Disabled || !ok {
		return vouchNone, ""
	}
	key := ro.Endpoint
	if ro.Served != "" {
		key = ro.Served
	}
	if ro.Kind == routing.OutcomeSuccess {
		if sl, ok := lr.ScrapedLoadOf(key); ok && sl.Load.FinishedKnown && s.fresh(sl, now) {
			return vouchCounter, key
		}
	}
	if s.freshLoad(ro.Endpoint, now) {
		return vouchScrape, ""
	}
	return vouchNone, ""
}

// hold queues ro for the next check of ep's count, within the queue's
// bounds: past the endpoint's, the oldest outcome of the peer with the
// most there goes (or ro, if that is its own peer); past the total, ro
// is dropped (outcome_pending_full).
func (s *Syncer) hold(p *peer, ro routing.RemoteOutcome, vouched bool, ep routing.EndpointKey, now time.Time) {
	c, cc := &s.done, &s.cfg.Claims
	size := 256 + len(ro.Endpoint) + len(ro.Served) + len(ro.PrefixID) + len(ro.Tenant) + len(ro.Model) + len(ro.Peer)
	if c.n >= cc.PendingOutcomesTotal || c.bytes+size > cc.PendingOutcomeBytes {
		s.m.rejected.WithLabelValues("outcome_pending_full").Inc()
		return
	}
	l := s.ledgerOf(ep)
	if len(l.pending) >= cc.PendingOutcomes && !s.evictPending(l, p) {
		s.m.rejected.WithLabelValues("outcome_pending_full").Inc()
		return
	}
	l.pending = append(l.pending, pendingOutcome{p: p, at: now, o: ro, vouched: vouched, size: size})
	l.byPeer[p]++
	c.n++
	c.bytes += size
}

// evictPending drops the oldest pending outcome of the peer with the
// most on l, unless that is p (then false: p's new one goes instead).
func (s *Syncer) evictPending(l *ledger, p *peer) bool {
	var top *peer
	for q, n := range l.byPeer {
		if top == nil || n > l.byPeer[top] || (n == l.byPeer[top] && q.replica < top.replica) {
			top = q
		}
	}
	if top == nil || top == p || l.byPeer[top] <= l.byPeer[p] {
		return false
	}
	for i := range l.pending {
		if l.pending[i].p == top {
			s.unpend(l, i)
			s.m.rejected.WithLabelValues("outcome_pending_full").Inc()
			return true
		}
	}
	return false
}

// unpend removes l.pending[i].
func (s *Syncer) unpend(l *ledger, i int) {
	s.forgetPending(l, &l.pending[i])
	last := len(l.pending) - 1
	copy(l.pending[i:], l.pending[i+1:])
	l.pending[last] = pendingOutcome{} // drop its strings and peer
	l.pending = l.pending[:last]
}

// forgetPending takes po out of the counts.
func (s *Syncer) forgetPending(l *ledger, po *pendingOutcome) {
	if l.byPeer[po.p]--; l.byPeer[po.p] <= 0 {
		delete(l.byPeer, po.p)
	}
	s.done.n--
	s.done.bytes -= po.size
}

func (s *Syncer) ledgerOf(ep routing.EndpointKey) *ledger {
	c := &s.done
	if c.ledgers == nil {
		c.ledgers = make(map[routing.EndpointKey]*ledger)
	}
	l := c.ledgers[ep]
	if l == nil {
		l = &ledger{byPeer: make(map[*peer]int)}
		c.ledgers[ep] = l
	}
	return l
}

// teach hands a vouched outcome to the engine.
func (s *Syncer) teach(ro routing.RemoteOutcome) {
	if err := s.eng.LearnRemote(ro); err != nil {
		s.reject(err)
	}
}

// advance moves l's baseline to the scrape's count w and returns the
// requests finished since the last one; false when there was no baseline
// (the first scrape, or the last one too long ago).
func (l *ledger) advance(w float64, at time.Time, maxGap time.Duration) (int, bool) {
	had := l.known && at.Sub(l.at) <= maxGap
	inc := w - l.finished
	if inc < 0 {
		inc = w // the worker restarted: its count began again at 0
	}
	l.known, l.finished, l.at = true, w, at
	if !had {
		l.carry = 0
		return 0, false
	}
	return int(math.Min(math.Round(inc), 1<<30)), true
}

// checkCompletions vouches for the pending outcomes of every endpoint
// freshly scraped (s.rmu held), and adds to struck the peer that lost
// the most outcomes on an endpoint, past the slack.
func (s *Syncer) checkCompletions(fresh []freshLoad, now time.Time, struck map[*peer]int) {
	for i := range fresh {
		f := &fresh[i]
		l := s.done.ledgers[f.sl.Endpoint]
		if l == nil {
			if !f.sl.Load.FinishedKnown {
				continue
			}
			l = s.ledgerOf(f.sl.Endpoint)
		}
		if p, n := s.vouchLedger(l, f, now); p != nil {
			struck[p] = max(struck[p], n)
		}
	}
}

// vouchLedger checks the outcomes pending on one endpoint that arrived by
// its fresh scrape against the worker's count: it learns what the budget
// covers and drops the rest, but for the young ones (they wait for the
// next scrape). It returns the peer that lost the most, past the slack,
// and how many (nil: none, or a tie).
func (s *Syncer) vouchLedger(l *ledger, f *freshLoad, now time.Time) (*peer, int) {
	if l.known && !f.sl.At.After(l.at) {
		return nil, 0 // this scrape was counted already
	}
	k := 0 // the outcomes that arrived by the scrape: a prefix
	for k < len(l.pending) && !l.pending[k].at.After(f.sl.At) {
		k++
	}
	if !f.sl.Load.FinishedKnown {
		l.known = false
		s.settlePending(l, k, now)
		return nil, 0
	}
	inc, ok := l.advance(f.sl.Load.Finished, f.sl.At, 2*s.cfg.Claims.MaxLoadAge)
	if !ok {
		s.settlePending(l, k, now) // no baseline yet: the rule of vouch.go
		return nil, 0
	}
	cc := &s.cfg.Claims
	tol := cc.SlackRequests + int(math.Ceil(cc.SlackFraction*float64(inc)))
	budget := inc - f.own + l.carry
	keep := map[*peer]int{}
	for _, po := range l.pending[:k] {
		keep[po.p]++
	}
	for p, n := range fairLoss(keep, max(budget, 0)) {
		keep[p] -= n
	}
	young := f.sl.At.Add(-cc.Slack)
	dropped := map[*peer]int{}
	learned, w := 0, 0
	for r := range k {
		po := l.pending[r]
		switch {
		case keep[po.p] > 0:
			keep[po.p]--
			learned++
			s.forgetPending(l, &po)
			s.teach(po.o)
		case po.at.After(young):
			l.pending[w] = po // it may be the next scrape's
			w++
		default:
			dropped[po.p]++
			s.forgetPending(l, &po)
			s.m.rejected.WithLabelValues("outcome_unvouched").Inc()
		}
	}
	s.compact(l, w, k)
	l.carry = min(max(budget-learned, -tol), tol)
	s.m.vouched.Add(float64(learned))
	return topLoser(dropped, tol)
}

// compact keeps l.pending[:w] (the deferred ones) and l.pending[k:].
func (s *Syncer) compact(l *ledger, w, k int) {
	n := copy(l.pending[w:], l.pending[k:])
	clear(l.pending[w+n:])
	l.pending = l.pending[:w+n]
	if len(l.pending) == 0 && cap(l.pending) > 256 {
		l.pending = nil // a burst's array
	}
}

// settlePending decides the first k pending outcomes of l by the rule
// of vouch.go (a scrape saw the decision open, where the decision's
// endpoint has fresh load).
func (s *Syncer) settlePending(l *ledger, k int, now time.Time) {
	for i := range k {
		po := &l.pending[i]
		s.forgetPending(l, po)
		if !po.vouched && s.freshLoad(po.o.Endpoint, now) {
			s.m.rejected.WithLabelValues("outcome_unvouched").Inc()
		} else {
			s.teach(po.o)
		}
	}
	s.compact(l, 0, k)
}

// topLoser returns the peer that lost the most, if more than tol and
// alone.
func topLoser(lost map[*peer]int, tol int) (*peer, int) {
	var top *peer
	most, tie := 0, false
	for p, n := range lost {
		switch {
		case n > most:
			top, most, tie = p, n, false
		case n == most:
			tie = true
		}
	}
	if top == nil || tie || most <= tol {
		return nil, 0
	}
	return top, most
}

// expirePending settles outcomes pending for longer than
// Claims.MaxLoadAge (no fresh scrape came to count them: the endpoint's
// load went stale) by the rule of vouch.go, and drops the ledgers of
// endpoints that left (s.rmu held).
func (s *Syncer) expirePending(now time.Time) {
	lr, ok := s.eng.(LoadReader)
	if !ok {
		return
	}
	old := now.Add(-s.cfg.Claims.MaxLoadAge)
	for ep, l := range s.done.ledgers {
		if _, ok := lr.ScrapedLoadOf(ep); !ok {
			for i := range l.pending {
				s.forgetPending(l, &l.pending[i])
				s.m.rejected.WithLabelValues("unknown_endpoint").Inc()
			}
			delete(s.done.ledgers, ep)
			continue
		}
		k := 0
		for k < len(l.pending) && l.pending[k].at.Before(old) {
			k++
		}
		s.settlePending(l, k, now)
	}
}

// dropPendingOf drops p's pending outcomes (it left, was evicted or
// quarantined: what it taught is being forgotten).
func (s *Syncer) dropPendingOf(p *peer) {
	for _, l := range s.done.ledgers {
		if l.byPeer[p] == 0 {
			continue
		}
		w := 0
		for _, po := range l.pending {
			if po.p == p {
				s.forgetPending(l, &po)
				s.m.rejected.WithLabelValues("outcome_peer_gone").Inc()
				continue
			}
			l.pending[w] = po
			w++
		}
		s.compact(l, w, len(l.pending))
	}
}

// pendingOutcomes counts the outcomes pending now (a gauge).
func (s *Syncer) pendingOutcomes() float64 {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	return float64(s.done.n)
}
