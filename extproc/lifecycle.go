package extproc

import (
	"fmt"
	"net/http"
	"time"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
)

// admit takes one of the server's MaxInflight slots for this request, or
// refuses it: 503 while draining or when every slot is taken. The slot is
// given back in close.
func (p *processor) admit() error {
	select {
	case <-p.s.drain:
		return ErrShuttingDown
	default:
	}
	if n := p.s.inflight.Add(1); n > int64(p.s.cfg.MaxInflight) {
		p.s.inflight.Add(-1)
		return fmt.Errorf("%w: %d in flight", ErrTooManyStreams, p.s.cfg.MaxInflight)
	}
	p.admitted = true
	p.s.metrics.requestsInflight.Inc()
	return nil
}

// finish ends the decision with an observed outcome.
func (p *processor) finish(kind routing.OutcomeKind) {
	p.phase = phaseDone
	if p.decision == nil || p.decision.Finished() {
		return
	}
	o := routing.NoUsage(kind)
	o.Served, o.Status = p.served, p.status
	if kind == routing.OutcomeSuccess || kind == routing.OutcomeUpstreamError {
		now := p.s.clk.Now()
		o.Latency = now.Sub(p.decision.At)
		o.TTFT = p.ttft
		var u openai.Usage
		var ok bool
		if p.stream != nil {
			u, ok = p.stream.Usage()
		} else if len(p.respBody) > 0 {
			u, ok = openai.ParseUsage(p.respBody)
		}
		if ok {
			o.PromptTokens, o.CompletionTokens, o.CachedTokens = u.PromptTokens, u.CompletionTokens, u.CachedTokens
		}
	}
	p.end(o)
}

// abort ends the decision without a complete response.
func (p *processor) abort(kind routing.OutcomeKind, reason string) {
	if reason != "" {
		p.s.metrics.streamErrors.WithLabelValues(reason).Inc()
	}
	p.phase = phaseDone
	if p.decision == nil || p.decision.Finished() {
		p.count(p.status)
		return
	}
	o := routing.NoUsage(kind)
	o.Served, o.Status = p.served, p.status
	p.end(o)
}

// finishRejected records a request answered with a local reply.
func (p *processor) finishRejected(err error) {
	status, code := http.StatusInternalServerError, "internal"
	if r := Reject(err); r != nil {
		status, code = r.Status, r.Code
	}
	p.span.Refused(status, code)
	p.phase = phaseDone
	if p.decision != nil && !p.decision.Finished() {
		p.end(routing.NoUsage(routing.OutcomeRejected))
	}
	p.count(status)
}

func (p *processor) end(o routing.Outcome) {
	m := p.s.metrics
	p.decision.Done(o)
	m.req.Outcome(o)
	if o.PromptTokens > 0 {
		m.tokens.WithLabelValues("prompt").Add(float64(o.PromptTokens))
	}
	if o.CompletionTokens > 0 {
		m.tokens.WithLabelValues("completion").Add(float64(o.CompletionTokens))
	}
	if o.CachedTokens > 0 {
		m.tokens.WithLabelValues("cached").Add(float64(o.CachedTokens))
	}
	p.count(o.Status)
}

// count records the request once, by path class and final status.
func (p *processor) count(status int) {
	if p.counted || p.path == "" && status == 0 {
		return
	}
	p.counted = true
	p.s.metrics.req.Request(PathClass(p.kind, p.path), status)
}

// endOfStream handles Envoy half-closing the stream.
func (p *processor) endOfStream() {
	switch {
	case p.decision == nil:
		p.abort(routing.OutcomeCancelled, "")
	case p.phase == phaseDone:
	case p.noResponsePhase():
		p.endWithoutResponse()
	case !p.s.cfg.ResponseProcessing && !p.respPhase && p.decision.Finished():
		// Response processing is off and the data plane sent no response
		// phase either: the stream simply ends (the decision ended at the
		// request phase).
		p.phase = phaseDone
		p.count(0)
	default:
		// The data plane closed before the response ended: the client or
		// the upstream went away.
		p.abort(routing.OutcomeCancelled, "closed_early")
	}
}

// close releases the stream's resources; it ends a still-open decision as
// a reset (a safety net: every path above should have ended it).
func (p *processor) close() {
	for _, t := range []clock.Timer{p.timer, p.headerTimer, p.idleTimer} {
		if t != nil {
			t.Stop()
		}
	}
	if p.admitted {
		p.admitted = false
		p.s.inflight.Add(-1)
		p.s.metrics.requestsInflight.Dec()
	}
	if p.held > 0 {
		p.s.budget.Release(p.held)
		p.held = 0
	}
	p.body, p.respBody = nil, nil
	if p.decision != nil && !p.decision.Finished() {
		p.abort(routing.OutcomeReset, "unfinished")
	}
	p.span.End(p.status)
}

// armIdle schedules the next idle check in d.
func (p *processor) armIdle(d time.Duration) {
	idle := p.idle
	p.idleTimer = p.s.clk.AfterFunc(d, func() {
		select {
		case idle <- struct{}{}:
		default:
		}
	})
}

// idleCheck runs (under the stream's lock) when the idle timer fires. A
// stream that received a message since re-arms for the rest of the
// period; one silent for StreamIdleTimeout ends its decision as abandoned
// and reports the stream settled, to be closed cleanly: Envoy then goes on
// without kvbandit, so a response that is merely slow (a non-streamed
// generation sends nothing until it is complete) still reaches the client,
// only its outcome is lost. Nothing is in flight to be dropped, since
// every message received has been answered.
func (p *processor) idleCheck() (error, bool) {
	if p.phase == phaseDone || !p.decided() {
		return nil, false
	}
	quiet := p.s.clk.Now().Sub(p.lastMsg)
	if rest := p.s.cfg.StreamIdleTimeout - quiet; rest > 0 {
		p.armIdle(rest)
		return nil, false
	}
	p.s.log.Warn("ext_proc stream idle: closing it and releasing its decision", "request_id", p.requestID, "idle", quiet, "phase", int(p.phase))
	p.abort(routing.OutcomeAbandoned, "idle_timeout")
	return nil, true
}
