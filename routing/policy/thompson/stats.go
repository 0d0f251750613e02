package thompson

import (
	"cmp"
	"slices"

	"github.com/kvbandit/kvbandit/routing"
)

// Stats is a point-in-time view of what the policy has learned and of its
// counters, for metrics and the debug endpoint.
type Stats struct {
	// Decisions counts committed decisions.
	Decisions uint64
	// Pending is the number of decisions awaiting an outcome.
	Pending int
	// Feedback counts outcomes that taught the learners (success and
	// upstream error).
	Feedback uint64
	// Timeouts counts decisions that learned the timeout reward (the
	// policy's timer or an OutcomeExpired).
	Timeouts uint64
	// Late counts outcomes that arrived after the timeout and were ignored.
	Late uint64
	// Remote counts peer replicas' outcomes that taught the Beta bandits
	// and baselines ([Policy.LearnRemote]).
	Remote uint64
	// NoLearning counts outcomes that teach nothing (cancelled, reset,
	// abandoned, rejected, or served by an endpoint outside the set).
	NoLearning uint64
	// ServedMismatch counts outcomes charged to a served endpoint other
	// than the chosen one.
	ServedMismatch uint64
	// EigenFallbacks counts LinTS updates whose Cholesky failed.
	EigenFallbacks uint64
	// DroppedEndpoints counts endpoint states dropped as idle.
	DroppedEndpoints uint64
	// PrefixEntries is the number of prefixes in the prefix store.
	PrefixEntries int
	// Endpoints are sorted by key.
	Endpoints []EndpointStats
}

// EndpointStats is one endpoint's learned state.
type EndpointStats struct {
	Endpoint routing.EndpointKey
	// Alpha and Beta are the Beta posterior; Mean is α/(α+β).
	Alpha, Beta, Mean float64
	// Rewards counts applied rewards; LastReward is the latest.
	Rewards    uint64
	LastReward float64
	// OutstandingWork is the prefix store's work pinned to the endpoint.
	OutstandingWork float64
	// Ranks are the LinTS samplers, sorted by rank.
	Ranks []RankStats
}

// RankStats is one (endpoint, rank) LinTS sampler.
type RankStats struct {
	DPRank int
	// Updates counts applied rewards.
	Updates uint64
	// Theta is the posterior mean μ = A⁻¹b, in feature order: bias,
	// inv_load, overlap, affinity, outstanding, decode, prefill, iat, reuse.
	Theta [dim]float64
}

// Stats returns the current counters and posteriors.
func (p *Policy) Stats() Stats {
	st := Stats{
		Decisions:        p.decisions.Load(),
		Pending:          int(p.pending.n.Load()),
		Feedback:         p.feedback.Load(),
		Timeouts:         p.timeouts.Load(),
		Late:             p.late.Load(),
		NoLearning:       p.noLearning.Load(),
		Remote:           p.remote.Load(),
		ServedMismatch:   p.servedMismatch.Load(),
		EigenFallbacks:   p.eigenFallbacks.Load(),
		DroppedEndpoints: p.dropped.Load(),
		PrefixEntries:    p.prefix.Len(),
	}
	learned := p.learned.Load()
	idx := make(map[routing.EndpointKey]int, len(learned.endpoints))
	for _, ep := range learned.endpoints {
		b := ep.beta.Load()
		ep.mu.Lock()
		es := EndpointStats{
			Endpoint: ep.key, Alpha: b.alpha, Beta: b.beta, Mean: b.alpha / (b.alpha + b.beta),
			Rewards: ep.rewards, LastReward: ep.lastReward,
		}
		ep.mu.Unlock()
		es.OutstandingWork = p.prefix.OutstandingWork(ep.key)
		idx[ep.key] = len(st.Endpoints)
		st.Endpoints = append(st.Endpoints, es)
	}
	for _, a := range learned.arms {
		i, ok := idx[a.key.endpoint]
		if !ok {
			continue
		}
		a.mu.Lock()
		n := a.updates
		a.mu.Unlock()
		st.Endpoints[i].Ranks = append(st.Endpoints[i].Ranks, RankStats{DPRank: a.key.rank, Updates: n, Theta: a.post.Load().mu})
	}
	slices.SortFunc(st.Endpoints, func(a, b EndpointStats) int { return cmp.Compare(a.Endpoint, b.Endpoint) })
	for i := range st.Endpoints {
		slices.SortFunc(st.Endpoints[i].Ranks, func(a, b RankStats) int { return cmp.Compare(a.DPRank, b.DPRank) })
	}
	return st
}
