package routing

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/admission"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/slots"
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
	// ranks holds each data-parallel rank's slot (in-flight load) and KV
	// index worker; immutable once the Live is published.
	ranks []*rankState
	// scraped is the endpoint's last scraped load; nil until a scrape.
	scraped atomic.Pointer[Load]
	// blockSize is the block size the worker reports (vllm:cache_config_info);
	// 0 until known. Discovery's block size, when given, wins.
	blockSize atomic.Int64
	// rankLoads is each rank's scraped load (one per rank); nil unless the
	// endpoint has several ranks and the worker reports them.
	rankLoads atomic.Pointer[[]Load]
	// health is the endpoint's ejection state.
	health health
	// adapters are the LoRA adapters the worker reported.
	adapters adapterSet

	// InFlight is the number of this replica's decisions on the endpoint
	// whose Done has not been called yet.
	InFlight atomic.Int64
	// RemoteInFlight is the number of peer replicas' decisions on the
	// endpoint applied with [Engine.StartRemote] and not ended yet.
	RemoteInFlight atomic.Int64
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
	// Sticky is set when the request stayed on its session's previous
	// endpoint (prefix affinity), for metrics and the decision log.
	Sticky bool
	// Session is where the request went relative to its session (a policy
	// that keeps sessions sets it for requests with a prefix id).
	Session SessionTurn
	// Predicted is each candidate's predicted TTFT (a [Predictor]'s
	// means), filled when Scoring.WantPredicted is set; Prediction is the
	// chosen candidate's, for a policy that predicts, when Predicted is
	// not filled. Both are optional.
	Predicted  []Prediction
	Prediction Prediction
}

// Policy chooses among eligible candidates. Implementations are safe for
// concurrent use and never block.
type Policy interface {
	// Name is the --policy value.
	Name() string
	// Choose picks one of s.Candidates (never empty). When commit is false
	// the call must have no side effects (Score): no learning, no budget
	// spent, no counters moved. s.Candidates is the engine's pooled buffer:
	// it is reused once Choose and the decision's making return, so a
	// policy must not keep it (or pointers into it) beyond the call.
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
	// OnFirst, if set, is called when a committed decision's first token
	// arrives (the first Decision.Prefilled before Done).
	OnFirst func(*Decision)
	// OnTimings, if set, receives the wall-clock cost of each committed
	// decision's phases (measured with the monotonic clock, not Clock:
	// this is routing overhead, not simulated time).
	OnTimings func(Timings)
	// Gate, if set, narrows the candidates of requests with a TTFT
	// objective before the policy chooses (routing/slo).
	Gate Gate
	// PD, if set, disaggregates requests in pools with prefill-role
	// endpoints (routing/pd); nil ignores roles.
	PD Disaggregator
}

// Gate narrows the candidates of a request that has a TTFT objective.
// Filter returns the indexes of s.Candidates the policy may choose from
// (ascending, at least one), nil for all, or an error that rejects the
// request (wrapping ErrOverloaded for a 429). It must not modify s and,
// when commit is false, must have no side effects. It is called
// concurrently and must not block.
type Gate interface {
	Filter(s *Scoring, p Policy, commit bool) ([]int, error)
}

// Timings is the routing overhead of one decision, by phase.
type Timings struct {
	// Hash is computing the prompt's block keys.
	Hash time.Duration
	// HashedBlocks is how many block keys the engine hashed (0 when it
	// used the request's Keys).
	HashedBlocks int
	// Lookup is the KV index and in-flight walks for every candidate.
	Lookup time.Duration
	// Score is the policy's Choose.
	Score time.Duration
	// Total is the whole Pick (without admission waiting).
	Total time.Duration
}

// Options are the engine's behaviour switches. The zero value is usable:
// zero fields take the defaults below.
type Options struct {
	// Fallbacks is the number of extra endpoints to append to decisions.
	Fallbacks int
	// PassThroughUnknownModels routes a model no endpoint declares to any
	// endpoint instead of failing with ErrModelNotFound.
	PassThroughUnknownModels bool
	// BlockSize is the KV block size in tokens for endpoints that do not
	// report their own (--router-block-size, default 16).
	BlockSize int
	// DisableActiveBlocks turns off the in-flight block accounting
	// (--no-router-track-active-blocks): no request blocks are held.
	DisableActiveBlocks bool
	// StaleAfter releases a decision whose Done never came
	// (default 5 minutes).
	StaleAfter time.Duration
	// Index configures the KV index's approximate mode (TTL, cap, pruning).
	Index kvindex.Options
	// Admission configures the admission queue (off unless Threshold > 0).
	Admission admission.Config
	// DefaultMaxBatchedTokens is an endpoint's prefill capacity when
	// discovery does not say (default 8192).
	DefaultMaxBatchedTokens int
	// SyncIndex applies approximate index inserts inside Pick instead of on
	// the engine's index goroutine. The virtual-time simulator and tests
	// use it for determinism; serving leaves it off so that Pick never
	// takes the index's writer lock.
	SyncIndex bool
	// Ejection configures passive (outcomes) and active (scrapes)
	// ejection of unhealthy endpoints.
	Ejection EjectionOptions
	// AdapterRetention is how long a LoRA adapter reported by an
	// endpoint's worker keeps routing its model there after the worker
	// last reported it (default 10 minutes; negative: only the latest
	// report counts).
	AdapterRetention time.Duration
	// MaxRemoteDecisions bounds the peer replicas' decisions open at once
	// ([Engine.StartRemote]; default DefaultMaxRemoteDecisions), and
	// RemoteBlockBudget the block keys they hold (default
	// DefaultRemoteBlockBudget). Beyond either, StartRemote refuses with
	// ErrRemoteLimit: the sync layer's TTLs normally keep far below.
	MaxRemoteDecisions int
	RemoteBlockBudget  int
	// TierWeights price lower-tier (CPU, disk) cache hits for the policies
	// (router.tier_weights; zero: DefaultTierWeights).
	TierWeights TierWeights
	// MaxInsertBlocks bounds the leading blocks of one prompt that go
	// into the approximate index (default DefaultMaxInsertBlocks; negative:
	// no bound). Deeper blocks are not recorded, so overlap is credited up
	// to it.
	MaxInsertBlocks int
	// InsertBlocksPerSecond bounds the blocks all approximate inserts add
	// per second of the engine's clock, with a burst of one second's worth
	// (default DefaultInsertBlocksPerSecond; negative: no bound). A prompt
	// beyond the budget has only its leading blocks that fit inserted (none
	// when it is spent), and the rest are counted (InsertBlocksLimited):
	// a burst of distinct prompts then cannot push the table to its cap and
	// into pruning.
	InsertBlocksPerSecond int
	// InsertTokensPerRank bounds, in the same way, the tokens (blocks ×
	// block size) approximate inserts add per second for one rank (default
	// DefaultInsertTokensPerRank; negative: no bound). A rank cannot have
	// cached more than it prefilled, and no engine rank prefills much beyond
	// the default a second, so blocks over it describe cache the rank never
	// built.
	InsertTokensPerRank int
}

// insert is one approximate index insert queued off the request path.
type insert struct {
	worker kvindex.WorkerID
	bs     int
	keys   []uint64
	at     time.Time
}

// insertQueue bounds the approximate inserts waiting for the index
// goroutine; beyond it inserts are dropped and counted.
const insertQueue = 4096

// Defaults for [Options].
const (
	DefaultBlockSize        = 16
	DefaultStaleAfter       = 5 * time.Minute
	DefaultMaxBatchedTokens = 8192
	// DefaultMaxInsertBlocks is 128k tokens at the default block size.
	DefaultMaxInsertBlocks = 8192
	// DefaultInsertBlocksPerSecond is 1/16 of the index's default cap
	// (kvindex.DefaultMaxEntries) per second.
	DefaultInsertBlocksPerSecond = 1 << 16
	// DefaultInsertTokensPerRank is 65,536 tokens a second (4096 blocks of
	// 16), above the prefill throughput of one engine rank serving the
	// models a router is put in front of (an 8B model's prefill costs about
	// 16 GFLOP a token: some 40k tokens a second on an H100 at a realistic
	// 700 TFLOP/s).
	DefaultInsertTokensPerRank = 1 << 16
)

func (o *Options) defaults() {
	if o.BlockSize <= 0 {
		o.BlockSize = DefaultBlockSize
	}
	if o.StaleAfter <= 0 {
		o.StaleAfter = DefaultStaleAfter
	}
	if o.DefaultMaxBatchedTokens <= 0 {
		o.DefaultMaxBatchedTokens = DefaultMaxBatchedTokens
	}
	if o.AdapterRetention == 0 {
		o.AdapterRetention = DefaultAdapterRetention
	}
	if o.MaxRemoteDecisions <= 0 {
		o.MaxRemoteDecisions = DefaultMaxRemoteDecisions
	}
	if o.RemoteBlockBudget <= 0 {
		o.RemoteBlockBudget = DefaultRemoteBlockBudget
	}
	if o.MaxInsertBlocks == 0 {
		o.MaxInsertBlocks = DefaultMaxInsertBlocks
	}
	if o.InsertBlocksPerSecond == 0 {
		o.InsertBlocksPerSecond = DefaultInsertBlocksPerSecond
	}
	if o.InsertTokensPerRank == 0 {
		o.InsertTokensPerRank = DefaultInsertTokensPerRank
	}
	o.TierWeights = o.TierWeights.OrDefault()
	o.Ejection.defaults()
}

// bucket is a token bucket of units (blocks engine-wide, tokens per rank)
// per second with a burst of one second's worth; rate <= 0 is unbounded.
// Its owner serialises it.
type bucket struct {
	rate   float64 // units per second
	blocks float64 // units available, at most rate
	at     time.Time
}

// avail refills the bucket to now and returns the whole units it holds
// (or want when unbounded), at most want.
func (b *bucket) avail(want int, now time.Time) int {
	if b.rate <= 0 {
		return want
	}
	if dt := now.Sub(b.at); dt > 0 || b.at.IsZero() {
		b.blocks = min(b.rate, b.blocks+b.rate*dt.Seconds())
		if b.at.IsZero() {
			b.blocks = b.rate
		}
		b.at = now
	}
	return min(want, int(b.blocks))
}

// spend takes n units that avail granted.
func (b *bucket) spend(n int) {
	if b.rate > 0 {
		b.blocks -= float64(n)
	}
}

// insertBudget is the engine-wide bucket of InsertBlocksPerSecond.
type insertBudget struct {
	mu      sync.Mutex
	b       bucket
	limited atomic.Int64 // blocks not inserted for want of budget
}

// take returns how many of want blocks may be inserted at now (a prefix of
// them), at most allow (the rank's own budget), spends them, and counts the
// rest as limited.
func (b *insertBudget) take(want, allow int, now time.Time) int {
	b.mu.Lock()
	got := b.b.avail(allow, now)
	b.b.spend(got)
	b.mu.Unlock()
	if got < want {
		b.limited.Add(int64(want - got))
	}
	return got
}

// rankState is one data-parallel rank of an endpoint.
type rankState struct {
	slot   *slots.Slot
	worker kvindex.WorkerID
	// eventFed is set when the rank's KV events keep the index exact; it
	// then gets no approximate inserts.
	eventFed atomic.Bool
	// memo is the policy's per-rank state (Candidate.Memo).
	memo atomic.Pointer[any]

	// recent remembers the last chains inserted into the approximate index
	// for this rank, so that a prompt extending one of them (an agent's
	// next turn, a shared system prompt) only inserts its new blocks: the
	// index stamps entries to the second, so a refresh within the same
	// second changes nothing.
	recentMu sync.Mutex
	recent   [4]recentChain
	recentAt int
	// budget is the rank's InsertTokensPerRank bucket, in tokens (under
	// recentMu).
	budget bucket
}

type recentChain struct {
	keys []uint64
	at   time.Time
}

// fresh returns the keys not inserted for this rank within the last
// second (those after the longest prefix shared with a recent chain), cut
// to the count the rank's budget (blocks of bs tokens) and b allow, and
// records what it returns as inserted at now.
func (r *rankState) fresh(keys []uint64, bs int, now time.Time, b *insertBudget) []uint64 {
	r.recentMu.Lock()
	defer r.recentMu.Unlock()
	skip := 0
	for i := range r.recent {
		c := &r.recent[i]
		if c.keys == nil || now.Sub(c.at) >= time.Second || now.Before(c.at) {
			continue
		}
		skip = max(skip, slots.CommonPrefix(keys, c.keys))
	}
	if skip == len(keys) {
		r.record(keys, now)
		return nil
	}
	want := len(keys) - skip
	got := b.take(want, r.budget.avail(want*bs, now)/bs, now)
	r.budget.spend(got * bs)
	if skip+got > 0 {
		r.record(keys[:skip+got], now)
	}
	return keys[skip : skip+got]
}

func (r *rankState) record(keys []uint64, now time.Time) {
	r.recent[r.recentAt] = recentChain{keys: keys, at: now}
	r.recentAt = (r.recentAt + 1) % len(r.recent)
}

type snapshot struct {
	set    EndpointSet
	states []*EndpointState
	byKey  map[EndpointKey]*EndpointState
	models map[ModelName]struct{}
	// anyModel is set when some endpoint declares no models.
	anyModel bool
	// prefillRole is set when some endpoint has the prefill role.
	prefillRole bool
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
	pdCount [pdOutcomes]atomic.Int64
	// inserts feeds the index goroutine (nil with SyncIndex).
	inserts      chan insert
	insertsDone  chan struct{}
	insertsDrop  atomic.Int64
	closeInserts sync.Once
	budget       insertBudget
	// keyBlockSize is the block size of the last prompt hashed or keyed
	// (KeyBlockSize).
	keyBlockSize atomic.Int64

	// mu serialises Update (the writer side only).
	mu sync.Mutex
}

var (
	_ Picker = (*Engine)(nil)
	_ Scorer = (*Engine)(nil)
)

// NewEngine returns an engine with an empty endpoint set. It fails only on
// invalid index or admission options. Close releases its timers.
func NewEngine(p Policy, opts Options, deps Deps) (*Engine, error) {
	opts.defaults()
	e := &Engine{policy: p, opts: opts, deps: deps, clk: clock.Or(deps.Clock), rnd: deps.Rand, log: deps.Logger}
	if e.rnd == nil {
		e.rnd = NewRand(0)
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
	e.snap.Store(&snapshot{byKey: map[EndpointKey]*EndpointState{}, models: map[ModelName]struct{}{}})
	return e, nil
}

// MustEngine is NewEngine for options known to be valid (tests, defaults).
func MustEngine(p Policy, opts Options, deps Deps) *Engine {
	e, err := NewEngine(p, opts, deps)
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

// applyInserts is the index goroutine: it applies approximate inserts in
// decision order.
func (e *Engine) applyInserts() {
	defer close(e.insertsDone)
	for in := range e.inserts {
		_ = e.index.InsertApprox(in.worker, in.bs, in.keys, in.at)
	}
}

// ApplyKVEvent feeds one KV event of an endpoint's rank (-1 for a
// single-rank endpoint) into the index. Whether the endpoint's events are
// complete (so approximate inserts stop) is said with TrustKVEvents. Events
// of one rank must be applied in order (the caller's
// per-endpoint consumer does that). Errors are the index's (unknown parent,
// block size mismatch, unknown endpoint).
func (e *Engine) ApplyKVEvent(ep EndpointKey, rank int, ev kvindex.Event) error {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return fmt.Errorf("%w: %s", kvindex.ErrUnknownWorker, ep)
	}
	i := max(rank, 0)
	if i >= len(st.ranks) {
		return fmt.Errorf("%w: %s rank %d of %d", kvindex.ErrUnknownWorker, ep, rank, len(st.ranks))
	}
	return e.index.Apply(st.ranks[i].worker, ev)
}

// TrustKVEvents says whether an endpoint's KV events can be trusted to
// describe its whole cache (no gap since a known state). A trusted endpoint
// gets no approximate inserts; an untrusted one is indexed approximately
// again, on top of what its events said, until it is trusted again.
func (e *Engine) TrustKVEvents(ep EndpointKey, trusted bool) {
	if st, ok := e.snap.Load().byKey[ep]; ok {
		for _, rs := range st.ranks {
			rs.eventFed.Store(trusted)
		}
	}
}

// InsertBlocksLimited counts the blocks approximate inserts left out
// for Options.MaxInsertBlocks or InsertBlocksPerSecond.
func (e *Engine) InsertBlocksLimited() int64 { return e.budget.limited.Load() }

// DroppedInserts counts approximate inserts dropped because the index
// goroutine fell behind.
func (e *Engine) DroppedInserts() int64 { return e.insertsDrop.Load() }

// Index returns the KV index (for KV-event ingestion and metrics).
func (e *Engine) Index() *kvindex.Index { return e.index }

// Queue returns the admission queue, or nil when it is off.
func (e *Engine) Queue() *admission.Queue { return e.queue }

// Expired returns how many decisions the stale-decision sweeper released.
func (e *Engine) Expired() int64 { return e.expired.Load() }

// Policy returns the engine's policy.
func (e *Engine) Policy() Policy { return e.policy }

// Rand returns the engine's random source.
func (e *Engine) Rand() *Rand { return e.rnd }

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
		st := &EndpointState{Endpoint: ep}
		prev, had := old.byKey[ep.Key]
		switch {
		case had && len(prev.ranks) == max(ep.DataParallelSize, 1):
			st.Live = prev.Live
		case had:
			// Its ranks changed: start its cache state afresh. In-flight
			// decisions keep their own slot pointers.
			e.index.RemoveEndpoint(string(ep.Key))
			st.Live = e.newLive(ep)
		default:
			st.Live = e.newLive(ep)
		}
		next.states = append(next.states, st)
		next.byKey[ep.Key] = st
		if len(ep.Models) == 0 {
			next.anyModel = true
		}
		next.prefillRole = next.prefillRole || ep.Role == RolePrefill
		for _, m := range ep.Models {
			next.models[m] = struct{}{}
		}
		for _, m := range ep.Adapters {
			next.models[m] = struct{}{}
		}
	}
	e.snap.Store(next)
	for k := range old.byKey {
		if _, ok := next.byKey[k]; !ok {
			e.index.RemoveEndpoint(string(k)) // purge a removed endpoint
		}
	}
	e.log.Info("endpoint set published", "source", set.Source, "endpoints", len(set.Endpoints))
	return nil
}

// Endpoints returns the current endpoint states (read-only).
func (e *Engine) Endpoints() []*EndpointState { return e.snap.Load().states }

// Ready reports whether an endpoint set has been published.
func (e *Engine) Ready() bool { return len(e.snap.Load().states) > 0 }

// Pick implements [Picker]. With the admission queue on, a request that
// arrives while every endpoint is saturated waits here (Pick blocks only
// then, never on I/O), up to the queue's maximum wait; it is rejected with
// an error wrapping ErrOverloaded when it is sheddable, the queue is full
// or the wait runs out, and with ctx's cause when ctx ends first.
func (e *Engine) Pick(ctx context.Context, req *Request) (*Decision, error) {
	if e.queue == nil {
		return e.decide(req, true)
	}
	var d *Decision
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
		return nil, fmt.Errorf("%w: %w", ErrOverloaded, err)
	}
	if cause := context.Cause(ctx); cause != nil {
		return nil, cause
	}
	return nil, err
}

// Score implements [Scorer].
func (e *Engine) Score(_ context.Context, req *Request) (*Decision, error) {
	return e.decide(req, false)
}

// candidates filters the snapshot by model and subset hint, then drops
// ejected endpoints (at now, unix nanos) unless health is false or every
// eligible endpoint is ejected.
func (s *snapshot) candidates(req *Request, passThrough, health bool, now int64) ([]*EndpointState, error) {
	if len(s.states) == 0 {
		return nil, ErrNoEndpoints
	}
	filterModel := req.Model != ""
	if filterModel && !s.anyModel {
		if _, ok := s.models[req.Model]; !ok && !s.scrapedAdapter(req.Model) {
			if !passThrough {
				return nil, fmt.Errorf("%w: %s", ErrModelNotFound, quoteModel(req.Model))
			}
			filterModel = false
		}
	}
	if !filterModel && req.Subset == nil {
		if health {
			return filterHealthy(s.states, now, false), nil
		}
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
	if health {
		out = filterHealthy(out, now, true)
	}
	return out, nil
}

// maxQuotedModel bounds the bytes of a model name quoted in an error: the
// name comes from the client's body, and the error goes back to it (and to
// logs).
const maxQuotedModel = 256

// quoteModel quotes m for an error message, cut to maxQuotedModel bytes.
func quoteModel(m ModelName) string {
	if len(m) <= maxQuotedModel {
		return strconv.Quote(string(m))
	}
	return strconv.Quote(string(m[:maxQuotedModel])) + "... (" + strconv.Itoa(len(m)) + " bytes)"
}

// scrapedAdapter reports whether some endpoint's worker reported model as
// a LoRA adapter (the slow path for models discovery does not declare).
func (s *snapshot) scrapedAdapter(model ModelName) bool {
	for _, st := range s.states {
		if st.adapters.has(model) {
			return true
		}
	}
	return false
}

// newLive makes the live state of a new endpoint: one slot and one index
// worker per data-parallel rank.
func (e *Engine) newLive(ep Endpoint) *Live {
	n := max(ep.DataParallelSize, 1)
	l := &Live{ranks: make([]*rankState, n)}
	for r := range n {
		rank := r
		if n == 1 {
			rank = -1
		}
		l.ranks[r] = &rankState{slot: &slots.Slot{}, worker: e.index.Worker(string(ep.Key), rank), budget: bucket{rate: float64(e.opts.InsertTokensPerRank)}}
	}
	return l
}

// SetLoad publishes a scraped load for the endpoint (called by the load
// scraper, off the request path).
func (l *Live) SetLoad(ld Load) { l.scraped.Store(&ld) }

// load returns the endpoint's last scraped load (zero when none).
func (l *Live) load() Load {
	if p := l.scraped.Load(); p != nil {
		return *p
	}
	return Load{}
}

// ActiveBlocks returns each rank's KV blocks held by in-flight requests.
func (l *Live) ActiveBlocks() []int64 {
	out := make([]int64, len(l.ranks))
	for i, r := range l.ranks {
		out[i] = r.slot.Blocks()
	}
	return out
}

// InFlightPrefill is the endpoint's prompt tokens still being prefilled,
// over all ranks.
func (l *Live) InFlightPrefill() int64 {
	var n int64
	for _, r := range l.ranks {
		n += r.slot.PrefillTokens()
	}
	return n
}

// saturated reports whether every endpoint is saturated: its active prefill
// tokens exceed Threshold × its prefill capacity, or its load data is stale.
// When every endpoint's data is stale, load is unknown, not overloaded, and
// only the prefill rule applies.
func (e *Engine) saturated() bool {
	states := e.snap.Load().states
	if len(states) == 0 {
		return false
	}
	allStale := true
	for _, st := range states {
		if !st.load().Stale {
			allStale = false
			break
		}
	}
	for _, st := range states {
		if st.load().Stale && !allStale {
			continue
		}
		capacity := st.MaxBatchedTokens
		if capacity <= 0 {
			capacity = e.opts.DefaultMaxBatchedTokens
		}
		if float64(st.InFlightPrefill()) <= e.opts.Admission.Threshold*float64(capacity) {
			return false
		}
	}
	return true
}

// rank returns the candidate's rank state.
func (c *Candidate) rank() *rankState {
	if c.DPRank < 0 {
		return c.State.ranks[0]
	}
	return c.State.ranks[c.DPRank]
}

// blockSize is the endpoint's KV block size: from discovery, else as the
// worker reports it, else the router default.
func (e *Engine) blockSize(st *EndpointState) int {
	if st.BlockSize > 0 {
		return st.BlockSize
	}
	if bs := st.Live.blockSize.Load(); bs > 0 {
		return int(bs)
	}
	return e.opts.BlockSize
}

// ReportLoad publishes an endpoint's scraped load and, when the worker
// reports it, its KV block size (0: unknown). It is called by the load
// scraper, off the request path; an unknown endpoint is ignored. It wakes
// the admission queue, since load data may have freed capacity. Known,
// fresh load (a good scrape) ends an ejection for failed scrapes.
func (e *Engine) ReportLoad(ep EndpointKey, ld Load, blockSize int) bool {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return false
	}
	st.SetLoad(ld)
	if ld.Known && !ld.Stale {
		e.scrapeOK(st)
	}
	if blockSize > 0 {
		st.Live.blockSize.Store(int64(blockSize))
	}
	if e.queue != nil {
		e.queue.Wake()
	}
	return true
}

// scratch holds per-call buffers, pooled: nothing in them outlives the
// decide call that took them (Policy.Choose keeps no candidate).
type scratch struct {
	index      []kvindex.Match
	candidates []Candidate
	spaceOf    []int8
}

// release clears the candidates' pointers (so a pooled buffer keeps no
// endpoint state alive) and returns sb to the pool.
func (e *Engine) release(sb *scratch, cs []Candidate) {
	clear(cs)
	e.bufs.Put(sb)
}

// keySpace is one block size's view of the request.
type keySpace struct {
	bs    int
	keys  []uint64
	index []kvindex.Match
}

func (e *Engine) decide(req *Request, commit bool) (*Decision, error) {
	snap := e.snap.Load()
	now := e.clk.Now()
	pdRoles, health := snap.prefillRole && e.deps.PD != nil, !e.opts.Ejection.Disabled
	eps, err := snap.candidates(req, e.opts.PassThroughUnknownModels, health && !pdRoles, now.UnixNano())
	if err != nil {
		return nil, err
	}
	if pdRoles && health {
		eps = healthyByRole(eps, now.UnixNano())
	}
	n := 0
	for _, st := range eps {
		n += len(st.ranks)
	}
	sb := e.bufs.Get().(*scratch)
	sc := &Scoring{Req: req, ISL: req.TokenCount, Rand: e.rnd, Now: now, Candidates: slices.Grow(sb.candidates[:0], n), WantRanked: e.opts.Fallbacks > 0, WantPredicted: !commit, TierWeights: e.opts.TierWeights}
	sb.candidates = sc.Candidates
	defer func() { e.release(sb, sb.candidates[:n]) }()
	timed := commit && e.deps.OnTimings != nil
	var tm Timings
	var t0, tLook time.Time
	if timed {
		t0 = time.Now()
	}
	seed := kvindex.Seed(req.LoRA, req.CacheSalt)
	var spaces [2]keySpace // almost always one block size; more spill to heap
	spaceList := spaces[:0]
	space := func(bs int) int {
		for i := range spaceList {
			if spaceList[i].bs == bs {
				return i
			}
		}
		var th time.Time
		if timed {
			th = time.Now()
		}
		ks := keySpace{bs: bs}
		var given bool
		if ks.keys, given = req.Keys.For(bs, seed, req.Tokens); !given {
			ks.keys = kvindex.AppendBlockKeys(nil, req.Tokens, bs, seed)
			tm.HashedBlocks += len(ks.keys)
		}
		if timed {
			tm.Hash += time.Since(th)
		}
		if len(spaceList) == 0 {
			if int64(bs) != e.keyBlockSize.Load() {
				e.keyBlockSize.Store(int64(bs))
			}
			ks.index = e.index.Overlaps(bs, ks.keys, sb.index[:0])
			sb.index = ks.index
		} else {
			ks.index = e.index.Overlaps(bs, ks.keys, nil)
		}
		// Candidates find their overlap by binary search on the worker id.
		byWorker := func(a, b kvindex.Match) int { return cmp.Compare(a.Worker, b.Worker) }
		if !slices.IsSortedFunc(ks.index, byWorker) {
			slices.SortFunc(ks.index, byWorker)
		}
		spaceList = append(spaceList, ks)
		return len(spaceList) - 1
	}
	spaceOf := slices.Grow(sb.spaceOf[:0], n)
	sb.spaceOf = spaceOf
	for _, st := range eps {
		si := space(e.blockSize(st))
		ks := &spaceList[si]
		ld := st.Live.load()
		var rankLoads []Load
		if len(st.ranks) > 1 {
			if p := st.rankLoads.Load(); p != nil && len(*p) == len(st.ranks) {
				rankLoads = *p
			}
		}
		for r, rs := range st.ranks {
			c := Candidate{State: st, DPRank: -1, NewBlocks: len(ks.keys)}
			if len(st.ranks) > 1 {
				c.DPRank = r
			}
			if i, found := slices.BinarySearchFunc(ks.index, rs.worker, func(m kvindex.Match, w kvindex.WorkerID) int { return cmp.Compare(m.Worker, w) }); found {
				c.Overlap = ks.index[i].Blocks
			}
			c.OverlapCPU, c.OverlapDisk = e.index.TierOverlap(rs.worker, ks.bs, ks.keys, c.Overlap)
			// Always, not only when some candidate caches a block: exact
			// ties between endpoints that cache nothing of the prompt (an
			// idle fleet, fresh prompts) go to the less cached one too.
			c.TreeSize = e.index.Size(rs.worker)
			if !e.opts.DisableActiveBlocks {
				c.NewBlocks = len(ks.keys) - rs.slot.ActivePrefix(ks.keys)
			}
			c.ActivePrefillTokens = rs.slot.PrefillTokens()
			c.ActiveBlocks = rs.slot.Blocks()
			c.Load = ld
			if rankLoads != nil {
				c.Load.Waiting, c.Load.Running, c.Load.KVUsage = rankLoads[r].Waiting, rankLoads[r].Running, rankLoads[r].KVUsage
			}
			sc.Candidates = append(sc.Candidates, c)
			spaceOf = append(spaceOf, int8(si))
		}
	}
	if len(spaceList) > 0 {
		sc.BlockSize = spaceList[0].bs
		sc.Blocks = spaceList[0].keys
	}
	if timed {
		tLook = time.Now()
		tm.Lookup = tLook.Sub(t0) - tm.Hash
	}
	var pre *Scoring
	var preSpace []int8
	if pdRoles {
		if pre, preSpace, spaceOf, err = splitRoles(sc, spaceOf); err != nil {
			return nil, err
		}
	}
	if e.deps.Gate != nil && req.Hints.TTFTObjective > 0 {
		keep, gerr := e.deps.Gate.Filter(sc, e.policy, commit)
		if gerr != nil {
			return nil, gerr
		}
		sc.Candidates, spaceOf = narrow(sc.Candidates, spaceOf, keep)
	}
	ch, err := e.policy.Choose(sc, commit)
	if timed {
		tm.Score = time.Since(tLook)
	}
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
		// How many the policy chose from (spans report it).
		Candidates: len(sc.Candidates),
		// The lower tiers' blocks, reported beside Overlap.
		OverlapCPU:  c.OverlapCPU,
		OverlapDisk: c.OverlapDisk,
		Sticky:      ch.Sticky,
		state:       ch.State,

		Objective: req.Hints.TTFTObjective,
	}
	d.Session, d.PrefillRank = ch.Session, -1
	e.disaggregate(d, c, pre, preSpace, spaceList, commit)
	d.Predicted = ch.Prediction
	if len(ch.Predicted) == len(sc.Candidates) {
		d.Predicted = ch.Predicted[ch.Index]
	}
	if ch.Scores != nil {
		d.Scores = make([]Score, len(sc.Candidates))
		var pred []Predicted
		if len(ch.Predicted) == len(sc.Candidates) {
			pred = make([]Predicted, len(sc.Candidates))
		}
		for i := range sc.Candidates {
			d.Scores[i] = Score{Endpoint: sc.Candidates[i].Key(), DPRank: sc.Candidates[i].DPRank, Score: ch.Scores[i]}
			if pred != nil {
				pred[i] = PredictedOf(ch.Predicted[i])
				d.Scores[i].Predicted = &pred[i]
			}
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
	d.num = e.ids.Add(1)
	d.ID = strconv.FormatUint(d.num, 36)
	d.live = st.Live
	st.InFlight.Add(1)
	st.Decisions.Add(1)
	rs := c.rank()
	ks := spaceList[spaceOf[ch.Index]]
	if !e.opts.DisableActiveBlocks || sc.ISL > 0 {
		keys := ks.keys
		if e.opts.DisableActiveBlocks {
			keys = nil
		}
		d.entry = rs.slot.Add(keys, d.decodeISL(sc.ISL), c.Overlap, ks.bs)
	}
	e.insertApprox(rs, ks.bs, ks.keys, sc.Now)
	d.share = shareInfo{keys: ks.keys, bs: ks.bs, isl: sc.ISL, queued: c.ActivePrefillTokens, req: req.shared()}
	d.onEnd = e.end
	d.onFirst = func() {
		d.entry.Prefilled()
		if e.queue != nil {
			e.queue.Wake()
		}
		if e.deps.OnFirst != nil {
			e.deps.OnFirst(d)
		}
	}
	d.timer = e.clk.AfterFunc(e.opts.StaleAfter, func() {
		if d.Done(NoUsage(OutcomeExpired)) {
			e.expired.Add(1)
		}
	})
	if e.deps.OnDecision != nil {
		e.deps.OnDecision(req, d)
	}
	if timed {
		tm.Total = time.Since(t0)
		e.deps.OnTimings(tm)
	}
	return d, nil
}

// insertApprox records, for a rank without trusted KV events, that its
// worker now caches keys (approximate mode): a committed decision's prompt
// ([Engine.Pick]) or a peer replica's ([Engine.StartRemote]). Keys already
// inserted for the rank within the last second are skipped, and the rest
// are bounded by Options.MaxInsertBlocks, InsertTokensPerRank and
// InsertBlocksPerSecond. keys is retained.
func (e *Engine) insertApprox(rs *rankState, bs int, keys []uint64, now time.Time) {
	if rs.eventFed.Load() || len(keys) == 0 {
		return
	}
	if m := e.opts.MaxInsertBlocks; m > 0 && len(keys) > m {
		e.budget.limited.Add(int64(len(keys) - m))
		keys = keys[:m]
	}
	fresh := rs.fresh(keys, bs, now, &e.budget)
	if len(fresh) == 0 {
		return
	}
	if e.inserts == nil {
		_ = e.index.InsertApprox(rs.worker, bs, fresh, now)
		return
	}
	select {
	case e.inserts <- insert{rs.worker, bs, fresh, now}:
	default:
		e.insertsDrop.Add(1)
	}
}

func (e *Engine) end(d *Decision, o Outcome) {
	if d.timer != nil {
		d.timer.Stop()
	}
	d.entry.Free()
	if e.queue != nil {
		e.queue.Wake()
	}
	l, key, known := e.servedBy(d, o)
	if !known {
		// A served endpoint outside the set (forged response metadata, or
		// one removed since): count it, and let nothing learn from it.
		e.servedUnknown.Add(1)
		o.Served, o.ServedUnknown = "", true
	}
	if l != nil {
		e.observe(key, l, o)
	}
	e.policy.Done(d, o)
	if e.deps.OnDone != nil {
		e.deps.OnDone(d, o)
	}
}

// servedBy returns the live state of the endpoint that served d: the
// outcome's Served endpoint when the data plane reports one (Envoy may
// have retried elsewhere), else the chosen one. known is false for a
// served endpoint that is neither the chosen one nor in the current set:
// the value comes from the data plane (response metadata), so it may be
// anything, and it must create no state (issue 11).
func (e *Engine) servedBy(d *Decision, o Outcome) (l *Live, key EndpointKey, known bool) {
	if o.Served == "" || o.Served == d.Endpoint {
		return d.live, d.Endpoint, true
	}
	if st, ok := e.snap.Load().byKey[o.Served]; ok {
		return st.Live, o.Served, true
	}
	return nil, "", false
}

// ServedUnknown counts outcomes whose served endpoint was neither the
// chosen one nor in the endpoint set; no learning used them.
func (e *Engine) ServedUnknown() int64 { return e.servedUnknown.Load() }

// narrow keeps the candidates (and their key spaces) at the ascending
// indexes keep; nil or invalid keep lists change nothing.
func narrow(cs []Candidate, spaceOf []int8, keep []int) ([]Candidate, []int8) {
	if len(keep) == 0 || len(keep) > len(cs) {
		return cs, spaceOf
	}
	for j, i := range keep {
		if i < j || i >= len(cs) || (j > 0 && i <= keep[j-1]) {
			return cs, spaceOf
		}
	}
	for j, i := range keep {
		cs[j], spaceOf[j] = cs[i], spaceOf[i]
	}
	return cs[:len(keep)], spaceOf[:len(keep)]
}
