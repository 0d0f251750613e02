package extproc

import (
	"time"

	"github.com/kvbandit/kvbandit/routing"
)

// Streams that end right after the request phase. NGINX Gateway Fabric's
// endpoint picker shim sends the request phase without protocol_config,
// half-closes the stream and never sends a response phase: the request is
// still being served when the stream ends. A data plane that sends
// protocol_config (Envoy does) follows Envoy's semantics, where such a
// half-close is a client that went away (OutcomeCancelled). Otherwise its
// decision ends as routing.OutcomeNoResponsePhase (no success, no failure:
// policies learn nothing from it) and its load stays counted for the
// request's predicted duration, released by a timer on the server's
// clock, so that the in-flight counts of such a data plane's workers
// reflect the requests they run.
const (
	// NoResponseWindow is how soon after the request phase a half-close
	// must come to be taken for a data plane without a response phase;
	// such a data plane half-closes as it sends the body, so the close is
	// read as soon as the replies are sent. A later one is a client that
	// went away (OutcomeCancelled).
	NoResponseWindow = time.Second
	// NoResponseHold is how long a decision's load is held beyond its
	// predicted time to first token (the latency model's prediction on
	// the decision; kvbandit's policy makes one), for the generation no
	// prediction covers; a decision without a prediction holds this long.
	NoResponseHold = 10 * time.Second
	// MaxNoResponseHold bounds any hold, below the engine's stale-decision
	// sweep (5 minutes by default), so that the hold, not the sweep, ends
	// the decision.
	MaxNoResponseHold = 2 * time.Minute
)

// noResponsePhase reports whether the stream half-closed right after its
// request phase, waiting for a response phase that the data plane will
// never send.
func (p *processor) noResponsePhase() bool {
	return p.s.cfg.ResponseProcessing && !p.modeKnown && p.phase == phaseAwaitResponse && !p.respPhase &&
		p.decision != nil && !p.decision.Finished() &&
		p.s.clk.Now().Sub(p.requestDone) <= NoResponseWindow
}

// holdDuration is how long d's load stays counted after a stream without
// a response phase ends.
func holdDuration(d *routing.Decision) time.Duration {
	return min(max(d.Predicted.TTFT, 0)+NoResponseHold, MaxNoResponseHold)
}

// endWithoutResponse ends the stream of a data plane that sends no
// response phase: the request is counted now (without a status: none was
// seen), the decision ends as OutcomeNoResponsePhase after holdDuration,
// and the first such stream of the process logs a warning.
func (p *processor) endWithoutResponse() {
	s, d := p.s, p.decision
	// The timer owns the decision now: close must not end it.
	p.phase, p.decision = phaseDone, nil
	p.count(0)
	o := routing.NoUsage(routing.OutcomeNoResponsePhase)
	o.Served = p.served
	hold := holdDuration(d)
	// The timer outlives the stream: it holds only the decision and the
	// metrics, never the processor.
	s.clk.AfterFunc(hold, func() {
		if d.Done(o) {
			s.metrics.req.Outcome(o)
		}
	})
	s.noResponseOnce.Do(func() {
		s.log.Warn("the data plane ends each ext_proc stream right after the request phase and sends no response phase (NGINX Gateway Fabric's endpoint picker shim does): kvbandit routes such requests but sees no outcome, records them as no_response_phase and keeps each decision's load counted for its predicted duration (at most "+MaxNoResponseHold.String()+"); see docs/envoy.md, \"Other data planes\"",
			"request_id", p.requestID, "held_for", hold)
	})
}
