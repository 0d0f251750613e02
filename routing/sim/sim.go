package sim

import (
	"context"
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
)

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
		transfer: cfg.Transfer.withDefaults(), observe: cfg.observe, rogue: cfg.rogue, probe: cfg.probe, blockSize: rbs,
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
	// held are the requests waiting for their replica's turn.
	held heldQueue
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
	// observe, rogue and probe are Config's.
	observe func(s *simulation, a *active, step string)
	rogue   *rogue
	probe   func(s *simulation, i int)
	// blockSize is the engines' block size.
	blockSize int
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
		tHeld := s.held.next()
		if change < len(schedule) {
			tChg = schedule[change].At
		}
		if ev, ok := s.events.peek(); ok {
			tStep = ev.at
		}
		t := min(tArr, tChg, tStep, tHeld)
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
		case tHeld:
			h := s.held.pop()
			s.route(h.i, h.rep, h.req)
		default:
			s.arrive(next)
			next++
			if s.progress != nil && (next%ProgressEvery == 0 || next == len(s.reqs)) {
				s.progress(next)
			}
		}
	}
}

// arrive takes request i in through a replica and routes it, at once or,
// in a burst across synced replicas, at its replica's turn
// (routing/burst).
func (s *simulation) arrive(i int) {
	s.forge(i)
	if s.probe != nil {
		s.probe(s, i)
	}
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
	if at := rep.eng.Turn(req); !at.IsZero() {
		s.res.Held++
		s.held.push(heldRequest{at: at.Sub(epoch), i: i, rep: rep, req: req})
		return
	}
	s.route(i, rep, req)
}

// route picks request i's endpoint on replica rep and queues it on the
// chosen worker.
func (s *simulation) route(i int, rep *replica, req *routing.Request) {
	r := &s.reqs[i]
	rr := &s.res.Requests[i]
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
