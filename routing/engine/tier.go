package engine

import "github.com/kvbandit/kvbandit/routing"

// TierBlocks is an endpoint's KV blocks per medium as the index has them,
// summed over its data-parallel ranks.
type TierBlocks struct {
	// GPU is the blocks indexed for the endpoint's GPU cache (event-fed
	// and approximate); CPU and Disk its lower tiers' blocks, from KV
	// events with those media.
	GPU  int `json:"gpu"`
	CPU  int `json:"cpu"`
	Disk int `json:"disk"`
}

// TierBlocks returns what the index holds for st per medium (zero for an
// endpoint not in the set). It does not lock.
func (e *Engine) TierBlocks(st *routing.EndpointState) TierBlocks {
	var tb TierBlocks
	ep, ok := e.snap.Load().byKey[st.Key]
	if !ok {
		return tb
	}
	for _, rs := range ep.ranks {
		c, d := e.index.TierSizes(rs.worker)
		tb.GPU += e.index.Size(rs.worker)
		tb.CPU += c
		tb.Disk += d
	}
	return tb
}
