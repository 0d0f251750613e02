package sync

import (
	"slices"
	"time"
)

// This file tells the engine this replica's place among the pool's live
// replicas, for the turns its decisions take in a burst (routing/burst).

// TransitAllowance is what ApplyDelay allows for a message's transit
// from one replica through NATS to another and its handling there, beyond
// the batch interval.
const TransitAllowance = time.Millisecond

// ApplyDelay is how long after a local decision its peers have applied
// it, at most: the batch interval (the flusher publishes a batch that long
// after its first item) plus TransitAllowance. It is the sync delay that
// routing/burst's turns are spaced by.
func (s *Syncer) ApplyDelay() time.Duration { return s.cfg.BatchInterval + TransitAllowance }

// replicaPlacer is implemented by an engine that gives its decisions
// turns in a burst (*engine.Engine).
type replicaPlacer interface {
	SetReplicas(rank, replicas int)
}

// place tells the engine this replica's rank among itself and its
// established peers (ordered by replica id, the same order on every
// replica), and their number. A newcomer (an id heard a few times only,
// such as a forged one) does not count until it is established, so a
// flood of fake ids cannot reorder the turns. Called from the sweeper.
func (s *Syncer) place() {
	pl, ok := s.eng.(replicaPlacer)
	if !ok {
		return
	}
	now := s.clk.Now()
	s.rmu.Lock()
	ids := make([]string, 0, len(s.peers)+1)
	ids = append(ids, s.cfg.Replica)
	for id, p := range s.peers {
		if p.established(now, s.cfg.HeartbeatInterval) {
			ids = append(ids, id)
		}
	}
	s.rmu.Unlock()
	slices.Sort(ids)
	rank, _ := slices.BinarySearch(ids, s.cfg.Replica)
	pl.SetReplicas(rank, len(ids))
}
