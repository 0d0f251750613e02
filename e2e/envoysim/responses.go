package envoysim

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// ---- messages from the server ------------------------------------------------

var errSpurious = errors.New("spurious message")

func (ex *exchange) onMessage(m *extprocv3.ProcessingResponse) {
	if ex.complete {
		ex.event(Event{Kind: Received, Response: m, Note: "ignored: processing complete"})
		return
	}
	if m.GetOverrideMessageTimeout() != nil {
		ex.event(Event{Kind: Received, Response: m, Note: "ignored: override_message_timeout needs max_message_timeout, which is not set"})
		return
	}
	ex.event(Event{Kind: Received, Response: m})
	if m.GetModeOverride() != nil {
		ex.note("mode_override ignored (allow_mode_override is off)")
	}
	var err error
	lastBody := false
	switch r := m.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		ex.applyMetadata(m)
		err = ex.handleHeadersResponse(ex.dec, r.RequestHeaders)
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		ex.applyMetadata(m)
		err = ex.handleHeadersResponse(ex.enc, r.ResponseHeaders)
	case *extprocv3.ProcessingResponse_RequestBody:
		lastBody = isLastBody(ex.dec, r.RequestBody)
		ex.applyMetadata(m)
		err = ex.handleBodyResponse(ex.dec, r.RequestBody)
	case *extprocv3.ProcessingResponse_ResponseBody:
		lastBody = isLastBody(ex.enc, r.ResponseBody)
		ex.applyMetadata(m)
		err = ex.handleBodyResponse(ex.enc, r.ResponseBody)
	case *extprocv3.ProcessingResponse_RequestTrailers:
		ex.applyMetadata(m)
		err = ex.handleTrailersResponse(ex.dec, r.RequestTrailers)
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		ex.applyMetadata(m)
		err = ex.handleTrailersResponse(ex.enc, r.ResponseTrailers)
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		ex.applyMetadata(m)
		ex.closeStream("immediate response")
		ex.stopTimer(ex.dec)
		ex.stopTimer(ex.enc)
		ir := r.ImmediateResponse
		code := int(ir.GetStatus().GetCode())
		if code < 200 {
			code = http.StatusOK // Envoy ignores invalid statuses
		}
		ex.localReply(code, string(ir.GetBody()), ir.GetDetails(), ir.GetHeaders(), true)
		return
	default:
		err = fmt.Errorf("%w: unhandled message %s", errSpurious, ResponseKind(m))
	}
	switch {
	case errors.Is(err, errSpurious):
		ex.rec.Spurious++
		ex.note(err.Error())
		if ex.failureModeAllow() {
			ex.note("failure_mode_allow: ignoring the server from now on")
			ex.closeStream("spurious message")
			ex.clearAsyncState()
		} else {
			ex.errorReply(err.Error())
		}
		return
	case err != nil:
		ex.errorReply(err.Error())
		return
	}
	ex.closeIfLastResponse(m, lastBody)
}

func spurious(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errSpurious}, args...)...)
}

func (ex *exchange) handleHeadersResponse(p *phase, hr *extprocv3.HeadersResponse) error {
	if p.cb != cbHeaders {
		return spurious("%s headers response while not waiting for one", p.name())
	}
	cr := hr.GetResponse()
	if hm := cr.GetHeaderMutation(); hm != nil {
		if err := ex.mutate(&p.headers, hm, p.mode == FullDuplexStreamed); err != nil {
			return err
		}
	}
	ex.clearRouteCache(p, cr)
	ex.stopTimer(p)
	switch {
	case cr.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE:
		p.cb = cbIdle
	case p.mode == FullDuplexStreamed && p.bodyReceived:
		p.cb = cbStreamedBody
	case p.mode == FullDuplexStreamed && p.hasTrailers:
		p.cb = cbTrailers
	default:
		p.cb = cbIdle
	}
	if cr.GetStatus() == extprocv3.CommonResponse_CONTINUE_AND_REPLACE {
		ex.replaceBody(p, cr)
		return nil
	}
	switch {
	case p.noBody:
		ex.finalizeContinue(p)
	case p.mode == Buffered && p.complete:
		// The whole body came while the headers were out: send it now.
		ex.sendBody(p, p.buffered, !p.hasTrailers, cbBufferedBody)
	case p.mode == Buffered:
		// Headers stay held until the body response.
	case p.mode == FullDuplexStreamed:
		ex.continueHeaders(p)
	default:
		ex.finalizeContinue(p)
	}
	return nil
}

func (ex *exchange) finalizeContinue(p *phase) {
	ex.continueHeaders(p)
	if ex.finished || !p.hasTrailers {
		return
	}
	if p.sendTrailers {
		ex.sendTrailers(p)
	} else {
		ex.forwardTrailers(p, p.trailers)
	}
}

// replaceBody handles CONTINUE_AND_REPLACE in a headers response.
func (ex *exchange) replaceBody(p *phase, cr *extprocv3.CommonResponse) {
	p.mode = None
	p.sendTrailers = false
	p.buffered, p.bufferedEOS = nil, false
	bm := cr.GetBodyMutation()
	if bm == nil {
		ex.finalizeContinue(p)
		return
	}
	p.headers.del("content-length")
	p.replaced = true
	p.held = false
	ex.forwardHeaders(p, p.headers, false)
	if !ex.finished {
		ex.forwardData(p, applyBodyMutation(nil, bm), p.complete)
	}
}

func (ex *exchange) handleBodyResponse(p *phase, br *extprocv3.BodyResponse) error {
	cr := br.GetResponse()
	switch p.cb {
	case cbBufferedBody:
		if hm := cr.GetHeaderMutation(); hm != nil {
			if p.held {
				if err := ex.mutate(&p.headers, hm, false); err != nil {
					return err
				}
			} else {
				ex.note("body response header mutation ignored: headers already sent")
			}
		}
		if bm := cr.GetBodyMutation(); bm != nil {
			if cl, ok := p.headers.get("content-length"); ok && p.held {
				if n, err := strconv.ParseUint(cl, 10, 64); err == nil && n != uint64(len(bm.GetBody())) {
					return errors.New("mismatch between content length and the length of the mutated body")
				}
			}
			p.buffered = applyBodyMutation(p.buffered, bm)
		}
		ex.stopTimer(p)
		p.cb = cbIdle
		ex.clearRouteCache(p, cr)
		body := p.buffered
		p.buffered, p.bufferedEOS = nil, false
		if p.held {
			p.held = false
			ex.forwardHeaders(p, p.headers, false)
		}
		if ex.finished {
			return nil
		}
		ex.forwardData(p, body, !p.hasTrailers)
		if p.hasTrailers && !ex.finished {
			if p.sendTrailers {
				ex.sendTrailers(p)
			} else {
				ex.forwardTrailers(p, p.trailers)
			}
		}
	case cbStreamedBody:
		sr := cr.GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return spurious("normal body mutation response received while the %s body mode is FULL_DUPLEX_STREAMED", p.name())
		}
		if sr.GetEndOfStream() {
			p.cb = cbIdle
		}
		ex.clearRouteCache(p, cr)
		ex.forwardData(p, sr.GetBody(), sr.GetEndOfStream())
	default:
		return spurious("%s body response while not waiting for one", p.name())
	}
	return nil
}

func (ex *exchange) handleTrailersResponse(p *phase, tr *extprocv3.TrailersResponse) error {
	if (p.cb != cbTrailers && p.mode != FullDuplexStreamed) || !p.trailersSent {
		return spurious("%s trailers response while not waiting for one", p.name())
	}
	if hm := tr.GetHeaderMutation(); hm != nil {
		if err := ex.mutate(&p.trailers, hm, false); err != nil {
			return err
		}
	}
	ex.stopTimer(p)
	p.cb = cbIdle
	ex.forwardTrailers(p, p.trailers)
	return nil
}

func isLastBody(p *phase, br *extprocv3.BodyResponse) bool {
	if p.mode != FullDuplexStreamed {
		return false
	}
	return br.GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream()
}

// closeIfLastResponse is closeGrpcStreamIfLastRespReceived (Envoy's
// ext_proc_stream_close_optimization, on by default).
func (ex *exchange) closeIfLastResponse(m *extprocv3.ProcessingResponse, lastBody bool) {
	if ex.closeQueued {
		return
	}
	last := false
	switch m.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		last = (ex.dec.noBody || (ex.dec.mode == None && !ex.dec.sendTrailers)) && ex.enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_RequestBody:
		last = lastBody && ex.enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_RequestTrailers:
		last = ex.enc.noExternalProcess()
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		last = ex.enc.noBody || (ex.enc.mode == None && !ex.enc.sendTrailers)
	case *extprocv3.ProcessingResponse_ResponseBody:
		last = lastBody
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		last = true
	}
	if last {
		ex.closeStream("last response received")
	}
}

func (ex *exchange) clearRouteCache(p *phase, cr *extprocv3.CommonResponse) {
	if !cr.GetClearRouteCache() {
		return
	}
	switch {
	case p.response:
		ex.note("clear_route_cache ignored in the response direction")
	case cr.GetHeaderMutation() == nil:
		ex.note("clear_route_cache ignored: no header mutation in the response (clear_route_cache_ignored)")
	default:
		ex.rec.RouteCacheCleared = true
		ex.note("route cache cleared")
	}
}

// applyMetadata is Filter::setDynamicMetadata: namespaces listed in
// receiving_namespaces are merged into the request's metadata, others are
// dropped.
func (ex *exchange) applyMetadata(m *extprocv3.ProcessingResponse) {
	dm := m.GetDynamicMetadata()
	if dm == nil {
		return
	}
	if len(ex.p.receive) == 0 {
		ex.note("dynamic metadata dropped: no receiving namespaces configured")
		return
	}
	keys := make([]string, 0, len(dm.GetFields()))
	for ns := range dm.GetFields() {
		keys = append(keys, ns)
	}
	slices.Sort(keys)
	for _, ns := range keys {
		if !slices.Contains(ex.p.receive, ns) {
			ex.note(fmt.Sprintf("dynamic metadata namespace %q dropped: not a receiving namespace", ns))
			continue
		}
		mergeStruct(ex.md, ns, dm.GetFields()[ns].GetStructValue())
	}
}

// mergeStruct merges s into md[ns] key by key (protobuf MergeFrom on a map).
func mergeStruct(md map[string]*structpb.Struct, ns string, s *structpb.Struct) {
	cur := md[ns]
	if cur == nil {
		cur = &structpb.Struct{}
		md[ns] = cur
	}
	if cur.Fields == nil {
		cur.Fields = make(map[string]*structpb.Value)
	}
	for k, v := range s.GetFields() {
		cur.Fields[k] = proto.Clone(v).(*structpb.Value)
	}
}

func applyBodyMutation(body []byte, bm *extprocv3.BodyMutation) []byte {
	switch m := bm.GetMutation().(type) {
	case *extprocv3.BodyMutation_Body:
		return append([]byte(nil), m.Body...)
	case *extprocv3.BodyMutation_ClearBody:
		if m.ClearBody {
			return nil
		}
	}
	return body
}
