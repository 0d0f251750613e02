package routing

import (
	"sync/atomic"

	"github.com/kvbandit/kvbandit/routing/slots"
)

// EndpointState is an endpoint in a snapshot together with its live
// counters. A snapshot's EndpointState is immutable except for *Live, which
// is shared by pointer across snapshot swaps so that a swap never resets
// in-flight counts.
type EndpointState struct {
	Endpoint
	*Live
}

// Live holds an endpoint's counters that outlive snapshots.
type Live struct {
	// Ranks are the endpoint's data-parallel ranks (one for a single-rank
	// endpoint), set by the engine before the Live is published and
	// immutable afterwards; nil for a Live made outside an engine.
	Ranks []*Rank

	// InFlight is the number of this replica's decisions on the endpoint
	// whose Done has not been called yet.
	InFlight atomic.Int64
	// RemoteInFlight is the number of peer replicas' decisions on the
	// endpoint applied by the engine (StartRemote) and not ended yet.
	RemoteInFlight atomic.Int64
	// Decisions counts decisions made for the endpoint.
	Decisions atomic.Int64
}

// Rank is one data-parallel rank of an endpoint: its in-flight load and
// the policy's memo for it.
type Rank struct {
	// Slot is the rank's in-flight load (prefill tokens, held blocks,
	// requests).
	Slot *slots.Slot
	// Memo is the policy's per-rank state ([Candidate.Memo]).
	Memo atomic.Pointer[any]
}

// FleetInFlight is the endpoint's in-flight decisions as far as this
// replica knows: its own (InFlight) and its peers' (RemoteInFlight). It is
// the load policies read as "in flight" (least_loaded, weighted's queue
// fallback, thompson's pending load), so that every replica sees the
// fleet's load; InFlight alone is this replica's share, which outcomes
// and draining are about.
func (l *Live) FleetInFlight() int64 { return l.InFlight.Load() + l.RemoteInFlight.Load() }

// ActiveBlocks returns each rank's KV blocks held by in-flight requests.
func (l *Live) ActiveBlocks() []int64 {
	out := make([]int64, len(l.Ranks))
	for i, r := range l.Ranks {
		out[i] = r.Slot.Blocks()
	}
	return out
}

// InFlightPrefill is the endpoint's prompt tokens still being prefilled,
// over all ranks.
func (l *Live) InFlightPrefill() int64 {
	var n int64
	for _, r := range l.Ranks {
		n += r.Slot.PrefillTokens()
	}
	return n
}
