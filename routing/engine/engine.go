package engine

import (
	"github.com/kvbandit/kvbandit/routing"

	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/admission"
	"github.com/kvbandit/kvbandit/routing/burst"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// Engine is the [Picker] built from the current endpoint snapshot and a
// [Policy].
type Engine struct {
	policy routing.Policy
	opts   Options
	log    *slog.Logger
	clk    clock.Clock
	rnd    *routing.Rand
	deps   Deps

	snap  atomic.Pointer[snapshot]
	ids   atomic.Uint64
	index *kvindex.Index
	queue *admission.Queue
	bufs  sync.Pool // *scratch

	expired atomic.Int64
	// servedUnknown counts outcomes served by an endpoint outside the set.
	servedUnknown atomic.Int64
	// remoteExpired counts peers' decisions released by their stale timer;
	// remoteOpen and remoteBlocks are the peers' decisions open and the
	// block keys they hold (bounded by the Options).
	remoteExpired atomic.Int64
	remoteOpen    atomic.Int64
	remoteBlocks  atomic.Int64
	// ejectErrors and ejectScrape count ejections by reason.
	ejectErrors atomic.Int64
	ejectScrape atomic.Int64
	// pdCount counts committed decisions by PDOutcome.
	pdCount [routing.PDOutcomeCount]atomic.Int64
	// inserts feeds the index goroutine (nil with SyncIndex).
	inserts      chan insert
	insertsDone  chan struct{}
	insertsDrop  atomic.Int64
	closeInserts sync.Once
	budget       insertBudget
	// keyBlockSize is the block size of the last prompt hashed or keyed
	// (KeyBlockSize).
	keyBlockSize atomic.Int64

	// burst gives decisions their turns in a burst (nil without
	// Options.Burst.Delay).
	burst *burst.Meter

	// mu serialises Update (the writer side only).
	mu sync.Mutex
}

var (
	_ routing.Picker = (*Engine)(nil)
	_ routing.Scorer = (*Engine)(nil)
)

// New returns an engine with an empty endpoint set. It fails only on
// invalid index or admission options. Close releases its timers.
func New(p routing.Policy, opts Options, deps Deps) (*Engine, error) {
	opts.defaults()
	e := &Engine{policy: p, opts: opts, deps: deps, clk: clock.Or(deps.Clock), rnd: deps.Rand, log: deps.Logger}
	if e.rnd == nil {
		e.rnd = routing.NewRand(0)
	}
	if e.log == nil {
		e.log = slog.Default()
	}
	io := opts.Index
	io.Clock = e.clk
	ix, err := kvindex.New(io)
	if err != nil {
		return nil, err
	}
	e.index = ix
	if e.burst, err = burst.NewMeter(opts.Burst); err != nil {
		ix.Close()
		return nil, err
	}
	if opts.Admission.Enabled() {
		q, err := admission.New(opts.Admission, e.clk, admission.SaturationFunc(e.saturated))
		if err != nil {
			ix.Close()
			return nil, err
		}
		e.queue = q
	}
	e.bufs.New = func() any { return &scratch{} }
	e.budget.b.rate = float64(opts.InsertBlocksPerSecond)
	if !opts.SyncIndex {
		e.inserts = make(chan insert, insertQueue)
		e.insertsDone = make(chan struct{})
		go e.applyInserts()
	}
	e.snap.Store(&snapshot{byKey: map[routing.EndpointKey]*endpoint{}, models: map[routing.ModelName]struct{}{}})
	return e, nil
}

// Must is New for options known to be valid (tests, defaults).
func Must(p routing.Policy, opts Options, deps Deps) *Engine {
	e, err := New(p, opts, deps)
	if err != nil {
		panic(err)
	}
	return e
}

// Close stops the engine's index goroutine (after applying what is queued)
// and timers. Decisions still open keep working; their stale-decision
// timers fire as usual. Pick must not be called after Close.
func (e *Engine) Close() {
	e.closeInserts.Do(func() {
		if e.inserts != nil {
			close(e.inserts)
			<-e.insertsDone
		}
		e.index.Close()
	})
}

// Index returns the KV index (for KV-event ingestion and metrics).
func (e *Engine) Index() *kvindex.Index { return e.index }

// Queue returns the admission queue, or nil when it is off.
func (e *Engine) Queue() *admission.Queue { return e.queue }

// Expired returns how many decisions the stale-decision sweeper released.
func (e *Engine) Expired() int64 { return e.expired.Load() }

// Policy returns the engine's policy.
func (e *Engine) Policy() routing.Policy { return e.policy }

// Rand returns the engine's random source.
func (e *Engine) Rand() *routing.Rand { return e.rnd }

// Clock returns the engine's clock.
func (e *Engine) Clock() clock.Clock { return e.clk }

// KeyBlockSize is the block size a caller should precompute a request's
// Keys at: that of the first candidate of the last decision (endpoints
// report their own), Options.BlockSize before any decision.
func (e *Engine) KeyBlockSize() int {
	if bs := e.keyBlockSize.Load(); bs > 0 {
		return int(bs)
	}
	return e.opts.BlockSize
}

// Endpoints returns the current endpoint states (read-only).
func (e *Engine) Endpoints() []*routing.EndpointState { return e.snap.Load().states }

// Ready reports whether an endpoint set has been published.
func (e *Engine) Ready() bool { return len(e.snap.Load().states) > 0 }

// Pick implements [Picker]. With the admission queue on, a request that
// arrives while every endpoint is saturated waits here (Pick blocks only
// then and for its turn in a burst, never on I/O), up to the queue's
// maximum wait; it is rejected with an error wrapping ErrOverloaded when
// it is sheddable, the queue is full or the wait runs out, and with ctx's
// cause when ctx ends first. In a burst across the pool's replicas
// (Options.Burst) a decision first waits for this replica's turn, a few
// milliseconds at most ([Engine.Turn]).
func (e *Engine) Pick(ctx context.Context, req *routing.Request) (*routing.Decision, error) {
	if err := e.waitTurn(ctx, req); err != nil {
		return nil, err
	}
	if e.queue == nil {
		return e.decide(req, true)
	}
	var d *routing.Decision
	var perr error
	prio := 0
	if req.Hints.HasPriority {
		prio = req.Hints.Priority
	}
	var deadline time.Time
	if obj := req.Hints.TTFTObjective; obj > 0 && !req.Arrival.IsZero() {
		deadline = req.Arrival.Add(obj)
	}
	err := e.queue.Admit(ctx, admission.Item{
		Priority:  prio,
		HeadStart: req.Hints.HeadStart(),
		Cost:      float64(req.TokenCount),
		Arrival:   req.Arrival,
		Deadline:  deadline,
		OnAdmit:   func() { d, perr = e.decide(req, true) },
	})
	switch {
	case err == nil:
		return d, perr
	case errors.Is(err, admission.ErrShed), errors.Is(err, admission.ErrQueueFull), errors.Is(err, admission.ErrWaitExceeded):
		return nil, fmt.Errorf("%w: %w", routing.ErrOverloaded, err)
	}
	if cause := context.Cause(ctx); cause != nil {
		return nil, cause
	}
	return nil, err
}

// Score implements [Scorer].
func (e *Engine) Score(_ context.Context, req *routing.Request) (*routing.Decision, error) {
	return e.decide(req, false)
}
