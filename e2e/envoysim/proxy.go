package envoysim

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"
)

// BodyMode is the ext_proc body send mode of one direction. The zero value
// is FULL_DUPLEX_STREAMED, the mode the shipped Envoy configuration uses.
type BodyMode int

// Body modes.
const (
	FullDuplexStreamed BodyMode = iota
	Buffered
	None
)

func (m BodyMode) String() string { return m.envoy().String() }

func (m BodyMode) envoy() filterv3.ProcessingMode_BodySendMode {
	switch m {
	case Buffered:
		return filterv3.ProcessingMode_BUFFERED
	case None:
		return filterv3.ProcessingMode_NONE
	}
	return filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// Config describes the Envoy listener, ext_proc filter and cluster the proxy
// imitates.
type Config struct {
	// ExtProcAddr is the ext_proc server's gRPC address (plaintext).
	ExtProcAddr string

	// RequestBodyMode is FullDuplexStreamed (default), Buffered or None.
	RequestBodyMode BodyMode
	// ResponseBodyMode is FullDuplexStreamed (default) or None; None turns
	// response processing off altogether (response headers and trailers
	// SKIP), so Envoy closes the stream once the request phase is done.
	ResponseBodyMode BodyMode

	// Hosts are the cluster's endpoints, "ip:port".
	Hosts []string

	// ForwardingNamespaces are the metadata_options forwarding namespaces
	// (untyped); nil means envoy.lb and envoy.lb.subset_hint, as shipped.
	ForwardingNamespaces []string
	// ReceivingNamespaces are the receiving namespaces; nil means envoy.lb.
	ReceivingNamespaces []string

	// SubsetHint, when set, is put in the request's dynamic metadata at
	// envoy.lb.subset_hint / x-gateway-destination-endpoint-subset (see
	// [SubsetList] and [SubsetString]).
	SubsetHint *structpb.Value
	// RequestMetadata, when set, returns dynamic metadata for a request, as
	// filters before ext_proc would set it (merged over SubsetHint).
	RequestMetadata func(*http.Request) map[string]*structpb.Struct

	// StripRequestHeaders are removed from the client's request before the
	// ext_proc filter sees it (a header_mutation filter in front of it, as
	// envoy/sidecar.yaml has for the x-gateway-destination-endpoint*
	// family). Default none, so tests see what kvbandit itself strips.
	StripRequestHeaders []string
	// RouteRemoveRequestHeaders are removed by the router before the
	// upstream (route_config request_headers_to_remove). Default none.
	RouteRemoveRequestHeaders []string

	// FailureModeAllow is the filter's failure_mode_allow.
	FailureModeAllow bool
	// MessageTimeout is message_timeout for non-FULL_DUPLEX messages
	// (default 200 ms, Envoy's default).
	MessageTimeout time.Duration
	// BufferLimit is per_connection_buffer_limit_bytes, which bounds a
	// BUFFERED request body (default 1 MiB, Envoy's default).
	BufferLimit int
	// ChunkSizes are the sizes the request body is cut into before it is
	// sent to the server, used in turn (default 16 KiB).
	ChunkSizes []int

	// GracefulClose makes the proxy half-close the stream and wait up to
	// CloseTimeout for the server to end it before resetting it (Envoy's
	// graceful close); by default it half-closes and resets at once.
	GracefulClose bool
	// CloseTimeout bounds the wait for queued messages and, with
	// GracefulClose, for the server's close (default 1 s).
	CloseTimeout time.Duration

	// Trace, when set, is called with every event, from the goroutine that
	// serves the request; it must be safe for concurrent use.
	Trace func(Event)
	// DiscardHistory keeps no events and no ended exchanges (Events and
	// Exchanges stay empty, WaitExchanges only counts): for long runs such
	// as the soak, where the history would grow without bound. Trace still
	// sees every event.
	DiscardHistory bool
}

// Proxy is a running imitation of Envoy. Create it with [New], then
// [Proxy.Start] it; [Proxy.Close] stops everything it started.
type Proxy struct {
	cfg     Config
	cluster *cluster
	forward []string
	receive []string

	nextID atomic.Uint64

	mu        sync.Mutex
	started   bool
	closed    bool
	events    []Event
	exchanges []Exchange
	ended     int           // exchanges that have ended
	changed   chan struct{} // closed and replaced when an exchange ends

	ctx       context.Context
	cancel    context.CancelFunc
	ln        net.Listener
	srv       *http.Server
	conn      *grpc.ClientConn
	client    extprocv3.ExternalProcessorClient
	transport *http.Transport
	wg        sync.WaitGroup
	serveErr  error
}

// New checks cfg, fills in defaults and returns a proxy ready to Start.
func New(cfg Config) (*Proxy, error) {
	if cfg.ExtProcAddr == "" {
		return nil, errors.New("envoysim: ExtProcAddr is required")
	}
	if cfg.RequestBodyMode < FullDuplexStreamed || cfg.RequestBodyMode > None {
		return nil, fmt.Errorf("envoysim: unknown request body mode %d", cfg.RequestBodyMode)
	}
	if cfg.ResponseBodyMode != FullDuplexStreamed && cfg.ResponseBodyMode != None {
		return nil, fmt.Errorf("envoysim: response body mode %v is not supported (FULL_DUPLEX_STREAMED or NONE)", cfg.ResponseBodyMode)
	}
	if cfg.MessageTimeout <= 0 {
		cfg.MessageTimeout = 200 * time.Millisecond
	}
	if cfg.BufferLimit <= 0 {
		cfg.BufferLimit = 1 << 20
	}
	if len(cfg.ChunkSizes) == 0 {
		cfg.ChunkSizes = []int{16 << 10}
	}
	for _, n := range cfg.ChunkSizes {
		if n <= 0 {
			return nil, fmt.Errorf("envoysim: chunk size %d must be positive", n)
		}
	}
	if cfg.CloseTimeout <= 0 {
		cfg.CloseTimeout = time.Second
	}
	cl, err := newCluster(cfg.Hosts)
	if err != nil {
		return nil, err
	}
	p := &Proxy{cfg: cfg, cluster: cl, changed: make(chan struct{})}
	p.forward = cfg.ForwardingNamespaces
	if p.forward == nil {
		p.forward = []string{NamespaceLB, NamespaceSubsetHint}
	}
	p.receive = cfg.ReceivingNamespaces
	if p.receive == nil {
		p.receive = []string{NamespaceLB}
	}
	return p, nil
}

// Start listens on 127.0.0.1 (a random port) and serves until Close. ctx is
// the parent of every context the proxy creates.
func (p *Proxy) Start(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.started {
		return errors.New("envoysim: already started")
	}
	conn, err := grpc.NewClient(p.cfg.ExtProcAddr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Envoy's gRPC client has no message size limits by default.
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32), grpc.MaxCallSendMsgSize(math.MaxInt32)))
	if err != nil {
		return fmt.Errorf("envoysim: ext_proc client: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		conn.Close()
		return fmt.Errorf("envoysim: listen: %w", err)
	}
	p.started = true
	p.ctx, p.cancel = context.WithCancel(ctx)
	p.conn = conn
	p.client = extprocv3.NewExternalProcessorClient(conn)
	p.ln = ln
	p.transport = &http.Transport{
		Proxy:               nil,
		DisableCompression:  true, // the body must reach the upstream as sent
		MaxIdleConnsPerHost: 16,
		IdleConnTimeout:     30 * time.Second,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
	}
	p.srv = &http.Server{
		Handler:           p,
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return p.ctx },
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		if err := p.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			p.mu.Lock()
			p.serveErr = err
			p.mu.Unlock()
		}
	}()
	return nil
}

// URL is the proxy's base URL, "http://127.0.0.1:port".
func (p *Proxy) URL() string { return "http://" + p.Addr() }

// Addr is the proxy's listen address.
func (p *Proxy) Addr() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		return ""
	}
	return p.ln.Addr().String()
}

// Close stops the listener, resets every open exchange, waits for the
// goroutines the proxy started and closes its client connections.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if !p.started || p.closed {
		p.closed = true
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()

	err := p.srv.Close()
	p.cancel()
	p.wg.Wait()
	p.transport.CloseIdleConnections()
	if cerr := p.conn.Close(); err == nil {
		err = cerr
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if err == nil {
		err = p.serveErr
	}
	return err
}

// goTracked runs f in a goroutine that Close waits for. It reports false,
// without running f, once the proxy is closing.
func (p *Proxy) goTracked(f func()) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		f()
	}()
	return true
}

// Events returns every event so far, in order.
func (p *Proxy) Events() []Event {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.events)
}

// Exchanges returns the exchanges that have ended, in the order they ended.
func (p *Proxy) Exchanges() []Exchange {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.exchanges)
}

// WaitExchanges waits until at least n exchanges have ended (the client may
// have its response slightly before the proxy is done with the exchange)
// and returns them all.
func (p *Proxy) WaitExchanges(ctx context.Context, n int) ([]Exchange, error) {
	for {
		p.mu.Lock()
		if p.ended >= n {
			out := slices.Clone(p.exchanges)
			p.mu.Unlock()
			return out, nil
		}
		ch := p.changed
		p.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return p.Exchanges(), fmt.Errorf("envoysim: waiting for %d exchanges: %w", n, ctx.Err())
		}
	}
}

func (p *Proxy) record(e Event) {
	if !p.cfg.DiscardHistory {
		p.mu.Lock()
		p.events = append(p.events, e)
		p.mu.Unlock()
	}
	if p.cfg.Trace != nil {
		p.cfg.Trace(e)
	}
}

func (p *Proxy) finishExchange(x Exchange) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ended++
	if !p.cfg.DiscardHistory {
		p.exchanges = append(p.exchanges, x)
	}
	close(p.changed)
	p.changed = make(chan struct{})
}

// ServeHTTP runs one exchange: the ext_proc conversation, the upstream
// request and the response.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		http.Error(w, "proxy closing", http.StatusServiceUnavailable)
		return
	}
	p.wg.Add(1)
	p.mu.Unlock()
	defer p.wg.Done()

	ex := newExchange(p, w, r)
	ex.run()
	if ex.reset {
		// Reset the downstream connection, as Envoy resets the stream.
		panic(http.ErrAbortHandler)
	}
}
