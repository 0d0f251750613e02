package proxy

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/routing"
)

// upstreamRequest builds the worker's request: the client's headers
// (outboundHeader), the decision's destination, data-parallel rank and,
// for a disaggregated request, its prefill stage (run here in the direct
// P/D mode, named for the sidecar otherwise), and the body. false: the
// decision has ended and the client been answered.
func (x *exchange) upstreamRequest(w http.ResponseWriter, r *http.Request, target string, body *reqBody) (*http.Request, bool) {
	p, d := x.p, x.d
	ep := string(d.Endpoint)
	up, err := http.NewRequestWithContext(x.ctx, r.Method, "http://"+ep+target, http.NoBody)
	if err != nil {
		body.release()
		x.end(routing.OutcomeRejected)
		x.reply = p.reply(w, err)
		return nil, false
	}
	up.Header = outboundHeader(r)
	up.Header.Set(extproc.HeaderDestination, ep)
	if d.DPRank >= 0 {
		up.Header.Set(extproc.HeaderDPRank, strconv.Itoa(d.DPRank))
	}
	// Only the picker's P/D protocol may name a host for the decode
	// engine's KV connector: a client's kv_transfer_params goes, whether or
	// not this request is disaggregated (extproc.StripsKVTransfer).
	if extproc.StripsKVTransfer(d, p.cfg.StripKVTransferParams) {
		if b, ok := extproc.StripKVTransferParams(body.bytes()); ok {
			body.shrink(b)
		}
	}
	switch {
	case d.Prefill == "":
	case p.cfg.PDMode == PDModeDirect:
		// Disaggregated, no sidecar: the proxy runs the prefill stage
		// and rewrites the body for the decode stage.
		if !x.direct(r, target, body, up) {
			body.release()
			x.endCut(w)
			return nil, false
		}
	default:
		// Disaggregated: the decode worker's P/D sidecar runs the
		// prefill stage on this endpoint.
		up.Header.Set(extproc.HeaderPrefiller, string(d.Prefill))
	}
	if b := body.bytes(); len(b) > 0 {
		up.Body, _ = body.open()
		up.GetBody, up.ContentLength = body.open, int64(len(b))
	}
	return up, true
}

// roundTrip sends up to the worker and releases the request body. false:
// the worker could not be reached (or the request was cut); the decision
// has ended and the client been answered if it is still there.
func (x *exchange) roundTrip(w http.ResponseWriter, up *http.Request, body *reqBody) (*http.Response, bool) {
	p := x.p
	ep := string(x.d.Endpoint)
	x.up = x.span.StartUpstream(up, ep)
	resp, err := p.rt.RoundTrip(up)
	// The worker has answered or cannot be reached: the body is no longer
	// needed (the transport replays it, through GetBody, only inside
	// RoundTrip).
	body.release()
	if err != nil {
		if x.ctx.Err() != nil {
			x.endCut(w)
			return nil, false
		}
		p.metrics.upstreamErrors.WithLabelValues("connect").Inc()
		x.end(routing.OutcomeUpstreamError) // status 0: no response
		p.log.Debug("upstream unreachable", "endpoint", ep, "err", err)
		x.reply = p.reply(w, fmt.Errorf("%w: %s: %w", ErrUpstreamUnavailable, ep, err))
		return nil, false
	}
	return resp, true
}

// outboundHeader copies the client's request headers for the worker
// without hop-by-hop headers and without headers that could pose as the
// gateway's (extproc.Steering: x-gateway-destination-endpoint*,
// x-data-parallel-rank, x-prefiller-host-port) or as
// kvbandit's own; it appends the client to X-Forwarded-For and keeps
// "TE: trailers" (gRPC-style clients need it end to end).
func outboundHeader(r *http.Request) http.Header {
	conn := r.Header.Values("Connection")
	out := make(http.Header, len(r.Header)+3)
	for k, vv := range r.Header {
		lk := strings.ToLower(k)
		if hop(k, conn) || extproc.Steering(k) || strings.HasPrefix(lk, "x-kvbandit-") {
			continue
		}
		out[k] = vv
	}
	for _, te := range r.Header.Values("Te") {
		if strings.Contains(strings.ToLower(te), "trailers") {
			out.Set("Te", "trailers")
		}
	}
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		if prior := out.Values("X-Forwarded-For"); len(prior) > 0 {
			ip = strings.Join(prior, ", ") + ", " + ip
		}
		out.Set("X-Forwarded-For", ip)
	}
	return out
}

// upstreamBody is the request body as sent to a worker. It forgets the
// bytes once the transport closes it (after writing them), so a long
// response does not keep the request body alive through resp.Request.
type upstreamBody struct {
	mu sync.Mutex
	r  bytes.Reader
}

func (u *upstreamBody) Read(b []byte) (int, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.r.Read(b)
}

// Close implements io.Closer.
func (u *upstreamBody) Close() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.r.Reset(nil)
	return nil
}
