package kvbandit

import (
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/latency"
)

var (
	_ routing.RemoteStarter = (*Policy)(nil)
	_ routing.RemoteLearner = (*Policy)(nil)
	_ routing.PeerForgetter = (*Policy)(nil)
)

// StartRemote implements [routing.RemoteStarter]: a peer replica's
// decision for a session counts one request of it and pins it to the
// peer's endpoint and rank, with the same reuse budget and announced work
// as Choose records for a local decision. The session's next request, on
// this replica, then gets the affinity credit for that endpoint as if this
// replica had routed the earlier one.
func (p *Policy) StartRemote(req *routing.Request, s *routing.RemoteStart) {
	if p.prefixes == nil {
		return
	}
	sess, ok := p.prefixes.Arrive(req, true)
	if !ok {
		return
	}
	bs := max(s.BlockSize, 1)
	promptBlocks := float64(s.ISL) / float64(bs)
	p.prefixes.Pin(req, s.Endpoint, s.DPRank, sess.Reuse, float64(sess.Reuse)*(promptBlocks+outputBlocks(req, bs)))
}

// LearnRemote implements [routing.RemoteLearner]: a peer's successful
// outcome updates the speed factor of its endpoint and rank, as Done does
// for a local decision. The features are rebuilt from the outcome's
// decision-time numbers (the rank's queued prefill tokens, prompt tokens,
// cached blocks, block size), which are the ones Choose used. Three things
// differ: the running sequences and scraped load at the peer's decision are
// not shared, so a peer's outcome teaches the endpoint's factor only, not
// the pooled fit; the factor's last-seen time is when this replica learnt
// the outcome; and in a fleet mixing block sizes the uncached tokens are in
// the chosen endpoint's block size where a local decision uses the
// request's first one. What each peer (o.Peer) teaches is kept apart from
// the rest, for ForgetPeer (routing/latency, "Peers").
func (p *Policy) LearnRemote(o *routing.RemoteOutcome) {
	if o.ServedUnknown || o.Kind != routing.OutcomeSuccess || o.TTFT <= 0 {
		return
	}
	p.model.Observe(latency.Observation{
		Endpoint: o.Endpoint, DPRank: o.DPRank, Remote: true, Peer: o.Peer, At: o.Received,
		Features: latency.Features{Queued: o.QueuedPrefillTokens, Uncached: max(o.ISL-o.Overlap*max(o.BlockSize, 1), 0)},
		TTFT:     o.TTFT,
	})
}

// ForgetPeer implements [routing.PeerForgetter]: what peer's outcomes
// taught the speed factors is taken out of them ([latency.Model.ForgetPeer]).
// The sessions its decisions pinned (StartRemote) are not undone: they
// expire as the prefix state's entries do.
func (p *Policy) ForgetPeer(peer string) { p.model.ForgetPeer(peer) }
