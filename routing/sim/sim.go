package sim

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/netip"
	"strconv"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/slo"
)

// Request is one request of a trace.
type Request struct {
	Arrival   time.Duration // offset from the trace start
	Tokens    []uint32      // prompt token ids (shared prefixes share ids)
	OutputLen int           // tokens to generate (>= 1)
	Hints     routing.Hints // x-prefix-* hints (agentic traces), zero otherwise
	Model     string        // "" = any
	Tenant    string
}

// WorkerConfig describes one simulated worker. Zero fields take the
// defaults (Dynamo's mocker).
type WorkerConfig struct {
	KVBlocks         int     // default 16384
	BlockSize        int     // default 64
	MaxNumSeqs       int     // default 256
	MaxBatchedTokens int     // default 8192
	Speed            float64 // default 1 (2 = twice as fast); must be > 0
	// Prefill is the time of a step that prefills newTokens uncached
	// prompt tokens (default MockerPrefill).
	Prefill func(newTokens int) time.Duration
	// Decode is the time of a decode-only step at KV utilisation kvUtil
	// (default MockerDecode).
	Decode func(kvUtil float64) time.Duration
	// CPUBlocks is the size of the worker's host-memory KV tier in blocks
	// (0: none). Blocks the GPU evicts move there (LRU), published as KV
	// events with medium CPU as vLLM's OffloadingConnector does; a request
	// whose next blocks are there loads them back at CPUReloadTokensPerSec
	// before its prefill instead of recomputing them.
	CPUBlocks int
	// CPUReloadTokensPerSec is the CPU tier's reload bandwidth in prompt
	// tokens per second (default DefaultCPUReloadTokensPerSec).
	CPUReloadTokensPerSec float64
}

// Change is a schedule entry: at At, worker Worker's speed becomes Speed.
// Speed 0 stops the worker (its requests wait; the step in progress
// completes), > 0 sets its speed factor.
type Change struct {
	Worker int
	At     time.Duration
	Speed  float64
}

// Config is a simulation.
type Config struct {
	Workers         []WorkerConfig
	Schedule        []Change
	Policy          string         // a name from policy.Builtin()
	Policies        *policy.Config // nil = defaults
	RouterBlockSize int            // default = the workers' BlockSize
	KVEvents        bool           // true: workers' KV events feed the engine's index (exact, trusted); false: approximate index only
	Seed            int64
	Logger          *slog.Logger
	// TierWeights price the workers' CPU-tier hits for the policies
	// (zero: routing.DefaultTierWeights).
	TierWeights routing.TierWeights

	// Replicas is the number of pickers: independent engines (same policy
	// and options, each its own random source, prefix store and index)
	// in front of the one fleet, as kvbandit serve replicas behind as
	// many Envoys. Each request enters through one of them chosen at
	// random (seeded by Seed). 0 or 1: one engine, exactly the run
	// without replicas. At most MaxReplicas.
	Replicas int
	// Sync is what the replicas share beyond the workers' own signals
	// (scraped load and KV events reach every replica): SyncNone or
	// SyncNATS, the model of the NATS sync. Ignored with one replica.
	Sync Sync
	// SyncDelay is SyncNATS's publish-to-apply latency in virtual time
	// (0: applied at once). At most MaxSyncDelay.
	SyncDelay time.Duration
	// ScrapeInterval is how often the workers' load (waiting and running
	// requests, KV usage) reaches the engines, as serve's --scrape-interval
	// (1 s there). 0: after every change of a worker, an oracle no scraper
	// matches. A stale load leaves the engines with what they count
	// themselves (their in-flight decisions), which is what replicas
	// share.
	ScrapeInterval time.Duration
	// SLO tunes the latency-objective rule (routing/slo) applied to
	// requests whose Hints carry a TTFTObjective; the zero value takes
	// its defaults.
	SLO slo.Config
	// Roles gives each worker its role (nil: all RoleBoth; otherwise one
	// per worker). With prefill-role workers and PD set, the engines
	// disaggregate (see the package doc, "Prefill/decode
	// disaggregation").
	Roles []routing.Role
	// PD is the engines' disaggregation config (nil: none, every request
	// aggregated whatever the roles).
	PD *pd.Config
	// Transfer prices the KV transfer from a prefill worker to a decode
	// worker; zero fields take the defaults.
	Transfer Transfer
	// observe, when set (tests), is called at the P/D steps of a request:
	// "handoff" (its prefill leg ended), "land" (its KV transfer ended)
	// and "first" (its first token reached the response path).
	observe func(s *simulation, a *active, step string)
	// Progress, when set, is called on Run's goroutine with the number of
	// requests routed so far, every ProgressEvery arrivals and after the
	// last one. It must return quickly.
	Progress func(arrived int)
}

// ProgressEvery is how many arrivals pass between two Config.Progress
// calls.
const ProgressEvery = 64

// ReqResult is what happened to one request (in the order of the input).
// Worker is -1 and Err set when the request was not served.
type ReqResult struct {
	Worker                                   int
	Replica                                  int // the replica it entered through
	Arrival, TTFT, E2E                       time.Duration
	PromptTokens, CachedTokens, OutputTokens int
	// Predicted is the policy's predicted TTFT at the decision (0 when
	// the policy does not predict).
	Predicted time.Duration
	// CPUCachedTokens are the CachedTokens loaded back from the worker's
	// CPU tier.
	CPUCachedTokens int
	// ITL is the mean inter-token latency, (E2E − TTFT)/(OutputTokens −
	// 1); 0 with a single output token.
	ITL time.Duration
	// PrefillWorker is the worker that ran a disaggregated request's
	// prefill (-1: aggregated on Worker; CachedTokens are then the
	// prefill worker's), TransferBlocks the blocks sent to Worker and
	// Transfer the transfer's time.
	PrefillWorker  int
	TransferBlocks int
	Transfer       time.Duration
	Err            string
}

// QueueSample is every worker's waiting and running requests at At.
type QueueSample struct {
	At               time.Duration
	Waiting, Running []int
}

// WorkerResult sums up one worker.
type WorkerResult struct {
	Requests int           // requests routed to it
	Busy     time.Duration // virtual time spent in steps
	// PrefillTokens are the prompt tokens it computed; CachedTokens those
	// it found in its cache, CPUCachedTokens those of them loaded back
	// from its CPU tier.
	PrefillTokens, CachedTokens, CPUCachedTokens int
}

// Result is the outcome of a run.
type Result struct {
	Policy   string
	Requests []ReqResult
	Workers  []WorkerResult
	Queue    []QueueSample
	Span     time.Duration // virtual time from first arrival to last completion
	Wall     time.Duration // real time Run took
	// Decisions counts engine picks; DecisionTime is the real time spent
	// inside engine.Pick.
	Decisions    int
	DecisionTime time.Duration
	// KVEventErrors counts KV events the engines' indexes refused (0
	// unless something is broken).
	KVEventErrors int

	// Replicas and Sync are the run's (Replicas at least 1); Entered is
	// the requests that entered through each replica.
	Replicas int
	Sync     Sync
	Entered  []int
	// SyncItems counts the sync items the replicas published (a start, a
	// first token, an end and an outcome per decision), SyncMessages the
	// messages that carried them (a replica's batch takes every item of
	// one SyncDelay), SyncErrors the items a peer refused (0 unless
	// something is broken). SyncOpen is the decisions still applied on
	// peers at the end, after the last items were delivered (0: every
	// end reached every peer). All 0 with SyncNone.
	SyncItems, SyncMessages, SyncErrors, SyncOpen int
}

// MessagesPerDecision is SyncMessages over Decisions (0 without any).
func (r *Result) MessagesPerDecision() float64 {
	if r.Decisions == 0 {
		return 0
	}
	return float64(r.SyncMessages) / float64(r.Decisions)
}

// HitRate is the fraction of served prompt tokens found in a worker's
// cache.
func (r *Result) HitRate() float64 {
	var p, c int
	for _, q := range r.Requests {
		if q.Err == "" {
			p += q.PromptTokens
			c += q.CachedTokens
		}
	}
	if p == 0 {
		return 0
	}
	return float64(c) / float64(p)
}

// CPUHitRate is the fraction of served prompt tokens loaded back from a
// worker's CPU tier (a part of HitRate).
func (r *Result) CPUHitRate() float64 {
	var p, c int
	for _, q := range r.Requests {
		if q.Err == "" {
			p += q.PromptTokens
			c += q.CPUCachedTokens
		}
	}
	if p == 0 {
		return 0
	}
	return float64(c) / float64(p)
}

// Configuration errors.
var (
	ErrNoWorkers      = errors.New("sim: no workers")
	ErrWorkerConfig   = errors.New("sim: invalid worker config")
	ErrSchedule       = errors.New("sim: invalid schedule")
	ErrInvalidRequest = errors.New("sim: invalid request")
)

// withDefaults fills zero fields and checks the rest.
func (c WorkerConfig) withDefaults(i int) (WorkerConfig, error) {
	bad := func(what string, v any) error {
		return fmt.Errorf("%w: worker %d: %s %v", ErrWorkerConfig, i, what, v)
	}
	switch {
	case c.KVBlocks < 0:
		return c, bad("negative KVBlocks", c.KVBlocks)
	case c.BlockSize < 0:
		return c, bad("negative BlockSize", c.BlockSize)
	case c.MaxNumSeqs < 0:
		return c, bad("negative MaxNumSeqs", c.MaxNumSeqs)
	case c.MaxBatchedTokens < 0:
		return c, bad("negative MaxBatchedTokens", c.MaxBatchedTokens)
	case c.Speed < 0 || math.IsNaN(c.Speed) || math.IsInf(c.Speed, 0):
		return c, bad("speed must be > 0, got", c.Speed)
	case c.CPUBlocks < 0:
		return c, bad("negative CPUBlocks", c.CPUBlocks)
	case c.CPUReloadTokensPerSec < 0 || math.IsNaN(c.CPUReloadTokensPerSec) || math.IsInf(c.CPUReloadTokensPerSec, 0):
		return c, bad("CPU reload bandwidth must be > 0, got", c.CPUReloadTokensPerSec)
	}
	if c.CPUReloadTokensPerSec == 0 {
		c.CPUReloadTokensPerSec = DefaultCPUReloadTokensPerSec
	}
	if c.KVBlocks == 0 {
		c.KVBlocks = DefaultKVBlocks
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.MaxNumSeqs == 0 {
		c.MaxNumSeqs = DefaultMaxNumSeqs
	}
	if c.MaxBatchedTokens == 0 {
		c.MaxBatchedTokens = DefaultMaxBatchedTokens
	}
	if c.Speed == 0 {
		c.Speed = 1
	}
	if c.Prefill == nil {
		c.Prefill = MockerPrefill
	}
	if c.Decode == nil {
		c.Decode = MockerDecode
	}
	return c, nil
}

// validate checks cfg and reqs and returns the workers' configs with
// defaults.
func validate(cfg *Config, reqs []Request) ([]WorkerConfig, error) {
	if len(cfg.Workers) == 0 {
		return nil, ErrNoWorkers
	}
	wcs := make([]WorkerConfig, len(cfg.Workers))
	for i, wc := range cfg.Workers {
		var err error
		if wcs[i], err = wc.withDefaults(i); err != nil {
			return nil, err
		}
	}
	if err := validateReplicas(cfg); err != nil {
		return nil, err
	}
	if cfg.Roles != nil && len(cfg.Roles) != len(wcs) {
		return nil, fmt.Errorf("%w: %d roles for %d workers", ErrWorkerConfig, len(cfg.Roles), len(wcs))
	}
	if cfg.PD != nil {
		if err := cfg.PD.Validate(); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	if err := cfg.Transfer.validate(); err != nil {
		return nil, err
	}
	if cfg.RouterBlockSize < 0 {
		return nil, fmt.Errorf("%w: negative RouterBlockSize %d", ErrWorkerConfig, cfg.RouterBlockSize)
	}
	if cfg.ScrapeInterval < 0 || cfg.ScrapeInterval > maxScrapeInterval {
		return nil, fmt.Errorf("%w: scrape interval %v (want 0 to %v)", ErrWorkerConfig, cfg.ScrapeInterval, maxScrapeInterval)
	}
	var last time.Duration
	for i, ch := range cfg.Schedule {
		switch {
		case ch.Worker < 0 || ch.Worker >= len(wcs):
			return nil, fmt.Errorf("%w: change %d: worker %d of %d", ErrSchedule, i, ch.Worker, len(wcs))
		case ch.At < 0:
			return nil, fmt.Errorf("%w: change %d: negative time %v", ErrSchedule, i, ch.At)
		case ch.Speed < 0 || math.IsNaN(ch.Speed) || math.IsInf(ch.Speed, 0):
			return nil, fmt.Errorf("%w: change %d: speed must be >= 0 (0 stops), got %v", ErrSchedule, i, ch.Speed)
		case ch.At < last:
			return nil, fmt.Errorf("%w: change %d: not sorted by time", ErrSchedule, i)
		}
		last = ch.At
	}
	last = 0
	for i := range reqs {
		r := &reqs[i]
		switch {
		case r.Arrival < 0:
			return nil, fmt.Errorf("%w: request %d: negative arrival %v", ErrInvalidRequest, i, r.Arrival)
		case r.Arrival < last:
			return nil, fmt.Errorf("%w: request %d: not sorted by arrival", ErrInvalidRequest, i)
		case len(r.Tokens) == 0:
			return nil, fmt.Errorf("%w: request %d: empty prompt", ErrInvalidRequest, i)
		case r.OutputLen < 1:
			return nil, fmt.Errorf("%w: request %d: output length %d < 1", ErrInvalidRequest, i, r.OutputLen)
		}
		last = r.Arrival
	}
	return wcs, nil
}

// epoch is virtual time zero.
var epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// staleAfter outlives any simulated request: every decision ends with
// Done, so the engine's sweeper must not release one early under overload.
const staleAfter = 1000 * time.Hour

// sampleEvery is the queue sampling period.
const sampleEvery = time.Second

// maxScrapeInterval bounds Config.ScrapeInterval.
const maxScrapeInterval = time.Hour

// EndpointKey is the fake address of worker i: 10.0.0.(i+1):8000 for the
// first 255 workers.
func EndpointKey(i int) routing.EndpointKey {
	a := i + 1
	ip := netip.AddrFrom4([4]byte{10, byte(a >> 16), byte(a >> 8), byte(a)})
	return routing.EndpointKey(netip.AddrPortFrom(ip, 8000).String())
}

// Run replays reqs (sorted by Arrival) on the simulated fleet, routing each
// request with the real engine under cfg.Policy.
func Run(ctx context.Context, cfg Config, reqs []Request) (*Result, error) {
	wall := time.Now()
	wcs, err := validate(&cfg, reqs)
	if err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	vc := clock.NewVirtual(epoch)
	rbs := cfg.RouterBlockSize
	if rbs == 0 {
		rbs = wcs[0].BlockSize
	}
	s := &simulation{
		ctx: ctx, vc: vc, reqs: reqs, log: log, syncDelay: cfg.SyncDelay, scrapeEvery: cfg.ScrapeInterval, progress: cfg.Progress,
		transfer: cfg.Transfer.withDefaults(), observe: cfg.observe,
		res: &Result{
			Policy: cfg.Policy, Requests: make([]ReqResult, len(reqs)), Workers: make([]WorkerResult, len(wcs)),
			Replicas: max(cfg.Replicas, 1), Entered: make([]int, max(cfg.Replicas, 1)),
		},
	}
	defer s.shut()
	for i := range s.res.Replicas {
		r, err := s.newReplica(&cfg, i, rbs)
		if err != nil {
			return nil, err
		}
		s.reps = append(s.reps, r)
	}
	if len(s.reps) > 1 {
		s.res.Sync = cfg.Sync
		s.entryRand = routing.NewRand(entrySeed(cfg.Seed))
	}
	set := routing.EndpointSet{Source: "sim"}
	for i, wc := range wcs {
		key := EndpointKey(i)
		ep := routing.Endpoint{Key: key, Engine: "vllm", BlockSize: rbs, MaxBatchedTokens: wc.MaxBatchedTokens}
		if cfg.Roles != nil {
			ep.Role = cfg.Roles[i]
		}
		set.Endpoints = append(set.Endpoints, ep)
		w := newWorker(wc)
		s.hook(w, key, cfg.KVEvents)
		s.workers = append(s.workers, w)
		s.keys = append(s.keys, key)
	}
	for _, r := range s.reps {
		if err := r.eng.Update(set); err != nil {
			return nil, fmt.Errorf("sim: %w", err)
		}
	}
	s.byKey = make(map[routing.EndpointKey]int, len(s.keys))
	for i, k := range s.keys {
		s.byKey[k] = i
		for _, r := range s.reps {
			r.eng.TrustKVEvents(k, cfg.KVEvents)
			r.eng.ReportLoad(k, s.workers[i].load(), wcs[i].BlockSize)
		}
	}
	if err := s.loop(cfg.Schedule); err != nil {
		return nil, err
	}
	s.abandon()
	s.flushSync()
	for i, w := range s.workers {
		s.res.Workers[i] = w.stats
	}
	if len(reqs) > 0 && s.lastDone > reqs[0].Arrival {
		s.res.Span = s.lastDone - reqs[0].Arrival
	}
	s.res.Wall = time.Since(wall)
	return s.res, nil
}

type simulation struct {
	ctx context.Context
	// reps are the replicas (pickers), at least one; entryRand chooses
	// each request's with several.
	reps      []*replica
	entryRand *routing.Rand
	syncDelay time.Duration
	// scrapeEvery is Config.ScrapeInterval.
	scrapeEvery time.Duration
	vc          *clock.Virtual
	log         *slog.Logger
	reqs        []Request
	workers     []*worker
	keys        []routing.EndpointKey
	byKey       map[routing.EndpointKey]int
	events      stepHeap
	now         time.Duration
	// open holds the requests not finished, by index (nil when done).
	open     []*active
	lastDone time.Duration
	res      *Result
	// progress is Config.Progress.
	progress func(arrived int)
	// transfer is Config.Transfer with defaults.
	transfer Transfer
	// observe is Config.observe.
	observe func(s *simulation, a *active, step string)
}

func (s *simulation) hook(w *worker, key routing.EndpointKey, events bool) {
	if events {
		// Every replica subscribes to every worker's KV events.
		w.onEvent = func(ev kvindex.Event) {
			for _, r := range s.reps {
				if err := r.eng.ApplyKVEvent(key, -1, ev); err != nil {
					s.res.KVEventErrors++
					s.log.Debug("kv event refused", "endpoint", key, "replica", r.idx, "err", err)
				}
			}
		}
	}
	w.onFirst = func(a *active, _ time.Duration) {
		// A prefill leg's token goes back to the sidecar, not the client:
		// the response path sees the decode worker's first token.
		if !a.prefillOnly {
			a.dec.Prefilled()
			s.note(a, "first")
		}
	}
	w.onFinish = s.finished
}

// finished reports a completed request to the engine and the result.
func (s *simulation) finished(a *active, at time.Duration) {
	rr := &s.res.Requests[a.idx]
	if !a.transferred {
		rr.CachedTokens = a.cached
		rr.CPUCachedTokens = a.cpuCached
	}
	if a.prefillOnly {
		s.handoff(a, at)
		return
	}
	rr.TTFT = a.firstAt - a.req.Arrival
	rr.E2E = at - a.req.Arrival
	rr.OutputTokens = a.generated
	if a.generated > 1 {
		rr.ITL = (rr.E2E - rr.TTFT) / time.Duration(a.generated-1)
	}
	s.lastDone = max(s.lastDone, at)
	s.open[a.idx] = nil
	a.dec.Done(routing.Outcome{
		Kind: routing.OutcomeSuccess, Served: a.dec.Endpoint, Status: 200,
		TTFT: rr.TTFT, Latency: rr.E2E,
		PromptTokens: a.prompt, CompletionTokens: a.generated, CachedTokens: rr.CachedTokens,
	})
}

// advance moves virtual time (and the engine's clock) to t.
func (s *simulation) advance(t time.Duration) {
	if t > s.now {
		s.now = t
		s.vc.Advance(epoch.Add(t))
	}
}

// after is called after any change to worker i: it reschedules the step
// end and publishes the worker's load.
func (s *simulation) after(i int, rescheduled bool) {
	w := s.workers[i]
	if rescheduled && w.busy {
		s.events.push(stepEvent{at: w.end, worker: int32(i), gen: w.gen})
	}
	if s.scrapeEvery == 0 {
		s.reportLoad(i)
	}
}

// reportLoad publishes worker i's load to every replica: scraped from the
// worker, it is the same for all.
func (s *simulation) reportLoad(i int) {
	ld := s.workers[i].load()
	for _, r := range s.reps {
		r.eng.ReportLoad(s.keys[i], ld, 0)
	}
}

// shut closes every replica, the last built first.
func (s *simulation) shut() {
	for i := len(s.reps) - 1; i >= 0; i-- {
		s.reps[i].shut()
	}
}

func (s *simulation) loop(schedule []Change) error {
	const never = time.Duration(math.MaxInt64)
	s.open = make([]*active, len(s.reqs))
	next, change := 0, 0
	sample, scrape := never, never
	if len(s.reqs) > 0 {
		sample = s.reqs[0].Arrival
		if s.scrapeEvery > 0 {
			scrape = s.reqs[0].Arrival
		}
	}
	for iter := 0; ; iter++ {
		if iter&1023 == 0 {
			if err := s.ctx.Err(); err != nil {
				return err
			}
		}
		tArr, tChg, tStep := never, never, never
		if next < len(s.reqs) {
			tArr = s.reqs[next].Arrival
		}
		if change < len(schedule) {
			tChg = schedule[change].At
		}
		if ev, ok := s.events.peek(); ok {
			tStep = ev.at
		}
		t := min(tArr, tChg, tStep)
		if t == never {
			return nil
		}
		if sample <= t && sample <= scrape {
			s.advance(sample)
			s.sample(sample)
			sample += sampleEvery
			continue
		}
		if scrape <= t {
			s.advance(scrape)
			for i := range s.workers {
				s.reportLoad(i)
			}
			scrape += s.scrapeEvery
			continue
		}
		s.advance(t)
		switch t {
		case tStep:
			ev := s.events.pop()
			if ev.worker == transferEvent {
				s.land(int(ev.gen))
				continue
			}
			w := s.workers[ev.worker]
			if ev.gen != w.gen || !w.busy {
				continue
			}
			s.after(int(ev.worker), w.stepEnd(t))
		case tChg:
			ch := schedule[change]
			change++
			s.after(ch.Worker, s.workers[ch.Worker].setSpeed(ch.Speed, t))
		default:
			s.arrive(next)
			next++
			if s.progress != nil && (next%ProgressEvery == 0 || next == len(s.reqs)) {
				s.progress(next)
			}
		}
	}
}

// arrive routes request i and queues it on the chosen worker.
func (s *simulation) arrive(i int) {
	r := &s.reqs[i]
	rr := &s.res.Requests[i]
	rr.Worker, rr.Arrival, rr.PromptTokens = -1, r.Arrival, len(r.Tokens)
	rep := s.entry()
	rr.Replica = rep.idx
	s.res.Entered[rep.idx]++
	req := &routing.Request{
		ID: strconv.Itoa(i), Model: routing.ModelName(r.Model), Tenant: r.Tenant,
		Tokens: r.Tokens, TokenCount: len(r.Tokens), Hints: r.Hints, Arrival: s.vc.Now(),
	}
	t0 := time.Now()
	d, err := rep.eng.Pick(s.ctx, req)
	s.res.DecisionTime += time.Since(t0)
	if err != nil {
		rr.Err = "route: " + err.Error()
		return
	}
	s.res.Decisions++
	rr.Predicted = d.Predicted.TTFT
	wi, ok := s.byKey[d.Endpoint]
	if !ok {
		rr.Err = "route: unknown endpoint " + string(d.Endpoint)
		d.Done(routing.NoUsage(routing.OutcomeRejected))
		return
	}
	rr.Worker, rr.PrefillWorker = wi, -1
	w := s.workers[wi]
	if !w.fits(r, false) {
		s.refuse(rr, d, w.blocksFor(r, false), wi)
		return
	}
	a := &active{idx: i, req: r, dec: d}
	if d.Prefill != "" {
		pi, ok := s.byKey[d.Prefill]
		if !ok {
			rr.Err = "route: unknown prefill endpoint " + string(d.Prefill)
			d.Done(routing.NoUsage(routing.OutcomeRejected))
			return
		}
		if !s.workers[pi].fits(r, true) {
			s.refuse(rr, d, s.workers[pi].blocksFor(r, true), pi)
			return
		}
		rr.PrefillWorker = pi
		a.prefillOnly, a.decodeOn, wi, w = true, wi, pi, s.workers[pi]
	}
	s.open[i] = a
	s.after(wi, w.enqueue(a, s.now))
}

// refuse fails a request that can never fit worker wi's KV cache.
func (s *simulation) refuse(rr *ReqResult, d *routing.Decision, blocks, wi int) {
	rr.Err = fmt.Sprintf("request needs %d KV blocks, worker %d has %d", blocks, wi, s.workers[wi].cfg.KVBlocks)
	d.Done(routing.Outcome{Kind: routing.OutcomeUpstreamError, Served: d.Endpoint, Status: 400, PromptTokens: -1, CompletionTokens: -1, CachedTokens: -1})
}

func (s *simulation) sample(at time.Duration) {
	q := QueueSample{At: at, Waiting: make([]int, len(s.workers)), Running: make([]int, len(s.workers))}
	for i, w := range s.workers {
		q.Waiting[i], q.Running[i] = len(w.waiting), len(w.running)
		if s.scrapeEvery == 0 {
			s.reportLoad(i)
		}
	}
	s.res.Queue = append(s.res.Queue, q)
}

// abandon ends the requests left on stopped workers.
func (s *simulation) abandon() {
	for i, a := range s.open {
		if a == nil {
			continue
		}
		rr := &s.res.Requests[i]
		rr.Err = "not finished: worker stopped"
		rr.OutputTokens = a.generated
		if !a.transferred {
			rr.CachedTokens, rr.CPUCachedTokens = a.cached, a.cpuCached
		}
		if a.prefillOnly {
			rr.OutputTokens = 0 // its token never reached the client
		} else if a.generated > 0 {
			rr.TTFT = a.firstAt - a.req.Arrival
		}
		a.dec.Done(routing.Outcome{Kind: routing.OutcomeAbandoned, Served: a.dec.Endpoint, PromptTokens: -1, CompletionTokens: -1, CachedTokens: -1})
	}
}

// stepEvent is a worker's step end; gen tells stale ones apart.
type stepEvent struct {
	at     time.Duration
	worker int32
	gen    uint64
}

// stepHeap is a binary min-heap of step ends (ties by worker).
type stepHeap []stepEvent

func (h stepHeap) less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].worker < h[j].worker
}

func (h stepHeap) peek() (stepEvent, bool) {
	if len(h) == 0 {
		return stepEvent{}, false
	}
	return h[0], true
}

func (h *stepHeap) push(e stepEvent) {
	*h = append(*h, e)
	a := *h
	for i := len(a) - 1; i > 0; {
		p := (i - 1) / 2
		if !a.less(i, p) {
			break
		}
		a[i], a[p] = a[p], a[i]
		i = p
	}
}

func (h *stepHeap) pop() stepEvent {
	a := *h
	top := a[0]
	n := len(a) - 1
	a[0] = a[n]
	a = a[:n]
	for i := 0; ; {
		l, m := 2*i+1, i
		if l < n && a.less(l, m) {
			m = l
		}
		if r := l + 1; r < n && a.less(r, m) {
			m = r
		}
		if m == i {
			break
		}
		a[i], a[m] = a[m], a[i]
		i = m
	}
	*h = a
	return top
}
