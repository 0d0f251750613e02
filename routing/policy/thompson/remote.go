package thompson

import (
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

var (
	_ routing.RemoteStarter = (*Policy)(nil)
	_ routing.RemoteLearner = (*Policy)(nil)
)

// StartRemote implements [routing.RemoteStarter]: a peer replica's
// decision for a prefix spends one unit of its reuse budget and pins it to
// the peer's endpoint and rank with the costs Choose would have recorded
// (decode cost from the output-length hint, prefill cost from the prompt
// and its cached blocks, inter-arrival factor), so that the prefix's next
// request gets the affinity bonus for that endpoint, and the others the
// switching cost, on this replica too. (With compat.late_joiners_blind, a
// local decision on an endpoint outside the startup fleet records its
// prefill cost as uncached; a remote one records what the peer found
// cached.)
func (p *Policy) StartRemote(req *routing.Request, s *routing.RemoteStart) {
	h := req.Hints
	if h.PrefixID == "" {
		return
	}
	key := prefixstate.NewKey(req.Tenant, h.PrefixID)
	reuse, _, _ := p.prefix.Arrive(key, h.TotalRequests, true)
	p.prefix.Pin(key, prefixstate.Pin{
		Endpoint: s.Endpoint, DPRank: s.DPRank,
		DecodeCost:  decodeCosts[levelIndex(h.OSL)],
		PrefillCost: p.prefillCost(s.ISL, overlapFraction(s.ISL, s.Overlap, s.BlockSize)),
		IATFactor:   iatFactors[levelIndex(h.IAT)],
		At:          p.clk.Now(),
	}, reuse)
}

// LearnRemote implements [routing.RemoteLearner]. A peer's outcome teaches
// what Done teaches of a local one, except LinTS:
//
//   - OutcomeSuccess and OutcomeUpstreamError: the reward (from the same
//     latency baselines, bucketed by the request's output-length hint and
//     the prefill bin rebuilt from the outcome's prompt tokens and cached
//     blocks) updates the Beta bandit of the endpoint that served it, and
//     the baselines learn the latency on success.
//   - OutcomeExpired: the timeout reward, to the Beta bandit.
//   - Other kinds teach nothing, as for a local decision.
//
// The LinTS arms do not learn from peers: their update needs the features
// the candidate was scored with (the peer's load view, outstanding work and
// session state at decision time), which only the deciding replica has. A
// local outcome served by another endpoint than the chosen one is treated
// the same way. Counted in Stats.Remote.
func (p *Policy) LearnRemote(o *routing.RemoteOutcome) {
	if o.ServedUnknown {
		return
	}
	endpoint := o.Endpoint
	if o.Served != "" {
		endpoint = o.Served
	}
	now := p.clk.Now().UnixNano()
	switch o.Kind {
	case routing.OutcomeSuccess, routing.OutcomeUpstreamError:
		ep := p.endpointFor(endpoint, now)
		bin := prefillBin(p.prefillCost(o.ISL, overlapFraction(o.ISL, o.Overlap, o.BlockSize)))
		p.remote.Add(1)
		p.reward(ep, nil, nil, endpoint, o.DPRank, levelIndex(o.OSL), bin, o.Outcome)
	case routing.OutcomeExpired:
		r := clip01(p.cfg.Feedback.TimeoutReward)
		p.endpointFor(o.Endpoint, now).observe(r)
		p.remote.Add(1)
		if p.onReward != nil {
			p.onReward(Reward{Endpoint: o.Endpoint, DPRank: o.DPRank, Value: r, Timeout: true, Kind: routing.OutcomeExpired})
		}
	}
}
