package extproc

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
)

// Errors the ext_proc layer raises itself. Each maps to one HTTP status in
// [Reject].
var (
	// ErrBodyTooLarge: the request body crossed --max-body-bytes (413).
	ErrBodyTooLarge = errors.New("request body too large")
	// ErrTooManyStreams: --max-inflight streams are already open (503).
	ErrTooManyStreams = errors.New("too many concurrent requests")
	// ErrBufferBudget: the global budget for buffered bodies is spent (503).
	ErrBufferBudget = errors.New("server is buffering too many request bytes")
	// ErrDecisionTimeout: no decision within --decision-timeout (503).
	ErrDecisionTimeout = errors.New("routing decision timed out")
	// ErrShuttingDown: the server is draining (503).
	ErrShuttingDown = errors.New("server is shutting down")
	// ErrProtocol: the data plane sent messages out of order. It is not an
	// HTTP error: the stream ends with a gRPC FailedPrecondition status.
	ErrProtocol = errors.New("ext_proc protocol violation")
	// ErrHeaderTimeout: a stream sent no request headers within
	// --stream-header-timeout. There is no request to answer: the stream
	// ends with a gRPC DeadlineExceeded status.
	ErrHeaderTimeout = errors.New("no request headers on the ext_proc stream")
	// ErrTooManyHeaders: the request carries more destination-like headers
	// (x-gateway-destination-endpoint*) than any data plane sends (431).
	ErrTooManyHeaders = errors.New("too many x-gateway-destination-endpoint* request headers")
	// ErrMethodNotAllowed: the path does not take the request's method
	// (405, with an Allow header: see [MethodError]).
	ErrMethodNotAllowed = errors.New("method not allowed")
)

// MethodError is a request whose method its path does not take. It wraps
// [ErrMethodNotAllowed]; Allow is the Allow header of the 405 reply.
type MethodError struct {
	Method, Path string
	// Allow lists the methods the path takes, as the Allow header
	// ("POST", "GET, HEAD").
	Allow string
}

func (e *MethodError) Error() string {
	return fmt.Sprintf("%v: %.64q %.256q takes %s", ErrMethodNotAllowed, e.Method, e.Path, e.Allow)
}

// Unwrap returns [ErrMethodNotAllowed].
func (e *MethodError) Unwrap() error { return ErrMethodNotAllowed }

// CheckMethod returns a *MethodError when method is not one a completion
// path of kind takes: chat and text completions take POST only. Other
// kinds take any method (the worker decides).
func CheckMethod(kind openai.Kind, method, path string) error {
	if (kind == openai.KindChat || kind == openai.KindCompletion) && method != http.MethodPost {
		return &MethodError{Method: method, Path: path, Allow: http.MethodPost}
	}
	return nil
}

// Allow returns the Allow header of a 405 reply for err ("POST" unless
// err carries a [MethodError] saying otherwise).
func Allow(err error) string {
	if me, ok := errors.AsType[*MethodError](err); ok && me.Allow != "" {
		return me.Allow
	}
	return http.MethodPost
}

// Rejection is an error answered to the client as an HTTP status with an
// OpenAI-style JSON error body.
type Rejection struct {
	Status int
	Type   string
	Code   string
	Err    error
}

func (r *Rejection) Error() string { return fmt.Sprintf("%d %s: %v", r.Status, r.Code, r.Err) }

// Unwrap returns the cause.
func (r *Rejection) Unwrap() error { return r.Err }

// Reject classifies err. It is the one place where errors become HTTP
// statuses: 400 bad request, 404 unknown model, 405 wrong method, 413 too large, 431 too
// many spoofable headers, 429 shed,
// 503 no endpoint / too many streams / timeout / shutdown. It returns nil
// for errors that are not the client's to see (internal errors and
// protocol violations), which end the stream with a gRPC status instead.
func Reject(err error) *Rejection {
	var r *Rejection
	switch {
	case err == nil:
		return nil
	case errors.As(err, &r):
		return r
	case errors.Is(err, openai.ErrMissingModel):
		return &Rejection{http.StatusBadRequest, "invalid_request_error", "missing_model", err}
	case errors.Is(err, openai.ErrInvalidJSON):
		return &Rejection{http.StatusBadRequest, "invalid_request_error", "invalid_json", err}
	case errors.Is(err, openai.ErrInvalidField):
		return &Rejection{http.StatusBadRequest, "invalid_request_error", "invalid_field", err}
	case errors.Is(err, routing.ErrModelNotFound):
		return &Rejection{http.StatusNotFound, "invalid_request_error", "model_not_found", err}
	case errors.Is(err, ErrBodyTooLarge):
		return &Rejection{http.StatusRequestEntityTooLarge, "invalid_request_error", "body_too_large", err}
	case errors.Is(err, ErrMethodNotAllowed):
		return &Rejection{http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", err}
	case errors.Is(err, ErrTooManyHeaders):
		return &Rejection{http.StatusRequestHeaderFieldsTooLarge, "invalid_request_error", "request_headers_too_large", err}
	case errors.Is(err, routing.ErrOverloaded):
		return &Rejection{http.StatusTooManyRequests, "rate_limit_error", "overloaded", err}
	case errors.Is(err, routing.ErrSubsetEmpty):
		return &Rejection{http.StatusServiceUnavailable, "service_unavailable", "subset_empty", err}
	case errors.Is(err, routing.ErrNoEndpoints):
		return &Rejection{http.StatusServiceUnavailable, "service_unavailable", "no_endpoint", err}
	case errors.Is(err, ErrTooManyStreams):
		return &Rejection{http.StatusServiceUnavailable, "service_unavailable", "too_many_requests_in_flight", err}
	case errors.Is(err, ErrBufferBudget):
		return &Rejection{http.StatusServiceUnavailable, "service_unavailable", "server_busy", err}
	case errors.Is(err, ErrDecisionTimeout):
		return &Rejection{http.StatusServiceUnavailable, "service_unavailable", "decision_timeout", err}
	case errors.Is(err, ErrShuttingDown):
		return &Rejection{http.StatusServiceUnavailable, "service_unavailable", "shutting_down", err}
	}
	return nil
}

// errorBody is the OpenAI error envelope.
type errorBody struct {
	Error struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    string `json:"code"`
	} `json:"error"`
}

// HeaderError names the rejection's code on every local reply.
const HeaderError = "x-kvbandit-error"

// Body returns the OpenAI-style JSON error body:
// {"error":{"message":...,"type":...,"code":...}}.
func (r *Rejection) Body() []byte {
	var b errorBody
	b.Error.Message = r.Err.Error()
	b.Error.Type = r.Type
	b.Error.Code = r.Code
	body, _ := json.Marshal(&b) // cannot fail: plain strings
	return body
}

// immediate builds the ImmediateResponse for a rejection.
func (r *Rejection) immediate() *extprocv3.ProcessingResponse {
	body := r.Body()
	headers := []*corev3.HeaderValueOption{
		setHeader("content-type", "application/json"),
		setHeader(HeaderError, r.Code),
	}
	if r.Status == http.StatusMethodNotAllowed {
		headers = append(headers, setHeader("allow", Allow(r.Err)))
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{
			Status:  &typev3.HttpStatus{Code: typev3.StatusCode(r.Status)},
			Headers: &extprocv3.HeaderMutation{SetHeaders: headers},
			Body:    body,
			Details: "kvbandit_" + r.Code,
		},
	}}
}

// grpcError turns an error that is not a Rejection into the stream's final
// status: protocol violations are FailedPrecondition, a stream without
// request headers DeadlineExceeded, the rest Internal.
func grpcError(err error) error {
	switch {
	case errors.Is(err, ErrProtocol):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, ErrHeaderTimeout):
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// setHeader replaces header k. Envoy's ext_proc reads the (deprecated)
// append field, not append_action, and its default is already "replace";
// it is set explicitly so that no data plane appends a second value.
func setHeader(k, v string) *corev3.HeaderValueOption {
	h := &headerOption{}
	h.header.Key, h.header.RawValue = k, []byte(v)
	h.opt.Header, h.opt.Append = &h.header, &h.append
	return &h.opt
}

// headerOption is a HeaderValueOption and the messages it points to, in
// one allocation (append is false, its zero value).
type headerOption struct {
	opt    corev3.HeaderValueOption
	header corev3.HeaderValue
	append wrapperspb.BoolValue
}
