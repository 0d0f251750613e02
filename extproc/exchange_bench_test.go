package extproc_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy/roundrobin"
)

// BenchmarkExtProcExchange measures one full request exchange over loopback
// gRPC: stream open, request headers, the body (one message), the decision
// (headers response) and the body re-streamed back, then the close.
// Sub-benchmarks: server=kvbandit (round_robin) and server=echo, a bare
// ext_proc server doing the same exchange with no parsing or routing, so
// that kvbandit's own cost is the difference.
//
//	go test -run '^$' -bench ExtProcExchange -benchmem -count 6 ./extproc/ | tee new.txt
//	benchstat new.txt
func BenchmarkExtProcExchange(b *testing.B) {
	for _, size := range []int{4 << 10, 256 << 10} {
		body := chatBody(size)
		for _, srv := range []string{"kvbandit", "echo"} {
			b.Run(fmt.Sprintf("body=%dKB/server=%s", size>>10, srv), func(b *testing.B) {
				var impl extprocv3.ExternalProcessorServer = echoServer{}
				if srv == "kvbandit" {
					impl = benchServer(b)
				}
				client, stop := startServer(b, impl)
				defer stop()
				b.SetBytes(int64(len(body)))
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					if err := exchange(b.Context(), client, body); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkExtProcExchangePaired runs BenchmarkExtProcExchange's exchange
// against kvbandit and the bare echo server in turn, alternating which goes
// first, so that both see the same machine load: on a shared machine the
// load moves between two sub-benchmarks run one after the other, and their
// ratio with it. It reports each server's time per exchange and the ratio
// kvbandit/echo (ns/op and allocs/op count both exchanges).
//
//	go test -run '^$' -bench ExtProcExchangePaired -benchmem -count 6 ./extproc/
func BenchmarkExtProcExchangePaired(b *testing.B) {
	for _, size := range []int{4 << 10, 256 << 10} {
		body := chatBody(size)
		b.Run(fmt.Sprintf("body=%dKB", size>>10), func(b *testing.B) {
			kv, stopKV := startServer(b, benchServer(b))
			defer stopKV()
			echo, stopEcho := startServer(b, echoServer{})
			defer stopEcho()
			clients := [2]extprocv3.ExternalProcessorClient{kv, echo}
			var spent [2]time.Duration
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				for j := range 2 {
					k := (i + j) % 2
					t0 := time.Now()
					if err := exchange(b.Context(), clients[k], body); err != nil {
						b.Fatal(err)
					}
					spent[k] += time.Since(t0)
				}
				i++
			}
			b.ReportMetric(float64(spent[0].Nanoseconds())/float64(i)/1e3, "kvbandit-µs/op")
			b.ReportMetric(float64(spent[1].Nanoseconds())/float64(i)/1e3, "echo-µs/op")
			b.ReportMetric(float64(spent[0])/float64(spent[1]), "kvbandit/echo")
		})
	}
}

// benchServer is the kvbandit server of the exchange benchmarks: round
// robin over two endpoints, response processing on.
func benchServer(b *testing.B) *extproc.Server {
	e := engine.Must(roundrobin.New(), engine.Options{}, engine.Deps{Logger: slog.New(slog.DiscardHandler)})
	b.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}, {Key: "10.0.0.2:8000"}}}); err != nil {
		b.Fatal(err)
	}
	return extproc.NewServer(extproc.Config{ResponseProcessing: true}, extproc.Deps{Picker: e, Logger: slog.New(slog.DiscardHandler)})
}

// chatBody returns a chat completion request of about n bytes.
func chatBody(n int) []byte {
	var buf bytes.Buffer
	buf.WriteString(`{"model":"m","stream":true,"messages":[{"role":"user","content":"`)
	word := []byte("lorem ipsum dolor sit amet ")
	for buf.Len() < n-4 {
		buf.Write(word)
	}
	buf.Truncate(n - 4)
	buf.WriteString(`"}]}`)
	return buf.Bytes()
}

// startServer serves impl on loopback and returns a client for it (dialled
// with opts after the defaults) and the function that stops both.
func startServer(tb testing.TB, impl extprocv3.ExternalProcessorServer, opts ...grpc.DialOption) (extprocv3.ExternalProcessorClient, func()) {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	// WaitForHandlers: Stop returns once every stream's handler has
	// returned, so its decision has ended before the test's cleanup looks
	// at in-flight counts.
	gs := grpc.NewServer(grpc.MaxRecvMsgSize(32<<20), grpc.WaitForHandlers(true))
	extprocv3.RegisterExternalProcessorServer(gs, impl)
	go gs.Serve(l)
	opts = append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(32 << 20))}, opts...)
	conn, err := grpc.NewClient(l.Addr().String(), opts...)
	if err != nil {
		tb.Fatal(err)
	}
	return extprocv3.NewExternalProcessorClient(conn), func() { conn.Close(); gs.Stop() }
}

var benchHeaders = &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
	{Key: ":method", RawValue: []byte("POST")},
	{Key: ":path", RawValue: []byte("/v1/chat/completions")},
	{Key: ":authority", RawValue: []byte("gateway")},
	{Key: "content-type", RawValue: []byte("application/json")},
}}

// exchange runs the FULL_DUPLEX_STREAMED request exchange as Envoy does.
func exchange(ctx context.Context, c extprocv3.ExternalProcessorClient, body []byte) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := c.Process(ctx)
	if err != nil {
		return err
	}
	if err := s.Send(&extprocv3.ProcessingRequest{
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: benchHeaders}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}); err != nil {
		return err
	}
	if err := s.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
		return err
	}
	got := 0
	for {
		r, err := s.Recv()
		if err != nil {
			return err
		}
		if r.GetRequestHeaders() != nil {
			continue
		}
		sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return fmt.Errorf("unexpected response %v", r)
		}
		got += len(sr.GetBody())
		if sr.GetEndOfStream() {
			break
		}
	}
	if got != len(body) {
		return fmt.Errorf("re-streamed %d bytes, want %d", got, len(body))
	}
	if err := s.CloseSend(); err != nil {
		return err
	}
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("after close: %v", err)
	}
	return nil
}

// echoServer is the bare baseline: buffer the body, answer with a fixed
// destination and the body back in chunks, nothing else.
type echoServer struct {
	extprocv3.UnimplementedExternalProcessorServer
}

func (echoServer) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	var body []byte
	for {
		m, err := s.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		rb := m.GetRequestBody()
		if rb == nil {
			continue
		}
		body = append(body, rb.GetBody()...)
		if !rb.GetEndOfStream() {
			continue
		}
		if err := s.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{ClearRouteCache: true, HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "x-gateway-destination-endpoint", RawValue: []byte("10.0.0.1:8000")}}}}},
		}}}); err != nil {
			return err
		}
		for len(body) > 0 {
			n := min(len(body), extproc.BodyChunkBytes)
			if err := s.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body[:n], EndOfStream: n == len(body)}}}}}}}); err != nil {
				return err
			}
			body = body[n:]
		}
	}
}
