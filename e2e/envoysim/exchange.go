package envoysim

import (
	"context"
	"net/http"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// This file is the per-request state machine, modelled on Envoy's
// ext_proc Filter (ext_proc.cc) and ProcessorState (processor_state.cc):
// its state and event loop. The rest of it is in stream.go (the ext_proc
// stream), callbacks.go (messages to the server, forwarding to the next
// hop), responses.go (messages from the server), mutation.go (header
// mutations) and queues.go (the inbox and the send queue); the HTTP side
// is in headers.go, downstream.go, upstream.go and bodypipe.go.
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
