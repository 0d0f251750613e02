package sim

import (
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// Worker defaults, as Dynamo's mocker.
const (
	DefaultKVBlocks         = 16384
	DefaultBlockSize        = 64
	DefaultMaxNumSeqs       = 256
	DefaultMaxBatchedTokens = 8192
)

// MockerPrefill is Dynamo's mocker prefill time for n new tokens in a step:
// t_ms = 4.209989e-07·n² + 1.518344e-02·n + 1.650142e+01.
func MockerPrefill(n int) time.Duration {
	x := float64(n)
	return msDuration(4.209989e-07*x*x + 1.518344e-02*x + 1.650142e+01)
}

// MockerDecode is Dynamo's mocker decode step time at KV utilisation u:
// t_ms = −25.74·u² + 54.01·u + 5.74, at least 1 ms.
func MockerDecode(u float64) time.Duration {
	return msDuration(max(-25.74*u*u+54.01*u+5.74, 1))
}

func msDuration(ms float64) time.Duration { return time.Duration(math.Round(ms * 1e6)) }

// active is one request on a worker.
type active struct {
	idx   int // index in the request list
	req   *Request
	dec   *routing.Decision
	keys  []uint64 // chained hashes of the prompt's full blocks
	slots []int32  // cache entries held: blocks 0..len(slots)-1
	// anon is the private blocks held (unfilled prompt blocks and the
	// output's reservation).
	anon      int
	prompt    int
	computed  int // prompt tokens in the KV cache (cached + prefilled)
	cached    int // prompt tokens found in the cache at admission
	cpuCached int // of which loaded back from the CPU tier
	generated int
	firstAt   time.Duration
	// prefillOnly: the prefill leg of a disaggregated request (it stops
	// after the first token); transferred: the decode leg, whose prompt's
	// KV arrives from the prefill worker instead of being computed.
	prefillOnly, transferred bool
	// decodeOn is a prefill leg's decode worker.
	decodeOn int
	// Step plan: chunk is the prompt tokens prefilled in the current step;
	// decoding says the request decodes in it.
	chunk    int
	decoding bool
}

type stepKind uint8

const (
	stepPrefill stepKind = iota + 1
	stepDecode
)

// worker is one simulated vLLM instance.
type worker struct {
	cfg   WorkerConfig
	speed float64
	cache *kvCache
	// capTokens is the cache size in tokens (the decode model's
	// denominator); activeTokens the KV tokens of running requests.
	capTokens    float64
	activeTokens int
	waiting      []*active
	running      []*active

	// The step in progress.
	busy       bool
	kind       stepKind
	start, end time.Duration
	// A decode run is steps identical decode steps of decoders requests
	// starting with runTokens active tokens at runSpeed.
	steps     int
	decoders  int
	runTokens int
	runSpeed  float64
	// gen changes whenever end does, so that stale step-end events can
	// be told apart.
	gen uint64

	stats WorkerResult

	// maxRun bounds the steps of a decode run (0: up to the next
	// completion); the real-time Worker sets 1.
	maxRun int

	// Hooks.
	onEvent  func(kvindex.Event)
	onAdmit  func(a *active)
	onFirst  func(a *active, at time.Duration)
	onFinish func(a *active, at time.Duration)

	stored []kvindex.StoredBlock

	// cpu is the host-memory tier (nil: none); reload is the load time of
	// the requests admitted into the step being planned.
	cpu        *cpuCache
	reload     time.Duration
	cpuStored  []kvindex.StoredBlock
	cpuDropped []uint64
}

func newWorker(cfg WorkerConfig) *worker {
	w := &worker{
		cfg:       cfg,
		speed:     cfg.Speed,
		cache:     newKVCache(cfg.KVBlocks),
		capTokens: float64(cfg.KVBlocks) * float64(cfg.BlockSize),
	}
	if cfg.CPUBlocks > 0 {
		w.cpu = newCPUCache(cfg.CPUBlocks)
	}
	return w
}

// blocksFor is the blocks a request reserves: its prompt and its output
// (one token for a prefill leg).
func (w *worker) blocksFor(r *Request, prefillOnly bool) int {
	out := r.OutputLen
	if prefillOnly {
		out = 1
	}
	return (len(r.Tokens) + out + w.cfg.BlockSize - 1) / w.cfg.BlockSize
}

// fits reports whether the request can ever run on this worker.
func (w *worker) fits(r *Request, prefillOnly bool) bool {
	return w.blocksFor(r, prefillOnly) <= w.cfg.KVBlocks
}

// done reports whether a has produced all it has to on this worker.
func (a *active) done() bool {
	return a.computed == a.prompt && (a.generated >= a.req.OutputLen || a.prefillOnly && a.generated > 0)
}

// enqueue adds a request that arrived at now. It returns whether the
// worker's step end changed (the caller reschedules it).
func (w *worker) enqueue(a *active, now time.Duration) bool {
	a.prompt = len(a.req.Tokens)
	w.waiting = append(w.waiting, a)
	w.stats.Requests++
	if !w.busy {
		return w.startStep(now)
	}
	// A decode run stops at the step in progress, so that the new
	// request is scheduled at the next step as with single steps.
	return w.truncate(now)
}

// setSpeed applies a schedule change at now.
func (w *worker) setSpeed(s float64, now time.Duration) bool {
	w.speed = s
	if !w.busy {
		if s > 0 {
			return w.startStep(now)
		}
		return false
	}
	return w.truncate(now)
}

// truncate cuts a decode run after the step in progress at now.
func (w *worker) truncate(now time.Duration) bool {
	if !w.busy || w.kind != stepDecode || w.end <= now || w.steps <= 1 {
		return false
	}
	steps, end := w.decodeRun(w.steps, now)
	if steps == w.steps {
		return false
	}
	w.steps, w.end = steps, end
	w.gen++
	return true
}

// decodeRun returns how many steps of the current run (at most limit)
// complete by the first step end at or after until, and when they end.
func (w *worker) decodeRun(limit int, until time.Duration) (int, time.Duration) {
	t := w.start
	tokens := w.runTokens
	for k := 1; ; k++ {
		d := w.cfg.Decode(float64(tokens) / w.capTokens)
		t += time.Duration(float64(d) / w.runSpeed)
		tokens += w.decoders
		if k == limit || t >= until {
			return k, t
		}
	}
}

// startStep plans the next step at now; false when there is nothing to do
// or the worker is stopped.
func (w *worker) startStep(now time.Duration) bool {
	if w.speed <= 0 || len(w.running)+len(w.waiting) == 0 {
		return false
	}
	budget := w.cfg.MaxBatchedTokens
	newTokens, decoders, minLeft := 0, 0, math.MaxInt
	w.reload = 0
	for _, a := range w.running {
		a.chunk, a.decoding = 0, false
		if a.computed < a.prompt {
			n := min(a.prompt-a.computed, budget)
			a.chunk = n
			budget -= n
			newTokens += n
			continue
		}
		if budget > 0 {
			a.decoding = true
			budget--
			decoders++
			minLeft = min(minLeft, a.decodeLeft())
		}
	}
	for len(w.waiting) > 0 && len(w.running) < w.cfg.MaxNumSeqs && budget > 0 {
		a := w.waiting[0]
		if !w.admit(a) {
			break // FCFS: the head waits for room
		}
		w.waiting[0] = nil
		w.waiting = w.waiting[1:]
		w.running = append(w.running, a)
		n := min(a.prompt-a.computed, budget)
		a.chunk, a.decoding = n, false
		budget -= n
		newTokens += n
		if a.transferred && n == 0 && budget > 0 {
			// Its KV arrived whole: it decodes in this very step.
			a.decoding = true
			budget--
			decoders++
			minLeft = min(minLeft, a.decodeLeft())
		}
	}
	if len(w.waiting) == 0 {
		w.waiting = w.waiting[:0:0] // let the drained backing array go
	}
	switch {
	case newTokens > 0:
		w.kind, w.steps = stepPrefill, 1
		// Blocks loaded back from the CPU tier for the requests admitted
		// now are copied before the step's prefill (a synchronous load).
		w.end = now + time.Duration(float64(w.cfg.Prefill(newTokens))/w.speed) + w.reload
		w.stats.PrefillTokens += newTokens
	case decoders > 0:
		w.kind = stepDecode
		w.decoders, w.runTokens, w.runSpeed = decoders, w.activeTokens, w.speed
		w.start = now
		if w.maxRun > 0 {
			minLeft = min(minLeft, w.maxRun)
		}
		w.steps, w.end = w.decodeRun(minLeft, math.MaxInt64)
	default:
		return false // waiting requests that cannot be admitted yet
	}
	w.busy, w.start = true, now
	w.gen++
	return true
}

// decodeLeft is the decode steps a may run in one decode run: its output
// left, and 1 before a transferred request's first token (so that its
// first token is timed at the end of its first step).
func (a *active) decodeLeft() int {
	if a.generated == 0 {
		return 1
	}
	return a.req.OutputLen - a.generated
}

// admit reserves the blocks of the waiting head: its cached prefix (as
// vLLM, at most the prompt minus one token, rounded down to blocks) and
// private blocks for the rest of the prompt and the output.
func (w *worker) admit(a *active) bool {
	bs := w.cfg.BlockSize
	if a.keys == nil {
		a.keys = kvindex.AppendBlockKeys(make([]uint64, 0, len(a.req.Tokens)/bs), a.req.Tokens, bs, kvindex.BaseSeed)
	}
	limit := (a.prompt - 1) / bs
	hit := min(w.cache.prefix(a.keys), limit)
	need := w.blocksFor(a.req, a.prefillOnly) - hit
	if !w.cache.canAllocate(a.keys[:hit], need) {
		return false
	}
	a.slots = make([]int32, 0, len(a.keys))
	for _, k := range a.keys[:hit] {
		a.slots = append(a.slots, w.cache.acquire(k))
	}
	cpuHit := 0
	if !a.transferred {
		cpuHit = w.cpuHits(a, hit, limit)
	}
	w.cache.allocate(need)
	a.anon = need
	// Evictions are published before the reloaded blocks are stored: a
	// reloaded block may have been evicted from the GPU just now.
	w.flushEvicted()
	if cpuHit > 0 {
		w.reloaded(a, hit, hit+cpuHit)
	}
	a.computed = (hit + cpuHit) * bs
	a.cached = a.computed
	a.cpuCached = cpuHit * bs
	w.reload += w.reloadTime(a.cpuCached)
	w.activeTokens += a.computed
	w.stats.CachedTokens += a.cached
	w.stats.CPUCachedTokens += a.cpuCached
	if a.transferred {
		// The rest of the prompt's KV came from the prefill worker: its
		// blocks join the cache as computed ones do.
		a.chunk = a.prompt - a.computed
		w.store(a)
		a.chunk = 0
	}
	if w.onAdmit != nil {
		w.onAdmit(a)
	}
	return true
}

func (w *worker) flushEvicted() {
	if len(w.cache.evicted) == 0 {
		return
	}
	switch {
	case w.cpu != nil:
		w.offload(w.cache.evicted)
	case w.onEvent != nil:
		w.onEvent(kvindex.Event{Kind: kvindex.Removed, BlockSize: w.cfg.BlockSize, RemovedHashes: w.cache.evicted})
	}
	w.cache.evicted = w.cache.evicted[:0]
}

// stepEnd completes the step in progress at now (its end) and starts the
// next one; it reports whether a step was started.
func (w *worker) stepEnd(now time.Duration) bool {
	w.busy = false
	w.stats.Busy += now - w.start
	kept := w.running[:0]
	for _, a := range w.running {
		switch {
		case a.chunk > 0:
			w.prefilled(a, now)
		case a.decoding && w.kind == stepDecode:
			w.decoded(a, w.steps, now)
		case a.decoding:
			w.decoded(a, 1, now)
		}
		a.chunk, a.decoding = 0, false
		if a.done() {
			w.finish(a, now)
			continue
		}
		kept = append(kept, a)
	}
	clear(w.running[len(kept):])
	w.running = kept
	return w.startStep(now)
}

// decoded adds n decode steps' tokens to a; the first token of a
// transferred request (its run is one step long) is its first token.
func (w *worker) decoded(a *active, n int, now time.Duration) {
	first := a.generated == 0
	a.generated += n
	w.activeTokens += n
	if first {
		a.firstAt = now
		if w.onFirst != nil {
			w.onFirst(a, now)
		}
	}
}

// prefilled records a's chunk as computed (store), and the end of the
// prompt gives the first token.
func (w *worker) prefilled(a *active, now time.Duration) {
	w.store(a)
	if a.computed == a.prompt {
		a.generated = 1
		w.activeTokens++
		a.firstAt = now
		if w.onFirst != nil {
			w.onFirst(a, now)
		}
	}
}

// store records a's chunk as computed: its newly full blocks join the
// cache (BlockStored).
func (w *worker) store(a *active) {
	bs := w.cfg.BlockSize
	a.computed += a.chunk
	w.activeTokens += a.chunk
	full := min(a.computed/bs, len(a.keys))
	first := -1 // first block of the pending stored chain
	flush := func() {
		if first < 0 {
			return
		}
		if w.onEvent != nil {
			ev := kvindex.Event{Kind: kvindex.Stored, BlockSize: bs, Blocks: w.stored}
			if first > 0 {
				ev.HasParent, ev.Parent = true, a.keys[first-1]
			}
			w.onEvent(ev)
		}
		w.stored = w.stored[:0]
		first = -1
	}
	for i := len(a.slots); i < full; i++ {
		slot, fresh := w.cache.register(a.keys[i])
		a.slots = append(a.slots, slot)
		a.anon--
		if !fresh {
			flush()
			continue
		}
		if first < 0 {
			first = i
		}
		w.stored = append(w.stored, kvindex.StoredBlock{EngineHash: a.keys[i], Tokens: a.req.Tokens[i*bs : (i+1)*bs]})
	}
	flush()
}

// finish releases a's blocks (the cached ones stay, evictable, tail blocks
// first as vLLM frees them) and reports it.
func (w *worker) finish(a *active, now time.Duration) {
	for i := len(a.slots) - 1; i >= 0; i-- {
		w.cache.release(a.slots[i])
	}
	w.cache.anon -= a.anon
	w.activeTokens -= a.computed + a.generated
	a.slots, a.keys, a.anon = nil, nil, 0
	if w.onFinish != nil {
		w.onFinish(a, now)
	}
}

// load is the worker's load as its metrics endpoint would report it.
func (w *worker) load() routing.Load {
	return routing.Load{
		Waiting: float64(len(w.waiting)),
		Running: float64(len(w.running)),
		KVUsage: float64(w.cache.used()) / float64(w.cfg.KVBlocks),
		Known:   true,
	}
}
