package eds_test

import (
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	edsv3 "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/kvbandit/kvbandit/routing/discovery/eds"
)

const (
	a = "10.0.0.1:8000"
	b = "10.0.0.2:8000"
	c = "[2001:db8::3]:8000"
	d = "10.0.0.4:8000"
)

var all = []string{a, b, c, d}

func TestTypeURLIsClusterLoadAssignment(t *testing.T) {
	res, err := anypb.New(&endpointv3.ClusterLoadAssignment{})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetTypeUrl() != eds.TypeURL {
		t.Errorf("TypeURL = %q, want %q", eds.TypeURL, res.GetTypeUrl())
	}
}

func TestNoClientEverythingPickable(t *testing.T) {
	srv := eds.New(eds.Config{}, eds.Deps{})
	if got := pickable(srv, all...); !equal(got, all) {
		t.Errorf("before any Offer: pickable %v, want all", got)
	}
	srv.Offer(eps(a), nil)
	if got := pickable(srv, all...); !equal(got, all) {
		t.Errorf("after Offer, nobody connected: pickable %v, want all", got)
	}
	if st := srv.Stats(); st.Gating || st.Version != 1 || st.Endpoints != 1 || len(st.Streams) != 0 {
		t.Errorf("Stats = %+v", st)
	}
}

func TestFirstResponseCarriesOfferedEndpoints(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(c, b, a), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	resp := cl.recv()
	if resp.GetVersionInfo() != "1" || resp.GetNonce() == "" {
		t.Errorf("version %q nonce %q, want version 1 and a nonce", resp.GetVersionInfo(), resp.GetNonce())
	}
	if got := assignmentOf(t, resp).GetClusterName(); got != eds.DefaultCluster {
		t.Errorf("cluster_name %q, want %q", got, eds.DefaultCluster)
	}
	if got, want := keysOf(t, resp), []string{a, b, c}; !equal(got, want) {
		t.Errorf("endpoints %v, want %v (sorted by address)", got, want)
	}
	// Sent, not ACKed yet: Envoy may already route with it (it applies a
	// version before it ACKs it), so what it lacks is held back.
	if got := pickable(f.srv, all...); !equal(got, []string{a, b, c}) {
		t.Errorf("before the first ACK: pickable %v, want [%s %s %s]", got, a, b, c)
	}
}

func TestFirstResponseWaitsForTheFirstOffer(t *testing.T) {
	f := start(t, eds.Config{Cluster: "pool"}, nil)
	cl := f.connect(t, "envoy-1", false, "pool")
	eventually(t, "the stream is subscribed", func() bool {
		s := f.srv.Stats().Streams
		return len(s) == 1 && s[0].Subscribed
	})
	f.srv.Offer(eps(a), nil)
	resp := cl.recv()
	if got := keysOf(t, resp); !equal(got, []string{a}) || assignmentOf(t, resp).GetClusterName() != "pool" {
		t.Errorf("got %v for %q, want [%s] for pool", got, assignmentOf(t, resp).GetClusterName(), a)
	}
}

func TestACKMakesEndpointsPickable(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)
	if got := pickable(f.srv, all...); !equal(got, []string{a, b}) {
		t.Errorf("pickable %v, want [%s %s]", got, a, b)
	}
	if f.changes.Load() == 0 {
		t.Error("OnChange not called after the first ACK")
	}
	st := f.srv.Stats()
	if !st.Gating || st.ACKs != 1 || len(st.Streams) != 1 || st.Streams[0].SentVersion != 1 || st.Streams[0].API != "eds" {
		t.Errorf("Stats = %+v", st)
	}
}

func TestNewEndpointUnpickableUntilACK(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)
	before := f.changes.Load()

	f.srv.Offer(eps(a, b, c), nil)
	if f.changes.Load() != before {
		t.Error("Offer called OnChange; pickability follows ACKs only")
	}
	resp := cl.recv()
	if resp.GetVersionInfo() != "2" || !equal(keysOf(t, resp), []string{a, b, c}) {
		t.Fatalf("got version %q %v, want version 2 with %s", resp.GetVersionInfo(), keysOf(t, resp), c)
	}
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b}) {
		t.Errorf("before the ACK of version 2: pickable %v, want [%s %s]", got, a, b)
	}
	cl.ack(resp)
	ackedBy(t, f.srv, "envoy-1", 2)
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b, c}) {
		t.Errorf("after the ACK: pickable %v, want all three", got)
	}
	if f.changes.Load() == before {
		t.Error("OnChange not called after the ACK of version 2")
	}
}

func TestVersionChangesOnlyWithContent(t *testing.T) {
	srv := eds.New(eds.Config{}, eds.Deps{})
	srv.Offer(eps(a, b), nil)
	srv.Offer(eps(b, a), nil)
	srv.Offer(eps(a), eps(b)) // b lingers: same addresses
	if v := srv.Stats().Version; v != 1 {
		t.Errorf("version %d after offers of the same addresses, want 1", v)
	}
	srv.Offer(eps(a), nil)
	srv.Offer(nil, nil)
	if st := srv.Stats(); st.Version != 3 || st.Endpoints != 0 {
		t.Errorf("Stats = %+v, want version 3 with 0 endpoints", st)
	}
}

func TestNACKKeepsThePreviousVersion(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)

	f.srv.Offer(eps(a, b, c), nil)
	v2 := cl.recv()
	cl.nack(v2, "1")
	eventually(t, "the NACK is counted", func() bool { return f.srv.Stats().NACKs == 1 })
	st := f.srv.Stats()
	if s := st.Streams[0]; s.AckedVersion != 1 || s.NACKs != 1 || s.LastNACK != "test rejects this version" {
		t.Errorf("stream after NACK: %+v", s)
	}
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b}) {
		t.Errorf("after the NACK: pickable %v, want [%s %s]", got, a, b)
	}

	// The rejected version is not sent again; the next one is.
	f.srv.Offer(eps(a, b, c, d), nil)
	v3 := cl.recv()
	if v3.GetVersionInfo() != "3" {
		t.Fatalf("after a NACK got version %q, want 3 (version 2 must not be resent)", v3.GetVersionInfo())
	}
	cl.ack(v3)
	ackedBy(t, f.srv, "envoy-1", 3)
	if got := pickable(f.srv, all...); !equal(got, all) {
		t.Errorf("after the ACK of version 3: pickable %v, want all", got)
	}
}

func TestUnknownNonceIsIgnored(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	resp := cl.recv()
	cl.send(&discoveryv3.DiscoveryRequest{VersionInfo: "1", ResponseNonce: "999"})
	cl.send(&discoveryv3.DiscoveryRequest{VersionInfo: "1", ResponseNonce: "not a number"})
	cl.ack(resp)
	ackedBy(t, f.srv, "envoy-1", 1)
	if st := f.srv.Stats(); st.ACKs != 1 || st.NACKs != 0 {
		t.Errorf("ACKs %d NACKs %d, want 1 and 0", st.ACKs, st.NACKs)
	}
}

func TestTwoClientsEveryACKingStreamCounts(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	one := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	two := f.connect(t, "envoy-2", true, eds.DefaultCluster) // over ADS
	one.ack(one.recv())
	two.ack(two.recv())
	ackedBy(t, f.srv, "envoy-1", 1)
	ackedBy(t, f.srv, "envoy-2", 1)

	f.srv.Offer(eps(a, b, c), nil)
	one.ack(one.recv())
	v2 := two.recv() // received, not ACKed yet
	ackedBy(t, f.srv, "envoy-1", 2)
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b}) {
		t.Errorf("one stream ACKed version 2, the other not yet: pickable %v, want [%s %s]", got, a, b)
	}
	two.ack(v2)
	ackedBy(t, f.srv, "envoy-2", 2)
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b, c}) {
		t.Errorf("both ACKed: pickable %v, want all three", got)
	}
}

func TestWarmingClientDoesNotCount(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	one := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	one.ack(one.recv())
	ackedBy(t, f.srv, "envoy-1", 1)
	f.srv.Offer(eps(a, b, c), nil)
	one.ack(one.recv())
	ackedBy(t, f.srv, "envoy-1", 2)

	// A new Envoy that has not ACKed anything is still warming.
	late := f.connect(t, "envoy-late", false, eds.DefaultCluster)
	if resp := late.recv(); resp.GetVersionInfo() != "2" {
		t.Errorf("late client got version %q, want 2", resp.GetVersionInfo())
	}
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b, c}) {
		t.Errorf("pickable %v, want all three", got)
	}
}

func TestDisconnectRecalculates(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	one := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	two := f.connect(t, "envoy-2", false, eds.DefaultCluster)
	one.ack(one.recv())
	two.ack(two.recv())
	ackedBy(t, f.srv, "envoy-1", 1)
	ackedBy(t, f.srv, "envoy-2", 1)
	f.srv.Offer(eps(a, b, c), nil)
	one.ack(one.recv())
	ackedBy(t, f.srv, "envoy-1", 2)
	if got := pickable(f.srv, c); len(got) != 0 {
		t.Fatalf("envoy-2 has not ACKed version 2, yet %s is pickable", c)
	}

	before := f.changes.Load()
	two.close()
	eventually(t, "envoy-2 leaves the calculation", func() bool { return len(f.srv.Stats().Streams) == 1 })
	if got := pickable(f.srv, a, b, c, d); !equal(got, []string{a, b, c}) {
		t.Errorf("after envoy-2 left: pickable %v, want [%s %s %s]", got, a, b, c)
	}
	if f.changes.Load() == before {
		t.Error("OnChange not called when the lagging stream closed")
	}

	before = f.changes.Load()
	one.close()
	eventually(t, "no stream left", func() bool { return len(f.srv.Stats().Streams) == 0 })
	if got := pickable(f.srv, all...); !equal(got, all) {
		t.Errorf("no stream left: pickable %v, want all", got)
	}
	if f.changes.Load() == before {
		t.Error("OnChange not called when the last stream closed")
	}
}

func TestLingeringEndpointsStayInTheAssignment(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)

	// b left the desired set with decisions in flight: it stays, HEALTHY.
	f.srv.Offer(eps(a, c), eps(b))
	resp := cl.recv()
	if got, want := keysOf(t, resp), []string{a, b, c}; !equal(got, want) {
		t.Errorf("assignment %v, want %v", got, want)
	}
	cl.ack(resp)
	ackedBy(t, f.srv, "envoy-1", 2)
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b, c}) {
		t.Errorf("pickable %v, want all three (the hub only asks about desired ones)", got)
	}

	// Its decisions ended: it leaves the assignment.
	f.srv.Offer(eps(a, c), nil)
	if got := keysOf(t, cl.recv()); !equal(got, []string{a, c}) {
		t.Errorf("assignment %v, want [%s %s]", got, a, c)
	}
}

func TestResourceNames(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a), nil)

	// Another cluster's name: nothing is sent, the stream never counts.
	other := f.connect(t, "envoy-other", false, "someone_else")
	eventually(t, "the request is seen", func() bool {
		s := f.srv.Stats().Streams
		return len(s) == 1 && s[0].Node == "envoy-other"
	})
	if s := f.srv.Stats().Streams[0]; s.Subscribed || s.SentVersion != 0 {
		t.Errorf("stream for another cluster: %+v", s)
	}
	// Adding ours subscribes it.
	other.send(&discoveryv3.DiscoveryRequest{ResourceNames: []string{"someone_else", eds.DefaultCluster}})
	if got := keysOf(t, other.recv()); !equal(got, []string{a}) {
		t.Errorf("got %v", got)
	}
	other.close()
	eventually(t, "envoy-other is gone", func() bool { return len(f.srv.Stats().Streams) == 0 })

	// Wildcard: no names on the first request.
	wild := f.connect(t, "envoy-wild", false)
	resp := wild.recv()
	wild.ack(resp)
	ackedBy(t, f.srv, "envoy-wild", 1)
	if !f.srv.Stats().Gating {
		t.Fatal("the wildcard stream's ACK does not count")
	}
	// An empty list after explicit names unsubscribes and leaves the calculation.
	wild.send(&discoveryv3.DiscoveryRequest{ResourceNames: []string{"*"}, ResponseNonce: resp.GetNonce(), VersionInfo: "1"})
	wild.send(&discoveryv3.DiscoveryRequest{ResourceNames: []string{}, VersionInfo: "1", ResponseNonce: resp.GetNonce()})
	eventually(t, "the empty list unsubscribes", func() bool { return !f.srv.Stats().Gating })
}

func TestADSIgnoresOtherTypes(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a), nil)
	cl := f.connect(t, "envoy-ads", true, eds.DefaultCluster)
	resp := cl.recv()
	cl.send(&discoveryv3.DiscoveryRequest{TypeUrl: "type.googleapis.com/envoy.config.cluster.v3.Cluster", ResourceNames: []string{}})
	cl.ack(resp)
	ackedBy(t, f.srv, "envoy-ads", 1)
	if s := f.srv.Stats().Streams[0]; s.API != "ads" || !s.Subscribed {
		t.Errorf("ADS stream: %+v", s)
	}
}

func TestEDSStreamRefusesOtherTypes(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.send(&discoveryv3.DiscoveryRequest{TypeUrl: "type.googleapis.com/envoy.config.cluster.v3.Cluster"})
	_, err := cl.stream.Recv()
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("Recv = %v, want InvalidArgument", err)
	}
}

func TestCloseEndsStreams(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)
	f.srv.Close()
	f.srv.Close()
	if _, err := cl.stream.Recv(); status.Code(err) != codes.Unavailable {
		t.Errorf("Recv after Close = %v, want Unavailable", err)
	}
	// A new stream is refused; the client's first Send may already see it.
	again, err := edsv3.NewEndpointDiscoveryServiceClient(f.conn).StreamEndpoints(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	_ = again.Send(&discoveryv3.DiscoveryRequest{TypeUrl: eds.TypeURL})
	if _, err := again.Recv(); status.Code(err) != codes.Unavailable {
		t.Errorf("new stream after Close: %v, want Unavailable", err)
	}
	eventually(t, "every stream is gone", func() bool { return len(f.srv.Stats().Streams) == 0 })
	if got := pickable(f.srv, all...); !equal(got, all) {
		t.Errorf("after Close: pickable %v, want all", got)
	}
}

func TestClientHangsUp(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.recv()
	if err := cl.stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.stream.Recv(); !errors.Is(err, io.EOF) {
		t.Errorf("Recv after CloseSend = %v, want EOF (server ends the stream with OK)", err)
	}
}

// TestConcurrentUse runs offers, picks and ACKing clients at once (for -race).
func TestConcurrentUse(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a), nil)
	var wg sync.WaitGroup
	for i := range 3 {
		cl := f.connect(t, "envoy-"+string(rune('a'+i)), i%2 == 1, eds.DefaultCluster)
		wg.Go(func() {
			for {
				resp, err := cl.stream.Recv()
				if err != nil {
					return
				}
				if cl.stream.Send(&discoveryv3.DiscoveryRequest{TypeUrl: eds.TypeURL, ResourceNames: cl.names,
					VersionInfo: resp.GetVersionInfo(), ResponseNonce: resp.GetNonce()}) != nil {
					return
				}
			}
		})
	}
	sets := [][]string{{a}, {a, b}, {a, b, c}, {b, c, d}, all}
	wg.Go(func() {
		for i := range 200 {
			f.srv.Offer(eps(sets[i%len(sets)]...), eps(sets[(i+1)%len(sets)]...))
		}
		f.srv.Offer(eps(all...), nil)
	})
	wg.Go(func() {
		for range 2000 {
			pickable(f.srv, all...)
			_ = f.srv.Stats()
		}
	})
	want := f.srv.Stats
	eventually(t, "every client ACKed the last version", func() bool {
		st := want()
		if st.Version == 0 || len(st.Streams) != 3 {
			return false
		}
		for _, s := range st.Streams {
			if s.AckedVersion != st.Version || st.Endpoints != len(all) {
				return false
			}
		}
		return true
	})
	if got := pickable(f.srv, all...); !equal(got, all) {
		t.Errorf("pickable %v, want all", got)
	}
	f.srv.Close()
	wg.Wait()
}

// TestSentVersionCountsBeforeItsACK: Envoy applies a version before it
// ACKs it, so a stream that was sent version 1 may already route with it
// while its ACK is on the way. An endpoint that version 1 lacks must not be
// pickable then (it was, while no ACK had arrived: the gate was open).
func TestSentVersionCountsBeforeItsACK(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	v1 := cl.recv() // applied by Envoy, ACK not sent yet
	f.srv.Offer(eps(a, b, c), nil)
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b}) {
		t.Errorf("version 1 sent, not ACKed yet: pickable %v, want [%s %s]", got, a, b)
	}
	cl.ack(v1)
	ackedBy(t, f.srv, "envoy-1", 1)
	v2 := cl.recv()
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b}) {
		t.Errorf("version 2 sent, not ACKed yet: pickable %v, want [%s %s]", got, a, b)
	}
	before := f.changes.Load()
	cl.ack(v2)
	ackedBy(t, f.srv, "envoy-1", 2)
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b, c}) {
		t.Errorf("after the ACK of version 2: pickable %v, want all three", got)
	}
	if f.changes.Load() == before {
		t.Error("OnChange not called after the ACK of version 2")
	}
}

// TestUnansweredVersionHoldsBackAReaddedEndpoint: b leaves (version 2) and
// comes back (version 3) while Envoy has ACKed only version 1 and has been
// sent version 2. Envoy will apply version 2, dropping b, before it sees
// version 3: b must not be pickable until version 3 is ACKed (it was, on
// the strength of version 1).
func TestUnansweredVersionHoldsBackAReaddedEndpoint(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)

	f.srv.Offer(eps(a), nil) // the hub has already dropped b from the engine
	if got := pickable(f.srv, a, b); !equal(got, []string{a}) {
		t.Errorf("version 2 without %s offered: pickable %v, want [%s]", b, got, a)
	}
	v2 := cl.recv()
	f.srv.Offer(eps(a, b), nil) // b is back before Envoy answered version 2
	if got := pickable(f.srv, a, b); !equal(got, []string{a}) {
		t.Errorf("version 3 offered, version 2 unanswered: pickable %v, want [%s]", got, a)
	}
	v3 := cl.recv()
	cl.ack(v2)
	ackedBy(t, f.srv, "envoy-1", 2)
	if got := pickable(f.srv, a, b); !equal(got, []string{a}) {
		t.Errorf("version 2 ACKed, version 3 not yet: pickable %v, want [%s]", got, a)
	}
	before := f.changes.Load()
	cl.ack(v3)
	ackedBy(t, f.srv, "envoy-1", 3)
	if got := pickable(f.srv, a, b); !equal(got, []string{a, b}) {
		t.Errorf("after the ACK of version 3: pickable %v, want [%s %s]", got, a, b)
	}
	if f.changes.Load() == before {
		t.Error("OnChange not called after the ACK of version 3")
	}
}

// TestUnansweredVersionReplacedBeforeSending: when version 3 replaces
// version 2 before the stream sent it, Envoy never sees version 2; b is
// pickable again once Envoy ACKs version 3.
func TestUnansweredVersionReplacedBeforeSending(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)
	f.srv.Offer(eps(a), nil)
	f.srv.Offer(eps(a, b), nil)
	for {
		resp := cl.recv()
		cl.ack(resp)
		if resp.GetVersionInfo() == "3" {
			break
		}
	}
	ackedBy(t, f.srv, "envoy-1", 3)
	if got := pickable(f.srv, a, b); !equal(got, []string{a, b}) {
		t.Errorf("after the ACK of version 3: pickable %v, want [%s %s]", got, a, b)
	}
}

// TestForgottenResponsesStillHoldBack: a client that leaves more than 16
// responses unanswered still holds back what the forgotten ones lack,
// until it answers.
func TestForgottenResponsesStillHoldBack(t *testing.T) {
	f := start(t, eds.Config{}, nil)
	f.srv.Offer(eps(a, b), nil)
	cl := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	cl.ack(cl.recv())
	ackedBy(t, f.srv, "envoy-1", 1)
	// Version 2 lacks b; then 20 more versions, each received, none answered.
	f.srv.Offer(eps(a), nil)
	cl.recv()
	var last *discoveryv3.DiscoveryResponse
	for i := range 20 {
		if i%2 == 0 {
			f.srv.Offer(eps(a, b, c), nil)
		} else {
			f.srv.Offer(eps(a, b), nil)
		}
		last = cl.recv()
	}
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a}) {
		t.Errorf("version 2 forgotten but unanswered: pickable %v, want [%s]", got, a)
	}
	cl.ack(last)
	eventually(t, "the last version is ACKed", func() bool { return len(pickable(f.srv, b)) == 1 })
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b}) {
		t.Errorf("after the ACK of the last version: pickable %v, want [%s %s]", got, a, b)
	}
}

// TestSilentClientIsClosedAfterAckTimeout: a client that subscribes and
// never answers a response would hold a new endpoint back for ever (the
// gate waits for every stream that may route with the version); past
// AckTimeout the stream is closed and the endpoint becomes pickable.
func TestSilentClientIsClosedAfterAckTimeout(t *testing.T) {
	f := start(t, eds.Config{AckTimeout: 400 * time.Millisecond}, nil)
	f.srv.Offer(eps(a, b), nil)
	good := f.connect(t, "envoy-1", false, eds.DefaultCluster)
	good.ack(good.recv())
	silent := f.connect(t, "hostile", false, eds.DefaultCluster)
	silent.recv() // and never answers
	f.srv.Offer(eps(a, b, c), nil)
	good.ack(good.recv())
	if got := pickable(f.srv, a, b, c); !equal(got, []string{a, b}) {
		t.Fatalf("with a silent stream holding version 1: pickable %v, want [%s %s]", got, a, b)
	}
	var err error
	for err == nil { // it is sent version 2 too, and answers nothing
		_, err = silent.stream.Recv()
	}
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("silent stream ended with %v, want DeadlineExceeded", err)
	}
	eventually(t, "c pickable after the silent stream was closed", func() bool { return equal(pickable(f.srv, a, b, c), []string{a, b, c}) })
	// The answering client is not affected.
	f.srv.Offer(eps(a, c), nil)
	good.ack(good.recv())
	ackedBy(t, f.srv, "envoy-1", 3)
}

// TestMaxStreams: streams over MaxStreams are refused.
func TestMaxStreams(t *testing.T) {
	f := start(t, eds.Config{MaxStreams: 2}, nil)
	f.srv.Offer(eps(a), nil)
	for i := range 2 {
		cl := f.connect(t, fmt.Sprintf("envoy-%d", i), false, eds.DefaultCluster)
		cl.ack(cl.recv())
	}
	third := f.connect(t, "envoy-3", false, eds.DefaultCluster)
	if _, err := third.stream.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("third stream: %v, want ResourceExhausted", err)
	}
}
