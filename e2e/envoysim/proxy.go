package envoysim

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
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

// ---- headers -------------------------------------------------------------

// header is one entry of an Envoy header map: lower-case key, raw value.
type header struct{ key, value string }

// headerMap is an ordered header map with repeated keys, like Envoy's.
type headerMap []header

func (h headerMap) get(key string) (string, bool) {
	for _, kv := range h {
		if kv.key == key {
			return kv.value, true
		}
	}
	return "", false
}

func (h *headerMap) add(key, value string) { *h = append(*h, header{key, value}) }

func (h *headerMap) del(key string) {
	*h = slices.DeleteFunc(*h, func(kv header) bool { return kv.key == key })
}

// set replaces every value of key with value, keeping the first position.
func (h *headerMap) set(key, value string) {
	for i, kv := range *h {
		if kv.key == key {
			(*h)[i].value = value
			rest := (*h)[i+1:]
			rest.del(key)
			*h = append((*h)[:i+1], rest...)
			return
		}
	}
	h.add(key, value)
}

func (h headerMap) proto() *corev3.HeaderMap {
	out := &corev3.HeaderMap{Headers: make([]*corev3.HeaderValue, len(h))}
	for i, kv := range h {
		out.Headers[i] = &corev3.HeaderValue{Key: kv.key, RawValue: []byte(kv.value)}
	}
	return out
}

// connectionHeaders are hop-by-hop headers Envoy's HTTP/1 codec does not
// forward (it writes its own framing).
var connectionHeaders = map[string]bool{
	"connection": true, "keep-alive": true, "proxy-connection": true,
	"transfer-encoding": true, "upgrade": true, "host": true,
}

// fromHTTP turns Go headers into a header map (sorted keys, as Go's map
// has no order).
func fromHTTP(hdr http.Header) headerMap {
	keys := make([]string, 0, len(hdr))
	for k := range hdr {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var h headerMap
	for _, k := range keys {
		lk := strings.ToLower(k)
		if connectionHeaders[lk] {
			continue
		}
		for _, v := range hdr[k] {
			h.add(lk, v)
		}
	}
	return h
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	s := hex.EncodeToString(b[:])
	return s[:8] + "-" + s[8:12] + "-" + s[12:16] + "-" + s[16:20] + "-" + s[20:]
}

// requestHeaders builds the request header map as Envoy's HTTP/1 codec and
// connection manager leave it before the ext_proc filter.
func (ex *exchange) requestHeaders() headerMap {
	r := ex.r
	h := headerMap{
		{":authority", r.Host},
		{":path", r.RequestURI},
		{":method", r.Method},
		{":scheme", "http"},
	}
	h = append(h, fromHTTP(r.Header)...)
	for _, name := range ex.p.cfg.StripRequestHeaders {
		h.del(strings.ToLower(name))
	}
	if _, ok := h.get("content-length"); !ok && r.ContentLength > 0 {
		h.add("content-length", strconv.FormatInt(r.ContentLength, 10))
	}
	if _, ok := h.get("x-forwarded-proto"); !ok {
		h.add("x-forwarded-proto", "http")
	}
	rid, ok := h.get("x-request-id")
	if !ok || rid == "" {
		rid = newRequestID()
		h.set("x-request-id", rid)
	}
	ex.rec.RequestID = rid
	return h
}

// ---- downstream body -----------------------------------------------------

// pumpRequest reads the client's body in ChunkSizes pieces and hands them
// to the exchange loop: the last piece carries end of stream when the
// length is known; a chunked body ends with an empty end-of-stream piece,
// or with trailers when the request has some (Envoy's HTTP/1 codec).
func (ex *exchange) pumpRequest() {
	r := ex.r
	sizes := ex.p.cfg.ChunkSizes
	var total int64
	for i := 0; ; i++ {
		buf := make([]byte, sizes[i%len(sizes)])
		n, err := io.ReadFull(r.Body, buf)
		buf = buf[:n]
		total += int64(n)
		known := r.ContentLength > 0
		switch {
		case known && total >= r.ContentLength:
			ex.post(event{kind: evRequestData, data: buf, eos: true})
			return
		case err == nil:
			if !ex.post(event{kind: evRequestData, data: buf}) {
				return
			}
		case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
			if known {
				ex.post(event{kind: evRequestError, err: fmt.Errorf("request body ended after %d of %d bytes", total, r.ContentLength)})
				return
			}
			if n > 0 && !ex.post(event{kind: evRequestData, data: buf}) {
				return
			}
			if tr := trailerMap(r.Trailer); len(tr) > 0 {
				ex.post(event{kind: evRequestTrailers, trailers: tr})
			} else {
				ex.post(event{kind: evRequestData, eos: true})
			}
			return
		default:
			ex.post(event{kind: evRequestError, err: err})
			return
		}
	}
}

// trailerMap returns the trailers that were actually sent.
func trailerMap(t http.Header) headerMap {
	var h headerMap
	for _, kv := range fromHTTP(t) {
		if kv.value != "" {
			h = append(h, kv)
		}
	}
	return h
}

// ---- upstream ------------------------------------------------------------

// startUpstream is the router: override_host picks the host, then the
// request goes out over HTTP/1.1 with the (mutated) headers.
func (ex *exchange) startUpstream(h headerMap, eos bool) {
	ch := ex.p.cluster.choose(ex.md)
	ex.rec.Destination = ch.destination
	ex.rec.Upstream = ch.host
	ex.rec.Fallback = ch.fallback
	if ch.fallback {
		ex.note("override_host: fallback policy (round robin) chose " + ch.host + ": " + ch.reason)
	}
	if ch.host == "" {
		ex.upstreamLocalReply(http.StatusServiceUnavailable, "no healthy upstream", "no_healthy_upstream")
		return
	}
	method, _ := h.get(":method")
	path, _ := h.get(":path")
	authority, _ := h.get(":authority")
	u, err := url.Parse("http://" + ch.host + path)
	if err != nil {
		ex.upstreamLocalReply(http.StatusBadRequest, "Bad Request", "invalid_path")
		return
	}
	ctx, cancel := context.WithCancel(ex.p.ctx)
	req := (&http.Request{Method: method, URL: u, Host: authority, Header: make(http.Header)}).WithContext(ctx)
	req.Proto, req.ProtoMajor, req.ProtoMinor = "HTTP/1.1", 1, 1
	for _, kv := range h {
		if strings.HasPrefix(kv.key, ":") || connectionHeaders[kv.key] || kv.key == "content-length" ||
			slices.ContainsFunc(ex.p.cfg.RouteRemoveRequestHeaders, func(n string) bool { return strings.EqualFold(n, kv.key) }) {
			continue
		}
		req.Header.Add(kv.key, kv.value)
	}
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header["User-Agent"] = nil // Envoy adds none; keep Go from adding its own
	}
	if !eos {
		ex.upBody = newBodyPipe()
		req.Body = ex.upBody
		req.ContentLength = -1
		if cl, ok := h.get("content-length"); ok {
			if n, err := strconv.ParseInt(cl, 10, 64); err == nil {
				req.ContentLength = n
			}
		}
		if req.ContentLength < 0 && len(ex.r.Trailer) > 0 {
			req.Trailer = make(http.Header)
			for k := range ex.r.Trailer {
				req.Trailer[k] = nil
			}
		}
	}
	ex.upCancel = cancel
	ex.upReq = req
	ex.note("upstream request to " + ch.host)
	transport := ex.p.transport
	if !ex.p.goTracked(func() {
		resp, err := transport.RoundTrip(req)
		if !ex.post(event{kind: evUpstreamResponse, resp: resp, err: err}) && resp != nil {
			resp.Body.Close()
		}
	}) {
		cancel()
	}
}

func (ex *exchange) upstreamData(b []byte, eos bool) {
	if ex.upBody == nil {
		return
	}
	ex.upBody.write(b)
	if eos {
		ex.upBody.closeWrite(nil)
	}
}

func (ex *exchange) upstreamTrailers(t headerMap) {
	if ex.upBody == nil {
		return
	}
	trailer := ex.upReq.Trailer
	if trailer == nil {
		ex.note("request trailers dropped: the upstream request is not chunked")
		ex.upBody.closeWrite(nil)
		return
	}
	// The transport reads req.Trailer in its own goroutine after the body's
	// EOF: fill it in there.
	ex.upBody.closeWriteThen(func() {
		for _, kv := range t {
			trailer.Add(kv.key, kv.value)
		}
	})
}

// abortUpstream resets the upstream request, if any.
func (ex *exchange) abortUpstream() {
	if ex.upCancel != nil {
		ex.upCancel()
	}
	if ex.upBody != nil {
		ex.upBody.closeWrite(errUpstreamAborted)
	}
}

var errUpstreamAborted = errors.New("envoysim: upstream request aborted")

// onUpstreamResponse starts the response path with the upstream's headers.
func (ex *exchange) onUpstreamResponse(resp *http.Response, err error) {
	if err != nil {
		if ex.p.ctx.Err() != nil {
			return
		}
		ex.note("upstream request failed: " + err.Error())
		ex.upstreamLocalReply(http.StatusServiceUnavailable,
			"upstream connect error or disconnect/reset before headers. reset reason: connection failure",
			"upstream_reset_before_response_started{connection_failure}")
		return
	}
	ex.upResp = resp
	h := headerMap{{":status", strconv.Itoa(resp.StatusCode)}}
	h = append(h, fromHTTP(resp.Header)...)
	h.del("content-length")
	noBody := resp.ContentLength == 0 || resp.Body == http.NoBody || ex.upReq.Method == http.MethodHead
	if resp.ContentLength >= 0 {
		h.add("content-length", strconv.FormatInt(resp.ContentLength, 10))
	}
	if noBody {
		resp.Body.Close()
		ex.upResp = nil
	}
	ex.onHeaders(ex.enc, h, noBody)
	if noBody || ex.finished {
		return
	}
	if ex.p.goTracked(func() { ex.pumpResponse(resp) }) {
		ex.upResp = nil // the pump owns (and closes) the body now
	}
}

// pumpResponse hands the upstream body to the exchange loop as it arrives.
func (ex *exchange) pumpResponse(resp *http.Response) {
	defer resp.Body.Close()
	known := resp.ContentLength > 0
	var total int64
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			total += int64(n)
			eos := known && total >= resp.ContentLength
			if !ex.post(event{kind: evResponseData, data: bytes.Clone(buf[:n]), eos: eos}) || eos {
				return
			}
		}
		switch {
		case err == nil:
		case errors.Is(err, io.EOF):
			if tr := trailerMap(resp.Trailer); len(tr) > 0 {
				ex.post(event{kind: evResponseTrailers, trailers: tr})
			} else {
				ex.post(event{kind: evResponseData, eos: true})
			}
			return
		default:
			ex.post(event{kind: evResponseError, err: err})
			return
		}
	}
}

// upstreamLocalReply is a reply Envoy's router generates (no host,
// connection failure). It goes through the response path like an upstream
// response, as local replies go through Envoy's encoder filters.
func (ex *exchange) upstreamLocalReply(code int, body, details string) {
	ex.rec.LocalReply = code
	ex.rec.Details = details
	ex.note(fmt.Sprintf("router local reply %d (%s)", code, details))
	h := headerMap{{":status", strconv.Itoa(code)}, {"content-length", strconv.Itoa(len(body))}}
	if body != "" {
		h.add("content-type", "text/plain")
	}
	ex.onHeaders(ex.enc, h, body == "")
	if body != "" && !ex.finished {
		ex.onData(ex.enc, []byte(body), true)
	}
}

// ---- downstream response -------------------------------------------------

func (ex *exchange) clientHeaders(h headerMap, eos bool) {
	status := http.StatusOK
	if s, ok := h.get(":status"); ok {
		if n, err := strconv.Atoi(s); err == nil {
			status = n
		}
	}
	wh := ex.w.Header()
	for _, kv := range h {
		if strings.HasPrefix(kv.key, ":") || connectionHeaders[kv.key] {
			continue
		}
		wh.Add(kv.key, kv.value)
	}
	if _, ok := wh["Content-Type"]; !ok {
		wh["Content-Type"] = nil // no sniffing: send what the upstream sent
	}
	ex.w.WriteHeader(status)
	ex.clientHeadersSent = true
	_ = ex.rc.Flush()
	if eos {
		ex.finished = true
	}
}

func (ex *exchange) clientData(b []byte, eos bool) {
	if len(b) > 0 {
		_, _ = ex.w.Write(b)
	}
	_ = ex.rc.Flush()
	if eos {
		ex.finished = true
	}
}

func (ex *exchange) clientTrailers(t headerMap) {
	for _, kv := range t {
		ex.w.Header().Add(http.TrailerPrefix+kv.key, kv.value)
	}
	ex.finished = true
}

// localReply sends a reply generated by the proxy (ImmediateResponse or an
// ext_proc failure), or resets the client connection when response headers
// already went out.
func (ex *exchange) localReply(code int, body, details string, mutation *extprocv3.HeaderMutation, immediate bool) {
	if ex.finished {
		return
	}
	ex.rec.LocalReply = code
	ex.rec.Immediate = immediate
	ex.rec.Details = details
	ex.note(fmt.Sprintf("local reply %d (%s)", code, details))
	ex.abortUpstream()
	if ex.clientHeadersSent {
		ex.downstreamReset("local reply after response headers were sent")
		return
	}
	var h headerMap
	if body != "" {
		h.add("content-type", "text/plain")
	}
	if mutation != nil {
		ex.mutateImmediate(&h, mutation)
	}
	wh := ex.w.Header()
	for _, kv := range h {
		if strings.HasPrefix(kv.key, ":") || connectionHeaders[kv.key] || kv.key == "content-length" {
			continue
		}
		wh.Add(kv.key, kv.value)
	}
	if _, ok := wh["Content-Type"]; !ok {
		wh["Content-Type"] = nil
	}
	wh.Set("Content-Length", strconv.Itoa(len(body)))
	ex.w.WriteHeader(code)
	_, _ = io.WriteString(ex.w, body)
	ex.clientHeadersSent = true
	ex.finished = true
}

func (ex *exchange) downstreamReset(reason string) {
	ex.rec.DownstreamReset = true
	ex.note("downstream reset: " + reason)
	ex.reset = true
	ex.finished = true
}

// ---- body pipe -----------------------------------------------------------

// bodyPipe is the upstream request body: the exchange loop writes to it
// without ever blocking, the HTTP transport reads it.
type bodyPipe struct {
	mu     sync.Mutex
	cond   *sync.Cond
	buf    bytes.Buffer
	done   bool   // no more writes
	err    error  // what Read returns once buf is drained (nil: io.EOF)
	atEOF  func() // run by the reader just before it returns io.EOF
	closed bool   // the reader is gone
}

func newBodyPipe() *bodyPipe {
	p := &bodyPipe{}
	p.cond = sync.NewCond(&p.mu)
	return p
}

func (p *bodyPipe) write(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done || p.closed {
		return
	}
	p.buf.Write(b)
	p.cond.Broadcast()
}

func (p *bodyPipe) closeWrite(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	p.done = true
	p.err = err
	p.cond.Broadcast()
}

// closeWriteThen ends the body; f runs in the reader's goroutine right
// before its Read returns io.EOF.
func (p *bodyPipe) closeWriteThen(f func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	p.done = true
	p.atEOF = f
	p.cond.Broadcast()
}

// Read implements io.Reader.
func (p *bodyPipe) Read(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.buf.Len() == 0 && !p.done && !p.closed {
		p.cond.Wait()
	}
	switch {
	case p.closed:
		return 0, io.ErrClosedPipe
	case p.buf.Len() > 0:
		return p.buf.Read(b)
	case p.err != nil:
		return 0, p.err
	}
	if f := p.atEOF; f != nil {
		p.atEOF = nil
		f()
	}
	return 0, io.EOF
}

// Close implements io.Closer (the reader side).
func (p *bodyPipe) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	p.buf.Reset()
	p.cond.Broadcast()
	return nil
}
