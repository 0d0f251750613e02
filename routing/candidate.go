package routing

import (
	"sync/atomic"
	"time"
)

// Load is an endpoint's load as its metrics report it (scraped off the
// request path). The zero value means "nothing known".
type Load struct {
	// Waiting is the number of requests queued in the engine.
	Waiting float64
	// Running is the number of requests being processed.
	Running float64
	// KVUsage is the fraction of KV cache in use, in [0, 1].
	KVUsage float64
	// Known is set once a scrape succeeded.
	Known bool
	// Stale is set when the last good scrape is too old; stale load counts
	// as saturated unless every endpoint is stale.
	Stale bool
	// KVBlocks is the worker's KV cache size in blocks of its block size
	// (vllm:cache_config_info num_gpu_blocks, per engine); 0: unknown.
	KVBlocks int
	// Finished is the worker's own count of the requests it finished
	// since it started (vllm:request_success_total,
	// sglang:num_requests_total), from every router; FinishedKnown is
	// false when the worker does not export it. routing/sync vouches for
	// peers' outcomes with its increase between two scrapes.
	Finished      float64
	FinishedKnown bool
}

// Candidate is one (endpoint, data-parallel rank) that a policy may choose,
// with what the engine knows about it for the current request. Policies
// must not modify candidates.
type Candidate struct {
	// State is the endpoint with its live counters.
	State *EndpointState
	// DPRank is the data-parallel rank, or -1 for a single-rank endpoint.
	DPRank int
	// Overlap is the number of the request's leading blocks cached on the
	// candidate, per the KV index.
	Overlap int
	// OverlapCPU and OverlapDisk are the blocks after those Overlap that
	// the candidate holds in host memory or on disk (its lower KV tiers, from
	// KV events with a CPU or disk medium): the leading run continues
	// through them, each block counted at its best tier, and stops at the
	// first block in no tier. Both are 0 without lower-tier events. See
	// EffectiveOverlap.
	OverlapCPU, OverlapDisk int
	// TreeSize is the number of blocks indexed for the candidate (the
	// tie-break: less cached state first).
	TreeSize int
	// ActivePrefillTokens is the prompt tokens of in-flight requests on the
	// candidate that have not finished prefill.
	ActivePrefillTokens int64
	// ActiveBlocks is the KV blocks held by in-flight requests, each shared
	// block counted once.
	ActiveBlocks int64
	// NewBlocks is the number of the request's blocks (partial last block
	// included) not already held by an in-flight request on the candidate.
	NewBlocks int
	// Load is the scraped load.
	Load Load
}

// Key returns the candidate's endpoint key.
func (c *Candidate) Key() EndpointKey { return c.State.Key }

// Scoring is everything a policy sees for one request.
type Scoring struct {
	Req *Request
	// BlockSize is the KV block size (tokens) used for this request's keys.
	BlockSize int
	// Blocks are the chained block keys of the prompt's complete blocks.
	Blocks []uint64
	// ISL is the prompt length in tokens.
	ISL int
	// Candidates are the eligible (endpoint, rank) pairs, in a stable order.
	Candidates []Candidate
	// Rand is the engine's lock-free random source.
	Rand *Rand
	// Now is the decision time from the engine's clock.
	Now time.Time
	// WantRanked is set when the engine needs Choice.Ranked (fallbacks);
	// policies may skip ranking otherwise.
	WantRanked bool
	// WantPredicted is set when the engine needs Choice.Predicted (Score:
	// /v1/route and Engine.Score show every candidate's prediction).
	WantPredicted bool
	// TierWeights price the candidates' lower-tier overlap (see
	// Candidate.EffectiveOverlap); the zero value means the defaults.
	TierWeights TierWeights
}

// Memo returns the candidate's policy memo: a per-(endpoint, rank) slot,
// stable across snapshot swaps, where a policy may keep a pointer to its
// own state for lock-free reads. Only one policy runs per engine.
func (c *Candidate) Memo() *atomic.Pointer[any] {
	r := c.rank()
	if r == nil {
		return new(atomic.Pointer[any]) // a candidate made outside an engine
	}
	return &r.Memo
}

// rank returns the candidate's rank, nil for a candidate made outside an
// engine.
func (c *Candidate) rank() *Rank {
	if c.State == nil || c.State.Live == nil || len(c.State.Ranks) == 0 {
		return nil
	}
	if c.DPRank < 0 {
		return c.State.Ranks[0]
	}
	return c.State.Ranks[c.DPRank]
}

// Prediction is a policy's predicted time to first token on one candidate,
// with its parts.
type Prediction struct {
	// TTFT is Wait + Prefill: the predicted time to first token.
	TTFT time.Duration
	// Wait is the predicted wait for the work already ahead of the request.
	Wait time.Duration
	// Prefill is the predicted prefill time of the tokens not cached there.
	Prefill time.Duration
	// Impact is the delay the request is predicted to add to the requests
	// already on the candidate (summed over them).
	Impact time.Duration
}

// InFlight returns the requests in flight on the candidate's rank (this
// engine's decisions and, with replicas, its peers'); 0 for a candidate
// made outside an engine.
func (c *Candidate) InFlight() int64 {
	if r := c.rank(); r != nil && r.Slot != nil {
		return r.Slot.Requests()
	}
	return 0
}
