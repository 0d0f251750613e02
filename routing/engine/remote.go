package engine

import (
	"github.com/kvbandit/kvbandit/routing"

	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/slots"
)

// This file holds the engine's side of active-active replicas: how a peer's decisions and outcomes are
// applied here ([Engine.StartRemote], [Engine.LearnRemote]). The transport
// (routing/sync) decides when to call them; nothing here does I/O.

// RemoteDecision is a peer replica's decision applied to this engine's
// load accounting. It holds its endpoint rank's slot by pointer, so it
// survives endpoint-set updates as a local decision does, and End stays
// safe after the endpoint left the set.
type RemoteDecision struct {
	// Endpoint and DPRank are where the peer routed the request.
	Endpoint routing.EndpointKey
	DPRank   int

	// PrefillEndpoint and PrefillDPRank are where it prefills when the
	// peer disaggregated it ("" otherwise).
	PrefillEndpoint routing.EndpointKey
	PrefillDPRank   int

	e         *Engine
	live      *routing.Live
	blocks    int64 // block keys counted in Engine.remoteBlocks
	entry     *slots.Entry
	pre       *prefillHold // a disaggregated decision's hold on its prefill endpoint
	timer     clock.Timer
	prefilled atomic.Bool
	ended     atomic.Bool
}

// StartRemote applies a peer replica's decision as if this engine had made
// it: it counts the decision in the endpoint's RemoteInFlight, adds its
// blocks and uncached prompt tokens to the chosen rank's slot, inserts its
// blocks into the approximate index when the rank's KV events are not
// trusted (through the same path as a local decision), and lets a policy
// that records session state at decision time ([RemoteStarter]) record it.
//
// A disaggregated decision (s.PrefillEndpoint set) is held as a local one
// is (routing/engine's prefillHold): its prefill endpoint's rank carries
// the prompt's uncached tokens (ISL − PrefillCached), one more
// RemoteInFlight and, in the same block size, its blocks (inserted into
// that rank's approximate index too), until Prefilled or End; the decode
// endpoint carries the decision and its blocks, no prefill tokens.
//
// s is checked against the current endpoint set: an endpoint or rank not
// in it gives ErrUnknownEndpoint, a value out of bounds ErrInvalidRemote,
// and more open peers' decisions or held block keys than the Options
// allow ErrRemoteLimit; nothing is recorded then. Blocks of another block size than this
// replica's for the endpoint (a worker-reported size one replica has not
// scraped yet) are another key space: their prefill tokens still count,
// their blocks are neither held nor indexed.
//
// The decision is released by [RemoteDecision.End] (the sync layer calls it
// on the peer's End, on snapshot replacement and when the peer's TTL
// expires), or after Options.StaleAfter like a local decision whose Done
// never came. No Deps hook is called (the sync layer must not publish its
// peers' decisions again), and the endpoint's health is not touched.
// StartRemote never blocks; it must not be called after Close.
func (e *Engine) StartRemote(s routing.RemoteStart) (*RemoteDecision, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	st, rs, err := e.rankOf(s.Endpoint, s.DPRank)
	if err != nil {
		return nil, err
	}
	var pst *endpoint
	var prs *rankState
	if s.PrefillEndpoint != "" {
		if pst, prs, err = e.rankOf(s.PrefillEndpoint, s.PrefillDPRank); err != nil {
			return nil, fmt.Errorf("prefill endpoint: %w", err)
		}
	}
	n := int64(len(s.Blocks))
	if open := e.remoteOpen.Add(1); open > int64(e.opts.MaxRemoteDecisions) {
		e.remoteOpen.Add(-1)
		return nil, fmt.Errorf("%w: %d open (max %d)", routing.ErrRemoteLimit, open-1, e.opts.MaxRemoteDecisions)
	}
	if held := e.remoteBlocks.Add(n); held > int64(e.opts.RemoteBlockBudget) {
		e.remoteBlocks.Add(-n)
		e.remoteOpen.Add(-1)
		return nil, fmt.Errorf("%w: %d block keys held, %d more (budget %d)", routing.ErrRemoteLimit, held-n, n, e.opts.RemoteBlockBudget)
	}
	now := e.clk.Now()
	e.burst.Remote(now)
	r := &RemoteDecision{Endpoint: st.Key, DPRank: s.DPRank, e: e, live: st.Live, blocks: n}
	st.RemoteInFlight.Add(1)
	isl := s.ISL
	if pst != nil {
		r.PrefillEndpoint, r.PrefillDPRank = pst.Key, s.PrefillDPRank
		r.pre = e.remotePrefill(pst, prs, &s, now)
		isl = 0 // the prefill endpoint prefills it
	}
	keys := e.ownKeys(st, &s)
	if !e.opts.DisableActiveBlocks || isl > 0 {
		held := keys
		if e.opts.DisableActiveBlocks {
			held = nil
		}
		r.entry = rs.slot.Add(held, isl, s.Overlap, s.BlockSize)
	}
	e.insertApprox(rs, s.BlockSize, keys, now)
	if p, ok := e.policy.(routing.RemoteStarter); ok && s.PrefixID != "" {
		p.StartRemote(s.SessionRequest(), &s)
	}
	r.timer = e.clk.AfterFunc(e.opts.StaleAfter, func() {
		if r.End() {
			e.remoteExpired.Add(1)
		}
	})
	return r, nil
}

// ownKeys is s's block keys when they are in st's key space (its block
// size), else nil: another key space's keys are neither held nor indexed.
func (e *Engine) ownKeys(st *endpoint, s *routing.RemoteStart) []uint64 {
	if s.BlockSize != e.blockSize(st) {
		return nil
	}
	return s.Blocks
}

// remotePrefill puts a peer's disaggregated decision's prefill load on
// its prefill endpoint pst's rank prs, as disaggregate does for a local
// one, and returns the hold.
func (e *Engine) remotePrefill(pst *endpoint, prs *rankState, s *routing.RemoteStart, now time.Time) *prefillHold {
	keys := e.ownKeys(pst, s)
	pst.RemoteInFlight.Add(1)
	h := &prefillHold{inflight: &pst.RemoteInFlight, cached: s.PrefillCached}
	held := keys
	if e.opts.DisableActiveBlocks {
		held = nil
	}
	// The uncached prompt tokens, whatever the block size: the cached
	// ones as one "block" of PrefillCached tokens.
	h.entry = prs.slot.Add(held, s.ISL, 1, s.PrefillCached)
	e.insertApprox(prs, s.BlockSize, keys, now)
	return h
}

// Prefilled reports the remote decision's first token: its prompt tokens
// stop counting as prefill load (a disaggregated decision's prefill
// endpoint is released). Calls after the first, or after End, do nothing.
func (r *RemoteDecision) Prefilled() {
	if r == nil || r.ended.Load() || !r.prefilled.CompareAndSwap(false, true) {
		return
	}
	r.pre.release()
	r.entry.Prefilled()
	if r.e.queue != nil {
		r.e.queue.Wake()
	}
}

// End releases the remote decision's load. The first call returns true;
// later calls do nothing and return false. It is safe after the endpoint
// left the endpoint set.
func (r *RemoteDecision) End() bool {
	if r == nil || !r.ended.CompareAndSwap(false, true) {
		return false
	}
	if r.timer != nil {
		r.timer.Stop()
	}
	r.pre.release()
	r.entry.Free()
	r.live.RemoteInFlight.Add(-1)
	r.e.remoteBlocks.Add(-r.blocks)
	r.e.remoteOpen.Add(-1)
	if r.e.queue != nil {
		r.e.queue.Wake()
	}
	return true
}

// Ended reports whether End was called (or the stale timer released it).
func (r *RemoteDecision) Ended() bool { return r.ended.Load() }

// RemoteExpired returns how many peers' decisions were released by their
// stale timer (Options.StaleAfter) because no End came.
func (e *Engine) RemoteExpired() int64 { return e.remoteExpired.Load() }

// LearnRemote lets the policy learn from a peer replica's outcome
// ([RemoteLearner]); a policy that learns nothing from outcomes ignores it.
// An endpoint, rank or served endpoint not in the current endpoint set
// gives ErrUnknownEndpoint, a value out of bounds ErrInvalidRemote, and
// nothing is learnt.
//
// Endpoint health (passive ejection) does not learn from peers' outcomes:
// a peer's errors may be its own network's, so health stays a local
// observation. Nor is Deps.OnDone called.
func (e *Engine) LearnRemote(o routing.RemoteOutcome) error {
	if err := o.Validate(); err != nil {
		return err
	}
	if _, _, err := e.rankOf(o.Endpoint, o.DPRank); err != nil {
		return err
	}
	if o.Served == o.Endpoint {
		o.Served = ""
	}
	if o.Served != "" {
		if _, ok := e.snap.Load().byKey[o.Served]; !ok {
			return fmt.Errorf("%w: served by %s", routing.ErrUnknownEndpoint, quoteBounded(string(o.Served)))
		}
	}
	o.ServedUnknown = false
	o.Received = e.clk.Now()
	if l, ok := e.policy.(routing.RemoteLearner); ok {
		l.LearnRemote(&o)
	}
	return nil
}

// ForgetPeer drops what the policy learnt from peer's outcomes, when it
// keeps them apart ([routing.PeerForgetter]); the transport calls it when
// the peer leaves. Other policies ignore it.
func (e *Engine) ForgetPeer(peer string) {
	if f, ok := e.policy.(routing.PeerForgetter); ok {
		f.ForgetPeer(peer)
	}
}

// rankOf returns the endpoint's state and rank for a peer's (endpoint,
// rank): rank -1 for a single-rank endpoint, 0..n-1 for one with n ranks.
func (e *Engine) rankOf(ep routing.EndpointKey, rank int) (*endpoint, *rankState, error) {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return nil, nil, fmt.Errorf("%w: %s", routing.ErrUnknownEndpoint, quoteBounded(string(ep)))
	}
	n := len(st.ranks)
	switch {
	case n == 1 && rank == -1:
		return st, st.ranks[0], nil
	case n > 1 && rank >= 0 && rank < n:
		return st, st.ranks[rank], nil
	}
	return nil, nil, fmt.Errorf("%w: %s rank %d of %d", routing.ErrUnknownEndpoint, st.Key, rank, n)
}

// quoteBounded quotes s for an error message, cut to MaxRemoteString
// bytes: peers' values end up in logs.
func quoteBounded(s string) string {
	if len(s) <= routing.MaxRemoteString {
		return strconv.Quote(s)
	}
	return strconv.Quote(s[:routing.MaxRemoteString]) + "... (" + strconv.Itoa(len(s)) + " bytes)"
}
