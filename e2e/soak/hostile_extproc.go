package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// EPP protocol names (extproc's).
const (
	keyDestination = "x-gateway-destination-endpoint"
	keyServed      = "x-gateway-destination-endpoint-served"
	namespaceLB    = "envoy.lb"
)

type epStream = extprocv3.ExternalProcessor_ProcessClient

func headerMap(kv ...string) *corev3.HeaderMap {
	hm := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		hm.Headers = append(hm.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return hm
}

func requestHeaders(body []byte, extra ...string) *extprocv3.ProcessingRequest {
	kv := append([]string{":method", "POST", ":path", "/v1/chat/completions", ":authority", "gateway", ":scheme", "http",
		"content-type", "application/json", "content-length", fmt.Sprint(len(body))}, extra...)
	return &extprocv3.ProcessingRequest{
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: headerMap(kv...)}},
	}
}

func requestBody(b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}}}
}

func servedMetadata(served string) *corev3.Metadata {
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{namespaceLB: {Fields: map[string]*structpb.Value{
		keyServed: structpb.NewStringValue(served)}}}}
}

func responseHeaders(served string) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		MetadataContext: servedMetadata(served),
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: headerMap(":status", "200", "content-type", "application/json")}},
	}
}

func responseBody(served string, b []byte, eos bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{
		MetadataContext: servedMetadata(served),
		Request:         &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{Body: b, EndOfStream: eos}},
	}
}

// completionJSON is a worker's answer with usage.
const completionJSON = `{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41}}`

// decision reads replies until the request headers' response (the
// destination) or an immediate response.
func decision(st epStream) (dest string, immediate *extprocv3.ImmediateResponse, err error) {
	for {
		m, err := st.Recv()
		if err != nil {
			return "", nil, err
		}
		if ir := m.GetImmediateResponse(); ir != nil {
			return "", ir, nil
		}
		if h := m.GetRequestHeaders(); h != nil {
			for _, o := range h.GetResponse().GetHeaderMutation().GetSetHeaders() {
				if o.GetHeader().GetKey() == keyDestination {
					return string(o.GetHeader().GetRawValue()), nil, nil
				}
			}
			return "", nil, errors.New("headers response without a destination")
		}
	}
}

// drain reads until the server ends the stream or within passes.
func drain(st epStream, within time.Duration) (ended bool, err error) {
	done := make(chan error, 1)
	go func() {
		for {
			if _, err := st.Recv(); err != nil {
				done <- err
				return
			}
		}
	}()
	t := time.NewTimer(within)
	defer t.Stop()
	select {
	case err := <-done:
		if errors.Is(err, io.EOF) {
			return true, nil
		}
		return true, err
	case <-t.C:
		return false, nil
	}
}

// fullStream runs one whole exchange as Envoy would, with extra request
// headers and the served endpoint the response metadata claims (served()
// gets the destination kvbandit chose).
func (e *env) fullStream(ctx context.Context, rng *rand.Rand, extra []string, served func(dest string) string) result {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := e.extproc.Process(ctx)
	if err != nil {
		return failf("open: %s", errText(err))
	}
	body := chatRequest(model, e.chatMessages(rng), false, 8, nil)
	if err := st.Send(requestHeaders(body, extra...)); err != nil {
		return failf("send headers: %s", errText(err))
	}
	if err := st.Send(requestBody(body, true)); err != nil {
		return failf("send body: %s", errText(err))
	}
	dest, ir, err := decision(st)
	if err != nil {
		return failf("no decision: %s", errText(err))
	}
	if ir != nil {
		code := ir.GetStatus().GetCode()
		if code == 503 || code == 429 {
			return skipped(fmt.Sprintf("immediate %d %s", code, errorCode(ir.GetBody())))
		}
		return failf("immediate %d: %s", code, errorCode(ir.GetBody()))
	}
	sv := served(dest)
	if err := st.Send(responseHeaders(sv)); err != nil {
		return failf("send response headers: %s", errText(err))
	}
	if err := st.Send(responseBody(sv, []byte(completionJSON), true)); err != nil {
		return failf("send response body: %s", errText(err))
	}
	_ = st.CloseSend()
	// Envoy closes the stream once the last response arrived; give the
	// server a moment to finish, then go.
	_, _ = drain(st, 2*time.Second)
	return ok()
}

// idleStream opens a stream and sends nothing, for 1 to 20 s.
func (e *env) idleStream(ctx context.Context, rng *rand.Rand) result {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := e.extproc.Process(ctx)
	if err != nil {
		return failf("open: %s", errText(err))
	}
	_, _ = drain(st, time.Duration(1000+rng.IntN(19000))*time.Millisecond)
	return ok()
}

// outOfOrder sends a message sequence Envoy never would; the server must
// end the stream or answer within 10 s, not wait forever.
func (e *env) outOfOrder(ctx context.Context, rng *rand.Rand) result {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	body := chatRequest(model, e.chatMessages(rng), false, 8, nil)
	served := e.randomWorker(rng)
	trailers := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}}
	scenarios := []struct {
		name    string
		msgs    []*extprocv3.ProcessingRequest
		half    bool // half-close after the messages
		decides bool // a decision is the right answer (the stream then waits for the response)
	}{
		{"body before headers", []*extprocv3.ProcessingRequest{requestBody(body, true)}, false, false},
		{"response headers first", []*extprocv3.ProcessingRequest{responseHeaders(served)}, false, false},
		{"response body first", []*extprocv3.ProcessingRequest{responseBody(served, []byte(completionJSON), true)}, false, false},
		{"headers twice", []*extprocv3.ProcessingRequest{requestHeaders(body), requestHeaders(body)}, false, false},
		{"trailers only", []*extprocv3.ProcessingRequest{trailers}, false, false},
		{"empty message", []*extprocv3.ProcessingRequest{{}}, false, false},
		{"response before the request body", []*extprocv3.ProcessingRequest{requestHeaders(body), responseHeaders(served)}, false, false},
		{"headers then half-close", []*extprocv3.ProcessingRequest{requestHeaders(body)}, true, false},
		{"headers after the body", []*extprocv3.ProcessingRequest{requestHeaders(body), requestBody(body, true), requestHeaders(body)}, false, false},
		// Data after the first end_of_stream is ignored (Envoy issue 46237).
		{"body after end of stream", []*extprocv3.ProcessingRequest{requestHeaders(body), requestBody(body, true), requestBody(body, true), requestBody(body, false)}, false, true},
	}
	sc := scenarios[rng.IntN(len(scenarios))]
	st, err := e.extproc.Process(ctx)
	if err != nil {
		return failf("open: %s", errText(err))
	}
	for _, m := range sc.msgs {
		if err := st.Send(m); err != nil {
			break // the server already ended the stream
		}
	}
	if sc.half {
		_ = st.CloseSend()
	}
	if sc.decides {
		if _, _, err := decision(st); err != nil {
			return failf("%s: no decision: %s", sc.name, errText(err))
		}
		return ok()
	}
	if ended, _ := drain(st, 10*time.Second); !ended {
		return failf("%s: stream still open 10 s later, no answer", sc.name)
	}
	return ok()
}

// longTenant sends a tenant header of 64 to 700 KB.
func (e *env) longTenant(ctx context.Context, rng *rand.Rand) result {
	n := 64<<10 + rng.IntN(636<<10)
	v := make([]byte, n)
	for i := range v {
		v[i] = 'a' + byte(rng.IntN(26))
	}
	return e.fullStream(ctx, rng, []string{tenantHeader, string(v), "x-prefix-id", fmt.Sprintf("p%d", rng.IntN(100))},
		func(dest string) string { return dest })
}

// forgedServed claims, in the response metadata, that a random endpoint
// served the request.
func (e *env) forgedServed(ctx context.Context, rng *rand.Rand) result {
	return e.fullStream(ctx, rng, nil, func(string) string {
		switch rng.IntN(6) {
		case 0:
			return fmt.Sprintf("10.%d.%d.%d:%d", rng.IntN(256), rng.IntN(256), rng.IntN(256), 1+rng.IntN(65535))
		case 1:
			return fmt.Sprintf("[2001:db8::%x]:%d", rng.Uint32(), 1+rng.IntN(65535))
		case 2:
			return strings.Repeat(fmt.Sprintf("garbage-%x-", rng.Uint64()), 1+rng.IntN(64))
		case 3:
			return fmt.Sprintf("10.0.0.%d:80, 10.0.0.%d:80", rng.IntN(256), rng.IntN(256))
		case 4:
			return ""
		}
		return fmt.Sprintf("127.0.0.1:%d", 1+rng.IntN(65535))
	})
}

// abandon takes a decision and goes away without any response.
func (e *env) abandon(ctx context.Context, rng *rand.Rand) result {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := e.extproc.Process(ctx)
	if err != nil {
		return failf("open: %s", errText(err))
	}
	body := chatRequest(model, e.chatMessages(rng), false, 8, nil)
	if err := st.Send(requestHeaders(body, tenantHeader, "tenant-1")); err != nil {
		return failf("send: %s", errText(err))
	}
	if err := st.Send(requestBody(body, true)); err != nil {
		return failf("send: %s", errText(err))
	}
	if _, ir, err := decision(st); err != nil {
		return failf("no decision: %s", errText(err))
	} else if ir != nil {
		return skipped(fmt.Sprintf("immediate %d", ir.GetStatus().GetCode()))
	}
	return ok() // cancel() resets the stream
}
