package envoysim

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
)

// ---- upstream ------------------------------------------------------------

// startUpstream is the router: override_host picks the host, then the
// request goes out over HTTP/1.1 with the (mutated) headers.
func (ex *exchange) startUpstream(h headerMap, eos bool) {
	ch := ex.p.cluster.choose(ex.md)
	ex.rec.Destination = ch.destination
	ex.rec.Upstream = ch.host
	ex.rec.Fallback = ch.fallback
	if ch.fallback {
		ex.note("override_host: fallback policy (round robin) chose " + ch.host + ": " + ch.reason)
	}
	if ch.host == "" {
		ex.upstreamLocalReply(http.StatusServiceUnavailable, "no healthy upstream", "no_healthy_upstream")
		return
	}
	method, _ := h.get(":method")
	path, _ := h.get(":path")
	authority, _ := h.get(":authority")
	u, err := url.Parse("http://" + ch.host + path)
	if err != nil {
		ex.upstreamLocalReply(http.StatusBadRequest, "Bad Request", "invalid_path")
		return
	}
	ctx, cancel := context.WithCancel(ex.p.ctx)
	req := (&http.Request{Method: method, URL: u, Host: authority, Header: make(http.Header)}).WithContext(ctx)
	req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/1.1", 1, 1
	for _, kv := range h {
		if strings.HasPrefix(kv.key, ":") || connectionHeaders[kv.key] || kv.key == "content-length" ||
			slices.ContainsFunc(ex.p.cfg.RouteRemoveRequestHeaders, func(n string) bool { return strings.EqualFold(n, kv.key) }) {
			continue
		}
		req.Header.Add(kv.key, kv.value)
	}
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header["User-Agent"] = nil // Envoy adds none; keep Go from adding its own
	}
	if !eos {
		ex.upBody = newBodyPipe()
		req.Body = ex.upBody
		req.ContentLength = -1
		if cl, ok := h.get("content-length"); ok {
			if n, err := strconv.ParseInt(cl, 10, 64); err == nil {
				req.ContentLength = n
			}
		}
		if req.ContentLength < 0 && len(ex.r.Trailer) > 0 {
			req.Trailer = make(http.Header)
			for k := range ex.r.Trailer {
				req.Trailer[k] = nil
			}
		}
	}
	ex.upCancel = cancel
	ex.upReq = req
	ex.note("upstream request to " + ch.host)
	transport := ex.p.transport
	if !ex.p.goTracked(func() {
		resp, err := transport.RoundTrip(req)
		if !ex.post(event{kind: evUpstreamResponse, resp: resp, err: err}) && resp != nil {
			resp.Body.Close()
		}
	}) {
		cancel()
	}
}

func (ex *exchange) upstreamData(b []byte, eos bool) {
	if ex.upBody == nil {
		return
	}
	ex.upBody.write(b)
	if eos {
		ex.upBody.closeWrite(nil)
	}
}

func (ex *exchange) upstreamTrailers(t headerMap) {
	if ex.upBody == nil {
		return
	}
	trailer := ex.upReq.Trailer
	if trailer == nil {
		ex.note("request trailers dropped: the upstream request is not chunked")
		ex.upBody.closeWrite(nil)
		return
	}
	// The transport reads req.Trailer in its own goroutine after the body's
	// EOF: fill it in there.
	ex.upBody.closeWriteThen(func() {
		for _, kv := range t {
			trailer.Add(kv.key, kv.value)
		}
	})
}

// abortUpstream resets the upstream request, if any.
func (ex *exchange) abortUpstream() {
	if ex.upCancel != nil {
		ex.upCancel()
	}
	if ex.upBody != nil {
		ex.upBody.closeWrite(errUpstreamAborted)
	}
}

var errUpstreamAborted = errors.New("envoysim: upstream request aborted")

// onUpstreamResponse starts the response path with the upstream's headers.
func (ex *exchange) onUpstreamResponse(resp *http.Response, err error) {
	if err != nil {
		if ex.p.ctx.Err() != nil {
			return
		}
		ex.note("upstream request failed: " + err.Error())
		ex.upstreamLocalReply(http.StatusServiceUnavailable,
			"upstream connect error or disconnect/reset before headers. reset reason: connection failure",
			"upstream_reset_before_response_started{connection_failure}")
		return
	}
	ex.upResp = resp
	h := headerMap{{":status", strconv.Itoa(resp.StatusCode)}}
	h = append(h, fromHTTP(resp.Header)...)
	h.del("content-length")
	noBody := resp.ContentLength == 0 || resp.Body == http.NoBody || ex.upReq.Method == http.MethodHead
	if resp.ContentLength >= 0 {
		h.add("content-length", strconv.FormatInt(resp.ContentLength, 10))
	}
	if noBody {
		resp.Body.Close()
		ex.upResp = nil
	}
	ex.onHeaders(ex.enc, h, noBody)
	if noBody || ex.finished {
		return
	}
	if ex.p.goTracked(func() { ex.pumpResponse(resp) }) {
		ex.upResp = nil // the pump owns (and closes) the body now
	}
}

// pumpResponse hands the upstream body to the exchange loop as it arrives.
func (ex *exchange) pumpResponse(resp *http.Response) {
	defer resp.Body.Close()
	known := resp.ContentLength > 0
	var total int64
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			total += int64(n)
			eos := known && total >= resp.ContentLength
			if !ex.post(event{kind: evResponseData, data: bytes.Clone(buf[:n]), eos: eos}) || eos {
				return
			}
		}
		switch {
		case err == nil:
		case errors.Is(err, io.EOF):
			if tr := trailerMap(resp.Trailer); len(tr) > 0 {
				ex.post(event{kind: evResponseTrailers, trailers: tr})
			} else {
				ex.post(event{kind: evResponseData, eos: true})
			}
			return
		default:
			ex.post(event{kind: evResponseError, err: err})
			return
		}
	}
}

// upstreamLocalReply is a reply Envoy's router generates (no host,
// connection failure). It goes through the response path like an upstream
// response, as local replies go through Envoy's encoder filters.
func (ex *exchange) upstreamLocalReply(code int, body, details string) {
	ex.rec.LocalReply = code
	ex.rec.Details = details
	ex.note(fmt.Sprintf("router local reply %d (%s)", code, details))
	h := headerMap{{":status", strconv.Itoa(code)}, {"content-length", strconv.Itoa(len(body))}}
	if body != "" {
		h.add("content-type", "text/plain")
	}
	ex.onHeaders(ex.enc, h, body == "")
	if body != "" && !ex.finished {
		ex.onData(ex.enc, []byte(body), true)
	}
}
