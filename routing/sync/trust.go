package sync

import (
	"context"
	"log/slog"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// This file bounds what one peer can make this replica believe, even with
// valid credentials (issue 22): how much it may claim at once (caps on
// its open decisions and prefill tokens, and per decision no more tokens
// than a worker's KV cache holds), which of its outcomes are learnt
// (only those of its own decisions applied here and not refuted, once
// each, and only if their timings fit this replica's own clock), and the
// quarantine of a peer whose claims the workers refute again and again
// (vouch.go). Everything here runs under s.rmu.

// endedCap bounds the recently ended decisions kept per peer to match
// their outcomes (an outcome follows its End in the same batch).
const endedCap = 1024

// peerTrust is what this replica keeps of one peer to bound it.
type peerTrust struct {
	// prefill is the prompt tokens of its open decisions not prefilled
	// yet (MaxPeerPrefillTokens).
	prefill int64
	// ended are its recently ended decisions, for their outcomes.
	ended map[uint64]endedDecision
	order []uint64 // ended's ids, oldest first (a ring of endedCap)
	next  int
}

// endedDecision is an ended peer decision whose outcome may still come.
type endedDecision struct {
	endpoint                  routing.EndpointKey
	rank                      int32
	applied, endedAt          time.Time
	refuted, learned, vouched bool
}

// remember keeps an ended decision for its outcome, forgetting the
// oldest past endedCap.
func (t *peerTrust) remember(id uint64, d endedDecision) {
	if t.ended == nil {
		t.ended = make(map[uint64]endedDecision)
	}
	if len(t.order) < endedCap {
		t.order = append(t.order, id)
	} else {
		delete(t.ended, t.order[t.next])
		t.order[t.next] = id
		t.next = (t.next + 1) % endedCap
	}
	t.ended[id] = d
}

// pruneEnded forgets ended decisions older than keep, refuted ones
// older than keepRefuted (the peer's snapshots list them while it keeps
// them open: they must not be applied again).
func (t *peerTrust) pruneEnded(now time.Time, keep, keepRefuted time.Duration) {
	for id, d := range t.ended {
		if age := now.Sub(d.endedAt); age > keepRefuted || (!d.refuted && age > keep) {
			delete(t.ended, id)
		}
	}
	if len(t.ended) == 0 {
		t.ended, t.order, t.next = nil, nil, 0
	}
}

// admit decides whether a peer's new Start may be applied: "" when it
// may, else the reason it is refused (counted by the caller).
func (s *Syncer) admit(p *peer, st *wire.Start, now time.Time) string {
	switch {
	case s.quarantined(p.replica, now):
		return "quarantined"
	case p.trust.ended[st.ID].refuted:
		return "refuted"
	case len(p.decisions) >= s.cfg.MaxPeerInFlight:
		return "peer_inflight"
	case !st.Prefilled && p.trust.prefill+int64(st.ISL) > s.cfg.MaxPeerPrefillTokens:
		return "peer_prefill_tokens"
	}
	if lr, ok := s.eng.(LoadReader); ok {
		// No worker holds a prompt longer than its KV cache.
		if sl, ok := lr.ScrapedLoadOf(routing.EndpointKey(st.Endpoint)); ok && sl.KVCapacityTokens > 0 && int64(st.ISL) > int64(sl.KVCapacityTokens) {
			return "over_kv_capacity"
		}
	}
	return ""
}

// applied records a decision just applied with StartRemote.
func (p *peer) applied(id uint64, st *wire.Start, r *remote, now time.Time) {
	r.applied, r.endpoint, r.rank, r.isl = now, routing.EndpointKey(st.Endpoint), st.DPRank, int64(st.ISL)
	p.trust.prefill += r.isl
	p.decisions[id] = r
	if st.Prefilled {
		p.setPrefilled(r)
	}
}

// setPrefilled marks a decision's first token: its prompt stops counting
// as the peer's prefill tokens.
func (p *peer) setPrefilled(r *remote) {
	r.rd.Prefilled()
	if !r.prefilled {
		r.prefilled = true
		p.trust.prefill -= r.isl
	}
}

// release ends one decision (if the engine has not already) and forgets
// it; unless gone, it is kept for its outcome, marked refuted or not.
func (p *peer) release(id uint64, r *remote, now time.Time, refuted, gone bool) {
	r.rd.End()
	if !r.prefilled {
		p.trust.prefill -= r.isl
	}
	delete(p.decisions, id)
	if !gone {
		p.trust.remember(id, endedDecision{endpoint: r.endpoint, rank: r.rank, applied: r.applied, endedAt: now, refuted: refuted, learned: r.learned, vouched: r.vouched})
	}
}

// learn applies a peer's outcome if it is one of the peer's own decisions
// applied here and not refuted, not learnt yet, with the decision's
// endpoint and rank, timings that fit how long the decision was open on
// this replica's clock, and, where the endpoint's load is freshly
// scraped, vouched for: a success on an endpoint that exports its count
// of finished requests waits for the next scrape's count
// (completions.go); any other, by a scrape that counted its decision
// open (a decision opened and closed between two scrapes is one no
// gauge saw). So a peer's outcomes never outnumber the requests the
// workers counted. Anything else is counted by reason.
func (s *Syncer) learn(p *peer, o *wire.Outcome, now time.Time) {
	reason, vouched := s.checkOutcome(p, o, now)
	if reason != "" {
		s.m.rejected.WithLabelValues(reason).Inc()
		return
	}
	ro := remoteOutcome(o)
	ro.Peer = p.replica
	switch mode, ep := s.vouchModeOf(&ro, now); {
	case mode == vouchCounter:
		s.hold(p, ro, vouched, ep, now)
	case mode == vouchScrape && !vouched:
		s.m.rejected.WithLabelValues("outcome_unvouched").Inc()
	default:
		s.teach(ro)
	}
}

// checkOutcome returns why o is not learnt ("" when it may be) and
// whether a scrape counted its decision open, and marks its decision
// learnt.
func (s *Syncer) checkOutcome(p *peer, o *wire.Outcome, now time.Time) (string, bool) {
	if s.quarantined(p.replica, now) {
		return "quarantined", false
	}
	var ep routing.EndpointKey
	var rank int32
	var applied, until time.Time
	ended, vouched := false, false
	if r, ok := p.decisions[o.ID]; ok {
		if r.learned {
			return "outcome_duplicate", false
		}
		r.learned = true
		ep, rank, applied, until, vouched = r.endpoint, r.rank, r.applied, now, r.vouched
	} else if d, ok := p.trust.ended[o.ID]; ok {
		switch {
		case d.refuted:
			return "outcome_refuted", false
		case d.learned:
			return "outcome_duplicate", false
		}
		d.learned = true
		p.trust.ended[o.ID] = d
		ep, rank, applied, until, ended, vouched = d.endpoint, d.rank, d.applied, d.endedAt, true, d.vouched
	} else {
		return "outcome_unmatched", false
	}
	if routing.EndpointKey(o.Endpoint) != ep || o.DPRank != rank {
		return "outcome_mismatch", false
	}
	// Open here from its Start's arrival to its End's (or now): the peer
	// timed the same span on its own clock, give or take the sync delay.
	open, slack := until.Sub(applied), s.cfg.OutcomeSlack
	ttft := time.Duration(o.TTFTMicros) * time.Microsecond
	lat := time.Duration(o.LatencyMicros) * time.Microsecond
	if ttft > open+slack || lat > open+slack || (ended && lat > 0 && lat+slack < open) {
		return "outcome_implausible", false
	}
	return "", vouched
}

// freshLoad reports whether the claim check applies to ep now: its load
// was scraped within Claims.MaxLoadAge.
func (s *Syncer) freshLoad(ep routing.EndpointKey, now time.Time) bool {
	lr, ok := s.eng.(LoadReader)
	if s.cfg.Claims.Disabled || !ok {
		return false
	}
	sl, ok := lr.ScrapedLoadOf(ep)
	return ok && sl.Load.Known && !sl.Load.Stale && !sl.At.IsZero() && now.Sub(sl.At) <= s.cfg.Claims.MaxLoadAge
}

// forgetPeer ends a peer's decisions and has the engine drop what the
// peer taught it (routing.PeerForgetter): the peer went silent, was
// evicted as a newcomer or was quarantined.
func (s *Syncer) forgetPeer(p *peer) {
	p.endAll()
	p.trust = peerTrust{}
	s.dropPendingOf(p)
	if f, ok := s.eng.(routing.PeerForgetter); ok {
		f.ForgetPeer(p.replica)
	}
}

// LoadReader is what the claim checks need of the engine beyond Engine:
// the workers' scraped load (*engine.Engine implements it). Without it
// only the caps apply.
type LoadReader interface {
	ScrapedLoads(dst []engine.ScrapedLoad) []engine.ScrapedLoad
	ScrapedLoadOf(ep routing.EndpointKey) (engine.ScrapedLoad, bool)
}

var (
	_ LoadReader            = (*engine.Engine)(nil)
	_ routing.PeerForgetter = (*engine.Engine)(nil)
)

// suspect is a replica id whose claims were refuted (strikes within the
// strike window) or that is quarantined.
type suspect struct {
	strikes []time.Time
	until   time.Time // quarantined until
}

// quarantined reports whether id's Starts and outcomes are refused now.
func (s *Syncer) quarantined(id string, now time.Time) bool {
	sp, ok := s.suspects[id]
	return ok && now.Before(sp.until)
}

// strike counts one refutation round against p; Claims.Strikes of them
// within Claims.StrikeWindow (or this one, when atOnce) quarantine it for
// Claims.Quarantine: its decisions end, its Starts and outcomes are
// refused, and the engine forgets what it taught.
func (s *Syncer) strike(p *peer, now time.Time, atOnce bool) {
	c := &s.cfg.Claims
	sp := s.suspects[p.replica]
	if sp == nil {
		s.makeSuspectRoom(now)
		sp = &suspect{}
		s.suspects[p.replica] = sp
	}
	keep := sp.strikes[:0]
	for _, t := range sp.strikes {
		if now.Sub(t) <= c.StrikeWindow {
			keep = append(keep, t)
		}
	}
	sp.strikes = append(keep, now)
	if (len(sp.strikes) < c.Strikes && !atOnce) || now.Before(sp.until) {
		return
	}
	sp.until, sp.strikes = now.Add(c.Quarantine), nil
	s.m.quarantined.Inc()
	s.quarantineLine(now, "peer replica quarantined: the workers' request counts refuted its decisions again and again; its decisions, outcomes and teaching are dropped",
		"peer", p.replica, "for", c.Quarantine, "ended", len(p.decisions))
	s.forgetPeer(p)
}

// makeSuspectRoom keeps the suspects table within MaxPeers entries: it
// drops expired entries, then the one whose quarantine ends first.
func (s *Syncer) makeSuspectRoom(now time.Time) {
	if len(s.suspects) < s.cfg.MaxPeers {
		return
	}
	var victim string
	var first time.Time
	for id, sp := range s.suspects {
		if !now.Before(sp.until) && (len(sp.strikes) == 0 || now.Sub(sp.strikes[len(sp.strikes)-1]) > s.cfg.Claims.StrikeWindow) {
			delete(s.suspects, id)
			continue
		}
		if victim == "" || sp.until.Before(first) {
			victim, first = id, sp.until
		}
	}
	if len(s.suspects) >= s.cfg.MaxPeers {
		delete(s.suspects, victim)
	}
}

// quarantinedPeers counts the ids quarantined now (a gauge).
func (s *Syncer) quarantinedPeers() float64 {
	now := s.clk.Now()
	s.rmu.Lock()
	defer s.rmu.Unlock()
	n := 0
	for _, sp := range s.suspects {
		if now.Before(sp.until) {
			n++
		}
	}
	return float64(n)
}

// quarantineLine writes a quarantine or refutation line within its own
// budget (quarantineLinesBurst a minute), apart from the peer lifecycle
// lines.
func (s *Syncer) quarantineLine(now time.Time, msg string, args ...any) {
	ok, held := s.claimLines.take(now)
	if !ok {
		return
	}
	if held > 0 {
		args = append(args, "lines_held_back", held)
	}
	s.log.Log(context.Background(), slog.LevelWarn, msg, args...)
}

// quarantineLinesBurst bounds refutation and quarantine log lines a
// minute.
const quarantineLinesBurst = 6
