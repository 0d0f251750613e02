package thompson

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/evidence"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// decision is the policy's record of a committed decision (Choice.State):
// what learning needs when the outcome, or the timeout, arrives.
type decision struct {
	p        *Policy
	seq      uint64
	arm      *arm
	endpoint routing.EndpointKey
	rank     int
	x        vec // the features the chosen candidate was scored with
	osl, bin int // baseline bucket: osl level, prefill bin
	prefix   prefixstate.Key
	at       time.Time

	state atomic.Bool // set by the first of Done, the timer, the engine's expiry

	// Guarded by the pending shard's mutex.
	timer      clock.Timer
	prev, next *decision
	linked     bool
}

// Done implements [routing.Policy]. Outcomes map to learning as follows:
//
//   - OutcomeSuccess: reward 1/(1+metric/baseline) with metric the latency
//     in ms per output token (or in ms when the token count is unknown);
//     the latency baselines learn the metric.
//   - OutcomeUpstreamError: reward 0, baselines unchanged (the reference's
//     success=false).
//   - OutcomeExpired: the timeout reward, as if the policy's own timer had
//     fired; counted as a timeout.
//   - OutcomeCancelled, OutcomeReset, OutcomeAbandoned, OutcomeRejected: no
//     learning. The client, the data plane or kvbandit itself ended the
//     request, which says nothing about the endpoint. (The reference never
//     hears of disconnects and charges them the timeout reward.)
//
// When the data plane served the request elsewhere (Outcome.Served differs
// from the chosen endpoint), the Beta bandit and baselines of the served
// endpoint learn; LinTS does not, since the stored features describe the
// chosen one. The engine passes only a Served endpoint of its set; one
// outside it (Outcome.ServedUnknown: forged or stale response metadata)
// teaches nothing and creates no state. A Done after the timeout applied
// its reward changes nothing. Done never blocks on anything but short
// per-endpoint mutexes.
func (p *Policy) Done(d *routing.Decision, o routing.Outcome) {
	rec, ok := d.PolicyState().(*decision)
	if !ok || rec == nil || rec.p != p {
		return
	}
	if !p.claim(rec, false) {
		p.late.Add(1)
		return
	}
	if o.ServedUnknown {
		p.noLearning.Add(1)
		return
	}
	switch o.Kind {
	case routing.OutcomeSuccess, routing.OutcomeUpstreamError:
		p.learn(rec, o)
	case routing.OutcomeExpired:
		p.applyTimeout(rec)
	default:
		p.noLearning.Add(1)
	}
}

// expire is the feedback timer's callback.
func (p *Policy) expire(rec *decision) {
	if p.claim(rec, true) {
		p.applyTimeout(rec)
	}
}

// claim ends a decision's pending life; only the first caller gets true.
func (p *Policy) claim(rec *decision, fromTimer bool) bool {
	if !rec.state.CompareAndSwap(false, true) {
		return false
	}
	if t := p.pending.remove(rec); t != nil && !fromTimer {
		t.Stop()
	}
	return true
}

func (p *Policy) applyTimeout(rec *decision) {
	r := clip01(p.cfg.Feedback.TimeoutReward)
	rec.arm.ep.observe(r, evidence.Local)
	if rec.arm.update(&rec.x, r, p.cfg.LinTS.Lambda, p.cfg.LinTS.ForgetRate) {
		p.eigenFallbacks.Add(1)
	}
	p.timeouts.Add(1)
	p.log.Debug("thompson: feedback timeout", "endpoint", rec.endpoint, "dp_rank", rec.rank,
		"prefix_id", rec.prefix.PrefixID, "age", p.clk.Now().Sub(rec.at), "reward", r)
	if p.onReward != nil {
		p.onReward(Reward{Endpoint: rec.endpoint, DPRank: rec.rank, Value: r, Timeout: true, Kind: routing.OutcomeExpired})
	}
}

func (p *Policy) learn(rec *decision, o routing.Outcome) {
	ep, a, endpoint := rec.arm.ep, rec.arm, rec.endpoint
	if o.Served != "" && o.Served != rec.endpoint {
		ep, a, endpoint = p.endpointFor(o.Served, p.clk.Now().UnixNano()), nil, o.Served
		p.servedMismatch.Add(1)
	}
	p.feedback.Add(1)
	p.reward(ep, a, &rec.x, endpoint, rec.rank, rec.osl, rec.bin, o, evidence.Local)
}

// reward applies a success or upstream error's reward, learnt from src, to
// the endpoint's Beta bandit and latency baselines (bucket osl, bin) and,
// when a is not nil, to the LinTS arm a with the features x it was scored
// with.
func (p *Policy) reward(ep *endpointState, a *arm, x *vec, endpoint routing.EndpointKey, rank, osl, bin int, o routing.Outcome, src evidence.Source) {
	metric := max(float64(o.Latency)/float64(time.Millisecond), 0)
	perTok := o.CompletionTokens > 0
	if perTok {
		metric /= float64(o.CompletionTokens)
	}
	success := o.Kind == routing.OutcomeSuccess
	baseline := p.baseline(ep, osl, bin, perTok, metric, success, src)
	var r float64
	if success {
		r = rewardFor(metric, baseline)
	}
	ep.observe(r, src)
	if a != nil && a.update(x, r, p.cfg.LinTS.Lambda, p.cfg.LinTS.ForgetRate) {
		p.eigenFallbacks.Add(1)
	}
	if p.onReward != nil {
		p.onReward(Reward{Endpoint: endpoint, DPRank: rank, Value: r, Kind: o.Kind, Latency: o.Latency,
			Metric: metric, Baseline: baseline, PerToken: perTok})
	}
}

// rewardFor is 1/(1 + metric/max(1e-3, baseline)), clipped to [0, 1]:
// 0.5 when the metric equals the baseline, 0.8 at a quarter of it, 1/3 at
// twice it.
func rewardFor(metric, baseline float64) float64 {
	return clip01(1 / (1 + metric/max(minBaseline, baseline)))
}

// baseline returns the latency baseline for the bucket (endpoint, osl,
// prefill bin, per_tok), falling back to the endpoint's, then the global
// one, then max(1, metric), all read before this outcome. On success it then
// moves all three averages toward metric, as src's.
func (p *Policy) baseline(ep *endpointState, osl, bin int, perTok bool, metric float64, success bool, src evidence.Source) float64 {
	i := 0
	if perTok {
		i = 1
	}
	p.emaMu.Lock()
	defer p.emaMu.Unlock()
	bucket, overall, global := &ep.bucket[osl][bin][i], &ep.overall[i], &p.global[i]
	var base float64
	switch {
	case bucket.ok:
		base = bucket.v
	case overall.ok:
		base = overall.v
	case global.ok:
		base = global.v
	default:
		base = max(1, metric)
	}
	if success {
		alpha := p.cfg.Feedback.LatencyEMAAlpha
		bucket.add(metric, alpha, src)
		overall.add(metric, alpha, src)
		global.add(metric, alpha, src)
	}
	return base
}

const pendingShards = 16

// pendingSet holds the decisions awaiting an outcome, so that Close can stop
// their timers. Each shard is an intrusive list.
type pendingSet struct {
	shards [pendingShards]pendingShard
	n      atomic.Int64
	closed atomic.Bool
}

type pendingShard struct {
	mu   sync.Mutex
	head *decision
	_    [48]byte // keep shards on separate cache lines
}

// add links rec and arms its timeout on clk.
func (ps *pendingSet) add(rec *decision, clk clock.Clock, timeout time.Duration) {
	sh := &ps.shards[rec.seq%pendingShards]
	sh.mu.Lock()
	if ps.closed.Load() {
		sh.mu.Unlock()
		return
	}
	rec.next = sh.head
	if sh.head != nil {
		sh.head.prev = rec
	}
	sh.head, rec.linked = rec, true
	ps.n.Add(1)
	sh.mu.Unlock()

	t := clk.AfterFunc(timeout, func() { rec.p.expire(rec) })
	sh.mu.Lock()
	if rec.linked {
		rec.timer, t = t, nil
	}
	sh.mu.Unlock()
	if t != nil { // claimed (or closed) before the timer was recorded
		t.Stop()
	}
}

// remove unlinks rec and returns its timer for the caller to stop.
func (ps *pendingSet) remove(rec *decision) clock.Timer {
	sh := &ps.shards[rec.seq%pendingShards]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if !rec.linked {
		return nil
	}
	ps.unlink(sh, rec)
	t := rec.timer
	rec.timer = nil
	return t
}

func (ps *pendingSet) unlink(sh *pendingShard, rec *decision) {
	if rec.prev != nil {
		rec.prev.next = rec.next
	} else {
		sh.head = rec.next
	}
	if rec.next != nil {
		rec.next.prev = rec.prev
	}
	rec.prev, rec.next, rec.linked = nil, nil, false
	ps.n.Add(-1)
}

// close stops every pending timer; later decisions arm none.
func (ps *pendingSet) close() {
	ps.closed.Store(true)
	var timers []clock.Timer
	for i := range ps.shards {
		sh := &ps.shards[i]
		sh.mu.Lock()
		for sh.head != nil {
			rec := sh.head
			if rec.timer != nil {
				timers = append(timers, rec.timer)
				rec.timer = nil
			}
			ps.unlink(sh, rec)
		}
		sh.mu.Unlock()
	}
	for _, t := range timers {
		t.Stop()
	}
}
