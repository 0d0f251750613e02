package extproc

import (
	"context"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
)

// decide parses the request, estimates or computes its tokens and picks.
func (p *processor) decide(ctx context.Context) error {
	m := p.s.metrics
	t0 := p.s.clk.Now()
	p.classifyByBody()
	req := routing.Request{ID: p.requestID, Path: p.path, Tenant: p.tenant, Arrival: p.started, Subset: p.subset}
	kind := p.kind
	if p.bodyUnseen {
		// Only what the headers carry: hints, the path, and the model when
		// a body-based router put it in a header. No tokens: the engine
		// routes on load and prefix or session affinity.
		kind = openai.KindOther
		req.Model = routing.ModelName(p.model)
	}
	parsed, problems, err := ParseRequest(kind, p.body, p.header, &req)
	if err != nil {
		return err
	}
	if problems.Count > 0 {
		m.hintProblems.Add(float64(problems.Count))
	}
	obj, cli := hints.ResolvePriority(p.header, p.s.objectives, p.s.cfg.ClientPriority, &req.Hints)
	if obj != hints.ObjectiveNone {
		m.inferenceObjectives.WithLabelValues(obj).Inc()
	}
	if cli != hints.ClientKept {
		m.clientPriorities.WithLabelValues(cli).Inc()
	}
	t1 := p.s.clk.Now()
	m.phaseParse.Observe(t1.Sub(t0).Seconds())
	if parsed != nil {
		p.tokenize(ctx, parsed, &req)
		t2 := p.s.clk.Now()
		m.phaseTokenize.Observe(t2.Sub(t1).Seconds())
		t1 = t2
	}
	pctx := p.pickCtx
	if pctx == nil {
		pctx = ctx
	}
	d, err := p.s.picker.Pick(pctx, &req)
	t3 := p.s.clk.Now()
	m.phasePick.Observe(t3.Sub(t1).Seconds())
	p.span.Decision(t0, t1, t3, d, err)
	if err != nil {
		return err
	}
	if p.timer != nil {
		p.timer.Stop()
	}
	p.decision = d
	p.tokensIn = req.TokenCount
	m.tokensRouted.Add(float64(req.TokenCount))
	m.phaseTotal.Observe(t3.Sub(p.started).Seconds())
	if p.bodyUnseen {
		p.s.decidedWithoutBody(p.reqMode)
	}
	// What the request phase read from the headers is no longer needed.
	p.hintVals, p.hintSet, p.tenant, p.model = [len(hintHeaders)]string{}, 0, "", ""
	p.session, p.sessionAt = "", 0
	if p.idle != nil {
		p.lastMsg = t3
		p.armIdle(p.s.cfg.StreamIdleTimeout)
	}
	return nil
}

// tokenize fills the request's tokens, falling back to a byte estimate.
func (p *processor) tokenize(ctx context.Context, parsed *openai.Request, req *routing.Request) {
	reason, err := TokenizeRequest(ctx, p.s.tok, p.s.cfg.TokenizerTimeout, parsed, p.body, req)
	if reason == "" {
		return
	}
	if err != nil {
		p.s.log.Debug("tokenizer failed; estimating", "err", err, "model", parsed.Model)
	}
	p.s.metrics.tokenizerFallbacks.WithLabelValues(reason).Inc()
}
