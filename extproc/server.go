package extproc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
)

// Defaults for [Config].
const (
	DefaultMaxBodyBytes    = 16 << 20
	DefaultMaxInflight     = 1024
	DefaultDecisionTimeout = 30 * time.Second
	// BodyChunkBytes is the largest StreamedBodyResponse chunk we send
	// (Envoy recommends at most 64 KiB; GIE uses 62,000).
	BodyChunkBytes = 62000
	// DefaultMaxSSEEvent bounds one buffered SSE event on the response path.
	DefaultMaxSSEEvent = 1 << 20
	// DefaultTokenizerTimeout bounds one request's tokenization.
	DefaultTokenizerTimeout = 5 * time.Second
	// DefaultStreamHeaderTimeout bounds stream open → request headers.
	// Envoy sends the headers message in the same step that opens the
	// stream, so a healthy data plane needs milliseconds; a few seconds
	// absorb a stalled connection or a CPU-starved process without letting
	// streams that never speak pile up.
	DefaultStreamHeaderTimeout = 5 * time.Second
	// DefaultStreamIdleTimeout is the --stream-idle-timeout default: a
	// decided stream with no message for this long is closed. It is far
	// longer than any gap between the chunks of a live response; a
	// non-streamed response sends nothing until it is complete, and a
	// false positive only loses its outcome (the close is clean, and Envoy
	// continues without kvbandit).
	DefaultStreamIdleTimeout = 10 * time.Minute
)

// Config holds the server's limits and switches.
type Config struct {
	// MaxBodyBytes is the largest request body accepted (413 beyond).
	MaxBodyBytes int64
	// MaxInflight is the number of concurrent requests (503 beyond). A
	// stream counts from its request headers on: one that has sent nothing
	// yet holds no slot, only the StreamHeaderTimeout bounds it.
	MaxInflight int
	// MaxBufferedBytes bounds the request bytes buffered across all
	// streams (503 beyond); 0 means 4 × MaxBodyBytes, at least 256 MiB.
	MaxBufferedBytes int64
	// DecisionTimeout bounds request headers → decision (503 beyond). It
	// never applies to the response phase.
	DecisionTimeout time.Duration
	// StreamHeaderTimeout bounds stream open → request headers: a stream
	// that sends none in time is closed with DEADLINE_EXCEEDED (there is no
	// HTTP request to answer yet). 0 means DefaultStreamHeaderTimeout.
	StreamHeaderTimeout time.Duration
	// StreamIdleTimeout closes a decided stream that has received no
	// message for this long: the decision ends as abandoned and the stream
	// closes cleanly, so that Envoy carries on without kvbandit. It bounds
	// what a data plane that went silent holds (goroutines, the buffered
	// body, the decision); a live response is never cut by it, since every
	// chunk resets it. 0 turns it off.
	StreamIdleTimeout time.Duration
	// ResponseProcessing keeps the stream open for the response, which
	// feeds outcomes back. When false the stream closes cleanly after the
	// request phase.
	ResponseProcessing bool
	// TenantHeader names the request header that carries the tenant.
	TenantHeader string
	// StripKVTransferParams removes a client's kv_transfer_params from
	// request bodies in every pool; in pools with prefill endpoints it is
	// always removed (StripsKVTransfer).
	StripKVTransferParams bool
	// SessionHeaders name the request headers that carry the session id
	// (the prefix id hint), the first present winning; checked by
	// hints.SessionHeaders. Empty means hints.DefaultSessionHeaders
	// (x-prefix-id).
	SessionHeaders []string
	// ClientPriority is the operator's rule for the priority a client
	// gives itself against its InferenceObjective's (hints.ResolvePriority;
	// the zero value caps a client at its objective's priority).
	ClientPriority hints.PriorityPolicy
	// MaxSSEEvent bounds one buffered SSE event.
	MaxSSEEvent int
	// TokenizerTimeout bounds one request's tokenization; past it the
	// request is routed on the byte-based estimate.
	TokenizerTimeout time.Duration
}

func (c *Config) defaults() {
	if c.MaxBodyBytes <= 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if c.MaxInflight <= 0 {
		c.MaxInflight = DefaultMaxInflight
	}
	if c.MaxBufferedBytes <= 0 {
		c.MaxBufferedBytes = DefaultMaxBufferedBytes(c.MaxBodyBytes)
	}
	if c.DecisionTimeout <= 0 {
		c.DecisionTimeout = DefaultDecisionTimeout
	}
	if c.StreamHeaderTimeout <= 0 {
		c.StreamHeaderTimeout = DefaultStreamHeaderTimeout
	}
	if c.StreamIdleTimeout < 0 {
		c.StreamIdleTimeout = 0
	}
	if c.MaxSSEEvent <= 0 {
		c.MaxSSEEvent = DefaultMaxSSEEvent
	}
	if c.TokenizerTimeout <= 0 {
		c.TokenizerTimeout = DefaultTokenizerTimeout
	}
	if len(c.SessionHeaders) == 0 {
		c.SessionHeaders = hints.DefaultSessionHeaders()
	}
}

// Tokenizer turns a parsed request (and its raw body, for what parsing
// does not keep, such as tool definitions) into token ids. It is optional;
// without one, or when it fails, the server routes on a byte-based estimate.
// body is always the body req was parsed from, so it is valid JSON.
type Tokenizer interface {
	Encode(ctx context.Context, req *openai.Request, body []byte) ([]uint32, error)
}

// Deps are the server's injected dependencies; nil fields get defaults
// except Picker, which is required.
type Deps struct {
	Picker    routing.Picker
	Tokenizer Tokenizer
	Logger    *slog.Logger
	Registry  prometheus.Registerer
	Clock     clock.Clock
	// Budget bounds the request bytes buffered across all streams and
	// whatever else shares it (the standalone proxy); nil: a private one of
	// Config.MaxBufferedBytes. A given Budget's limit is the effective
	// MaxBufferedBytes.
	Budget *Budget
	// Objectives gives the priority of a request's InferenceObjective
	// (x-gateway-inference-objective); nil when objectives are not
	// discovered (see hints.ResolvePriority).
	Objectives hints.Priorities
	// Tracer records each stream's spans and hands the trace context to
	// the worker (traceparent); nil: tracing off, headers untouched.
	Tracer *tracing.Tracer
}

// Server implements the ext_proc ExternalProcessor service.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer

	cfg     Config
	picker  routing.Picker
	tok     Tokenizer
	log     *slog.Logger
	clk     clock.Clock
	metrics *Metrics
	// objectives is Deps.Objectives (nil: none).
	objectives hints.Priorities
	tracer     *tracing.Tracer

	streams atomic.Int64
	budget  *Budget
	// inflight counts the requests admitted at their headers, against
	// MaxInflight.
	inflight atomic.Int64

	drainOnce sync.Once
	drain     chan struct{}
	stopping  atomic.Bool
	// unsafeClose warns once that response processing is off while the
	// data plane still streams responses to kvbandit.
	unsafeClose sync.Once
	// bodyUnseen warns once that the request body mode hides bodies.
	bodyUnseen sync.Once
	// noResponseOnce warns once that the data plane sends no response
	// phase (noresponse.go).
	noResponseOnce sync.Once
	wg             sync.WaitGroup
}

var _ extprocv3.ExternalProcessorServer = (*Server)(nil)

// NewServer returns a server. deps.Picker must be set.
func NewServer(cfg Config, deps Deps) *Server {
	cfg.defaults()
	s := &Server{cfg: cfg, picker: deps.Picker, tok: deps.Tokenizer, log: deps.Logger, clk: clock.Or(deps.Clock), drain: make(chan struct{}), objectives: deps.Objectives, tracer: deps.Tracer}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.budget = deps.Budget; s.budget == nil {
		s.budget = NewBudget(s.cfg.MaxBufferedBytes)
	}
	s.cfg.MaxBufferedBytes = s.budget.Limit()
	s.metrics = NewMetrics(deps.Registry, func() float64 { return float64(s.budget.Used()) })
	return s
}

// Config returns the effective configuration.
func (s *Server) Config() Config { return s.cfg }

// Streams returns the number of open streams.
func (s *Server) Streams() int64 { return s.streams.Load() }

// InFlight returns the number of requests admitted at their headers and
// not finished: what MaxInflight bounds. It is at most Streams.
func (s *Server) InFlight() int64 { return s.inflight.Load() }

// Drain tells open streams to finish: streams still waiting for their
// decision are answered 503 shutting_down, and new streams are refused
// with 503. Decided streams keep echoing their response until it ends,
// since closing a FULL_DUPLEX_STREAMED stream mid-body would lose the
// chunks Envoy has in flight. Drain returns at once; Wait blocks until the
// streams are gone.
func (s *Server) Drain() { s.drainOnce.Do(func() { close(s.drain) }) }

// Stopping marks the server as being stopped for good: streams whose
// context ends from now on (the gRPC server's hard stop) end their
// decisions as abandoned rather than cancelled.
func (s *Server) Stopping() { s.stopping.Store(true) }

// Wait blocks until every stream has ended or ctx is done.
func (s *Server) Wait(ctx context.Context) error {
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Process implements [extprocv3.ExternalProcessorServer]. It only moves
// messages: protocol state lives in the per-stream processor.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	s.wg.Add(1)
	defer s.wg.Done()
	s.metrics.streams.Inc()
	defer s.metrics.streams.Dec()
	s.streams.Add(1)
	defer s.streams.Add(-1)

	// gRPC runs each stream's handler on a new goroutine; the end of a
	// stream (a decision's Done, its timers) runs here and would grow the
	// small stack, copying gRPC's frames each time.
	reserveStack(1)
	ctx := stream.Context()
	p := newProcessor(s)
	defer p.close()

	// Admission (--max-inflight, drain) happens at the request headers,
	// before anything is buffered: a stream that never sends them holds
	// no slot, and the header timeout closes it.
	headerTimeout := make(chan struct{})
	p.headerTimer = s.clk.AfterFunc(s.cfg.StreamHeaderTimeout, func() { close(headerTimeout) })
	if s.cfg.StreamIdleTimeout > 0 {
		p.idle = make(chan struct{}, 1)
	}

	// Pick may wait in the admission queue while the receive loop holds the
	// stream's lock; the control paths below cancel this context (with the
	// reason as its cause) before they take the lock.
	pickCtx, cancelPick := context.WithCancelCause(ctx)
	defer cancelPick(nil)
	p.pickCtx = pickCtx
	r := &run{s: s, stream: stream, p: p, finished: make(chan struct{})}
	// The receive loop handles each message as it arrives (no hand-off
	// between goroutines on the hot path). It ends on a Recv error or when
	// the stream context is done, which gRPC guarantees once Process
	// returns; it is not waited for, since it may be blocked in Recv.
	go r.receive(ctx)

	timeout, drain, idle := p.deadline(), s.drain, p.idle
	for {
		select {
		case <-r.finished:
			return r.result
		case <-headerTimeout:
			headerTimeout = nil
			if err, ok := r.control(func() (error, bool) {
				if p.phase != phaseRequestHeaders {
					return nil, false
				}
				p.abort(routing.OutcomeCancelled, "header_timeout")
				return grpcError(fmt.Errorf("%w: none within %v", ErrHeaderTimeout, s.cfg.StreamHeaderTimeout)), true
			}); ok {
				return err
			}
		case <-idle:
			if err, ok := r.control(p.idleCheck); ok {
				return err
			}
		case <-timeout:
			timeout = nil
			cancelPick(ErrDecisionTimeout)
			if err, ok := r.control(func() (error, bool) {
				if p.decided() {
					return nil, false
				}
				return s.fail(stream, p, ErrDecisionTimeout), true
			}); ok {
				return err
			}
		case <-drain:
			drain = nil
			cancelPick(ErrShuttingDown)
			// A stream still waiting for its decision is answered 503. A
			// decided stream runs to its end: in FULL_DUPLEX_STREAMED mode
			// Envoy drops the chunks it has sent but the server has not
			// echoed yet, so an early close would cut holes in a response.
			// The caller's hard stop bounds how long that may take. A
			// stream without request headers yet is refused when they come
			// (processor.admit), so that the refusal answers a request.
			if err, settled := r.control(func() (error, bool) {
				if p.decided() || p.phase == phaseRequestHeaders {
					return nil, false
				}
				return s.fail(stream, p, ErrShuttingDown), true
			}); settled {
				return err
			}
		case <-ctx.Done():
			r.control(func() (error, bool) {
				if s.stopping.Load() {
					p.abort(routing.OutcomeAbandoned, "server_stopped")
				} else {
					p.abort(routing.OutcomeCancelled, "context_done")
				}
				return nil, true
			})
			return nil
		}
	}
}

// run is one stream's receive loop and its shared state. mu serialises the
// processor and every Send between the receive loop and Process (timeouts,
// drain, cancellation).
type run struct {
	s      *Server
	stream extprocv3.ExternalProcessor_ProcessServer
	p      *processor

	mu       sync.Mutex
	done     bool          // the stream's outcome is settled; nothing more is sent
	result   error         // what Process returns once finished is closed
	finished chan struct{} // closed by the receive loop when it settles the stream
}

// control runs f under the lock unless the stream is already settled. f
// reports whether it settled the stream.
func (r *run) control(f func() (error, bool)) (error, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		return nil, false
	}
	err, settled := f()
	r.done = settled
	return err, settled
}

func (r *run) receive(ctx context.Context) {
	reserveStack(0)
	for {
		m, err := r.stream.Recv()
		r.mu.Lock()
		if r.done {
			r.mu.Unlock()
			return
		}
		result, settled := r.step(ctx, m, err)
		if settled {
			r.done, r.result = true, result
			close(r.finished)
		}
		r.mu.Unlock()
		if settled {
			return
		}
	}
}

// receiveStackBytes is the stack the receive loop reaches on a request
// exchange (gRPC's Recv and proto decoding, parsing, Pick, Send), measured
// with the exchange benchmark's profile, and enough for Process's end of a
// stream. A new goroutine starts small and doubles its stack each time a
// call runs out, copying every frame above it each time; growing once, at
// the start where there are few frames to copy, costs a fraction of that.
const receiveStackBytes = 16 << 10

// reserveStack makes the calling goroutine's stack at least
// receiveStackBytes deep. i is any small value: an index the compiler
// cannot see keeps the frame from being optimised away.
//
//go:noinline
func reserveStack(i int) byte {
	var pad [receiveStackBytes]byte
	pad[i%len(pad)] = 1
	return pad[(i+1)%len(pad)]
}

// step handles one received message (or receive error) under the lock and
// reports whether the stream is settled, with Process's return value.
func (r *run) step(ctx context.Context, m *extprocv3.ProcessingRequest, err error) (error, bool) {
	p, s := r.p, r.s
	if err != nil {
		if errors.Is(err, io.EOF) {
			p.endOfStream()
			return nil, true
		}
		switch {
		case s.stopping.Load():
			p.abort(routing.OutcomeAbandoned, "server_stopped")
		case status.Code(err) == codes.Canceled:
			p.abort(routing.OutcomeCancelled, "cancelled")
			return nil, true
		default:
			p.abort(routing.OutcomeReset, "recv_error")
		}
		return err, true
	}
	out, done, err := p.handle(ctx, m)
	if err != nil {
		return s.fail(r.stream, p, err), true
	}
	if err := s.send(r.stream, out); err != nil {
		p.abort(routing.OutcomeReset, "send_error")
		return err, true
	}
	return nil, done
}

// fail ends the stream for err: a rejection is sent as an
// ImmediateResponse and the stream closes cleanly; anything else ends the
// stream with a gRPC error status.
func (s *Server) fail(stream extprocv3.ExternalProcessor_ProcessServer, p *processor, err error) error {
	if r := Reject(err); r != nil {
		p.finishRejected(err)
		if p.respPhase {
			// Too late for a local reply: the response has started.
			p.abort(routing.OutcomeReset, "late_rejection")
			return grpcError(err)
		}
		return s.send(stream, []*extprocv3.ProcessingResponse{r.immediate()})
	}
	reason := "internal"
	kind := routing.OutcomeReset
	if errors.Is(err, ErrProtocol) {
		reason = "protocol"
	}
	p.abort(kind, reason)
	s.log.Warn("ext_proc stream failed", "err", err, "request_id", p.requestID)
	return grpcError(err)
}

// decidedWithoutBody counts a request decided at the headers although it
// has a body, because the data plane's request_body_mode does not show the
// body first, and warns once: such requests are routed without their model
// (unless a header carries it) or prompt, so KV-cache overlap plays no part.
func (s *Server) decidedWithoutBody(mode filterv3.ProcessingMode_BodySendMode) {
	reason := "request_body_mode_none"
	if mode == filterv3.ProcessingMode_STREAMED {
		reason = "request_body_mode_streamed"
	}
	s.metrics.withoutBody.WithLabelValues(reason).Inc()
	s.bodyUnseen.Do(func() {
		s.log.Warn("the data plane's request_body_mode hides request bodies from kvbandit: requests are routed at the headers on load, hints and session affinity only, without the prompt's KV-cache overlap (and without the model unless "+HeaderModel+" carries it); set the ext_proc filter's request_body_mode to FULL_DUPLEX_STREAMED (or BUFFERED)",
			"request_body_mode", mode.String())
	})
}

func (s *Server) send(stream extprocv3.ExternalProcessor_ProcessServer, out []*extprocv3.ProcessingResponse) error {
	for _, m := range out {
		if err := stream.Send(m); err != nil {
			return err
		}
	}
	return nil
}
