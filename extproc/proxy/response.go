package proxy

import (
	"io"
	"net/http"
	"strings"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
)

// writeHeader notes the worker's status and content type (for the outcome
// and the TTFT and usage trackers) and sends the client the worker's
// response headers, flushed at once for SSE.
func (x *exchange) writeHeader(w http.ResponseWriter, resp *http.Response) *http.ResponseController {
	x.status = resp.StatusCode
	ct := strings.ToLower(resp.Header.Get("Content-Type"))
	x.sse = strings.Contains(ct, "text/event-stream")
	x.json = strings.Contains(ct, "json")
	if x.sse {
		x.stream = openai.NewStreamParser(x.p.cfg.MaxSSEEvent)
	}

	h := w.Header()
	copyHeader(h, resp.Header)
	h.Set(HeaderEndpoint, string(x.d.Endpoint))
	for k := range resp.Trailer {
		h.Add("Trailer", k)
	}
	w.WriteHeader(resp.StatusCode)
	x.reply = resp.StatusCode
	rc := http.NewResponseController(w)
	if x.sse {
		_ = rc.Flush() // headers out now: an SSE client sees the stream open
	}
	return rc
}

// copyBody streams the worker's body to the client through buf, writing
// and flushing every chunk as it is read. false: the client went away or
// the request was cut, and the decision has ended. A worker body that
// breaks off ends the decision and panics with http.ErrAbortHandler, so
// that the client sees the truncation.
func (x *exchange) copyBody(w http.ResponseWriter, rc *http.ResponseController, src io.Reader, buf []byte) bool {
	p := x.p
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			x.observe(buf[:n])
			if _, werr := w.Write(buf[:n]); werr != nil {
				x.end(x.cancelKind())
				return false
			}
			if ferr := rc.Flush(); ferr != nil {
				x.end(x.cancelKind())
				return false
			}
		}
		if rerr == io.EOF {
			return true
		}
		if rerr != nil {
			if x.ctx.Err() != nil {
				x.end(x.cancelKind())
				return false
			}
			// The worker broke off: end the decision, then abort the
			// client's connection so the truncation is visible.
			p.metrics.upstreamErrors.WithLabelValues("body").Inc()
			p.log.Debug("upstream body broke off", "endpoint", string(x.d.Endpoint), "err", rerr)
			x.end(routing.OutcomeUpstreamError)
			panic(http.ErrAbortHandler)
		}
	}
}

// finishResponse sends the worker's trailers and ends the decision by the
// worker's status.
func (x *exchange) finishResponse(w http.ResponseWriter, resp *http.Response) {
	for k, vv := range resp.Trailer {
		w.Header()[http.TrailerPrefix+k] = vv
	}
	if x.status >= 200 && x.status < 400 {
		x.end(routing.OutcomeSuccess)
	} else {
		x.p.metrics.upstreamErrors.WithLabelValues("status").Inc()
		x.end(routing.OutcomeUpstreamError)
	}
}

// observe feeds a response chunk to the TTFT and usage trackers (as the
// ext_proc processor does).
func (x *exchange) observe(chunk []byte) {
	switch {
	case x.stream != nil:
		if x.stream.Feed(chunk) && !x.sawContent {
			x.markFirstContent()
		}
	default:
		if !x.sawContent && x.status >= 200 && x.status < 300 {
			x.markFirstContent()
		}
		if x.json && !x.respOver {
			if len(x.respBody)+len(chunk) > x.p.cfg.MaxSSEEvent {
				x.respOver, x.respBody = true, nil
			} else {
				x.respBody = append(x.respBody, chunk...)
			}
		}
	}
}

func (x *exchange) markFirstContent() {
	x.sawContent = true
	x.ttft = x.p.clk.Now().Sub(x.d.At)
	x.d.Prefilled()
}

// copyHeader copies the worker's response headers without hop-by-hop ones.
func copyHeader(dst, src http.Header) {
	conn := src.Values("Connection")
	for k, vv := range src {
		if hop(k, conn) || strings.HasPrefix(strings.ToLower(k), "x-kvbandit-") {
			continue
		}
		dst[k] = vv
	}
}
