package thompson

import (
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

// TestPendingLoadCountsPeers: without scraped load, a candidate's pending
// load is its endpoint's in-flight decisions, peers' included.
func TestPendingLoadCountsPeers(t *testing.T) {
	c := routing.Candidate{State: &routing.EndpointState{Live: &routing.Live{}}, DPRank: -1}
	c.State.InFlight.Store(3)
	c.State.RemoteInFlight.Store(7)
	if gpu, queue := pendingLoad(&c); queue != 10 || gpu != 0.5 {
		t.Fatalf("pending load (gpu %v, queue %v), want (0.5, 10)", gpu, queue)
	}
	c.Load = routing.Load{Known: true, Waiting: 2, KVUsage: 0.25}
	if gpu, queue := candidateLoad(&c); queue != 10 || gpu != 0.25 {
		t.Fatalf("scraped load (gpu %v, queue %v), want (0.25, 10): max(waiting, pending)", gpu, queue)
	}
}
