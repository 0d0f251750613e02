package extproc

import (
	"context"
	"fmt"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvbandit/kvbandit/routing"
)

func (p *processor) onRequestBody(ctx context.Context, b *extprocv3.HttpBody) ([]*extprocv3.ProcessingResponse, bool, error) {
	switch {
	case p.reqBodyPassthrough:
		if b.GetEndOfStream() {
			p.reqBodyPassthrough = false
			if p.phase == phaseRequestBody {
				p.phase = phaseAwaitResponse
			}
			out := []*extprocv3.ProcessingResponse{bodyAck(true)}
			return p.afterRequestPhase(out)
		}
		return []*extprocv3.ProcessingResponse{bodyAck(true)}, false, nil
	case p.phase == phaseAwaitResponse || p.phase == phaseResponseBody:
		// Data after the first end of stream (Envoy issue 46237): ignore.
		return nil, false, nil
	case p.phase != phaseRequestBody:
		return nil, false, protocolError("request body in phase %d", p.phase)
	}
	if err := p.appendBody(b.GetBody()); err != nil {
		return nil, false, err
	}
	if !b.GetEndOfStream() {
		return nil, false, nil
	}
	return p.requestComplete(ctx, true)
}

func (p *processor) onRequestTrailers(ctx context.Context) ([]*extprocv3.ProcessingResponse, bool, error) {
	trailers := &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}}
	if p.phase != phaseRequestBody || p.reqBodyPassthrough {
		if p.phase == phaseRequestHeaders {
			return nil, false, protocolError("request trailers before headers")
		}
		return []*extprocv3.ProcessingResponse{trailers}, false, nil
	}
	// Trailers end a body that had no end_of_stream flag.
	out, _, err := p.requestComplete(ctx, false)
	if err != nil {
		return nil, false, err
	}
	return p.afterRequestPhase(append(out, trailers))
}

// requestComplete routes the buffered request and builds the request-phase
// replies for the stream's mode. eos says whether the body ended with
// end_of_stream (false when trailers ended it).
func (p *processor) requestComplete(ctx context.Context, eos bool) ([]*extprocv3.ProcessingResponse, bool, error) {
	if err := p.decide(ctx); err != nil {
		return nil, false, err
	}
	p.phase = phaseAwaitResponse
	p.stripKVTransfer()
	var out []*extprocv3.ProcessingResponse
	if p.reqMode == filterv3.ProcessingMode_BUFFERED || p.reqMode == filterv3.ProcessingMode_BUFFERED_PARTIAL {
		out = []*extprocv3.ProcessingResponse{p.bufferedBodyResponse()}
	} else {
		out = make([]*extprocv3.ProcessingResponse, 0, 2+len(p.body)/BodyChunkBytes)
		out = append(out, p.headersResponse(true))
		out = appendBodyChunks(out, p.body, eos)
	}
	if !eos {
		// Trailers follow: the caller appends the trailers response.
		return out, false, nil
	}
	return p.afterRequestPhase(out)
}

// afterRequestPhase handles response processing being off: the decision
// ends now (abandoned: no outcome will be observed) and the stream closes
// cleanly, which Envoy treats as "continue without the server". The close
// is only safe when the data plane sends no response body to kvbandit
// (response_body_mode NONE): otherwise response chunks already on their way
// would be dropped, so kvbandit keeps echoing them until the response ends
// and warns once.
func (p *processor) afterRequestPhase(out []*extprocv3.ProcessingResponse) ([]*extprocv3.ProcessingResponse, bool, error) {
	if !p.reqBodyPassthrough {
		p.requestDone = p.s.clk.Now()
	}
	if p.s.cfg.ResponseProcessing || p.reqBodyPassthrough {
		return out, false, nil
	}
	p.finish(routing.OutcomeAbandoned)
	if p.modeKnown && p.respMode == filterv3.ProcessingMode_NONE {
		return out, true, nil
	}
	p.phase = phaseAwaitResponse
	return out, false, nil
}

// echoingResponse warns once, when a response phase does arrive, that
// response processing is off while the data plane streams responses to
// kvbandit (not before: a data plane may send no response phase at all).
func (p *processor) echoingResponse() {
	if p.s.cfg.ResponseProcessing {
		return
	}
	p.s.unsafeClose.Do(func() {
		p.s.log.Warn("response processing is off, but the data plane streams response bodies to kvbandit; closing early would drop response bytes, so kvbandit echoes them (set the ext_proc filter's response_header_mode SKIP and response_body_mode NONE to save the work)",
			"response_body_mode", p.respMode.String(), "protocol_config_sent", p.modeKnown)
	})
}

// stripKVTransfer removes the client's kv_transfer_params from the body
// the data plane forwards (the replies below carry the new body and its
// Content-Length), so that only the picker's P/D protocol names a host for
// the decode engine's KV connector. The bytes saved go back to the budget.
func (p *processor) stripKVTransfer() {
	if p.bodyUnseen || !StripsKVTransfer(p.decision, p.s.cfg.StripKVTransferParams) {
		return
	}
	b, ok := StripKVTransferParams(p.body)
	if !ok {
		return
	}
	p.s.budget.Release(int64(len(p.body) - len(b)))
	p.held -= int64(len(p.body) - len(b))
	p.body, p.owned, p.bodyRewritten = b, true, true
}

func (p *processor) appendBody(chunk []byte) error {
	if len(chunk) == 0 {
		return nil
	}
	total := int64(len(p.body) + len(chunk))
	if total > p.s.cfg.MaxBodyBytes {
		return fmt.Errorf("%w: more than %d bytes", ErrBodyTooLarge, p.s.cfg.MaxBodyBytes)
	}
	if p.body == nil {
		// Keep a reference to the first chunk: a body that arrives in one
		// message is never copied. gRPC gives each message its own buffer.
		p.body = chunk
		return p.hold(int64(len(chunk)))
	}
	if err := p.hold(int64(len(chunk))); err != nil {
		return err
	}
	if !p.owned {
		grow := make([]byte, len(p.body), max(2*len(p.body), int(total)))
		copy(grow, p.body)
		p.body = grow
		p.owned = true
	}
	p.body = append(p.body, chunk...)
	return nil
}

// hold charges n bytes against the server-wide buffer budget.
func (p *processor) hold(n int64) error {
	if !p.s.budget.Take(n) {
		return ErrBufferBudget
	}
	p.held += n
	return nil
}
