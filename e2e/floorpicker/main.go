// Command floorpicker is the floor of the ext_proc hop, for the side-by-side
// benchmark (`make bench-vs-gie`): a minimal Go ext_proc endpoint picker with
// no engine. It does the same exchange as kvbandit and GIE's EPP in
// FULL_DUPLEX_STREAMED mode (receive the headers and the whole body, answer
// with x-gateway-destination-endpoint, stream the body back) but parses
// nothing and picks round robin, so its CPU per request is what gRPC, proto
// and the exchange itself cost. It is a measuring stick, not a product.
//
//	floorpicker -addr 127.0.0.1:9002 -endpoints 10.0.0.1:8000,10.0.0.2:8000
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
)

// chunkBytes is the size of the re-streamed body chunks, as kvbandit's
// (extproc.BodyChunkBytes).
const chunkBytes = 62000

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "ext_proc listen address")
	endpoints := flag.String("endpoints", "", "comma-separated destinations, picked round robin")
	flag.Parse()
	eps := strings.Split(*endpoints, ",")
	if *endpoints == "" {
		fmt.Fprintln(os.Stderr, "floorpicker: -endpoints is required")
		os.Exit(2)
	}
	lis, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, "floorpicker:", err)
		os.Exit(1)
	}
	srv := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(srv, &picker{endpoints: eps})
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-sig; srv.Stop() }()
	if err := srv.Serve(lis); err != nil {
		fmt.Fprintln(os.Stderr, "floorpicker:", err)
		os.Exit(1)
	}
}

type picker struct {
	extprocv3.UnimplementedExternalProcessorServer
	endpoints []string
	next      atomic.Uint64
}

func (p *picker) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
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
		dst := p.endpoints[p.next.Add(1)%uint64(len(p.endpoints))]
		set := []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: "x-gateway-destination-endpoint", RawValue: []byte(dst)}}}
		if err := s.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{
			Response: &extprocv3.CommonResponse{ClearRouteCache: true, HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: set}},
		}}}); err != nil {
			return err
		}
		for len(body) > 0 {
			n := min(len(body), chunkBytes)
			if err := s.Send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
				BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body[:n], EndOfStream: n == len(body)}}},
			}}}}); err != nil {
				return err
			}
			body = body[n:]
		}
	}
}
