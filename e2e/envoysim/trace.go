package envoysim

import (
	"fmt"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/status"
)

// EventKind says what an [Event] records.
type EventKind int

// The kinds of events.
const (
	// Sent: a ProcessingRequest was sent to the ext_proc server.
	Sent EventKind = iota + 1
	// Received: a ProcessingResponse arrived and was processed.
	Received
	// StreamEnded: the server ended the stream (Status says how) before the
	// proxy closed it.
	StreamEnded
	// Note: something the proxy decided or observed (spurious message,
	// fallback, local reply, dropped namespace...), in Note.
	Note
)

func (k EventKind) String() string {
	switch k {
	case Sent:
		return "sent"
	case Received:
		return "received"
	case StreamEnded:
		return "stream-ended"
	case Note:
		return "note"
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Event is one step of an exchange. The proxy owns the messages: callers
// must not modify them.
type Event struct {
	Exchange uint64 // ID of the HTTP request (see [Exchange])
	Kind     EventKind
	Time     time.Time
	Request  *extprocv3.ProcessingRequest  // Sent
	Response *extprocv3.ProcessingResponse // Received
	Status   *status.Status                // StreamEnded
	Note     string                        // Note, and why a Received message was ignored
}

func (e Event) String() string {
	switch e.Kind {
	case Sent:
		return fmt.Sprintf("#%d sent %s", e.Exchange, RequestKind(e.Request))
	case Received:
		s := fmt.Sprintf("#%d received %s", e.Exchange, ResponseKind(e.Response))
		if e.Note != "" {
			s += " (" + e.Note + ")"
		}
		return s
	case StreamEnded:
		return fmt.Sprintf("#%d stream ended: %v", e.Exchange, e.Status)
	}
	return fmt.Sprintf("#%d note: %s", e.Exchange, e.Note)
}

// Exchange summarises one HTTP request through the proxy.
type Exchange struct {
	ID        uint64
	Method    string
	Path      string
	RequestID string // x-request-id as sent upstream

	// Destination is envoy.lb / x-gateway-destination-endpoint when the
	// upstream was chosen ("" when unset or not a string).
	Destination string
	// Upstream is the cluster host the request was sent to ("" if none).
	Upstream string
	// Fallback: override_host found no usable cluster host in Destination
	// and round robin chose Upstream.
	Fallback bool

	// LocalReply is the status of a reply the proxy generated (0 if the
	// response came from the upstream); Immediate says it came from an
	// ImmediateResponse; Details is Envoy's response code details.
	LocalReply int
	Immediate  bool
	Details    string

	// Spurious counts spurious (out-of-order or unexpected) messages.
	Spurious int
	// ServerClosed is how the server ended the stream when it did so before
	// the proxy closed it (OK for a clean close), nil otherwise.
	ServerClosed *status.Status
	// RouteCacheCleared: a request-path response cleared the route cache
	// (clear_route_cache with a header mutation).
	RouteCacheCleared bool
	// ClientCanceled: the downstream client went away. DownstreamReset: the
	// proxy reset the client connection (error after response headers).
	ClientCanceled  bool
	DownstreamReset bool

	// Notes lists the Note events; Events every event, in order.
	Notes  []string
	Events []Event
}

// Sent returns the ProcessingRequests of the exchange, in order.
func (x Exchange) Sent() []*extprocv3.ProcessingRequest {
	var out []*extprocv3.ProcessingRequest
	for _, e := range x.Events {
		if e.Kind == Sent {
			out = append(out, e.Request)
		}
	}
	return out
}

// Received returns the ProcessingResponses of the exchange, in order.
func (x Exchange) Received() []*extprocv3.ProcessingResponse {
	var out []*extprocv3.ProcessingResponse
	for _, e := range x.Events {
		if e.Kind == Received {
			out = append(out, e.Response)
		}
	}
	return out
}

// Flow is the sequence of message kinds, "> kind" for sent and "< kind" for
// received, handy for asserting the order of an exchange.
func (x Exchange) Flow() []string {
	var out []string
	for _, e := range x.Events {
		switch e.Kind {
		case Sent:
			out = append(out, "> "+RequestKind(e.Request))
		case Received:
			out = append(out, "< "+ResponseKind(e.Response))
		}
	}
	return out
}

// RequestKind names the oneof case of a ProcessingRequest ("request_body"
// and "response_body" get an " eos" suffix on the last chunk).
func RequestKind(r *extprocv3.ProcessingRequest) string {
	switch r.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return "request_headers"
	case *extprocv3.ProcessingRequest_RequestBody:
		if r.GetRequestBody().GetEndOfStream() {
			return "request_body eos"
		}
		return "request_body"
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return "request_trailers"
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return "response_headers"
	case *extprocv3.ProcessingRequest_ResponseBody:
		if r.GetResponseBody().GetEndOfStream() {
			return "response_body eos"
		}
		return "response_body"
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		return "response_trailers"
	}
	return "unknown"
}

// ResponseKind names the oneof case of a ProcessingResponse (streamed body
// responses get " streamed", plus " eos" on the last chunk).
func ResponseKind(r *extprocv3.ProcessingResponse) string {
	body := func(b *extprocv3.BodyResponse) string {
		sr := b.GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return ""
		}
		if sr.GetEndOfStream() {
			return " streamed eos"
		}
		return " streamed"
	}
	switch r.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return "request_headers"
	case *extprocv3.ProcessingResponse_RequestBody:
		return "request_body" + body(r.GetRequestBody())
	case *extprocv3.ProcessingResponse_RequestTrailers:
		return "request_trailers"
	case *extprocv3.ProcessingResponse_ResponseHeaders:
		return "response_headers"
	case *extprocv3.ProcessingResponse_ResponseBody:
		return "response_body" + body(r.GetResponseBody())
	case *extprocv3.ProcessingResponse_ResponseTrailers:
		return "response_trailers"
	case *extprocv3.ProcessingResponse_ImmediateResponse:
		return "immediate_response"
	case *extprocv3.ProcessingResponse_StreamedImmediateResponse:
		return "streamed_immediate_response"
	}
	return "unknown"
}
