package eds

import (
	"cmp"
	"errors"
	"io"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	edsv3 "github.com/envoyproxy/go-control-plane/envoy/service/endpoint/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

const (
	// DefaultCluster is the EDS service name kvbandit serves: the
	// eds_cluster_config.service_name of the worker cluster in envoy/eds.yaml.
	DefaultCluster = "kvbandit_workers"
	// DefaultAddr is where envoy/eds.yaml expects kvbandit's xDS server
	// (its kvbandit_xds cluster).
	DefaultAddr = "127.0.0.1:18000"
	// TypeURL is the xDS type this server serves.
	TypeURL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
)

// maxUnanswered bounds the responses a stream may leave unanswered before
// the oldest nonces are forgotten (Envoy answers every response; this only
// caps the memory a broken client can hold). A forgotten response still
// holds the gate back, through the stream's floor.
const maxUnanswered = 16

// Config configures a [Server].
type Config struct {
	// Cluster is the EDS service name (the ClusterLoadAssignment's
	// cluster_name); empty means [DefaultCluster].
	Cluster string
	// AckTimeout bounds how long a stream may leave a response unanswered
	// (neither ACK nor NACK): past it the stream is closed
	// (DEADLINE_EXCEEDED; Envoy reconnects and is sent the current
	// version), so that a client that never answers cannot hold new
	// endpoints back for ever. Envoy answers within milliseconds. 0 means
	// [DefaultAckTimeout].
	AckTimeout time.Duration
	// MaxStreams bounds the open streams (RESOURCE_EXHAUSTED beyond); 0
	// means [DefaultMaxStreams].
	MaxStreams int
}

// Defaults of [Config].
const (
	DefaultAckTimeout = 30 * time.Second
	DefaultMaxStreams = 256
)

// Deps are the server's collaborators.
type Deps struct {
	// Logger; nil discards.
	Logger *slog.Logger
	// OnChange, when set, is called when pickability may have changed (an
	// ACK of a new version, a stream that ended or unsubscribed): the hub's
	// Refresh. It is never called with the server's locks held, and is
	// called from stream goroutines, possibly concurrently.
	OnChange func()
	// Clock times the ACK deadline; nil is the real clock.
	Clock clock.Clock
}

// Server is the EDS server and the [discovery.Gate]. Make one with [New].
type Server struct {
	cluster    string
	log        *slog.Logger
	onChange   func()
	clk        clock.Clock
	ackTimeout time.Duration
	maxStreams int

	// gate is what Pickable reads; replaced whole under mu.
	gate atomic.Pointer[gate]

	mu      sync.Mutex
	closed  bool
	done    chan struct{}
	current *assignment // nil before the first Offer
	version uint64
	nonce   uint64
	nextID  uint64
	streams map[uint64]*stream
	acks    uint64
	nacks   uint64
}

var _ discovery.Gate = (*Server)(nil)

// assignment is one version of the ClusterLoadAssignment; immutable.
type assignment struct {
	version  uint64
	addrs    []netip.AddrPort // sorted, unique
	keys     map[routing.EndpointKey]struct{}
	resource *anypb.Any
}

// gate is the set of keys that every counted stream has in every version
// it may hold; open when no stream counts (everything is pickable).
type gate struct {
	open bool
	keys map[routing.EndpointKey]struct{}
}

func (g *gate) equal(o *gate) bool {
	if g.open || o.open {
		return g.open == o.open
	}
	if len(g.keys) != len(o.keys) {
		return false
	}
	for k := range g.keys {
		if _, ok := o.keys[k]; !ok {
			return false
		}
	}
	return true
}

// stream is one connected xDS stream; its fields are guarded by Server.mu,
// except wake.
type stream struct {
	id   uint64
	api  string // "eds" or "ads"
	node string
	// wake (capacity 1) tells the stream goroutine a new version exists.
	wake chan struct{}
	// subscribed: the client asks for the cluster; explicit: it has named
	// resources (an empty list then unsubscribes instead of meaning
	// wildcard).
	subscribed, explicit bool
	// waiting is when the stream last had no unanswered response (or
	// last answered one): AckTimeout counts from it while sent or floor
	// is not empty.
	waiting time.Time
	// sent maps the nonces of responses not answered yet to what they
	// carried.
	sent map[uint64]*assignment
	// floor holds the keys common to the responses forgotten from sent
	// (maxUnanswered) while they are unanswered; nil when none is.
	floor    map[routing.EndpointKey]struct{}
	lastSent *assignment
	acked    *assignment
	acks     uint64
	nacks    uint64
	lastNACK string
}

// New makes a server. Nothing runs until [Server.Register] and the caller's
// gRPC server serve streams.
func New(cfg Config, deps Deps) *Server {
	if cfg.Cluster == "" {
		cfg.Cluster = DefaultCluster
	}
	if cfg.AckTimeout <= 0 {
		cfg.AckTimeout = DefaultAckTimeout
	}
	if cfg.MaxStreams <= 0 {
		cfg.MaxStreams = DefaultMaxStreams
	}
	if deps.Logger == nil {
		deps.Logger = slog.New(slog.DiscardHandler)
	}
	if deps.OnChange == nil {
		deps.OnChange = func() {}
	}
	s := &Server{cluster: cfg.Cluster, log: deps.Logger, onChange: deps.OnChange, clk: clock.Or(deps.Clock),
		ackTimeout: cfg.AckTimeout, maxStreams: cfg.MaxStreams,
		done: make(chan struct{}), streams: map[uint64]*stream{}}
	s.gate.Store(&gate{open: true})
	return s
}

// Register adds the EDS and ADS services to g, which the caller owns and
// serves.
func (s *Server) Register(g *grpc.Server) {
	edsv3.RegisterEndpointDiscoveryServiceServer(g, edsService{s: s})
	discoveryv3.RegisterAggregatedDiscoveryServiceServer(g, adsService{s: s})
}

// Close ends every stream with code Unavailable and refuses new ones, so
// that the caller's grpc.Server.GracefulStop does not wait for Envoy to
// hang up. Offer and Pickable keep working. Close is idempotent.
func (s *Server) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.closed = true
		close(s.done)
	}
}

// Offer implements [discovery.Gate]. It builds the assignment of desired ∪
// lingering (every endpoint HEALTHY), and when the addresses differ from
// the current version's, makes it the next version and wakes every stream
// to send it. It never blocks on a stream and never calls OnChange: it may
// only narrow pickability (a key the new version lacks), which grows on
// ACKs only.
func (s *Server) Offer(desired, lingering []routing.Endpoint) {
	addrs := make([]netip.AddrPort, 0, len(desired)+len(lingering))
	for _, list := range [][]routing.Endpoint{desired, lingering} {
		for i := range list {
			ap, err := routing.ParseAddrPort(string(list[i].Key))
			if err != nil {
				s.log.Error("eds: endpoint left out of the assignment", "endpoint", list[i].Key, "err", err)
				continue
			}
			addrs = append(addrs, ap)
		}
	}
	slices.SortFunc(addrs, netip.AddrPort.Compare)
	addrs = slices.Compact(addrs)

	s.mu.Lock()
	defer s.mu.Unlock()
	if s.current != nil && slices.Equal(s.current.addrs, addrs) {
		return
	}
	a, err := s.build(s.version+1, addrs)
	if err != nil {
		// Cannot happen for validated endpoints; keep the last good version.
		s.log.Error("eds: assignment refused, keeping the previous version", "err", err)
		return
	}
	s.version, s.current = a.version, a
	s.narrowLocked()
	for _, st := range s.streams {
		select {
		case st.wake <- struct{}{}:
		default:
		}
	}
	s.log.Debug("eds: new version", "version", a.version, "endpoints", len(addrs), "lingering", len(lingering))
}

// build makes and validates the assignment of addrs.
func (s *Server) build(version uint64, addrs []netip.AddrPort) (*assignment, error) {
	a := &assignment{version: version, addrs: addrs, keys: make(map[routing.EndpointKey]struct{}, len(addrs))}
	cla := &endpointv3.ClusterLoadAssignment{ClusterName: s.cluster}
	if len(addrs) > 0 {
		lbs := make([]*endpointv3.LbEndpoint, 0, len(addrs))
		for _, ap := range addrs {
			a.keys[routing.EndpointKey(ap.String())] = struct{}{}
			lbs = append(lbs, &endpointv3.LbEndpoint{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{
					Address: &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
						Protocol:      corev3.SocketAddress_TCP,
						Address:       ap.Addr().String(),
						PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: uint32(ap.Port())},
					}}},
				}},
				// Lingering endpoints too: override_host must still reach them.
				HealthStatus: corev3.HealthStatus_HEALTHY,
			})
		}
		cla.Endpoints = []*endpointv3.LocalityLbEndpoints{{LbEndpoints: lbs}}
	}
	if err := cla.ValidateAll(); err != nil {
		return nil, err
	}
	res, err := anypb.New(cla)
	if err != nil {
		return nil, err
	}
	a.resource = res
	return a, nil
}

// Pickable implements [discovery.Gate]: true while no stream counts (none
// has been sent an assignment); otherwise true when key is in every version
// a counted stream may hold now or next: the one it ACKed, every one sent
// to it that it has not answered yet (Envoy applies a version before it
// ACKs it), and the current one, which it will be sent. It is lock-free.
func (s *Server) Pickable(key routing.EndpointKey) bool {
	g := s.gate.Load()
	if g.open {
		return true
	}
	_, ok := g.keys[key]
	return ok
}

// counts reports whether the stream holds the gate back: it uses the
// cluster and has been sent an assignment, so Envoy may route with it. A
// stream that was never sent one (or NACKed every one) holds nothing.
func (st *stream) counts() bool {
	return st.subscribed && (st.acked != nil || len(st.sent) > 0 || st.floor != nil)
}

// computeLocked builds the gate: the keys in every version each counted
// stream may hold. s.mu must be held.
func (s *Server) computeLocked() *gate {
	var sets []map[routing.EndpointKey]struct{}
	var seen []*assignment
	add := func(a *assignment) {
		if a != nil && !slices.Contains(seen, a) {
			seen = append(seen, a)
			sets = append(sets, a.keys)
		}
	}
	counted := false
	for _, st := range s.streams {
		if !st.counts() {
			continue
		}
		counted = true
		add(st.acked)
		for _, a := range st.sent {
			add(a)
		}
		if st.floor != nil {
			sets = append(sets, st.floor)
		}
	}
	if !counted {
		return &gate{open: true}
	}
	// A counted stream is sent the current version when it has not been.
	add(s.current)
	return &gate{keys: intersect(sets)}
}

// intersect returns the keys present in every set (none for no set).
func intersect(sets []map[routing.EndpointKey]struct{}) map[routing.EndpointKey]struct{} {
	if len(sets) == 0 {
		return map[routing.EndpointKey]struct{}{}
	}
	slices.SortFunc(sets, func(x, y map[routing.EndpointKey]struct{}) int { return cmp.Compare(len(x), len(y)) })
	out := make(map[routing.EndpointKey]struct{}, len(sets[0]))
next:
	for k := range sets[0] {
		for _, o := range sets[1:] {
			if _, ok := o[k]; !ok {
				continue next
			}
		}
		out[k] = struct{}{}
	}
	return out
}

// recomputeLocked rebuilds the gate from the streams' versions and reports
// whether it changed. s.mu must be held.
func (s *Server) recomputeLocked() bool {
	g := s.computeLocked()
	if s.gate.Load().equal(g) {
		return false
	}
	s.gate.Store(g)
	return true
}

// narrowLocked applies a new current version to the gate without widening
// it: nobody is told when Offer changes the gate (it runs under the hub's
// lock), so a key may only become pickable again on the ACK that calls
// OnChange. Narrowing never takes a key from the engine: the hub removes
// an endpoint from the engine before it offers a version without it.
// s.mu must be held.
func (s *Server) narrowLocked() {
	old, g := s.gate.Load(), s.computeLocked()
	if !old.open && !g.open {
		g.keys = intersect([]map[routing.EndpointKey]struct{}{old.keys, g.keys})
	}
	if !old.equal(g) {
		s.gate.Store(g)
	}
}

// open registers a new stream.
func (s *Server) open(api string) (*stream, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, status.Error(codes.Unavailable, "kvbandit EDS server is shutting down")
	}
	if len(s.streams) >= s.maxStreams {
		return nil, status.Errorf(codes.ResourceExhausted, "kvbandit EDS server: %d streams open already", len(s.streams))
	}
	s.nextID++
	st := &stream{id: s.nextID, api: api, wake: make(chan struct{}, 1), sent: map[uint64]*assignment{}}
	s.streams[st.id] = st
	return st, nil
}

// end removes a stream and recalculates the gate.
func (s *Server) end(st *stream, err error) {
	s.mu.Lock()
	delete(s.streams, st.id)
	changed := s.recomputeLocked()
	s.mu.Unlock()
	s.log.Info("eds: stream closed", "stream", st.id, "api", st.api, "node", st.node, "err", err)
	if changed {
		s.onChange()
	}
}

// serve runs one SotW stream until it ends.
func (s *Server) serve(ss grpc.BidiStreamingServer[discoveryv3.DiscoveryRequest, discoveryv3.DiscoveryResponse], api string) (err error) {
	st, err := s.open(api)
	if err != nil {
		return err
	}
	defer func() { s.end(st, err) }()
	ctx := ss.Context()
	// check ticks every quarter of the ACK timeout, to close a stream that
	// leaves a response unanswered for longer.
	check := make(chan struct{}, 1)
	var timer clock.Timer
	arm := func() {
		timer = s.clk.AfterFunc(s.ackTimeout/4, func() {
			select {
			case check <- struct{}{}:
			default:
			}
		})
	}
	arm()
	defer func() { timer.Stop() }()
	reqs := make(chan *discoveryv3.DiscoveryRequest)
	recvErr := make(chan error, 1)
	go func() {
		for {
			req, err := ss.Recv()
			if err != nil {
				recvErr <- err
				return
			}
			select {
			case reqs <- req:
			case <-ctx.Done():
				return
			}
		}
	}()
	for {
		var resp *discoveryv3.DiscoveryResponse
		select {
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-s.done:
			return status.Error(codes.Unavailable, "kvbandit EDS server is shutting down")
		case err := <-recvErr:
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		case req := <-reqs:
			if resp, err = s.handle(st, req); err != nil {
				return err
			}
		case <-check:
			if s.overdue(st) {
				return status.Errorf(codes.DeadlineExceeded, "kvbandit EDS server: no ACK or NACK within %v", s.ackTimeout)
			}
			arm()
		case <-st.wake:
			var changed bool
			if resp, changed = s.pending(st); changed {
				s.onChange()
			}
		}
		if resp != nil {
			if err := ss.Send(resp); err != nil {
				return err
			}
		}
	}
}

// handle processes one request: ACK or NACK, subscription, and the
// response to send, if any.
func (s *Server) handle(st *stream, req *discoveryv3.DiscoveryRequest) (*discoveryv3.DiscoveryResponse, error) {
	if t := req.GetTypeUrl(); t != "" && t != TypeURL {
		if st.api == "eds" {
			return nil, status.Errorf(codes.InvalidArgument, "EDS stream: type %q, want %s", t, TypeURL)
		}
		s.log.Debug("eds: ADS request for a type this server does not serve", "stream", st.id, "type", t)
		return nil, nil
	}
	s.mu.Lock()
	if st.node == "" && req.GetNode().GetId() != "" {
		st.node = req.GetNode().GetId()
		s.log.Info("eds: stream opened", "stream", st.id, "api", st.api, "node", st.node)
	}
	changed := false
	var nack *nackInfo
	if n := req.GetResponseNonce(); n != "" {
		seq, err := strconv.ParseUint(n, 10, 64)
		if a, ok := st.sent[seq]; err == nil && ok {
			for k := range st.sent {
				if k <= seq {
					delete(st.sent, k)
				}
			}
			// Envoy answers in order: the forgotten responses, older than
			// any remembered one, are answered too.
			st.floor = nil
			st.waiting = s.clk.Now()
			changed = true // the answered versions leave the gate
			if d := req.GetErrorDetail(); d != nil {
				st.nacks++
				s.nacks++
				st.lastNACK = d.GetMessage()
				nack = &nackInfo{version: a.version, acked: versionOf(st.acked), msg: d.GetMessage()}
			} else {
				st.acks++
				s.acks++
				st.acked = a
			}
		}
	}
	wasSubscribed := st.subscribed
	if names := req.GetResourceNames(); len(names) == 0 {
		st.subscribed = !st.explicit
	} else {
		st.explicit = true
		st.subscribed = slices.Contains(names, s.cluster) || slices.Contains(names, "*")
	}
	if wasSubscribed && !st.subscribed {
		// It no longer uses the cluster: it leaves the calculation.
		st.lastSent, st.acked, st.sent, st.floor = nil, nil, map[uint64]*assignment{}, nil
		changed = true
	}
	var resp *discoveryv3.DiscoveryResponse
	if st.subscribed && s.current != nil && (st.lastSent != s.current || req.GetResponseNonce() == "") {
		resp = s.responseLocked(st)
		changed = true
	}
	if changed {
		changed = s.recomputeLocked()
	}
	node, id := st.node, st.id
	s.mu.Unlock()

	if nack != nil {
		s.log.Warn("eds: data plane rejected a version (NACK)", "stream", id, "node", node,
			"version", nack.version, "kept_version", nack.acked, "err", nack.msg)
	}
	if changed {
		s.onChange()
	}
	return resp, nil
}

type nackInfo struct {
	version, acked uint64
	msg            string
}

// overdue reports whether the stream has left a response unanswered for
// longer than the ACK timeout.
func (s *Server) overdue(st *stream) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return (len(st.sent) > 0 || st.floor != nil) && s.clk.Now().Sub(st.waiting) > s.ackTimeout
}

// pending returns the response a woken stream owes, if any, and whether
// sending it changed the gate (a stream's first response makes it count).
func (s *Server) pending(st *stream) (*discoveryv3.DiscoveryResponse, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !st.subscribed || s.current == nil || st.lastSent == s.current {
		return nil, false
	}
	resp := s.responseLocked(st)
	return resp, s.recomputeLocked()
}

// responseLocked makes the response carrying the current version and
// remembers its nonce; the caller recomputes the gate. s.mu must be held.
func (s *Server) responseLocked(st *stream) *discoveryv3.DiscoveryResponse {
	if len(st.sent) == 0 && st.floor == nil {
		st.waiting = s.clk.Now()
	}
	s.nonce++
	if len(st.sent) >= maxUnanswered {
		oldest := slices.Min(slices.Collect(maps.Keys(st.sent)))
		if st.floor == nil {
			st.floor = maps.Clone(st.sent[oldest].keys)
		} else {
			st.floor = intersect([]map[routing.EndpointKey]struct{}{st.floor, st.sent[oldest].keys})
		}
		delete(st.sent, oldest)
	}
	st.sent[s.nonce] = s.current
	st.lastSent = s.current
	return &discoveryv3.DiscoveryResponse{
		VersionInfo: strconv.FormatUint(s.current.version, 10),
		Resources:   []*anypb.Any{s.current.resource},
		TypeUrl:     TypeURL,
		Nonce:       strconv.FormatUint(s.nonce, 10),
	}
}

func versionOf(a *assignment) uint64 {
	if a == nil {
		return 0
	}
	return a.version
}

// Stats are the server's state and counters.
type Stats struct {
	// Version is the current assignment's version (0 before the first
	// Offer); Endpoints its number of endpoints.
	Version   uint64
	Endpoints int
	// Gating is true when some stream has ACKed, so that Pickable filters.
	Gating bool
	// ACKs and NACKs count, over every stream so far.
	ACKs, NACKs uint64
	// Streams are the connected streams, by ID.
	Streams []StreamStats
}

// StreamStats describe one connected stream.
type StreamStats struct {
	ID uint64
	// API is "eds" or "ads"; Node the node id Envoy sent.
	API, Node string
	// Subscribed: the stream asks for the cluster.
	Subscribed bool
	// SentVersion and AckedVersion are the last versions sent and ACKed (0:
	// none).
	SentVersion, AckedVersion uint64
	ACKs, NACKs               uint64
	// LastNACK is the error_detail message of the last NACK.
	LastNACK string
}

// Stats returns a copy of the server's state.
func (s *Server) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := Stats{Version: s.version, ACKs: s.acks, NACKs: s.nacks, Gating: !s.gate.Load().open}
	if s.current != nil {
		out.Endpoints = len(s.current.addrs)
	}
	for _, st := range s.streams {
		out.Streams = append(out.Streams, StreamStats{ID: st.id, API: st.api, Node: st.node, Subscribed: st.subscribed,
			SentVersion: versionOf(st.lastSent), AckedVersion: versionOf(st.acked),
			ACKs: st.acks, NACKs: st.nacks, LastNACK: st.lastNACK})
	}
	slices.SortFunc(out.Streams, func(a, b StreamStats) int { return cmp.Compare(a.ID, b.ID) })
	return out
}

// edsService serves envoy.service.endpoint.v3.EndpointDiscoveryService.
type edsService struct {
	edsv3.UnimplementedEndpointDiscoveryServiceServer
	s *Server
}

// StreamEndpoints implements [edsv3.EndpointDiscoveryServiceServer].
func (e edsService) StreamEndpoints(ss grpc.BidiStreamingServer[discoveryv3.DiscoveryRequest, discoveryv3.DiscoveryResponse]) error {
	return e.s.serve(ss, "eds")
}

// adsService serves envoy.service.discovery.v3.AggregatedDiscoveryService,
// for ClusterLoadAssignment only.
type adsService struct {
	discoveryv3.UnimplementedAggregatedDiscoveryServiceServer
	s *Server
}

// StreamAggregatedResources implements [discoveryv3.AggregatedDiscoveryServiceServer].
func (a adsService) StreamAggregatedResources(ss grpc.BidiStreamingServer[discoveryv3.DiscoveryRequest, discoveryv3.DiscoveryResponse]) error {
	return a.s.serve(ss, "ads")
}
