package simworker

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/sim"
)

// Defaults.
const (
	DefaultModel     = "sim-model"
	DefaultMaxTokens = 16
	// maxBody bounds a request body.
	maxBody = 16 << 20
)

// Errors.
var (
	// ErrConfig: the configuration is invalid.
	ErrConfig = errors.New("simworker: invalid config")
	// ErrClosed: the server stopped before the request finished.
	ErrClosed = errors.New("simworker: server closed")
)

// Config is one simulated worker.
type Config struct {
	// Model is the served model name; requests for another model get 404
	// (as vLLM). Default DefaultModel.
	Model string
	// Addr is the HTTP listen address; default "127.0.0.1:0".
	Addr string
	// KVEventsAddr is the ZMQ address the KV event PUB socket binds, e.g.
	// "tcp://127.0.0.1:0"; empty: no KV events.
	KVEventsAddr string
	// KVEventsDial makes the PUB socket connect to KVEventsAddr, where the
	// subscriber is bound (llm-d-inference-sim's way, the endpoint record's
	// kv_events_bind), instead of binding it. It dials in the background
	// and again whenever the connection breaks, until Close.
	KVEventsDial bool
	// Speed is the worker's speed factor (2 = twice as fast); when > 0 it
	// replaces Worker.Speed.
	Speed float64
	// SpeedUp divides every model time again, to run the model faster
	// than real time; default 1.
	SpeedUp float64
	// Worker is the worker model (zero fields: Dynamo's mocker defaults).
	Worker sim.WorkerConfig
	// DefaultMaxTokens is the output length of a request without
	// max_tokens or max_completion_tokens; default DefaultMaxTokens.
	DefaultMaxTokens int
	// Logger; nil discards.
	Logger *slog.Logger
}

// Server is one simulated worker serving HTTP (and KV events) in real time.
type Server struct {
	cfg   Config
	log   *slog.Logger
	model *sim.Worker // owned by the run goroutine

	ln     net.Listener
	srv    *http.Server
	pub    *kvPub
	submit chan *call
	cancel context.CancelFunc
	done   chan struct{} // closed when the run goroutine stops
	wg     sync.WaitGroup
	once   sync.Once
	start  time.Time // wall time of model time 0

	mu     sync.Mutex
	met    metrics
	nextID uint64
	// pending KV events of the current run-loop iteration (run goroutine).
	events []kvindex.Event
}

// metrics are the counters /metrics reports, written by the run goroutine.
type metrics struct {
	waiting, running    int
	kvUsage             float64
	queries, hits       int64 // prefix cache: prompt tokens looked up, found
	prompt, generation  int64
	success             int64
	kvEvents, kvDropped uint64
}

// call is one request on its way through the run goroutine.
type call struct {
	req    *sim.Request
	notify chan struct{} // capacity 1: "progress was made"
	// Written by the run goroutine under mu.
	mu        sync.Mutex
	accepted  bool
	err       error
	cached    int
	generated int
	done      bool
}

func (c *call) update(f func(c *call)) {
	c.mu.Lock()
	f(c)
	c.mu.Unlock()
	select {
	case c.notify <- struct{}{}:
	default:
	}
}

type progress struct {
	accepted  bool
	err       error
	cached    int
	generated int
	done      bool
}

func (c *call) progress() progress {
	c.mu.Lock()
	defer c.mu.Unlock()
	return progress{c.accepted, c.err, c.cached, c.generated, c.done}
}

// New checks cfg and returns a server that is not started yet.
func New(cfg Config) (*Server, error) {
	if cfg.Model == "" {
		cfg.Model = DefaultModel
	}
	if cfg.Addr == "" {
		cfg.Addr = "127.0.0.1:0"
	}
	if cfg.SpeedUp == 0 {
		cfg.SpeedUp = 1
	}
	if cfg.DefaultMaxTokens == 0 {
		cfg.DefaultMaxTokens = DefaultMaxTokens
	}
	switch {
	case cfg.SpeedUp < 0 || math.IsNaN(cfg.SpeedUp) || math.IsInf(cfg.SpeedUp, 0):
		return nil, fmt.Errorf("%w: speed-up must be > 0, got %v", ErrConfig, cfg.SpeedUp)
	case cfg.Speed < 0 || math.IsNaN(cfg.Speed) || math.IsInf(cfg.Speed, 0):
		return nil, fmt.Errorf("%w: speed factor must be > 0, got %v", ErrConfig, cfg.Speed)
	case cfg.DefaultMaxTokens < 0:
		return nil, fmt.Errorf("%w: negative DefaultMaxTokens %d", ErrConfig, cfg.DefaultMaxTokens)
	}
	if cfg.Speed > 0 {
		cfg.Worker.Speed = cfg.Speed
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	s := &Server{cfg: cfg, log: log, submit: make(chan *call), done: make(chan struct{})}
	w, err := sim.NewWorker(cfg.Worker, sim.WorkerHooks{
		KVEvent:  s.onKVEvent,
		Admitted: s.onAdmitted,
		Finished: s.onFinished,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	s.model = w
	s.cfg.Worker = w.Config()
	return s, nil
}

// Config is the server's configuration with defaults applied.
func (s *Server) Config() Config { return s.cfg }

// Start binds the HTTP listener (and the KV event socket) and starts
// serving until ctx ends or Close is called. Close must be called either
// way.
func (s *Server) Start(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("simworker: listen %s: %w", s.cfg.Addr, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	if s.cfg.KVEventsAddr != "" {
		pub, err := newKVPub(ctx, s.cfg.KVEventsAddr, s.cfg.KVEventsDial, s.log)
		if err != nil {
			cancel()
			ln.Close()
			return fmt.Errorf("simworker: kv events %s: %w", s.cfg.KVEventsAddr, err)
		}
		s.pub = pub
		pub.start("kv@" + ln.Addr().String() + "@" + s.cfg.Model)
	}
	s.ln, s.cancel = ln, cancel
	s.start = time.Now()
	s.srv = &http.Server{Handler: s.handler(), ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)}
	s.wg.Add(2)
	go func() {
		defer s.wg.Done()
		s.run(ctx)
	}()
	go func() {
		defer s.wg.Done()
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("simworker: serve", "err", err)
		}
	}()
	return nil
}

// Addr is the HTTP address (host:port) once started.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// KVEventsAddr is the bound ZMQ address ("tcp://host:port"), the dialed
// one with Config.KVEventsDial, or "" without KV events.
func (s *Server) KVEventsAddr() string {
	if s.pub == nil {
		return ""
	}
	return s.pub.addr()
}

// Close stops serving: open requests end with an error, and Close waits
// for every goroutine the server started.
func (s *Server) Close() error {
	s.once.Do(func() {
		if s.cancel == nil {
			return // never started
		}
		s.cancel()
		<-s.done
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if err := s.srv.Shutdown(sctx); err != nil {
			s.srv.Close()
		}
		cancel()
		s.wg.Wait()
		if s.pub != nil {
			s.pub.close()
		}
	})
	return nil
}

// modelNow is the model's clock: real time since start, sped up.
func (s *Server) modelNow() time.Duration {
	return time.Duration(float64(time.Since(s.start)) * s.cfg.SpeedUp)
}

// wallAt is the real time of model time t.
func (s *Server) wallAt(t time.Duration) time.Time {
	return s.start.Add(time.Duration(float64(t) / s.cfg.SpeedUp))
}

// run owns the model: it takes submissions, completes steps when their
// end comes, and reports progress to the callers.
func (s *Server) run(ctx context.Context) {
	defer close(s.done)
	open := map[*sim.Job]*call{}
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var tick <-chan time.Time
		end, busy := s.model.Next()
		if busy {
			timer.Reset(time.Until(s.wallAt(end)))
			tick = timer.C
		}
		select {
		case <-ctx.Done():
			for _, c := range open {
				c.update(func(c *call) { c.err = ErrClosed })
			}
			return
		case c := <-s.submit:
			j, err := s.model.Submit(s.modelNow(), c.req)
			if err != nil {
				c.update(func(c *call) { c.err = err })
				break
			}
			j.Value = c
			open[j] = c
			c.update(func(c *call) { c.accepted = true })
		case <-tick:
			s.model.Advance(max(s.modelNow(), end))
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		s.report(open)
	}
}

// report sends the iteration's progress: token counts to the callers, the
// KV events to subscribers, the load to /metrics.
func (s *Server) report(open map[*sim.Job]*call) {
	var generated int64
	for j, c := range open {
		p := c.progress()
		if j.Generated() != p.generated || j.Done() != p.done || j.Cached() != p.cached {
			generated += int64(j.Generated() - p.generated)
			c.update(func(c *call) { c.generated, c.done, c.cached = j.Generated(), j.Done(), j.Cached() })
		}
		if j.Done() {
			delete(open, j)
		}
	}
	if s.pub != nil && len(s.events) > 0 {
		s.pub.publish(s.events)
	}
	nev := uint64(len(s.events))
	clear(s.events)
	s.events = s.events[:0]
	l := s.model.Load()
	s.mu.Lock()
	s.met.waiting, s.met.running, s.met.kvUsage = int(l.Waiting), int(l.Running), l.KVUsage
	s.met.generation += generated
	s.met.kvEvents += nev
	s.mu.Unlock()
}

func (s *Server) onKVEvent(ev kvindex.Event) {
	if s.pub != nil {
		s.events = append(s.events, copyEvent(ev))
	}
}

func (s *Server) onAdmitted(j *sim.Job) {
	s.mu.Lock()
	s.met.queries += int64(j.Prompt())
	s.met.hits += int64(j.Cached())
	s.met.prompt += int64(j.Prompt())
	s.mu.Unlock()
}

func (s *Server) onFinished(*sim.Job) {
	s.mu.Lock()
	s.met.success++
	s.mu.Unlock()
}

// do submits r to the model and returns its call, or an error when the
// server stops or ctx ends first.
func (s *Server) do(ctx context.Context, r *sim.Request) (*call, error) {
	c := &call{req: r, notify: make(chan struct{}, 1)}
	select {
	case s.submit <- c:
	case <-s.done:
		return nil, ErrClosed
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return c, nil
}

// wait blocks until c has progressed past seen generated tokens (or
// finished, or failed), the server stops, or ctx ends.
func (s *Server) wait(ctx context.Context, c *call, seen int) (progress, error) {
	for {
		p := c.progress()
		if p.err != nil {
			return p, p.err
		}
		if p.done || p.generated > seen {
			return p, nil
		}
		select {
		case <-c.notify:
		case <-s.done:
			if p := c.progress(); p.done || p.generated > seen {
				return p, nil
			}
			return p, ErrClosed
		case <-ctx.Done():
			return p, ctx.Err()
		}
	}
}
