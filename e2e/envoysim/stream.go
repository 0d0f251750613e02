package envoysim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

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
