package sync

import (
	"cmp"
	"math"
	"slices"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// This file holds peers' claims up to the workers' own word (issue 22).
// Caps bound what one peer may claim, but within them a peer with valid
// credentials could still claim a thousand long decisions on every
// endpoint but one and herd all traffic there, or make every endpoint
// look saturated. The workers know better: vllm:num_requests_running +
// vllm:num_requests_waiting (routing/scrape) count every request on a
// worker, whichever replica sent it. So, each time an endpoint's load is
// freshly scraped, the peers' decisions applied on it are held up to what
// the worker vouches for:
//
//	vouched = running + waiting - this replica's own decisions there
//	          + SlackRequests + SlackFraction × (running + waiting)
//
// counting only decisions (local and peers') applied at least Slack
// before the scrape: younger ones may not have reached the worker when it
// was scraped. In pools with prefill-role endpoints, decisions not
// prefilled yet are left out too (a disaggregated request sits on its
// prefill worker first). When the peers claim more than vouched, the
// excess is refuted: its decisions end here (kvbandit_sync_refuted_total)
// and their outcomes will not be learnt; the others are vouched for (an
// outcome is learnt only for a decision a fresh scrape vouched for, where
// the endpoint's load is fresh: trust.go). The blame goes to the peers with
// the most claims: the vouched count is shared out max-min fairly (every
// peer keeps its claims up to a common level, the largest claimants are
// cut down to it), so an honest peer keeps its decisions unless it holds
// more than an equal share of what the worker vouches for while another
// peer over-claims. The peer that loses the most in a check gets a
// strike (one per sweep); Strikes within StrikeWindow, or one check that
// refutes QuarantineAt of its decisions, quarantine it for Quarantine:
// its decisions end, its Starts and outcomes are refused and the engine
// forgets what it taught (routing.PeerForgetter).
//
// Without fresh load (no /metrics, a stale or failed scrape) nothing is
// checked: only the caps apply.

// Defaults of ClaimCheck's zero fields (and DefaultPendingOutcomes...,
// completions.go).
const (
	DefaultClaimMaxLoadAge    = 2 * time.Second
	DefaultClaimSlack         = 250 * time.Millisecond
	DefaultClaimSlackRequests = 4
	DefaultClaimSlackFraction = 0.1
	DefaultClaimStrikes       = 3
	DefaultClaimQuarantineAt  = 32
	DefaultClaimStrikeWindow  = 30 * time.Second
	DefaultClaimQuarantine    = time.Minute
)

// ClaimCheck configures the check of peers' open decisions against the
// workers' scraped request counts. Zero fields take the defaults above.
type ClaimCheck struct {
	// Disabled turns the check off (only the caps apply).
	Disabled bool
	// MaxLoadAge: a scraped load older than this is not checked (serve:
	// two scrape intervals).
	MaxLoadAge time.Duration
	// Slack: decisions applied less than this before the scrape are not
	// expected in it yet.
	Slack time.Duration
	// SlackRequests and SlackFraction: unvouched claims tolerated per
	// endpoint, a number plus a fraction of the worker's own count (ends
	// not heard yet, requests on their way).
	SlackRequests int
	SlackFraction float64
	// Strikes checks that cut a peer down most, within StrikeWindow,
	// quarantine it for Quarantine; so does one check that refutes
	// QuarantineAt or more of its decisions (no honest peer is that far
	// off its worker's count).
	Strikes      int
	StrikeWindow time.Duration
	Quarantine   time.Duration
	QuarantineAt int
	// PendingOutcomes bounds the peers' outcomes waiting for a scrape's
	// count of finished requests on one endpoint (past it, the oldest of
	// the peer with the most there goes), PendingOutcomesTotal and
	// PendingOutcomeBytes all of them (past either, new ones are
	// dropped: reason outcome_pending_full). They wait at most
	// MaxLoadAge (completions.go).
	PendingOutcomes      int
	PendingOutcomesTotal int
	PendingOutcomeBytes  int
}

func (c *ClaimCheck) defaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.MaxLoadAge, DefaultClaimMaxLoadAge)
	def(&c.Slack, DefaultClaimSlack)
	def(&c.StrikeWindow, DefaultClaimStrikeWindow)
	def(&c.Quarantine, DefaultClaimQuarantine)
	if c.SlackRequests <= 0 {
		c.SlackRequests = DefaultClaimSlackRequests
	}
	if c.SlackFraction <= 0 || math.IsNaN(c.SlackFraction) {
		c.SlackFraction = DefaultClaimSlackFraction
	}
	if c.Strikes <= 0 {
		c.Strikes = DefaultClaimStrikes
	}
	if c.QuarantineAt <= 0 {
		c.QuarantineAt = DefaultClaimQuarantineAt
	}
	if c.PendingOutcomes <= 0 {
		c.PendingOutcomes = DefaultPendingOutcomes
	}
	if c.PendingOutcomesTotal <= 0 {
		c.PendingOutcomesTotal = DefaultPendingOutcomesTotal
	}
	if c.PendingOutcomeBytes <= 0 {
		c.PendingOutcomeBytes = DefaultPendingOutcomeBytes
	}
}

// freshLoad is one endpoint whose new scrape is to be checked.
type freshLoad struct {
	sl    engine.ScrapedLoad
	cut   time.Time // decisions applied before it are expected in the scrape
	local int       // this replica's own decisions applied before cut, open now
	own   int       // this replica's own outcomes there ended by the scrape (completions.go)
}

// claimCheckState is the flusher's own state of the check (sweep only).
type claimCheckState struct {
	loads   []engine.ScrapedLoad
	checked map[routing.EndpointKey]time.Time // the last scrape checked
	fresh   []freshLoad
	claims  map[routing.EndpointKey][]claim
	pd      bool // the pool has prefill-role endpoints
}

// claim is one peer decision on the endpoint being checked.
type claim struct {
	p  *peer
	id uint64
	r  *remote
}

// freshLoads returns the endpoints with a scrape not checked yet, fresh
// enough, with this replica's own decisions that scrape should count. It
// takes s.lmu (the local in-flight set), not s.rmu.
func (s *Syncer) freshLoads(now time.Time) []freshLoad {
	c := &s.claims
	lr, ok := s.eng.(LoadReader)
	if s.cfg.Claims.Disabled || !ok {
		return nil
	}
	c.loads = lr.ScrapedLoads(c.loads[:0])
	c.fresh, c.pd = c.fresh[:0], false
	if c.checked == nil {
		c.checked = make(map[routing.EndpointKey]time.Time)
	}
	idx := make(map[routing.EndpointKey]int)
	for _, sl := range c.loads {
		c.pd = c.pd || sl.Role == routing.RolePrefill
		ld := sl.Load
		if !ld.Known || ld.Stale || sl.At.IsZero() || now.Sub(sl.At) > s.cfg.Claims.MaxLoadAge || !sl.At.After(c.checked[sl.Endpoint]) {
			continue
		}
		c.checked[sl.Endpoint] = sl.At
		idx[sl.Endpoint] = len(c.fresh)
		c.fresh = append(c.fresh, freshLoad{sl: sl, cut: sl.At.Add(-s.cfg.Claims.Slack)})
	}
	if len(c.checked) > 2*len(c.loads)+16 {
		clear(c.checked) // endpoints that left; at worst one scrape is checked twice
	}
	s.lmu.Lock()
	defer s.lmu.Unlock()
	s.trimOwnLocked(now)
	if len(c.fresh) == 0 {
		return nil
	}
	for i := range c.fresh {
		c.fresh[i].own = s.takeOwnLocked(c.fresh[i].sl.Endpoint, c.fresh[i].sl.At)
	}
	for id, st := range s.inflight {
		i, ok := idx[routing.EndpointKey(st.Endpoint)]
		if ok && s.inflightAt[id].Before(c.fresh[i].cut) && (!c.pd || st.Prefilled) {
			c.fresh[i].local++
		}
	}
	return c.fresh
}

// checkClaims refutes peers' decisions the fresh scrapes do not vouch
// for, and strikes the peer cut down most on each endpoint (s.rmu held).
func (s *Syncer) checkClaims(fresh []freshLoad, now time.Time) {
	if len(fresh) == 0 {
		return
	}
	c := &s.claims
	if c.claims == nil {
		c.claims = make(map[routing.EndpointKey][]claim)
	}
	for i := range fresh {
		c.claims[fresh[i].sl.Endpoint] = c.claims[fresh[i].sl.Endpoint][:0]
	}
	for _, p := range s.peers {
		for id, r := range p.decisions {
			list, ok := c.claims[r.endpoint]
			if ok && !r.rd.Ended() && (!c.pd || r.prefilled) {
				c.claims[r.endpoint] = append(list, claim{p, id, r})
			}
		}
	}
	struck := map[*peer]int{} // the most refuted on one endpoint
	for i := range fresh {
		if p, n := s.refute(&fresh[i], c.claims[fresh[i].sl.Endpoint], now); p != nil {
			struck[p] = max(struck[p], n)
		}
		clear(c.claims[fresh[i].sl.Endpoint]) // drop the pointers
	}
	s.checkCompletions(fresh, now, struck)
	for p, n := range struck {
		s.strike(p, now, n >= s.cfg.Claims.QuarantineAt)
	}
	if len(c.claims) > 2*len(c.loads)+16 {
		c.claims = nil
	}
}

// refute checks one endpoint's claims against its fresh load, ends the
// unvouched ones, and returns the peer that lost the most and how many
// (nil when none lost any, or two lost as many).
func (s *Syncer) refute(f *freshLoad, all []claim, now time.Time) (*peer, int) {
	old := all[:0:0]
	for _, cl := range all {
		if cl.r.applied.Before(f.cut) {
			old = append(old, cl)
		}
	}
	worker := math.Ceil(f.sl.Load.Running + f.sl.Load.Waiting)
	cc := &s.cfg.Claims
	vouched := max(int(worker)-f.local, 0) + cc.SlackRequests + int(math.Ceil(cc.SlackFraction*worker))
	if len(old) <= vouched {
		for _, cl := range old {
			cl.r.vouched = true
		}
		return nil, 0
	}
	byPeer := map[*peer][]claim{}
	for _, cl := range old {
		byPeer[cl.p] = append(byPeer[cl.p], cl)
	}
	cut := fairCut(byPeer, vouched)
	defer func() {
		for _, cl := range old {
			if !cl.r.rd.Ended() {
				cl.r.vouched = true // counted by the worker (what is left)
			}
		}
	}()
	var top *peer
	most, tie, total := 0, false, 0
	for p, n := range cut {
		list := byPeer[p]
		slices.SortFunc(list, func(a, b claim) int { return a.r.applied.Compare(b.r.applied) })
		for _, cl := range list[:n] { // the oldest first
			p.release(cl.id, cl.r, now, true, false)
		}
		total += n
		switch {
		case n > most:
			top, most, tie = p, n, false
		case n == most:
			tie = true
		}
	}
	s.m.refuted.Add(float64(total))
	if top != nil {
		s.refuteLine(now, "peers' decisions refuted: the worker's own request count does not vouch for them",
			"endpoint", f.sl.Endpoint, "worker_requests", worker, "local", f.local, "claimed", len(old), "refuted", total, "most_refuted_peer", top.replica, "its_refuted", most)
	}
	if tie {
		return nil, 0
	}
	return top, most
}

// fairCut shares vouched claims out max-min fairly among the peers
// (fairLoss) and returns how many claims each peer loses (only peers that
// lose some).
func fairCut(byPeer map[*peer][]claim, vouched int) map[*peer]int {
	n := make(map[*peer]int, len(byPeer))
	for p, l := range byPeer {
		n[p] = len(l)
	}
	return fairLoss(n, vouched)
}

// fairLoss shares a budget out max-min fairly among peers holding n[p]
// items each (every peer keeps its items up to a common level; what is
// left of a level goes to the peers with fewer) and returns how many
// items each peer loses (only peers that lose some).
func fairLoss(n map[*peer]int, vouched int) map[*peer]int {
	type share struct {
		p *peer
		n int
	}
	shares := make([]share, 0, len(n))
	for p, k := range n {
		shares = append(shares, share{p, k})
	}
	slices.SortFunc(shares, func(a, b share) int {
		return cmp.Or(cmp.Compare(a.n, b.n), cmp.Compare(a.p.replica, b.p.replica))
	})
	cut := map[*peer]int{}
	left := vouched
	for i, sh := range shares {
		k := len(shares) - i
		if sh.n*k <= left {
			left -= sh.n
			continue
		}
		level, extra := left/k, left%k
		for j, rest := range shares[i:] {
			keep := level
			if j < extra {
				keep++
			}
			if rest.n > keep {
				cut[rest.p] = rest.n - keep
			}
		}
		break
	}
	return cut
}

// refuteLine writes a refutation line within its budget.
func (s *Syncer) refuteLine(now time.Time, msg string, args ...any) {
	ok, held := s.refuteLines.take(now)
	if !ok {
		return
	}
	if held > 0 {
		args = append(args, "lines_held_back", held)
	}
	s.log.Warn(msg, args...)
}
