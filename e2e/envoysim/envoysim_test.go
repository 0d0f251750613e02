package envoysim_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// ---- a small ext_proc server ----------------------------------------------------

type processFunc func(extprocv3.ExternalProcessor_ProcessServer) error

type processServer struct {
	extprocv3.UnimplementedExternalProcessorServer
	f processFunc
}

func (s processServer) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	return s.f(stream)
}

// startExtProc serves f on a loopback port and returns the address.
func startExtProc(t *testing.T, f processFunc) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, processServer{f: f})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return ln.Addr().String()
}

// picker is an endpoint picker in the style of an EPP: in FULL_DUPLEX it
// buffers the body to end of stream, then answers the headers with the
// destination and re-streams the body; in BUFFERED it answers the headers
// at once and puts the destination in the body response; the response is
// echoed back.
type picker struct {
	dest          string
	chunk         int                        // re-stream chunk size (default 62,000)
	metadata      map[string]*structpb.Value // extra dynamic metadata namespaces
	mutation      func(*extprocv3.HeaderMutation)
	closeAfterReq bool // return OK once the request phase is answered

	mu      sync.Mutex
	streams [][]*extprocv3.ProcessingRequest
}

func (p *picker) decision() (*extprocv3.CommonResponse, *structpb.Struct) {
	hm := &extprocv3.HeaderMutation{
		SetHeaders: []*corev3.HeaderValueOption{{
			Header: &corev3.HeaderValue{Key: envoysim.KeyDestination, RawValue: []byte(p.dest)},
		}},
	}
	if p.mutation != nil {
		p.mutation(hm)
	}
	md := &structpb.Struct{Fields: map[string]*structpb.Value{
		envoysim.NamespaceLB: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			envoysim.KeyDestination: structpb.NewStringValue(p.dest),
		}}),
	}}
	for ns, v := range p.metadata {
		md.Fields[ns] = v
	}
	return &extprocv3.CommonResponse{HeaderMutation: hm, ClearRouteCache: true}, md
}

func (p *picker) seen() [][]*extprocv3.ProcessingRequest {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.streams)
}

func (p *picker) process(s extprocv3.ExternalProcessor_ProcessServer) error {
	p.mu.Lock()
	idx := len(p.streams)
	p.streams = append(p.streams, nil)
	p.mu.Unlock()
	chunk := p.chunk
	if chunk == 0 {
		chunk = 62000
	}
	mode := filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	var body []byte
	for {
		req, err := s.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		p.mu.Lock()
		p.streams[idx] = append(p.streams[idx], req)
		p.mu.Unlock()
		if pc := req.GetProtocolConfig(); pc != nil {
			mode = pc.GetRequestBodyMode()
		}
		var out []*extprocv3.ProcessingResponse
		switch r := req.GetRequest().(type) {
		case *extprocv3.ProcessingRequest_RequestHeaders:
			if mode == filterv3.ProcessingMode_BUFFERED && !r.RequestHeaders.GetEndOfStream() {
				out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
					RequestHeaders: &extprocv3.HeadersResponse{}}})
				break
			}
			if !r.RequestHeaders.GetEndOfStream() && mode != filterv3.ProcessingMode_NONE {
				continue // decide at the end of the body
			}
			cr, md := p.decision()
			out = append(out, &extprocv3.ProcessingResponse{
				Response:        &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: cr}},
				DynamicMetadata: md,
			})
		case *extprocv3.ProcessingRequest_RequestBody:
			if mode == filterv3.ProcessingMode_BUFFERED {
				cr, md := p.decision()
				out = append(out, &extprocv3.ProcessingResponse{
					Response:        &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: cr}},
					DynamicMetadata: md,
				})
				break
			}
			body = append(body, r.RequestBody.GetBody()...)
			if !r.RequestBody.GetEndOfStream() {
				continue
			}
			cr, md := p.decision()
			out = append(out, &extprocv3.ProcessingResponse{
				Response:        &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: cr}},
				DynamicMetadata: md,
			})
			for off := 0; ; off += chunk {
				end := min(off+chunk, len(body))
				out = append(out, streamed(true, body[off:end], end == len(body)))
				if end == len(body) {
					break
				}
			}
		case *extprocv3.ProcessingRequest_RequestTrailers:
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
				RequestTrailers: &extprocv3.TrailersResponse{}}})
		case *extprocv3.ProcessingRequest_ResponseHeaders:
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{
				ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
					HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
						Header: &corev3.HeaderValue{Key: "x-picked-by", RawValue: []byte("picker")},
					}}},
				}}}})
		case *extprocv3.ProcessingRequest_ResponseBody:
			out = append(out, streamed(false, r.ResponseBody.GetBody(), r.ResponseBody.GetEndOfStream()))
		case *extprocv3.ProcessingRequest_ResponseTrailers:
			out = append(out, &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
				ResponseTrailers: &extprocv3.TrailersResponse{}}})
		}
		for _, m := range out {
			if err := s.Send(m); err != nil {
				return err
			}
		}
		if p.closeAfterReq && len(out) > 0 && isRequestDone(out[len(out)-1]) {
			return nil
		}
	}
}

func isRequestDone(m *extprocv3.ProcessingResponse) bool {
	switch r := m.GetResponse().(type) {
	case *extprocv3.ProcessingResponse_RequestHeaders:
		return true // only sent when the request phase ends here (GET, NONE)
	case *extprocv3.ProcessingResponse_RequestBody:
		sr := r.RequestBody.GetResponse().GetBodyMutation().GetStreamedResponse()
		return sr == nil || sr.GetEndOfStream()
	}
	return false
}

func streamed(request bool, b []byte, eos bool) *extprocv3.ProcessingResponse {
	br := &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
		BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: eos},
		}},
	}}
	if request {
		return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: br}}
	}
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: br}}
}

// ---- fixtures ---------------------------------------------------------------------

func startWorker(t *testing.T, cfg worker.Config) *worker.Worker {
	t.Helper()
	w := worker.New(cfg)
	if err := w.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = w.Close() })
	return w
}

func startProxy(t *testing.T, cfg envoysim.Config) *envoysim.Proxy {
	t.Helper()
	p, err := envoysim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("proxy close: %v", err)
		}
	})
	return p
}

func client(t *testing.T) *http.Client {
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func do(t *testing.T, c *http.Client, method, url string, body []byte, hdr map[string]string) response {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, url, err)
	}
	return response{resp.StatusCode, resp.Header, b}
}

func waitOne(t *testing.T, p *envoysim.Proxy) envoysim.Exchange {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	xs, err := p.WaitExchanges(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	return xs[len(xs)-1]
}

// chatBody is a chat completion request of exactly n bytes (n >= 64).
func chatBody(n int) []byte {
	const head, tail = `{"model":"test-model","messages":[{"role":"user","content":"`, `"}]}`
	return []byte(head + strings.Repeat("x", max(0, n-len(head)-len(tail))) + tail)
}

func headerValue(h *corev3.HeaderMap, key string) (string, bool) {
	for _, hv := range h.GetHeaders() {
		if hv.GetKey() == key {
			return string(hv.GetRawValue()), true
		}
	}
	return "", false
}

// ---- tests --------------------------------------------------------------------------

func TestFullDuplexExchange(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	w2 := startWorker(t, worker.Config{})
	pk := &picker{dest: w2.Addr(), chunk: 5000}
	p := startProxy(t, envoysim.Config{
		ExtProcAddr: startExtProc(t, pk.process),
		Hosts:       []string{w1.Addr(), w2.Addr()},
		ChunkSizes:  []int{7001, 3333},
		SubsetHint:  envoysim.SubsetList(w1.Addr(), w2.Addr()),
	})
	body := chatBody(40000)
	resp := do(t, client(t), "POST", p.URL()+"/v1/chat/completions", body, map[string]string{
		"Content-Type":              "application/json",
		envoysim.KeyDestination:     "10.9.9.9:1", // spoofed by the client
		"x-request-id":              "req-1",
		"x-gateway-destination-xyz": "untouched",
	})
	if resp.status != http.StatusOK {
		t.Fatalf("status %d, body %s", resp.status, resp.body)
	}
	if got := resp.header.Get(worker.HeaderWorker); got != w2.Addr() {
		t.Errorf("served by %q, want %q", got, w2.Addr())
	}
	if got := resp.header.Get("x-picked-by"); got != "picker" {
		t.Errorf("response header mutation not applied: x-picked-by=%q", got)
	}
	x := waitOne(t, p)
	if x.Upstream != w2.Addr() || x.Fallback || x.Destination != w2.Addr() {
		t.Errorf("upstream %q fallback %v destination %q", x.Upstream, x.Fallback, x.Destination)
	}
	if !x.RouteCacheCleared {
		t.Error("route cache not cleared")
	}

	checkFullDuplexUpstream(t, w1, w2, body)
	sent := checkFullDuplexOrder(t, x, len(body))
	checkFullDuplexFirstMessage(t, sent, p.Addr(), w2.Addr())
	checkFullDuplexResponsePath(t, sent, w2.Addr())
}

// checkFullDuplexUpstream checks what TestFullDuplexExchange's worker w2
// received (w1 receiving nothing).
func checkFullDuplexUpstream(t *testing.T, w1, w2 *worker.Worker, body []byte) {
	t.Helper()
	// The body reached the worker byte for byte, chunked (content-length
	// removed in FULL_DUPLEX), with the destination header set by the picker.
	reqs := w2.Requests()
	if len(reqs) != 1 || len(w1.Requests()) != 0 {
		t.Fatalf("worker requests: w1 %d, w2 %d", len(w1.Requests()), len(reqs))
	}
	if !bytes.Equal(reqs[0].Body, body) {
		t.Errorf("upstream body differs: %d bytes, want %d", len(reqs[0].Body), len(body))
	}
	if reqs[0].ContentLength != -1 {
		t.Errorf("upstream content length %d, want chunked", reqs[0].ContentLength)
	}
	if got := reqs[0].Header.Values(envoysim.KeyDestination); !slices.Equal(got, []string{w2.Addr()}) {
		t.Errorf("upstream %s = %q", envoysim.KeyDestination, got)
	}
	if got := reqs[0].Header.Get("x-request-id"); got != "req-1" {
		t.Errorf("x-request-id %q", got)
	}
}

// checkFullDuplexOrder checks the order of TestFullDuplexExchange's
// messages and the sizes of its request body chunks, and returns the
// messages sent.
func checkFullDuplexOrder(t *testing.T, x envoysim.Exchange, bodyLen int) []*extprocv3.ProcessingRequest {
	t.Helper()
	// Order: headers, every body chunk (without waiting for the headers
	// response), then the picker's headers response and the body coming back.
	flow := x.Flow()
	nChunks := 0
	for _, s := range flow {
		if strings.HasPrefix(s, "> request_body") {
			nChunks++
		}
	}
	wantPrefix := []string{"> request_headers"}
	for i := 0; i < nChunks-1; i++ {
		wantPrefix = append(wantPrefix, "> request_body")
	}
	wantPrefix = append(wantPrefix, "> request_body eos", "< request_headers")
	if len(flow) < len(wantPrefix) || !slices.Equal(flow[:len(wantPrefix)], wantPrefix) {
		t.Fatalf("flow:\n%s", strings.Join(flow, "\n"))
	}
	if last := flow[len(flow)-1]; last != "< response_body streamed eos" {
		t.Errorf("flow ends with %q", last)
	}
	// Chunk sizes follow ChunkSizes.
	sent := x.Sent()
	for i, m := range sent[1 : 1+nChunks] {
		want := []int{7001, 3333}[i%2]
		if i == nChunks-1 {
			want = bodyLen - (nChunks-1)/2*(7001+3333) - (nChunks-1)%2*7001
		}
		if got := len(m.GetRequestBody().GetBody()); got != want {
			t.Errorf("chunk %d: %d bytes, want %d", i, got, want)
		}
	}
	return sent
}

// checkFullDuplexFirstMessage checks TestFullDuplexExchange's first
// message (and that no other has protocol_config).
func checkFullDuplexFirstMessage(t *testing.T, sent []*extprocv3.ProcessingRequest, authority, dest string) {
	t.Helper()
	// First message: protocol_config, raw_value headers with the
	// pseudo-headers, the subset hint forwarded; nothing else has
	// protocol_config.
	first := sent[0]
	pc := first.GetProtocolConfig()
	if pc.GetRequestBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED ||
		pc.GetResponseBodyMode() != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
		t.Errorf("protocol_config %v", pc)
	}
	for _, m := range sent[1:] {
		if m.GetProtocolConfig() != nil {
			t.Errorf("protocol_config on %s", envoysim.RequestKind(m))
		}
	}
	hdrs := first.GetRequestHeaders().GetHeaders()
	for key, want := range map[string]string{
		":method": "POST", ":path": "/v1/chat/completions", ":scheme": "http", ":authority": authority,
		envoysim.KeyDestination: "10.9.9.9:1", "content-length": "40000",
	} {
		if got, ok := headerValue(hdrs, key); !ok || got != want {
			t.Errorf("request header %s = %q (present %v), want %q", key, got, ok, want)
		}
	}
	for _, hv := range hdrs.GetHeaders() {
		if hv.GetValue() != "" || len(hv.GetRawValue()) == 0 && hv.GetKey() != "" {
			t.Errorf("header %s not in raw_value only: %v", hv.GetKey(), hv)
		}
	}
	if first.GetRequestHeaders().GetEndOfStream() {
		t.Error("end_of_stream on headers of a request with a body")
	}
	hint := first.GetMetadataContext().GetFilterMetadata()[envoysim.NamespaceSubsetHint].GetFields()[envoysim.KeySubset]
	if got := hint.GetListValue().GetValues(); len(got) != 2 || got[1].GetStringValue() != dest {
		t.Errorf("subset hint forwarded as %v", hint)
	}
}

// checkFullDuplexResponsePath checks TestFullDuplexExchange's response
// headers message.
func checkFullDuplexResponsePath(t *testing.T, sent []*extprocv3.ProcessingRequest, served string) {
	t.Helper()
	// Response path: headers with :status, the served endpoint in metadata.
	var rh *extprocv3.ProcessingRequest
	for _, m := range sent {
		if m.GetResponseHeaders() != nil {
			rh = m
		}
	}
	if rh == nil {
		t.Fatal("no response headers sent")
	}
	if got, _ := headerValue(rh.GetResponseHeaders().GetHeaders(), ":status"); got != "200" {
		t.Errorf(":status %q", got)
	}
	lb := rh.GetMetadataContext().GetFilterMetadata()[envoysim.NamespaceLB].GetFields()
	if got := lb[envoysim.KeyServed].GetStringValue(); got != served {
		t.Errorf("served %q, want %q", got, served)
	}
	if got := lb[envoysim.KeyDestination].GetStringValue(); got != served {
		t.Errorf("destination metadata on the response path %q", got)
	}
}

func TestEmptyChunkedBodyAndGet(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	pk := &picker{dest: w1.Addr()}
	p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w1.Addr()}})
	c := client(t)

	resp := do(t, c, "GET", p.URL()+"/v1/models", nil, nil)
	if resp.status != http.StatusOK || !bytes.Contains(resp.body, []byte("test-model")) {
		t.Fatalf("GET: %d %s", resp.status, resp.body)
	}
	x := waitOne(t, p)
	if !x.Sent()[0].GetRequestHeaders().GetEndOfStream() {
		t.Error("GET headers without end_of_stream")
	}
	if x.Upstream != w1.Addr() || x.Fallback {
		t.Errorf("GET upstream %q fallback %v", x.Upstream, x.Fallback)
	}
	// The response body goes to the server without waiting for the
	// response headers' answer, so the middle may interleave either way.
	flow := x.Flow()
	want := []string{"> request_headers", "< request_headers", "> response_headers"}
	if len(flow) != 6 || !slices.Equal(flow[:3], want) || flow[5] != "< response_body streamed eos" ||
		!slices.Contains(flow[3:5], "> response_body eos") || !slices.Contains(flow[3:5], "< response_headers") {
		t.Errorf("GET flow %v", flow)
	}

	// A chunked request body ends with an empty end-of-stream chunk.
	req, _ := http.NewRequestWithContext(t.Context(), "POST", p.URL()+"/v1/chat/completions", io.MultiReader(strings.NewReader(string(chatBody(200)))))
	req.ContentLength = -1
	r2, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, r2.Body)
	r2.Body.Close()
	xs, err := p.WaitExchanges(t.Context(), 2)
	if err != nil {
		t.Fatal(err)
	}
	sent := xs[1].Sent()
	var bodies []*extprocv3.HttpBody
	for _, m := range sent {
		if b := m.GetRequestBody(); b != nil {
			bodies = append(bodies, b)
		}
	}
	if len(bodies) < 2 || len(bodies[len(bodies)-1].GetBody()) != 0 || !bodies[len(bodies)-1].GetEndOfStream() {
		t.Errorf("chunked body did not end with an empty end_of_stream chunk: %v", bodies)
	}
	if _, ok := headerValue(sent[0].GetRequestHeaders().GetHeaders(), "content-length"); ok {
		t.Error("content-length on a chunked request")
	}
}

func TestOverrideHostFallback(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	w2 := startWorker(t, worker.Config{})
	for _, tc := range []struct {
		name string
		dest string
		want string // "" = fallback
	}{
		{"not in cluster", "10.0.0.1:80", ""},
		{"second of a list", "10.0.0.1:80, " + "WORKER2", "WORKER2"},
		{"garbage", "not-an-address", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dest := strings.ReplaceAll(tc.dest, "WORKER2", w2.Addr())
			pk := &picker{dest: dest}
			p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w1.Addr(), w2.Addr()}})
			resp := do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), nil)
			if resp.status != http.StatusOK {
				t.Fatalf("status %d %s", resp.status, resp.body)
			}
			x := waitOne(t, p)
			if tc.want == "" {
				if !x.Fallback || x.Upstream != w1.Addr() {
					t.Errorf("fallback %v upstream %q, want round robin to %s; notes %v", x.Fallback, x.Upstream, w1.Addr(), x.Notes)
				}
				return
			}
			want := strings.ReplaceAll(tc.want, "WORKER2", w2.Addr())
			if x.Fallback || x.Upstream != want {
				t.Errorf("fallback %v upstream %q, want %q", x.Fallback, x.Upstream, want)
			}
		})
	}
}

func TestNamespaces(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	w2 := startWorker(t, worker.Config{})
	hosts := []string{w1.Addr(), w2.Addr()}
	extra := map[string]*structpb.Value{"other.ns": structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
		"k": structpb.NewStringValue("v"),
	}})}

	t.Run("receiving filters", func(t *testing.T) {
		pk := &picker{dest: w2.Addr(), metadata: extra}
		p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: hosts,
			ForwardingNamespaces: []string{envoysim.NamespaceLB, "other.ns"}})
		do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), nil)
		x := waitOne(t, p)
		if x.Upstream != w2.Addr() {
			t.Errorf("upstream %q", x.Upstream)
		}
		if !slices.ContainsFunc(x.Notes, func(n string) bool { return strings.Contains(n, `"other.ns" dropped`) }) {
			t.Errorf("other.ns not dropped: %v", x.Notes)
		}
		for _, m := range x.Sent() {
			if _, ok := m.GetMetadataContext().GetFilterMetadata()["other.ns"]; ok {
				t.Errorf("other.ns forwarded back on %s", envoysim.RequestKind(m))
			}
		}
	})

	t.Run("envoy.lb not received", func(t *testing.T) {
		pk := &picker{dest: w2.Addr()}
		p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: hosts,
			ReceivingNamespaces: []string{}})
		resp := do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), nil)
		x := waitOne(t, p)
		// The destination header alone never selects the host.
		if !x.Fallback || x.Upstream != w1.Addr() || resp.header.Get(worker.HeaderWorker) != w1.Addr() {
			t.Errorf("fallback %v upstream %q served by %q", x.Fallback, x.Upstream, resp.header.Get(worker.HeaderWorker))
		}
	})

	t.Run("subset hint not forwarded", func(t *testing.T) {
		pk := &picker{dest: w2.Addr()}
		p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: hosts,
			ForwardingNamespaces: []string{envoysim.NamespaceLB},
			SubsetHint:           envoysim.SubsetString(w1.Addr())})
		do(t, client(t), "GET", p.URL()+"/health", nil, nil)
		x := waitOne(t, p)
		if md := x.Sent()[0].GetMetadataContext(); md == nil || len(md.GetFilterMetadata()) != 0 {
			t.Errorf("metadata_context %v, want present and empty", md)
		}
	})
}

func TestHeaderMutationRules(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	pk := &picker{dest: w1.Addr(), mutation: func(hm *extprocv3.HeaderMutation) {
		set := func(k, v string, appendValue bool) {
			hm.SetHeaders = append(hm.SetHeaders, &corev3.HeaderValueOption{
				Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
				Append: wrapBool(appendValue),
			})
		}
		set(":authority", "evil.example", false)
		set("host", "evil.example", false)
		set(":method", "DELETE", false)
		set("x-envoy-original-path", "/x", false)
		set("x-added", "a", false)
		set("x-multi", "2", true)
		set("x-replaced", "new", false)
		hm.SetHeaders = append(hm.SetHeaders, &corev3.HeaderValueOption{
			Header: &corev3.HeaderValue{Key: "x-value-only", Value: "ignored"}})
		hm.RemoveHeaders = append(hm.RemoveHeaders, "host", ":path", "x-remove-me")
	}}
	p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w1.Addr()}})
	resp := do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), map[string]string{
		"x-multi": "1", "x-replaced": "old", "x-remove-me": "yes",
	})
	if resp.status != http.StatusOK {
		t.Fatalf("status %d %s", resp.status, resp.body)
	}
	got := w1.Requests()[0]
	if got.Host != p.Addr() || got.Method != "POST" || got.Path != "/v1/completions" {
		t.Errorf("routing headers changed: host %q method %q path %q", got.Host, got.Method, got.Path)
	}
	for k, want := range map[string][]string{
		"X-Envoy-Original-Path": nil, "X-Added": {"a"}, "X-Multi": {"1", "2"}, "X-Replaced": {"new"},
		"X-Remove-Me": nil, "X-Value-Only": {""},
	} {
		if v := got.Header.Values(k); !slices.Equal(v, want) {
			t.Errorf("upstream %s = %q, want %q", k, v, want)
		}
	}
}

func wrapBool(b bool) *wrapperspb.BoolValue { return wrapperspb.Bool(b) }

func TestImmediateResponse(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	addr := startExtProc(t, func(s extprocv3.ExternalProcessor_ProcessServer) error {
		for {
			req, err := s.Recv()
			if err != nil {
				return nil
			}
			if b := req.GetRequestBody(); b != nil && b.GetEndOfStream() {
				return s.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
					ImmediateResponse: &extprocv3.ImmediateResponse{
						Status: &typev3.HttpStatus{Code: typev3.StatusCode_TooManyRequests},
						Body:   []byte(`{"error":{"message":"shed","type":"rate_limit","code":"shed"}}`),
						Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{
							Header: &corev3.HeaderValue{Key: "content-type", RawValue: []byte("application/json")},
						}}},
						Details: "shed",
					}}})
			}
		}
	})
	p := startProxy(t, envoysim.Config{ExtProcAddr: addr, Hosts: []string{w1.Addr()}})
	resp := do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), nil)
	if resp.status != http.StatusTooManyRequests || resp.header.Get("content-type") != "application/json" ||
		!bytes.Contains(resp.body, []byte(`"shed"`)) {
		t.Errorf("got %d %v %s", resp.status, resp.header, resp.body)
	}
	x := waitOne(t, p)
	if !x.Immediate || x.LocalReply != 429 || x.Upstream != "" {
		t.Errorf("exchange %+v", x)
	}
	if n := len(w1.Requests()); n != 0 {
		t.Errorf("worker contacted %d times", n)
	}
}

func TestBuffered(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	w2 := startWorker(t, worker.Config{})
	pk := &picker{dest: w2.Addr()}
	p := startProxy(t, envoysim.Config{
		ExtProcAddr:     startExtProc(t, pk.process),
		Hosts:           []string{w1.Addr(), w2.Addr()},
		RequestBodyMode: envoysim.Buffered,
		MessageTimeout:  5 * time.Second,
		BufferLimit:     64 << 10,
		ChunkSizes:      []int{1000},
	})
	c := client(t)
	body := chatBody(30000)
	resp := do(t, c, "POST", p.URL()+"/v1/chat/completions", body, nil)
	if resp.status != http.StatusOK || resp.header.Get(worker.HeaderWorker) != w2.Addr() {
		t.Fatalf("status %d served by %q: %s", resp.status, resp.header.Get(worker.HeaderWorker), resp.body)
	}
	x := waitOne(t, p)
	want := []string{"> request_headers", "< request_headers", "> request_body eos", "< request_body"}
	if flow := x.Flow(); len(flow) < 4 || !slices.Equal(flow[:4], want) {
		t.Errorf("flow %v", flow)
	}
	if got := len(x.Sent()[1].GetRequestBody().GetBody()); got != len(body) {
		t.Errorf("buffered body message %d bytes, want %d", got, len(body))
	}
	if x.Sent()[0].GetProtocolConfig().GetRequestBodyMode() != filterv3.ProcessingMode_BUFFERED {
		t.Error("protocol_config request_body_mode not BUFFERED")
	}
	up := w2.Requests()[0]
	if !bytes.Equal(up.Body, body) || up.ContentLength != int64(len(body)) {
		t.Errorf("upstream body %d bytes, content length %d", len(up.Body), up.ContentLength)
	}
	if up.Header.Get(envoysim.KeyDestination) != w2.Addr() {
		t.Errorf("destination header from the body response not applied: %v", up.Header)
	}

	big := do(t, c, "POST", p.URL()+"/v1/chat/completions", chatBody(100<<10), nil)
	if big.status != http.StatusRequestEntityTooLarge {
		t.Errorf("over the buffer limit: %d %s", big.status, big.body)
	}
}

func TestBufferedMessageTimeout(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	addr := startExtProc(t, func(s extprocv3.ExternalProcessor_ProcessServer) error {
		for { // never answers
			if _, err := s.Recv(); err != nil {
				return nil
			}
		}
	})
	p := startProxy(t, envoysim.Config{ExtProcAddr: addr, Hosts: []string{w1.Addr()},
		RequestBodyMode: envoysim.Buffered, MessageTimeout: 100 * time.Millisecond})
	resp := do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), nil)
	if resp.status != http.StatusGatewayTimeout {
		t.Errorf("status %d", resp.status)
	}
}

func TestCleanCloseIsPassthrough(t *testing.T) {
	// The worker takes 3 x 50 ms before its response headers, so the
	// server's close (sent right after its last request-path message)
	// arrives first. Had the response started earlier, the bytes sent to
	// the server would be lost, as in Envoy: a clean close is only safe
	// while nothing is streaming to the server.
	w1 := startWorker(t, worker.Config{})
	w2 := startWorker(t, worker.Config{TokenDelay: 50 * time.Millisecond})
	pk := &picker{dest: w2.Addr(), closeAfterReq: true}
	p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w1.Addr(), w2.Addr()}})
	resp := do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi","max_tokens":3}`), nil)
	if resp.status != http.StatusOK || resp.header.Get(worker.HeaderWorker) != w2.Addr() {
		t.Fatalf("status %d served by %q", resp.status, resp.header.Get(worker.HeaderWorker))
	}
	if resp.header.Get("x-picked-by") != "" {
		t.Error("response was processed after a clean close")
	}
	if !bytes.Contains(resp.body, []byte(worker.Text(3))) {
		t.Errorf("body %s", resp.body)
	}
	x := waitOne(t, p)
	if x.ServerClosed == nil || x.ServerClosed.Code() != codes.OK {
		t.Errorf("server close status %v", x.ServerClosed)
	}
	for _, m := range x.Sent() {
		if m.GetResponseHeaders() != nil || m.GetResponseBody() != nil {
			t.Errorf("sent %s after the server closed", envoysim.RequestKind(m))
		}
	}
}

func TestServerErrors(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	hosts := []string{w1.Addr()}
	failOnHeaders := func(s extprocv3.ExternalProcessor_ProcessServer) error {
		if _, err := s.Recv(); err != nil {
			return err
		}
		return status.Error(codes.Internal, "boom")
	}
	failOnBody := func(s extprocv3.ExternalProcessor_ProcessServer) error {
		for {
			req, err := s.Recv()
			if err != nil {
				return err
			}
			if req.GetRequestBody() != nil {
				return status.Error(codes.Internal, "boom")
			}
		}
	}
	body := []byte(`{"model":"test-model","prompt":"hi"}`)
	for _, tc := range []struct {
		name      string
		f         processFunc
		allow     bool
		method    string
		want      int
		upstreams int
	}{
		{"error", failOnHeaders, false, "POST", 500, 0},
		{"error with failure_mode_allow before the body", failOnHeaders, true, "GET", 200, 1},
		{"error with failure_mode_allow after body went out", failOnBody, true, "POST", 500, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w1.ClearRequests()
			p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, tc.f), Hosts: hosts, FailureModeAllow: tc.allow})
			var b []byte
			path := "/v1/models"
			if tc.method == "POST" {
				b, path = body, "/v1/completions"
			}
			resp := do(t, client(t), tc.method, p.URL()+path, b, nil)
			if resp.status != tc.want {
				t.Errorf("status %d, want %d", resp.status, tc.want)
			}
			x := waitOne(t, p)
			if x.ServerClosed == nil || x.ServerClosed.Code() != codes.Internal {
				t.Errorf("server closed %v", x.ServerClosed)
			}
			if n := len(w1.Requests()); n != tc.upstreams {
				t.Errorf("%d upstream requests, want %d", n, tc.upstreams)
			}
		})
	}

	t.Run("unreachable server", func(t *testing.T) {
		// A listener that hangs up at once (a closed port could be reused
		// by the proxy's own listener).
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Close()
			}
		}()
		t.Cleanup(func() { ln.Close(); <-done })
		p := startProxy(t, envoysim.Config{ExtProcAddr: ln.Addr().String(), Hosts: hosts})
		if resp := do(t, client(t), "GET", p.URL()+"/health", nil, nil); resp.status != 500 {
			t.Errorf("status %d", resp.status)
		}
	})
}

func TestSpurious(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	for _, tc := range []struct {
		name  string
		reply func(*extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse
	}{
		{"body response before headers response", func(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
			if req.GetRequestBody() != nil {
				return streamed(true, req.GetRequestBody().GetBody(), req.GetRequestBody().GetEndOfStream())
			}
			return nil
		}},
		{"plain body response in FULL_DUPLEX", func(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
			if req.GetRequestHeaders() != nil {
				return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{}}}
			}
			if req.GetRequestBody() != nil {
				return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{}}}
			}
			return nil
		}},
		{"response headers answer to request headers", func(req *extprocv3.ProcessingRequest) *extprocv3.ProcessingResponse {
			if req.GetRequestHeaders() != nil {
				return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{}}}
			}
			return nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := startExtProc(t, func(s extprocv3.ExternalProcessor_ProcessServer) error {
				for {
					req, err := s.Recv()
					if err != nil {
						return nil
					}
					if m := tc.reply(req); m != nil {
						if err := s.Send(m); err != nil {
							return nil
						}
					}
				}
			})
			p := startProxy(t, envoysim.Config{ExtProcAddr: addr, Hosts: []string{w1.Addr()}})
			resp := do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), nil)
			if resp.status != 500 {
				t.Errorf("status %d", resp.status)
			}
			if x := waitOne(t, p); x.Spurious != 1 || x.LocalReply != 500 {
				t.Errorf("spurious %d local reply %d notes %v", x.Spurious, x.LocalReply, x.Notes)
			}
		})
	}
}

func TestSSEStreamsThrough(t *testing.T) {
	w1 := startWorker(t, worker.Config{TokenDelay: 30 * time.Millisecond})
	pk := &picker{dest: w1.Addr()}
	p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w1.Addr()}})
	body := []byte(`{"model":"test-model","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":20}`)
	req, _ := http.NewRequestWithContext(t.Context(), "POST", p.URL()+"/v1/chat/completions", bytes.NewReader(body))
	resp, err := client(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Errorf("content type %q", resp.Header.Get("Content-Type"))
	}
	rd := bufio.NewReader(resp.Body)
	line, err := rd.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first line %q: %v", line, err)
	}
	// The first event arrived while the worker is still generating.
	if w1.Running() != 1 {
		t.Errorf("first event only after the generation finished")
	}
	rest, err := io.ReadAll(rd)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasSuffix(rest, []byte("data: [DONE]\n\n")) {
		t.Errorf("stream does not end with [DONE]: %q", rest[max(0, len(rest)-100):])
	}
}

func TestClientCancel(t *testing.T) {
	w1 := startWorker(t, worker.Config{TokenDelay: 20 * time.Millisecond})
	ended := make(chan error, 1)
	pk := &picker{dest: w1.Addr()}
	addr := startExtProc(t, func(s extprocv3.ExternalProcessor_ProcessServer) error {
		err := pk.process(s)
		ended <- err
		return err
	})
	p := startProxy(t, envoysim.Config{ExtProcAddr: addr, Hosts: []string{w1.Addr()}})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	body := []byte(`{"model":"test-model","prompt":"hi","stream":true,"max_tokens":1000}`)
	req, _ := http.NewRequestWithContext(ctx, "POST", p.URL()+"/v1/completions", bytes.NewReader(body))
	resp, err := client(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()

	x := waitOne(t, p)
	if !x.ClientCanceled {
		t.Errorf("exchange not marked canceled: %v", x.Notes)
	}
	wctx, wcancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer wcancel()
	reqs, err := w1.WaitRequests(wctx, 1)
	if err != nil || !reqs[0].Canceled {
		t.Errorf("worker request not canceled: %v %+v", err, reqs)
	}
	select {
	case <-ended: // the ext_proc stream ended (half-close or reset)
	case <-wctx.Done():
		t.Error("ext_proc stream still open after the client went away")
	}
}

func TestResponseProcessingOff(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	pk := &picker{dest: w1.Addr()}
	p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w1.Addr()},
		ResponseBodyMode: envoysim.None})
	body := chatBody(5000)
	resp := do(t, client(t), "POST", p.URL()+"/v1/chat/completions", body, nil)
	if resp.status != 200 || resp.header.Get("x-picked-by") != "" {
		t.Errorf("status %d, x-picked-by %q", resp.status, resp.header.Get("x-picked-by"))
	}
	x := waitOne(t, p)
	flow := x.Flow()
	if flow[len(flow)-1] != "< request_body streamed eos" {
		t.Errorf("flow %v", flow)
	}
	if x.Sent()[0].GetProtocolConfig().GetResponseBodyMode() != filterv3.ProcessingMode_NONE {
		t.Error("response_body_mode not NONE")
	}
	if !slices.ContainsFunc(x.Notes, func(n string) bool { return strings.Contains(n, "last response received") }) {
		t.Errorf("stream not closed after the last response: %v", x.Notes)
	}
}

func TestManyConcurrent(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	w2 := startWorker(t, worker.Config{})
	pk := &picker{dest: w1.Addr() + "," + w2.Addr()}
	p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w1.Addr(), w2.Addr()},
		ChunkSizes: []int{777}})
	c := client(t)
	var wg sync.WaitGroup
	for i := range 16 {
		wg.Go(func() {
			b := make([]byte, 1000+rand.IntN(20000))
			for j := range b {
				b[j] = 'a' + byte((i+j)%26)
			}
			body := []byte(`{"model":"test-model","prompt":"` + string(b) + `"}`)
			resp := do(t, c, "POST", p.URL()+"/v1/completions", body, map[string]string{"x-request-id": string(rune('A' + i))})
			if resp.status != 200 {
				t.Errorf("status %d", resp.status)
			}
		})
	}
	wg.Wait()
	xs, err := p.WaitExchanges(t.Context(), 16)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range xs {
		if x.Upstream != w1.Addr() {
			t.Errorf("exchange %d went to %q", x.ID, x.Upstream)
		}
	}
	for _, r := range w1.Requests() {
		id := r.Header.Get("x-request-id")
		if len(id) != 1 {
			t.Errorf("x-request-id %q", id)
		}
	}
}

func TestShippedHeaderFilters(t *testing.T) {
	w1 := startWorker(t, worker.Config{})
	pk := &picker{dest: w1.Addr()}
	family := []string{envoysim.KeyDestination, envoysim.KeyServed, envoysim.KeySubset}
	p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w1.Addr()},
		StripRequestHeaders: family, RouteRemoveRequestHeaders: family})
	resp := do(t, client(t), "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), map[string]string{
		envoysim.KeyDestination: "10.0.0.1:1", envoysim.KeyServed: "x",
	})
	if resp.status != 200 {
		t.Fatalf("status %d", resp.status)
	}
	x := waitOne(t, p)
	for _, name := range family {
		if _, ok := headerValue(x.Sent()[0].GetRequestHeaders().GetHeaders(), name); ok {
			t.Errorf("%s reached the ext_proc server", name)
		}
		if v := w1.Requests()[0].Header.Values(name); len(v) != 0 {
			t.Errorf("%s reached the upstream: %q", name, v)
		}
	}
	if x.Upstream != w1.Addr() || x.Fallback {
		t.Errorf("upstream %q fallback %v", x.Upstream, x.Fallback)
	}
}

// DiscardHistory keeps neither events nor exchanges, still counts ended
// exchanges for WaitExchanges, and still calls Trace.
func TestDiscardHistory(t *testing.T) {
	w := startWorker(t, worker.Config{})
	pk := &picker{dest: w.Addr()}
	var traced atomic.Int64
	p := startProxy(t, envoysim.Config{ExtProcAddr: startExtProc(t, pk.process), Hosts: []string{w.Addr()},
		DiscardHistory: true, Trace: func(envoysim.Event) { traced.Add(1) }})
	c := client(t)
	for range 3 {
		if resp := do(t, c, "POST", p.URL()+"/v1/completions", []byte(`{"model":"test-model","prompt":"hi"}`), nil); resp.status != http.StatusOK {
			t.Fatalf("status %d %s", resp.status, resp.body)
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	xs, err := p.WaitExchanges(ctx, 3)
	if err != nil {
		t.Fatal(err)
	}
	if len(xs) != 0 || len(p.Exchanges()) != 0 || len(p.Events()) != 0 {
		t.Errorf("kept %d exchanges (%d) and %d events, want none", len(xs), len(p.Exchanges()), len(p.Events()))
	}
	if traced.Load() == 0 {
		t.Error("Trace saw no event")
	}
}
