package evidence_test

import (
	"testing"

	"github.com/kvbandit/kvbandit/routing/evidence"
	"github.com/kvbandit/kvbandit/routing/sync"
)

// TestMaxPeersIsSyncs: the learners track as many peers as the sync layer
// does, so a peer it tracks is never evicted from a learner's table by
// the others.
func TestMaxPeersIsSyncs(t *testing.T) {
	if evidence.MaxPeers != sync.DefaultMaxPeers {
		t.Fatalf("evidence.MaxPeers %d, routing/sync DefaultMaxPeers %d", evidence.MaxPeers, sync.DefaultMaxPeers)
	}
}
