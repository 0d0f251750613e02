package routing

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/kvbandit/kvbandit/routing/clock"
)

// Picker chooses an endpoint for one request. Pick does not block, does no
// I/O and may be called from many goroutines at once. Every returned
// Decision must be ended with Decision.Done exactly once.
type Picker interface {
	Pick(ctx context.Context, req *Request) (*Decision, error)
}

// Scorer scores the candidates for a request without side effects: no slot
// accounting, no reuse budget spent, no learning.
type Scorer interface {
	Score(ctx context.Context, req *Request) (*Decision, error)
}

// EndpointState is an endpoint in a snapshot together with its live
// counters. A snapshot's EndpointState is immutable except for *Live, which
// is shared by pointer across snapshot swaps so that a swap never resets
// in-flight counts.
type EndpointState struct {
	Endpoint
	*Live
}

// Live holds an endpoint's counters that outlive snapshots.
type Live struct {
	// InFlight is the number of decisions on the endpoint whose Done has
	// not been called yet.
	InFlight atomic.Int64
	// Decisions counts decisions made for the endpoint.
	Decisions atomic.Int64
}

// Choice is a policy's answer: the index of the chosen candidate in
// Scoring.Candidates, further candidates in preference order for fallbacks
// (may be nil), optional per-candidate scores aligned with the candidates,
// and policy-private state that comes back with the decision in Done.
type Choice struct {
	Index  int
	Ranked []int
	Scores []float64
	// State is kept in the Decision and handed back to the policy's Done.
	State any
}

// Policy chooses among eligible candidates. Implementations are safe for
// concurrent use and never block.
type Policy interface {
	// Name is the --policy value.
	Name() string
	// Choose picks one of s.Candidates (never empty). When commit is false
	// the call must have no side effects (Score): no learning, no budget
	// spent, no counters moved.
	Choose(s *Scoring, commit bool) (Choice, error)
	// Done receives the outcome of a committed decision, exactly once.
	Done(d *Decision, o Outcome)
}

// Deps are the engine's injected dependencies. Nil fields get defaults.
type Deps struct {
	Logger *slog.Logger
	Clock  clock.Clock
	Rand   *Rand
	// OnDecision, if set, is called after each committed pick.
	OnDecision func(*Request, *Decision)
	// OnDone, if set, is called after each Done with the outcome.
	OnDone func(*Decision, Outcome)
}

// Options are the engine's behaviour switches.
type Options struct {
	// Fallbacks is the number of extra endpoints to append to decisions.
	Fallbacks int
	// PassThroughUnknownModels routes a model no endpoint declares to any
	// endpoint instead of failing with ErrModelNotFound.
	PassThroughUnknownModels bool
}

type snapshot struct {
	set    EndpointSet
	states []*EndpointState
	byKey  map[EndpointKey]*EndpointState
	models map[ModelName]struct{}
	// anyModel is set when some endpoint declares no models.
	anyModel bool
}

// Engine is the [Picker] built from the current endpoint snapshot and a
// [Policy].
type Engine struct {
	policy Policy
	opts   Options
	log    *slog.Logger
	clk    clock.Clock
	rnd    *Rand
	deps   Deps

	snap atomic.Pointer[snapshot]
	ids  atomic.Uint64

	// mu serialises Update (the writer side only).
	mu sync.Mutex
}

var (
	_ Picker = (*Engine)(nil)
	_ Scorer = (*Engine)(nil)
)

// NewEngine returns an engine with an empty endpoint set.
func NewEngine(p Policy, opts Options, deps Deps) *Engine {
	e := &Engine{policy: p, opts: opts, deps: deps, clk: clock.Or(deps.Clock), rnd: deps.Rand, log: deps.Logger}
	if e.rnd == nil {
		e.rnd = NewRand(0)
	}
	if e.log == nil {
		e.log = slog.Default()
	}
	e.snap.Store(&snapshot{byKey: map[EndpointKey]*EndpointState{}, models: map[ModelName]struct{}{}})
	return e
}

// Policy returns the engine's policy.
func (e *Engine) Policy() Policy { return e.policy }

// Rand returns the engine's random source.
func (e *Engine) Rand() *Rand { return e.rnd }

// Clock returns the engine's clock.
func (e *Engine) Clock() clock.Clock { return e.clk }

// Update validates set and publishes it. On a validation error the current
// snapshot stays and the error is returned. Live counters of endpoints that
// stay are carried over.
func (e *Engine) Update(set EndpointSet) error {
	set.Endpoints = append([]Endpoint(nil), set.Endpoints...)
	if err := set.Validate(); err != nil {
		e.log.Warn("endpoint set rejected", "source", set.Source, "err", err)
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	old := e.snap.Load()
	next := &snapshot{set: set, byKey: make(map[EndpointKey]*EndpointState, len(set.Endpoints)), models: map[ModelName]struct{}{}}
	for _, ep := range set.Endpoints {
		st := &EndpointState{Endpoint: ep, Live: &Live{}}
		if prev, ok := old.byKey[ep.Key]; ok {
			st.Live = prev.Live
		}
		next.states = append(next.states, st)
		next.byKey[ep.Key] = st
		if len(ep.Models) == 0 {
			next.anyModel = true
		}
		for _, m := range ep.Models {
			next.models[m] = struct{}{}
		}
		for _, m := range ep.Adapters {
			next.models[m] = struct{}{}
		}
	}
	e.snap.Store(next)
	e.log.Info("endpoint set published", "source", set.Source, "endpoints", len(set.Endpoints))
	return nil
}

// Endpoints returns the current endpoint states (read-only).
func (e *Engine) Endpoints() []*EndpointState { return e.snap.Load().states }

// Ready reports whether an endpoint set has been published.
func (e *Engine) Ready() bool { return len(e.snap.Load().states) > 0 }

// Pick implements [Picker].
func (e *Engine) Pick(_ context.Context, req *Request) (*Decision, error) {
	return e.decide(req, true)
}

// Score implements [Scorer].
func (e *Engine) Score(_ context.Context, req *Request) (*Decision, error) {
	return e.decide(req, false)
}

// candidates filters the snapshot by model and subset hint.
func (s *snapshot) candidates(req *Request, passThrough bool) ([]*EndpointState, error) {
	if len(s.states) == 0 {
		return nil, ErrNoEndpoints
	}
	filterModel := req.Model != ""
	if filterModel && !s.anyModel {
		if _, ok := s.models[req.Model]; !ok {
			if !passThrough {
				return nil, fmt.Errorf("%w: %q", ErrModelNotFound, req.Model)
			}
			filterModel = false
		}
	}
	if !filterModel && req.Subset == nil {
		return s.states, nil
	}
	out := make([]*EndpointState, 0, len(s.states))
	for _, st := range s.states {
		if filterModel && !st.Serves(req.Model) {
			continue
		}
		if req.Subset != nil && !req.Subset.Contains(st.addr) {
			continue
		}
		out = append(out, st)
	}
	if len(out) == 0 {
		if req.Subset != nil {
			return nil, ErrSubsetEmpty
		}
		return nil, ErrNoEndpoints
	}
	return out, nil
}

func (e *Engine) decide(req *Request, commit bool) (*Decision, error) {
	snap := e.snap.Load()
	eps, err := snap.candidates(req, e.opts.PassThroughUnknownModels)
	if err != nil {
		return nil, err
	}
	sc := &Scoring{Req: req, ISL: req.TokenCount, Rand: e.rnd, Now: e.clk.Now(), Candidates: make([]Candidate, 0, len(eps))}
	for _, st := range eps {
		sc.Candidates = append(sc.Candidates, Candidate{State: st, DPRank: -1})
	}
	ch, err := e.policy.Choose(sc, commit)
	if err != nil {
		return nil, err
	}
	if ch.Index < 0 || ch.Index >= len(sc.Candidates) {
		return nil, fmt.Errorf("policy %s chose index %d of %d: %w", e.policy.Name(), ch.Index, len(sc.Candidates), ErrNoEndpoints)
	}
	c := &sc.Candidates[ch.Index]
	st := c.State
	d := &Decision{
		Policy:   e.policy.Name(),
		Endpoint: st.Key,
		DPRank:   c.DPRank,
		Overlap:  c.Overlap,
		At:       sc.Now,
		state:    ch.State,
	}
	if ch.Scores != nil {
		d.Scores = make([]Score, len(sc.Candidates))
		for i := range sc.Candidates {
			d.Scores[i] = Score{Endpoint: sc.Candidates[i].Key(), DPRank: sc.Candidates[i].DPRank, Score: ch.Scores[i]}
		}
	}
	if e.opts.Fallbacks > 0 {
		for _, i := range ch.Ranked {
			if len(d.Fallbacks) == e.opts.Fallbacks {
				break
			}
			if i >= 0 && i < len(sc.Candidates) {
				k := sc.Candidates[i].Key()
				if k != st.Key && !slices.Contains(d.Fallbacks, k) {
					d.Fallbacks = append(d.Fallbacks, k)
				}
			}
		}
	}
	if !commit {
		d.done.Store(true)
		return d, nil
	}
	d.ID = strconv.FormatUint(e.ids.Add(1), 36)
	d.live = st.Live
	st.InFlight.Add(1)
	st.Decisions.Add(1)
	d.onEnd = e.end
	if e.deps.OnDecision != nil {
		e.deps.OnDecision(req, d)
	}
	return d, nil
}

func (e *Engine) end(d *Decision, o Outcome) {
	e.policy.Done(d, o)
	if e.deps.OnDone != nil {
		e.deps.OnDone(d, o)
	}
}
