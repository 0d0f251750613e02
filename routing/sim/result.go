package sim

import "time"

// ReqResult is what happened to one request (in the order of the input).
// Worker is -1 and Err set when the request was not served.
type ReqResult struct {
	Worker                                   int
	Replica                                  int // the replica it entered through
	Arrival, TTFT, E2E                       time.Duration
	PromptTokens, CachedTokens, OutputTokens int
	// Predicted is the policy's predicted TTFT at the decision (0 when
	// the policy does not predict).
	Predicted time.Duration
	// CPUCachedTokens are the CachedTokens loaded back from the worker's
	// CPU tier.
	CPUCachedTokens int
	// ITL is the mean inter-token latency, (E2E − TTFT)/(OutputTokens −
	// 1); 0 with a single output token.
	ITL time.Duration
	// PrefillWorker is the worker that ran a disaggregated request's
	// prefill (-1: aggregated on Worker; CachedTokens are then the
	// prefill worker's), TransferBlocks the blocks sent to Worker and
	// Transfer the transfer's time.
	PrefillWorker  int
	TransferBlocks int
	Transfer       time.Duration
	Err            string
}

// QueueSample is every worker's waiting and running requests at At.
type QueueSample struct {
	At               time.Duration
	Waiting, Running []int
}

// WorkerResult sums up one worker.
type WorkerResult struct {
	Requests int           // requests routed to it
	Busy     time.Duration // virtual time spent in steps
	// PrefillTokens are the prompt tokens it computed; CachedTokens those
	// it found in its cache, CPUCachedTokens those of them loaded back
	// from its CPU tier.
	PrefillTokens, CachedTokens, CPUCachedTokens int
}

// Result is the outcome of a run.
type Result struct {
	Policy   string
	Requests []ReqResult
	Workers  []WorkerResult
	Queue    []QueueSample
	Span     time.Duration // virtual time from first arrival to last completion
	Wall     time.Duration // real time Run took
	// Decisions counts engine picks; DecisionTime is the real time spent
	// inside engine.Pick.
	Decisions    int
	DecisionTime time.Duration
	// KVEventErrors counts KV events the engines' indexes refused (0
	// unless something is broken).
	KVEventErrors int

	// Replicas and Sync are the run's (Replicas at least 1); Entered is
	// the requests that entered through each replica.
	Replicas int
	Sync     Sync
	Entered  []int
	// SyncItems counts the sync items the replicas published (a start, a
	// first token, an end and an outcome per decision), SyncMessages the
	// messages that carried them (a replica's batch takes every item of
	// one SyncDelay), SyncErrors the items a peer refused (0 unless
	// something is broken). SyncOpen is the decisions still applied on
	// peers at the end, after the last items were delivered (0: every
	// end reached every peer). All 0 with SyncNone.
	SyncItems, SyncMessages, SyncErrors, SyncOpen int
	// Held counts the requests that waited for their replica's turn in a
	// burst (routing/burst); 0 with one replica or SyncNone.
	Held int
}

// MessagesPerDecision is SyncMessages over Decisions (0 without any).
func (r *Result) MessagesPerDecision() float64 {
	if r.Decisions == 0 {
		return 0
	}
	return float64(r.SyncMessages) / float64(r.Decisions)
}

// HitRate is the fraction of served prompt tokens found in a worker's
// cache.
func (r *Result) HitRate() float64 {
	var p, c int
	for _, q := range r.Requests {
		if q.Err == "" {
			p += q.PromptTokens
			c += q.CachedTokens
		}
	}
	if p == 0 {
		return 0
	}
	return float64(c) / float64(p)
}

// CPUHitRate is the fraction of served prompt tokens loaded back from a
// worker's CPU tier (a part of HitRate).
func (r *Result) CPUHitRate() float64 {
	var p, c int
	for _, q := range r.Requests {
		if q.Err == "" {
			p += q.PromptTokens
			c += q.CPUCachedTokens
		}
	}
	if p == 0 {
		return 0
	}
	return float64(c) / float64(p)
}
