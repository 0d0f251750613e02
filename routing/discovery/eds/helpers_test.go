package eds_test

import (
	"context"
	"errors"
	"io"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	edsv3 "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery/eds"
)

// fixture is an EDS server on a real loopback gRPC server.
type fixture struct {
	srv     *eds.Server
	conn    *grpc.ClientConn
	changes atomic.Int64
}

// start serves srv (made by New with OnChange counting into f.changes and
// calling hook) on 127.0.0.1 and dials it; everything stops at cleanup.
func start(t *testing.T, cfg eds.Config, hook func()) *fixture {
	t.Helper()
	f := &fixture{}
	f.srv = eds.New(cfg, eds.Deps{OnChange: func() {
		f.changes.Add(1)
		if hook != nil {
			hook()
		}
	}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	f.srv.Register(g)
	var wg sync.WaitGroup
	wg.Go(func() { _ = g.Serve(lis) })
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	f.conn = conn
	t.Cleanup(func() {
		conn.Close()
		g.Stop()
		wg.Wait()
	})
	return f
}

// client is an xDS client on one stream, driven step by step by a test.
type client struct {
	t      *testing.T
	stream grpc.BidiStreamingClient[discoveryv3.DiscoveryRequest, discoveryv3.DiscoveryResponse]
	cancel context.CancelFunc
	names  []string
	ads    bool
	node   string
}

// connect opens an EDS (or ADS) stream and sends the initial request for
// names.
func (f *fixture) connect(t *testing.T, node string, ads bool, names ...string) *client {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	var (
		st  grpc.BidiStreamingClient[discoveryv3.DiscoveryRequest, discoveryv3.DiscoveryResponse]
		err error
	)
	if ads {
		st, err = discoveryv3.NewAggregatedDiscoveryServiceClient(f.conn).StreamAggregatedResources(ctx)
	} else {
		st, err = edsv3.NewEndpointDiscoveryServiceClient(f.conn).StreamEndpoints(ctx)
	}
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	c := &client{t: t, stream: st, cancel: cancel, names: names, ads: ads, node: node}
	t.Cleanup(c.close)
	c.send(&discoveryv3.DiscoveryRequest{Node: &corev3.Node{Id: node}})
	return c
}

// close ends the stream, as an Envoy that goes away.
func (c *client) close() { c.cancel() }

func (c *client) send(req *discoveryv3.DiscoveryRequest) {
	c.t.Helper()
	if req.TypeUrl == "" {
		req.TypeUrl = eds.TypeURL
	}
	if req.ResourceNames == nil {
		req.ResourceNames = c.names
	}
	// io.EOF: the server ended the stream (e.g. refused it); gRPC says the
	// status is then read with Recv, which the test does next.
	if err := c.stream.Send(req); err != nil && !errors.Is(err, io.EOF) {
		c.t.Fatalf("send: %v", err)
	}
}

// recv waits for the next response.
func (c *client) recv() *discoveryv3.DiscoveryResponse {
	c.t.Helper()
	resp, err := c.stream.Recv()
	if err != nil {
		c.t.Fatalf("recv: %v", err)
	}
	return resp
}

func (c *client) ack(resp *discoveryv3.DiscoveryResponse) {
	c.t.Helper()
	c.send(&discoveryv3.DiscoveryRequest{VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()})
}

// nack rejects resp, reporting prev as the version the client keeps.
func (c *client) nack(resp *discoveryv3.DiscoveryResponse, prev string) {
	c.t.Helper()
	c.send(&discoveryv3.DiscoveryRequest{VersionInfo: prev, ResponseNonce: resp.GetNonce(),
		ErrorDetail: status.New(codes.InvalidArgument, "test rejects this version").Proto()})
}

// assignmentOf decodes the one ClusterLoadAssignment of resp.
func assignmentOf(t *testing.T, resp *discoveryv3.DiscoveryResponse) *endpointv3.ClusterLoadAssignment {
	t.Helper()
	if resp.GetTypeUrl() != eds.TypeURL || len(resp.GetResources()) != 1 {
		t.Fatalf("response type %q with %d resources, want %s with 1", resp.GetTypeUrl(), len(resp.GetResources()), eds.TypeURL)
	}
	var cla endpointv3.ClusterLoadAssignment
	if err := resp.GetResources()[0].UnmarshalTo(&cla); err != nil {
		t.Fatal(err)
	}
	return &cla
}

// keysOf lists the endpoints of resp's assignment as "ip:port", checking
// that each is HEALTHY.
func keysOf(t *testing.T, resp *discoveryv3.DiscoveryResponse) []string {
	t.Helper()
	var out []string
	for _, loc := range assignmentOf(t, resp).GetEndpoints() {
		for _, lbe := range loc.GetLbEndpoints() {
			if lbe.GetHealthStatus() != corev3.HealthStatus_HEALTHY {
				t.Errorf("endpoint %v is %v, want HEALTHY", lbe.GetEndpoint().GetAddress(), lbe.GetHealthStatus())
			}
			sa := lbe.GetEndpoint().GetAddress().GetSocketAddress()
			out = append(out, net.JoinHostPort(sa.GetAddress(), strconv.FormatUint(uint64(sa.GetPortValue()), 10)))
		}
	}
	return out
}

// eps makes endpoints from keys.
func eps(keys ...string) []routing.Endpoint {
	out := make([]routing.Endpoint, len(keys))
	for i, k := range keys {
		out[i] = routing.Endpoint{Key: routing.EndpointKey(k)}
	}
	return out
}

// eventually polls cond until it holds or 5 s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// ackedBy waits until the stream of node has ACKed version.
func ackedBy(t *testing.T, srv *eds.Server, node string, version uint64) {
	t.Helper()
	eventually(t, node+" acked version "+strconv.FormatUint(version, 10), func() bool {
		for _, st := range srv.Stats().Streams {
			if st.Node == node && st.AckedVersion == version {
				return true
			}
		}
		return false
	})
}

// pickable lists which of keys srv reports pickable.
func pickable(srv *eds.Server, keys ...string) []string {
	var out []string
	for _, k := range keys {
		if srv.Pickable(routing.EndpointKey(k)) {
			out = append(out, k)
		}
	}
	return out
}

func equal(a, b []string) bool { return slices.Equal(a, b) }
