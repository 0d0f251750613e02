package proxy

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/routing"
)

// exchange is one proxied request after its decision: it owns the
// decision until it ends it, exactly once.
type exchange struct {
	p   *Proxy
	d   *routing.Decision
	ctx context.Context
	// reply is the status the client got (0: none, the client went away).
	reply int
	// span is the request's server span, up the worker call's (zero when
	// tracing is off).
	span tracing.Span
	up   tracing.Upstream

	status     int
	sse        bool
	json       bool
	stream     *openai.StreamParser
	respBody   []byte
	respOver   bool
	ttft       time.Duration
	sawContent bool
	ended      bool
}

// run sends the request to the chosen worker (target is the cleaned path
// and the query) and streams the response back.
func (x *exchange) run(w http.ResponseWriter, r *http.Request, target string, body *reqBody) {
	up, ok := x.upstreamRequest(w, r, target, body)
	if !ok {
		return
	}
	resp, ok := x.roundTrip(w, up, body)
	if !ok {
		return
	}
	defer resp.Body.Close()
	rc := x.writeHeader(w, resp)
	bp := x.p.bufs.Get().(*[]byte)
	defer x.p.bufs.Put(bp)
	if !x.copyBody(w, rc, resp.Body, *bp) {
		return
	}
	x.finishResponse(w, resp)
}

// recoverEnd is the safety net: a panic (http.ErrAbortHandler included)
// still ends the decision, as a reset, and is re-raised.
func (x *exchange) recoverEnd() {
	if x.ended {
		return
	}
	v := recover()
	x.end(routing.OutcomeReset)
	if v != nil {
		panic(v)
	}
}

// endCut ends the decision of a request whose context ended before the
// worker answered; a request Stop cut (abandoned) is answered with the
// cause, a client that went away (cancelled) is not.
func (x *exchange) endCut(w http.ResponseWriter) {
	x.end(x.cancelKind())
	if x.cancelKind() == routing.OutcomeAbandoned {
		x.reply = x.p.reply(w, context.Cause(x.ctx))
	}
}

// cancelKind says how a request whose context ended is charged: abandoned
// when Stop cut it, cancelled when the client went away.
func (x *exchange) cancelKind() routing.OutcomeKind {
	if errors.Is(context.Cause(x.ctx), errStopped) || x.p.stopCtx.Err() != nil {
		return routing.OutcomeAbandoned
	}
	return routing.OutcomeCancelled
}

// end reports the outcome; only the first call counts.
func (x *exchange) end(kind routing.OutcomeKind) {
	if x.ended {
		return
	}
	x.ended = true
	o := routing.NoUsage(kind)
	o.Status = x.status
	if x.status != 0 {
		o.Served = x.d.Endpoint
	}
	if kind == routing.OutcomeSuccess || kind == routing.OutcomeUpstreamError {
		o.Latency = x.p.clk.Now().Sub(x.d.At)
		o.TTFT = x.ttft
		var u openai.Usage
		var ok bool
		if x.stream != nil {
			u, ok = x.stream.Usage()
		} else if len(x.respBody) > 0 {
			u, ok = openai.ParseUsage(x.respBody)
		}
		if ok {
			o.PromptTokens, o.CompletionTokens, o.CachedTokens = u.PromptTokens, u.CompletionTokens, u.CachedTokens
		}
	}
	x.d.Done(o)
	x.up.End(x.status, kind)
	x.respBody = nil
	x.p.metrics.req.Outcome(o)
}

// hopHeaders are removed in both directions (RFC 9110 section 7.6.1, and
// the ones net/http/httputil.ReverseProxy removes).
var hopHeaders = [...]string{
	"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade",
}

// hop reports whether k is a hop-by-hop header, either by name or because
// the Connection header lists it.
func hop(k string, connection []string) bool {
	for _, h := range hopHeaders {
		if strings.EqualFold(k, h) {
			return true
		}
	}
	for _, v := range connection {
		for f := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(f), k) {
				return true
			}
		}
	}
	return false
}
