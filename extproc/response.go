package extproc

import (
	"strconv"
	"strings"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
)

func (p *processor) onResponseHeaders(h *extprocv3.HttpHeaders) ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.decision == nil || (p.phase != phaseAwaitResponse && !p.reqBodyPassthrough) {
		return nil, false, protocolError("response headers in phase %d", p.phase)
	}
	p.respPhase = true
	p.phase = phaseResponseBody
	p.echoingResponse()
	for _, hv := range h.GetHeaders().GetHeaders() {
		switch hv.GetKey() {
		case ":status":
			p.status, _ = strconv.Atoi(headerValue(hv))
		case "content-type":
			ct := strings.ToLower(headerValue(hv))
			p.sse = strings.Contains(ct, "text/event-stream")
			p.json = strings.Contains(ct, "json")
		}
	}
	if p.served != "" && p.served != p.decision.Endpoint {
		p.s.metrics.servedMismatch.Inc()
	}
	if p.sse {
		p.stream = openai.NewStreamParser(p.s.cfg.MaxSSEEvent)
	}
	out := []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}}
	if h.GetEndOfStream() || p.respMode == filterv3.ProcessingMode_NONE {
		// No body will come through this stream.
		p.finish(p.statusKind())
		return out, true, nil
	}
	return out, false, nil
}

func (p *processor) onResponseBody(b *extprocv3.HttpBody) ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.phase != phaseResponseBody {
		if p.phase == phaseDone {
			return nil, false, nil
		}
		return nil, false, protocolError("response body in phase %d", p.phase)
	}
	chunk := b.GetBody()
	p.observeResponse(chunk)
	eos := b.GetEndOfStream()
	var out *extprocv3.ProcessingResponse
	if p.respMode == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		out = p.respChunk.set(false, chunk, eos)
	} else {
		out = bodyAck(false)
	}
	p.respOut[0] = out
	if eos || p.respMode == filterv3.ProcessingMode_BUFFERED {
		p.finish(p.statusKind())
		return p.respOut[:], true, nil
	}
	return p.respOut[:], false, nil
}

func (p *processor) onResponseTrailers() ([]*extprocv3.ProcessingResponse, bool, error) {
	if p.decision == nil {
		return nil, false, protocolError("response trailers before a decision")
	}
	p.finish(p.statusKind())
	return []*extprocv3.ProcessingResponse{{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}}}, true, nil
}

// observeResponse feeds a response chunk to the TTFT and usage trackers.
func (p *processor) observeResponse(chunk []byte) {
	if len(chunk) == 0 {
		return
	}
	switch {
	case p.stream != nil:
		if p.stream.Feed(chunk) && !p.sawContent {
			p.markFirstContent()
		}
	default:
		if !p.sawContent && p.status >= 200 && p.status < 300 {
			p.markFirstContent()
		}
		if p.json && !p.respOver {
			if len(p.respBody)+len(chunk) > p.s.cfg.MaxSSEEvent {
				p.respOver, p.respBody = true, nil
			} else {
				p.respBody = append(p.respBody, chunk...)
			}
		}
	}
}

func (p *processor) markFirstContent() {
	p.sawContent = true
	p.ttft = p.s.clk.Now().Sub(p.decision.At)
	p.decision.Prefilled()
}

func (p *processor) statusKind() routing.OutcomeKind {
	if p.status >= 200 && p.status < 400 {
		return routing.OutcomeSuccess
	}
	return routing.OutcomeUpstreamError
}
