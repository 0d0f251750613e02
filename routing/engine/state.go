package engine

import (
	"fmt"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file gathers the engine's state for the warm start (issue 22): a
// replica that starts asks a peer for it (routing/sync) and imports it
// here. The KV index is exported and imported per endpoint, between two
// of its KV-event messages (the caller holds the endpoint's stream,
// kvevents.Sub.Export and Resume); the policy's learning through
// [StatefulPolicy].

// StatefulPolicy is a policy whose learning can be handed to a replica
// that starts: the kvbandit policy (its latency model and sessions) and
// thompson (its bandits, baselines and sessions) implement it.
type StatefulPolicy interface {
	// ExportState adds the policy's state to dst, ages taken from now.
	ExportState(dst *warmstate.Snapshot, now time.Time)
	// ImportState takes what src holds that this policy has not learnt
	// itself, for endpoint ranks known reports in the set (rank
	// warmstate.AnyRank: the endpoint, any rank), checking every value;
	// it reports what it took and what it refused.
	ImportState(src *warmstate.Snapshot, now time.Time, known func(routing.EndpointKey, int) bool) warmstate.Imported
}

// ExportState adds the policy's state to dst; nothing for a policy that
// learns nothing (round_robin, kv, ...).
func (e *Engine) ExportState(dst *warmstate.Snapshot) {
	if p, ok := e.policy.(StatefulPolicy); ok {
		p.ExportState(dst, e.clk.Now())
	}
}

// ImportState hands a peer's policy state to the policy, for the
// endpoints of the current set only. It never blocks Pick.
func (e *Engine) ImportState(src *warmstate.Snapshot) warmstate.Imported {
	p, ok := e.policy.(StatefulPolicy)
	if !ok {
		return warmstate.Imported{}
	}
	return p.ImportState(src, e.clk.Now(), e.knownRank)
}

// knownRank reports whether (ep, rank) is in the current set: rank -1 on a
// single-rank endpoint, 0..n-1 on one with n ranks, warmstate.AnyRank for
// the endpoint itself.
func (e *Engine) knownRank(ep routing.EndpointKey, rank int) bool {
	if rank == warmstate.AnyRank {
		_, ok := e.snap.Load().byKey[ep]
		return ok
	}
	_, _, err := e.rankOf(ep, rank)
	return err == nil
}

// ExportKV returns the endpoint's event-fed index entries, its ranks'
// runs (kvindex.Index.ExportWorker) with Endpoint and Rank (the rank's
// index) filled in, at most maxBlocks blocks (0: no bound; complete is
// false when some were left out). The caller runs it between two of the
// endpoint's KV-event messages. An endpoint not in the set has none.
func (e *Engine) ExportKV(ep routing.EndpointKey, maxBlocks int) (runs []warmstate.Blocks, complete bool) {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return nil, true
	}
	complete = true
	left := maxBlocks
	for i, rs := range st.ranks {
		if maxBlocks > 0 && left <= 0 {
			complete = false
			break
		}
		r, whole := e.index.ExportWorker(rs.worker, left)
		complete = complete && whole
		for j := range r {
			r[j].Endpoint, r[j].Rank = string(ep), int32(i)
			left -= len(r[j].Blocks)
		}
		runs = append(runs, r...)
	}
	return runs, complete
}

// ImportKV replaces the endpoint's index entries, rank by rank, with a
// peer's export (kvindex.Index.ImportWorker: checked like events; every
// rank without a run is cleared). A run for another endpoint or a rank
// the endpoint does not have is refused (kvindex.ErrUnknownWorker) after
// the others are imported; the first error is returned, and the caller
// must then not trust the endpoint's view. The caller holds the
// endpoint's KV-event stream (no event is applied meanwhile).
func (e *Engine) ImportKV(ep routing.EndpointKey, runs []warmstate.Blocks) error {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return fmt.Errorf("%w: %s", kvindex.ErrUnknownWorker, quoteBounded(string(ep)))
	}
	byRank := make([][]warmstate.Blocks, len(st.ranks))
	var first error
	for _, r := range runs {
		if r.Endpoint != string(ep) || r.Rank < 0 || int(r.Rank) >= len(st.ranks) {
			if first == nil {
				first = fmt.Errorf("%w: %s rank %d of %d", kvindex.ErrUnknownWorker, quoteBounded(r.Endpoint), r.Rank, len(st.ranks))
			}
			continue
		}
		byRank[r.Rank] = append(byRank[r.Rank], r)
	}
	for i, rs := range st.ranks {
		if err := e.index.ImportWorker(rs.worker, byRank[i]); err != nil && first == nil {
			first = err
		}
	}
	return first
}
