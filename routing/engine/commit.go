package engine

import (
	"github.com/kvbandit/kvbandit/routing"

	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/slots"
)

// commitment is a decision together with the engine's hold on it: the
// load it charged and what ending it releases. It implements
// [routing.Ticket] for the Decision it embeds, so a committed decision is
// one allocation.
type commitment struct {
	routing.Decision
	e *Engine
	// num is the engine's decision number (ID in base 36).
	num uint64
	// share is what a peer replica needs to reproduce the decision's load
	// and learn from its outcome (Share, ShareOutcome); set at commit.
	share shareInfo
	live  *routing.Live
	rt    *runtime
	entry *slots.Entry
	timer clock.Timer
	// pre is a disaggregated decision's hold on its prefill endpoint.
	pre *prefillHold
}

var _ routing.Ticket = (*commitment)(nil)

// First implements [routing.Ticket]: the prompt has been prefilled.
func (cm *commitment) First(d *routing.Decision) {
	cm.pre.release()
	cm.entry.Prefilled()
	if cm.e.queue != nil {
		cm.e.queue.Wake()
	}
	if cm.e.deps.OnFirst != nil {
		cm.e.deps.OnFirst(d)
	}
}

// End implements [routing.Ticket].
func (cm *commitment) End(_ *routing.Decision, o routing.Outcome) {
	if cm.live != nil {
		cm.live.InFlight.Add(-1)
	}
	cm.pre.release()
	cm.e.end(cm, o)
}

// ReleasePrefill implements [routing.Ticket].
func (cm *commitment) ReleasePrefill() { cm.pre.release() }

// PrefillHeld implements [routing.Ticket].
func (cm *commitment) PrefillHeld() bool { return cm.pre != nil && !cm.pre.released.Load() }

// decodeISL is the prompt tokens the decode endpoint prefills: isl, or 0
// when a prefill endpoint holds the prefill load.
func (cm *commitment) decodeISL(isl int) int {
	if cm.pre != nil {
		return 0
	}
	return isl
}

// end releases a committed decision's load and hands o to the policy and
// the OnDone hook (after Decision.Done's first call).
func (e *Engine) end(cm *commitment, o routing.Outcome) {
	d := &cm.Decision
	if cm.timer != nil {
		cm.timer.Stop()
	}
	cm.entry.Free()
	if e.queue != nil {
		e.queue.Wake()
	}
	l, key, known := e.servedBy(cm, o)
	if !known {
		// A served endpoint outside the set (forged response metadata, or
		// one removed since): count it, and let nothing learn from it.
		e.servedUnknown.Add(1)
		o.Served, o.ServedUnknown = "", true
	}
	if l != nil {
		e.observe(key, l, o)
	}
	e.policy.Done(d, o)
	if e.deps.OnDone != nil {
		e.deps.OnDone(d, o)
	}
}

// servedBy returns the live state of the endpoint that served d: the
// outcome's Served endpoint when the data plane reports one (Envoy may
// have retried elsewhere), else the chosen one. known is false for a
// served endpoint that is neither the chosen one nor in the current set:
// the value comes from the data plane (response metadata), so it may be
// anything, and it must create no state (issue 11).
func (e *Engine) servedBy(cm *commitment, o routing.Outcome) (rt *runtime, key routing.EndpointKey, known bool) {
	if o.Served == "" || o.Served == cm.Endpoint {
		return cm.rt, cm.Endpoint, true
	}
	if st, ok := e.snap.Load().byKey[o.Served]; ok {
		return st.runtime, o.Served, true
	}
	return nil, "", false
}

// ServedUnknown counts outcomes whose served endpoint was neither the
// chosen one nor in the endpoint set; no learning used them.
func (e *Engine) ServedUnknown() int64 { return e.servedUnknown.Load() }

// shareInfo is what a committed decision keeps for Share and
// ShareOutcome. It is filled without allocating: keys is the decision's
// block key slice (the one the slot holds), strings are the request's.
type shareInfo struct {
	keys   []uint64
	bs     int
	isl    int
	queued int64
	req    requestInfo
}

// requestInfo is the part of a Request a peer replica needs.
type requestInfo struct {
	model         routing.ModelName
	tenant        string
	prefixID      string
	totalRequests int
	oslTokens     int
	maxTokens     int
	osl, iat      routing.Level
}

func shared(r *routing.Request) requestInfo {
	return requestInfo{
		model: r.Model, tenant: r.Tenant, prefixID: r.Hints.PrefixID, totalRequests: r.Hints.TotalRequests,
		oslTokens: r.Hints.OSLTokens, maxTokens: r.MaxTokens, osl: r.Hints.OSL, iat: r.Hints.IAT,
	}
}

// Number implements [routing.Ticket].
func (cm *commitment) Number() uint64 { return cm.num }

// Share implements [routing.Ticket] ([Decision.Share]).
func (cm *commitment) Share(d *routing.Decision) routing.RemoteStart {
	sh := &cm.share
	r := &sh.req
	s := routing.RemoteStart{
		Endpoint: d.Endpoint, DPRank: d.DPRank, BlockSize: sh.bs, Blocks: sh.keys, ISL: sh.isl, Overlap: d.Overlap,
		ExpectedDecodeBlocks: expectedDecodeBlocks(r.oslTokens, r.maxTokens, sh.bs),
	}
	if len(r.model) <= routing.MaxRemoteString {
		s.Model = r.model
	}
	if cm.pre != nil {
		s.PrefillEndpoint, s.PrefillDPRank, s.PrefillCached = d.Prefill, d.PrefillRank, cm.pre.cached
	}
	if r.prefixID != "" && len(r.prefixID) <= routing.MaxRemoteString && len(r.tenant) <= routing.MaxRemoteString {
		s.PrefixID, s.Tenant, s.TotalRequests = r.prefixID, r.tenant, r.totalRequests
		s.OSL, s.OSLTokens, s.IAT, s.MaxTokens = r.osl, r.oslTokens, r.iat, r.maxTokens
	}
	return s
}

// expectedDecodeBlocks is the response's expected blocks from the output
// length hint, else max_tokens; 0 when neither is known.
func expectedDecodeBlocks(oslTokens, maxTokens, bs int) int {
	n := oslTokens
	if n <= 0 {
		n = maxTokens
	}
	if n <= 0 || bs <= 0 {
		return 0
	}
	return min((n+bs-1)/bs, routing.MaxRemoteTokens)
}

// ShareOutcome implements [routing.Ticket] ([Decision.ShareOutcome]).
func (cm *commitment) ShareOutcome(d *routing.Decision, o routing.Outcome) (ro routing.RemoteOutcome, ok bool) {
	if o.ServedUnknown {
		return routing.RemoteOutcome{}, false
	}
	sh := &cm.share
	ro = routing.RemoteOutcome{
		Endpoint: d.Endpoint, DPRank: d.DPRank, Outcome: o,
		BlockSize: sh.bs, ISL: sh.isl, Overlap: d.Overlap, QueuedPrefillTokens: sh.queued, OSL: sh.req.osl,
	}
	if cm.pre != nil {
		// A disaggregated decision's first token came from its prefill
		// endpoint, which an outcome cannot name (nor its queue and
		// cache at the decision): shared as Endpoint's, it would teach
		// peers Endpoint's speed from another endpoint's prefill. It is
		// left out; the end-to-end latency, Endpoint's, stays.
		ro.TTFT = 0
	}
	if o.Served == d.Endpoint {
		ro.Served = ""
	}
	if len(sh.req.model) <= routing.MaxRemoteString {
		ro.Model = sh.req.model
	}
	if len(sh.req.prefixID) <= routing.MaxRemoteString && len(sh.req.tenant) <= routing.MaxRemoteString {
		ro.PrefixID, ro.Tenant = sh.req.prefixID, sh.req.tenant
	}
	return ro, true
}
