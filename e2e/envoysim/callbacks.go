package envoysim

import (
	"fmt"
	"net/http"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// ---- messages to the server --------------------------------------------------

func (ex *exchange) onHeaders(p *phase, h headerMap, eos bool) {
	p.started = true
	p.headers = h
	p.held = true
	p.noBody = eos
	p.complete = eos
	if ex.complete || !p.sendHeaders {
		ex.continueHeaders(p)
		if p.response && p.noExternalProcess() {
			ex.closeStream("no response processing")
		}
		return
	}
	hh := &extprocv3.HttpHeaders{Headers: h.proto(), EndOfStream: eos}
	req := &extprocv3.ProcessingRequest{}
	if p.response {
		req.Request = &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: hh}
	} else {
		req.Request = &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: hh}
	}
	p.cb = cbHeaders
	ex.send(req)
	ex.startTimer(p)
	if p.mode == FullDuplexStreamed {
		// shouldRemoveContentLength: the body goes out chunked.
		p.headers.del("content-length")
	}
}

func (ex *exchange) onData(p *phase, b []byte, eos bool) {
	p.bodyReceived = true
	if eos {
		p.complete = true
	}
	if p.replaced {
		if eos {
			ex.forwardData(p, nil, true)
		}
		return
	}
	if ex.complete {
		ex.forwardData(p, b, eos)
		return
	}
	if p.cb == cbHeaders && p.mode != FullDuplexStreamed {
		// Header processing still in progress: hold the data.
		p.buffered = append(p.buffered, b...)
		p.bufferedEOS = eos
		if p.mode == Buffered && len(p.buffered) > ex.p.cfg.BufferLimit {
			ex.payloadTooLarge()
		}
		return
	}
	switch p.mode {
	case Buffered:
		p.buffered = append(p.buffered, b...)
		p.bufferedEOS = eos
		if len(p.buffered) > ex.p.cfg.BufferLimit {
			ex.payloadTooLarge()
			return
		}
		if eos {
			ex.sendBody(p, p.buffered, true, cbBufferedBody)
		}
	case FullDuplexStreamed:
		next := cbStreamedBody
		if p.cb == cbHeaders {
			next = cbHeaders // the headers response is still due
		}
		ex.sendBody(p, b, eos, next)
	default:
		ex.forwardData(p, b, eos)
	}
}

func (ex *exchange) onTrailers(p *phase, t headerMap) {
	bodyDelivered := p.complete
	p.complete = true
	p.trailers = t
	p.hasTrailers = true
	if ex.complete {
		ex.forwardTrailers(p, t)
		return
	}
	if p.cb != cbIdle && p.mode != FullDuplexStreamed {
		return // sent once the current callback is done
	}
	if !bodyDelivered && p.mode == Buffered && p.buffered != nil {
		ex.sendBody(p, p.buffered, false, cbBufferedBody)
		return
	}
	if !p.sendTrailers {
		ex.forwardTrailers(p, t)
		return
	}
	ex.sendTrailers(p)
}

func (ex *exchange) sendBody(p *phase, b []byte, eos bool, next callbackState) {
	body := &extprocv3.HttpBody{Body: b, EndOfStream: eos}
	req := &extprocv3.ProcessingRequest{}
	if p.response {
		req.Request = &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: body}
	} else {
		req.Request = &extprocv3.ProcessingRequest_RequestBody{RequestBody: body}
	}
	p.cb = next
	ex.send(req)
	ex.startTimer(p)
}

func (ex *exchange) sendTrailers(p *phase) {
	if p.trailersSent {
		return
	}
	p.trailersSent = true
	tr := &extprocv3.HttpTrailers{Trailers: p.trailers.proto()}
	req := &extprocv3.ProcessingRequest{}
	if p.response {
		req.Request = &extprocv3.ProcessingRequest_ResponseTrailers{ResponseTrailers: tr}
	} else {
		req.Request = &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: tr}
	}
	if p.cb == cbIdle {
		p.cb = cbTrailers
	}
	ex.send(req)
	ex.startTimer(p)
}

func (ex *exchange) payloadTooLarge() {
	ex.note(fmt.Sprintf("request body over the buffer limit (%d bytes)", ex.p.cfg.BufferLimit))
	ex.closeStream("buffer limit exceeded")
	ex.stopTimer(ex.dec)
	ex.localReply(http.StatusRequestEntityTooLarge, "Payload Too Large", "request_payload_too_large", nil, false)
}

// ---- forwarding to the next hop --------------------------------------------

func (ex *exchange) continueHeaders(p *phase) {
	if !p.held {
		return
	}
	p.held = false
	ex.forwardHeaders(p, p.headers, p.noBody)
	if ex.finished {
		return
	}
	if len(p.buffered) > 0 || p.bufferedEOS {
		b, eos := p.buffered, p.bufferedEOS
		p.buffered, p.bufferedEOS = nil, false
		ex.forwardData(p, b, eos)
	}
}

func (ex *exchange) forwardHeaders(p *phase, h headerMap, eos bool) {
	if eos {
		p.eosForwarded = true
	}
	if p.response {
		ex.clientHeaders(h, eos)
	} else {
		ex.startUpstream(h, eos)
	}
}

func (ex *exchange) forwardData(p *phase, b []byte, eos bool) {
	if p.held {
		p.buffered = append(p.buffered, b...)
		p.bufferedEOS = eos
		return
	}
	if p.eosForwarded {
		if len(b) > 0 {
			ex.note(fmt.Sprintf("%d %s body bytes after end of stream dropped", len(b), p.name()))
		}
		return
	}
	if eos {
		p.eosForwarded = true
	}
	if p.response {
		ex.clientData(b, eos)
	} else {
		ex.upstreamData(b, eos)
	}
}

func (ex *exchange) forwardTrailers(p *phase, t headerMap) {
	if p.held {
		ex.continueHeaders(p)
	}
	if p.eosForwarded || ex.finished {
		return
	}
	p.eosForwarded = true
	if p.response {
		ex.clientTrailers(t)
	} else {
		ex.upstreamTrailers(t)
	}
}
