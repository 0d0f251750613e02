package envoysim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// This file is the per-request state machine, modelled on Envoy's
// ext_proc Filter (ext_proc.cc) and ProcessorState (processor_state.cc).
// One goroutine, the HTTP handler's, runs the loop; helper goroutines only
// do I/O (gRPC receive and send, client and upstream body reads, the
// upstream round trip) and post events to it.

// callbackState is what a direction waits for from the server
// (ProcessorState::CallbackState).
type callbackState int

const (
	cbIdle callbackState = iota
	cbHeaders
	cbBufferedBody
	cbStreamedBody
	cbTrailers
)

// phase is one direction of the exchange: the request path (decoding) or
// the response path (encoding).
type phase struct {
	response     bool
	mode         BodyMode
	sendHeaders  bool
	sendTrailers bool

	cb     callbackState
	timer  *time.Timer
	timerC <-chan time.Time

	started      bool      // headers seen
	headers      headerMap // the headers, mutated in place
	held         bool      // headers not yet continued to the next hop
	noBody       bool      // headers carried end of stream
	bodyReceived bool      // some body data arrived (even empty)
	complete     bool      // the source's end of stream was seen
	buffered     []byte    // body held back (BUFFERED body, or data waiting for the headers)
	bufferedEOS  bool
	trailers     headerMap
	hasTrailers  bool
	trailersSent bool
	eosForwarded bool // end of stream went to the next hop
	replaced     bool // CONTINUE_AND_REPLACE replaced the body
}

func (p *phase) name() string {
	if p.response {
		return "response"
	}
	return "request"
}

// noExternalProcess mirrors ProcessorState::noExternalProcess.
func (p *phase) noExternalProcess() bool {
	return !p.sendHeaders && p.mode == None && !p.sendTrailers
}

type eventKind int

const (
	evMessage eventKind = iota
	evStreamEnd
	evRequestData
	evRequestTrailers
	evRequestError
	evUpstreamResponse
	evResponseData
	evResponseTrailers
	evResponseError
)

type event struct {
	kind     eventKind
	msg      *extprocv3.ProcessingResponse
	err      error
	data     []byte
	eos      bool
	trailers headerMap
	resp     *http.Response
}

// exchange is one HTTP request through the proxy.
type exchange struct {
	p   *Proxy
	w   http.ResponseWriter
	rc  *http.ResponseController
	r   *http.Request
	rec Exchange

	md       map[string]*structpb.Struct // the request's dynamic metadata
	dec, enc *phase

	// The ext_proc stream.
	out          *sendQueue // nil when the stream never opened
	closeQueued  bool       // the proxy closed the stream
	serverEnded  bool       // the server ended the stream
	complete     bool       // processing_complete_: the server is no longer consulted
	protocolSent bool

	inbox    *inbox        // messages and the end of the stream, from the server
	events   chan event    // everything else
	done     chan struct{} // closed when the loop has ended
	pumpDone chan struct{} // closed when the request body reader has stopped

	upReq    *http.Request
	upBody   *bodyPipe
	upCancel context.CancelFunc
	upResp   *http.Response // body not yet owned by a pump

	clientHeadersSent bool
	finished          bool // the client has its whole response (or a reset)
	reset             bool // reset the client connection
}

func newExchange(p *Proxy, w http.ResponseWriter, r *http.Request) *exchange {
	ex := &exchange{
		p:      p,
		w:      w,
		rc:     http.NewResponseController(w),
		r:      r,
		md:     make(map[string]*structpb.Struct),
		inbox:  newInbox(),
		events: make(chan event),
		done:   make(chan struct{}),
		dec: &phase{
			mode:         p.cfg.RequestBodyMode,
			sendHeaders:  true,
			sendTrailers: true,
		},
		enc: &phase{
			response:     true,
			mode:         p.cfg.ResponseBodyMode,
			sendHeaders:  p.cfg.ResponseBodyMode != None,
			sendTrailers: p.cfg.ResponseBodyMode != None,
		},
	}
	ex.rec.ID = p.nextID.Add(1)
	ex.rec.Method = r.Method
	ex.rec.Path = r.URL.RequestURI()
	if p.cfg.SubsetHint != nil {
		ex.md[NamespaceSubsetHint] = &structpb.Struct{Fields: map[string]*structpb.Value{
			KeySubset: proto.Clone(p.cfg.SubsetHint).(*structpb.Value),
		}}
	}
	if p.cfg.RequestMetadata != nil {
		for ns, s := range p.cfg.RequestMetadata(r) {
			mergeStruct(ex.md, ns, s)
		}
	}
	// Reading the request body while the response is written.
	_ = ex.rc.EnableFullDuplex()
	return ex
}

// post hands an event to the loop; false once the loop has ended.
func (ex *exchange) post(ev event) bool {
	select {
	case ex.events <- ev:
		return true
	case <-ex.done:
		return false
	}
}

func (ex *exchange) event(e Event) {
	e.Exchange = ex.rec.ID
	e.Time = time.Now()
	ex.rec.Events = append(ex.rec.Events, e)
	if e.Kind == Note {
		ex.rec.Notes = append(ex.rec.Notes, e.Note)
	}
	ex.p.record(e)
}

func (ex *exchange) note(s string) { ex.event(Event{Kind: Note, Note: s}) }

// run drives the exchange until the client has its response.
func (ex *exchange) run() {
	defer ex.finish()
	ex.openStream()
	if !ex.finished {
		ex.onHeaders(ex.dec, ex.requestHeaders(), ex.r.ContentLength == 0)
	}
	if !ex.dec.noBody && !ex.finished {
		pumpDone := make(chan struct{})
		if ex.p.goTracked(func() {
			defer close(pumpDone)
			ex.pumpRequest()
		}) {
			ex.pumpDone = pumpDone
		}
	}
	for !ex.finished {
		// What the server sent before anything else happened is handled
		// first, as Envoy reads it off the connection in order.
		ex.handleInbox()
		if ex.finished {
			return
		}
		select {
		case <-ex.r.Context().Done():
			ex.rec.ClientCanceled = true
			ex.note("client went away: closing the ext_proc stream and resetting the upstream request")
			ex.reset = true
			return
		case <-ex.inbox.notify:
		case ev := <-ex.events:
			ex.handleInbox()
			if !ex.finished {
				ex.handle(ev)
			}
		case <-ex.dec.timerC:
			ex.onMessageTimeout(ex.dec)
		case <-ex.enc.timerC:
			ex.onMessageTimeout(ex.enc)
		}
	}
}

func (ex *exchange) handleInbox() {
	for _, ev := range ex.inbox.drain() {
		if ex.finished {
			return
		}
		ex.handle(ev)
	}
}

// finish is Filter::onDestroy: the stream is closed and the upstream
// request reset if still running.
func (ex *exchange) finish() {
	ex.closeStream("request ended")
	ex.stopTimer(ex.dec)
	ex.stopTimer(ex.enc)
	ex.abortUpstream()
	if ex.upResp != nil {
		ex.upResp.Body.Close()
	}
	close(ex.done)
	if ex.pumpDone != nil {
		// The request body must not be read once the handler has returned:
		// stop a read still waiting for the client (the connection is then
		// closed, as Envoy closes an HTTP/1 connection it did not drain).
		select {
		case <-ex.pumpDone:
		default:
			_ = ex.rc.SetReadDeadline(time.Now())
			<-ex.pumpDone
		}
	}
	ex.p.finishExchange(ex.rec)
}

func (ex *exchange) handle(ev event) {
	switch ev.kind {
	case evMessage:
		ex.onMessage(ev.msg)
	case evStreamEnd:
		ex.onStreamEnd(ev.err)
	case evRequestData:
		ex.onData(ex.dec, ev.data, ev.eos)
	case evRequestTrailers:
		ex.onTrailers(ex.dec, ev.trailers)
	case evRequestError:
		ex.rec.ClientCanceled = true
		ex.downstreamReset("reading the request body failed: " + ev.err.Error())
	case evUpstreamResponse:
		ex.onUpstreamResponse(ev.resp, ev.err)
	case evResponseData:
		ex.onData(ex.enc, ev.data, ev.eos)
	case evResponseTrailers:
		ex.onTrailers(ex.enc, ev.trailers)
	case evResponseError:
		ex.downstreamReset("upstream reset after the response started: " + ev.err.Error())
	}
}

// ---- the stream ------------------------------------------------------------

func (ex *exchange) openStream() {
	ctx, cancel := context.WithCancel(ex.p.ctx)
	stream, err := ex.p.client.Process(ctx)
	if err != nil {
		cancel()
		ex.serverEnded = true
		st := status.Convert(err)
		ex.rec.ServerClosed = st
		ex.event(Event{Kind: StreamEnded, Status: st, Note: "stream open failed"})
		ex.onGrpcError(st)
		return
	}
	q := newSendQueue()
	ex.out = q
	recvDone := make(chan struct{})
	senderDone := make(chan struct{})
	timeout := ex.p.cfg.CloseTimeout
	graceful := ex.p.cfg.GracefulClose
	started := ex.p.goTracked(func() {
		defer close(recvDone)
		for {
			m, err := stream.Recv()
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = nil
				}
				ex.inbox.push(event{kind: evStreamEnd, err: err})
				return
			}
			ex.inbox.push(event{kind: evMessage, msg: m})
		}
	})
	started = started && ex.p.goTracked(func() {
		defer close(senderDone)
		defer cancel()
		failed := false
		for {
			it := q.pop()
			if it.close {
				_ = stream.CloseSend()
				if graceful {
					t := time.NewTimer(timeout)
					select {
					case <-recvDone:
					case <-t.C:
					}
					t.Stop()
				}
				return // cancel: Envoy resets the stream after closing it
			}
			if !failed && stream.Send(it.msg) != nil {
				failed = true // the receiver reports why
			}
		}
	})
	// If messages cannot be written (the server does not read), do not wait
	// forever before resetting the stream.
	started = started && ex.p.goTracked(func() {
		<-ex.done
		t := time.NewTimer(2 * timeout)
		defer t.Stop()
		select {
		case <-senderDone:
		case <-t.C:
			cancel()
		}
	})
	if !started {
		cancel()
	}
}

// send queues a message to the server with the forwarded metadata and, on
// the first message, the protocol configuration.
func (ex *exchange) send(req *extprocv3.ProcessingRequest) {
	if ex.out == nil || ex.closeQueued {
		return
	}
	mc := &corev3.Metadata{}
	for _, ns := range ex.p.forward {
		if s, ok := ex.md[ns]; ok {
			if mc.FilterMetadata == nil {
				mc.FilterMetadata = make(map[string]*structpb.Struct)
			}
			mc.FilterMetadata[ns] = proto.Clone(s).(*structpb.Struct)
		}
	}
	req.MetadataContext = mc
	if !ex.protocolSent {
		ex.protocolSent = true
		req.ProtocolConfig = &extprocv3.ProtocolConfiguration{
			RequestBodyMode:  ex.p.cfg.RequestBodyMode.envoy(),
			ResponseBodyMode: ex.p.cfg.ResponseBodyMode.envoy(),
		}
	}
	ex.out.push(sendItem{msg: req})
	ex.event(Event{Kind: Sent, Request: req})
}

// closeStream is closeStreamMaybeGraceful: no more messages either way.
func (ex *exchange) closeStream(reason string) {
	ex.complete = true
	if ex.out == nil || ex.closeQueued {
		return
	}
	ex.closeQueued = true
	ex.out.push(sendItem{close: true})
	if !ex.serverEnded {
		ex.note("ext_proc stream closed by the proxy: " + reason)
	}
}

func (ex *exchange) onStreamEnd(err error) {
	if ex.closeQueued || ex.serverEnded {
		return // the proxy closed it first; whatever the server says is moot
	}
	ex.serverEnded = true
	st := status.New(codes.OK, "")
	if err != nil {
		st = status.Convert(err)
	}
	ex.rec.ServerClosed = st
	ex.event(Event{Kind: StreamEnded, Status: st})
	if ex.complete {
		return
	}
	if st.Code() == codes.OK {
		ex.onGrpcClose()
	} else {
		ex.onGrpcError(st)
	}
}

// onGrpcClose: the server closed cleanly; it is not consulted again.
func (ex *exchange) onGrpcClose() {
	ex.closeStream("server closed the stream")
	ex.clearAsyncState()
}

func (ex *exchange) onGrpcError(st *status.Status) {
	if ex.complete {
		return
	}
	if ex.failureModeAllow() {
		ex.note("failure_mode_allow: continuing without the ext_proc server")
		ex.onGrpcClose()
		return
	}
	ex.errorReply(fmt.Sprintf("ext_proc_error_gRPC_error_%d{%s}", st.Code(), st.Message()))
}

// failureModeAllow is Filter::failureModeAllow: once FULL_DUPLEX body data
// went to the server, failing open would lose it, so it fails closed.
func (ex *exchange) failureModeAllow() bool {
	if (ex.dec.mode == FullDuplexStreamed && ex.dec.bodyReceived) ||
		(ex.enc.mode == FullDuplexStreamed && ex.enc.bodyReceived) {
		return false
	}
	return ex.p.cfg.FailureModeAllow
}

// errorReply is handleErrorResponse: 500 (status_on_error) local reply.
func (ex *exchange) errorReply(details string) {
	ex.closeStream("error: " + details)
	ex.stopTimer(ex.dec)
	ex.stopTimer(ex.enc)
	ex.localReply(http.StatusInternalServerError, "", details, nil, false)
}

// clearAsyncState lets both directions go on without the server: held
// headers and data continue; data the server had and did not return is
// lost.
func (ex *exchange) clearAsyncState() {
	for _, p := range []*phase{ex.dec, ex.enc} {
		p.cb = cbIdle
		ex.stopTimer(p)
		if ex.finished {
			return
		}
		if !p.started {
			continue
		}
		ex.continueHeaders(p)
		if ex.finished {
			return
		}
		if p.complete && !p.eosForwarded {
			if p.hasTrailers {
				ex.forwardTrailers(p, p.trailers)
			} else {
				ex.forwardData(p, nil, true)
			}
		}
	}
}

func (ex *exchange) startTimer(p *phase) {
	ex.stopTimer(p)
	if p.mode == FullDuplexStreamed {
		return // no message timeout in FULL_DUPLEX_STREAMED
	}
	p.timer = time.NewTimer(ex.p.cfg.MessageTimeout)
	p.timerC = p.timer.C
}

func (ex *exchange) stopTimer(p *phase) {
	if p.timer != nil {
		p.timer.Stop()
		p.timer = nil
	}
	p.timerC = nil
}

func (ex *exchange) onMessageTimeout(p *phase) {
	p.timerC = nil
	p.timer = nil
	ex.note("message timeout on the " + p.name() + " path")
	if ex.failureModeAllow() {
		ex.closeStream("message timeout (failure_mode_allow)")
		ex.clearAsyncState()
		return
	}
	ex.closeStream("message timeout")
	ex.localReply(http.StatusGatewayTimeout, "", "ext_proc_error_per-message_timeout_exceeded", nil, false)
}

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

// ---- header mutations -------------------------------------------------------

type mutationOp int

const (
	opSet mutationOp = iota
	opAppend
	opRemove
)

// allowedByRules is Envoy's MutationRules Checker with the default
// (empty) HeaderMutationRules; immediate uses the permissive rules of
// immediate responses (allow_all_routing, allow_envoy).
func allowedByRules(op mutationOp, name, value string, immediate bool) bool {
	if op == opRemove && (strings.HasPrefix(name, ":") || name == "host") {
		return false
	}
	if !immediate {
		switch name {
		case "host", ":authority", ":method", ":scheme":
			return false
		}
	}
	if strings.HasPrefix(name, ":") && op == opAppend {
		return false
	}
	if !immediate && strings.HasPrefix(name, "x-envoy") {
		return false
	}
	if op == opRemove {
		return true
	}
	if !strings.HasPrefix(name, ":") && !validHeaderValue(value) {
		return false
	}
	if name == ":status" {
		n, err := strconv.Atoi(value)
		if err != nil || n < 200 {
			return false
		}
	}
	return true
}

// mutate applies a header mutation as MutationUtils::applyHeaderMutations
// does with the filter's default rules. Disallowed changes are ignored (and
// noted); malformed ones fail the whole mutation.
func (ex *exchange) mutate(h *headerMap, hm *extprocv3.HeaderMutation, removeContentLength bool) error {
	for _, name := range hm.GetRemoveHeaders() {
		if !validHeaderName(name) {
			return errors.New("invalid character in remove_headers mutation")
		}
		ln := strings.ToLower(name)
		if !allowedByRules(opRemove, ln, "", false) {
			ex.note(fmt.Sprintf("remove_headers %q ignored by the mutation rules", ln))
			continue
		}
		h.del(ln)
	}
	for _, sh := range hm.GetSetHeaders() {
		hv := sh.GetHeader()
		if hv == nil {
			continue
		}
		if removeContentLength && strings.EqualFold(hv.GetKey(), "content-length") {
			ex.note("set_headers content-length ignored: the body is streamed")
			continue
		}
		if hv.GetValue() != "" && len(hv.GetRawValue()) > 0 {
			return errors.New("only one of value or raw_value in the HeaderValue message should be set")
		}
		if hv.GetValue() != "" {
			ex.note(fmt.Sprintf("set_headers %q: value %q ignored, Envoy reads raw_value", hv.GetKey(), hv.GetValue()))
		}
		if sh.GetAppendAction() != corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD {
			ex.note(fmt.Sprintf("set_headers %q: append_action %v ignored, ext_proc reads append", hv.GetKey(), sh.GetAppendAction()))
		}
		value := string(hv.GetRawValue())
		if !validHeaderName(hv.GetKey()) || !validHeaderValue(value) {
			return errors.New("invalid character in set_headers mutation")
		}
		ln := strings.ToLower(hv.GetKey())
		appendValue := sh.GetAppend().GetValue()
		op := opSet
		if _, exists := h.get(ln); appendValue && exists {
			op = opAppend
		}
		if !allowedByRules(op, ln, value, false) {
			ex.note(fmt.Sprintf("set_headers %q ignored by the mutation rules", ln))
			continue
		}
		if appendValue {
			h.add(ln, value)
		} else {
			h.set(ln, value)
		}
	}
	return nil
}

// mutateImmediate applies an ImmediateResponse's headers; failures there
// are only logged by Envoy.
func (ex *exchange) mutateImmediate(h *headerMap, hm *extprocv3.HeaderMutation) {
	for _, name := range hm.GetRemoveHeaders() {
		ln := strings.ToLower(name)
		if validHeaderName(name) && allowedByRules(opRemove, ln, "", true) {
			h.del(ln)
		}
	}
	for _, sh := range hm.GetSetHeaders() {
		hv := sh.GetHeader()
		if hv == nil {
			continue
		}
		if hv.GetValue() != "" && len(hv.GetRawValue()) == 0 {
			ex.note(fmt.Sprintf("immediate response header %q: value %q ignored, Envoy reads raw_value", hv.GetKey(), hv.GetValue()))
		}
		ln := strings.ToLower(hv.GetKey())
		value := string(hv.GetRawValue())
		appendValue := sh.GetAppend().GetValue()
		op := opSet
		if _, exists := h.get(ln); appendValue && exists {
			op = opAppend
		}
		if !validHeaderName(hv.GetKey()) || !allowedByRules(op, ln, value, true) {
			continue
		}
		if appendValue {
			h.add(ln, value)
		} else {
			h.set(ln, value)
		}
	}
}

func validHeaderName(s string) bool {
	s = strings.TrimPrefix(s, ":")
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

func validHeaderValue(s string) bool {
	return !strings.ContainsAny(s, "\x00\r\n")
}

// ---- the inbox ----------------------------------------------------------------

// inbox queues what the server sends without ever blocking the receiver,
// so a message and the end of the stream right behind it are both there
// when the loop looks.
type inbox struct {
	mu     sync.Mutex
	items  []event
	notify chan struct{}
}

func newInbox() *inbox { return &inbox{notify: make(chan struct{}, 1)} }

func (b *inbox) push(ev event) {
	b.mu.Lock()
	b.items = append(b.items, ev)
	b.mu.Unlock()
	select {
	case b.notify <- struct{}{}:
	default:
	}
}

func (b *inbox) drain() []event {
	b.mu.Lock()
	defer b.mu.Unlock()
	items := b.items
	b.items = nil
	return items
}

// ---- the send queue -----------------------------------------------------------

type sendItem struct {
	msg   *extprocv3.ProcessingRequest
	close bool
}

// sendQueue decouples the loop from gRPC flow control: push never blocks.
type sendQueue struct {
	mu    sync.Mutex
	cond  *sync.Cond
	items []sendItem
}

func newSendQueue() *sendQueue {
	q := &sendQueue{}
	q.cond = sync.NewCond(&q.mu)
	return q
}

func (q *sendQueue) push(it sendItem) {
	q.mu.Lock()
	q.items = append(q.items, it)
	q.mu.Unlock()
	q.cond.Signal()
}

func (q *sendQueue) pop() sendItem {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.items) == 0 {
		q.cond.Wait()
	}
	it := q.items[0]
	q.items = q.items[1:]
	return it
}
