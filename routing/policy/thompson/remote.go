package thompson

import (
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/evidence"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

var (
	_ routing.RemoteStarter = (*Policy)(nil)
	_ routing.RemoteLearner = (*Policy)(nil)
	_ routing.PeerForgetter = (*Policy)(nil)
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
	reuse, _, _ := p.prefix.Arrive(key, p.total(h), true)
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
//
// What each peer (o.Peer) teaches the Beta bandits and the baselines is
// kept apart from the rest (routing/evidence), for ForgetPeer.
func (p *Policy) LearnRemote(o *routing.RemoteOutcome) {
	if o.ServedUnknown {
		return
	}
	switch o.Kind {
	case routing.OutcomeSuccess, routing.OutcomeUpstreamError, routing.OutcomeExpired:
		p.sources.Use(o.Peer, p.forgetSource, func(src evidence.Source) { p.learnRemote(o, src) })
	}
}

func (p *Policy) learnRemote(o *routing.RemoteOutcome, src evidence.Source) {
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
		p.reward(ep, nil, nil, endpoint, o.DPRank, levelIndex(o.OSL), bin, o.Outcome, src)
	case routing.OutcomeExpired:
		r := clip01(p.cfg.Feedback.TimeoutReward)
		p.endpointFor(o.Endpoint, now).observe(r, src)
		p.remote.Add(1)
		if p.onReward != nil {
			p.onReward(Reward{Endpoint: o.Endpoint, DPRank: o.DPRank, Value: r, Timeout: true, Kind: routing.OutcomeExpired})
		}
	}
}

// ForgetPeer implements [routing.PeerForgetter]: what peer's outcomes
// taught is taken out of every endpoint's Beta bandit (its rewards
// subtracted: the bandit does not forget, so this is exact) and of every
// latency baseline (the average of the other sources' values, their
// relative weights kept; unset when only peer taught it). What those
// baselines made of local rewards in the meantime (the LinTS arms learnt
// from them) stays, forgotten at LinTS's own rate (forget_rate); the
// sessions its decisions pinned expire as the prefix store's entries do.
// At most evidence.MaxPeers peers are kept apart (the least recently heard
// one is forgotten for a new one). It blocks the learning of peers'
// outcomes, not Choose, while it runs, O(endpoints).
func (p *Policy) ForgetPeer(peer string) { p.sources.Forget(peer, p.forgetSource) }

// forgetSource takes src's part out of every learner that has one.
func (p *Policy) forgetSource(src evidence.Source) {
	learned := p.learned.Load()
	for _, ep := range learned.endpoints {
		ep.forget(src)
	}
	p.emaMu.Lock()
	defer p.emaMu.Unlock()
	for i := range p.global {
		p.global[i].forget(src)
	}
	for _, ep := range learned.endpoints {
		for i := range ep.overall {
			ep.overall[i].forget(src)
		}
		for osl := range ep.bucket {
			for bin := range ep.bucket[osl] {
				for i := range ep.bucket[osl][bin] {
					ep.bucket[osl][bin][i].forget(src)
				}
			}
		}
	}
}
