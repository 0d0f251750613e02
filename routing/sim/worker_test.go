package sim

import (
	"slices"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// rig drives one worker on its own (no engine): requests arrive at given
// times and steps end in order.
type rig struct {
	t     *testing.T
	w     *worker
	now   time.Duration
	steps []stepKind // kinds of the steps that ended
	done  []*active
	// cached mirrors the cache from the KV events alone, cpu the CPU tier.
	cached, cpu map[uint64]bool
	// check runs after every step.
	check func()
}

func newRig(t *testing.T, wc WorkerConfig) *rig {
	t.Helper()
	wc, err := wc.withDefaults(0)
	if err != nil {
		t.Fatal(err)
	}
	r := &rig{t: t, w: newWorker(wc), cached: map[uint64]bool{}, cpu: map[uint64]bool{}}
	r.w.onFinish = func(a *active, _ time.Duration) { r.done = append(r.done, a) }
	r.w.onEvent = func(ev kvindex.Event) {
		if ev.Medium == kvindex.MediumCPU {
			r.cpuEvent(ev)
			return
		}
		switch ev.Kind {
		case kvindex.Stored:
			if ev.HasParent && !r.cached[ev.Parent] {
				t.Errorf("stored block with unknown parent %x", ev.Parent)
			}
			for _, b := range ev.Blocks {
				if len(b.Tokens) != ev.BlockSize {
					t.Errorf("stored block of %d tokens", len(b.Tokens))
				}
				if r.cached[b.EngineHash] {
					t.Errorf("block %x stored twice", b.EngineHash)
				}
				r.cached[b.EngineHash] = true
			}
		case kvindex.Removed:
			for _, h := range ev.RemovedHashes {
				if !r.cached[h] {
					t.Errorf("removed unknown block %x", h)
				}
				delete(r.cached, h)
			}
		}
	}
	return r
}

// cpuEvent checks a CPU tier event as vLLM's offloading sends them: a
// location-only store of blocks the GPU still holds, a removal of held ones.
func (r *rig) cpuEvent(ev kvindex.Event) {
	t := r.t
	switch ev.Kind {
	case kvindex.Stored:
		for _, b := range ev.Blocks {
			if b.Tokens != nil || !r.cached[b.EngineHash] || r.cpu[b.EngineHash] {
				t.Errorf("cpu store of %x: tokens %d, on gpu %v, on cpu %v", b.EngineHash, len(b.Tokens), r.cached[b.EngineHash], r.cpu[b.EngineHash])
			}
			r.cpu[b.EngineHash] = true
		}
	case kvindex.Removed:
		for _, h := range ev.RemovedHashes {
			if !r.cpu[h] {
				t.Errorf("cpu removal of unknown block %x", h)
			}
			delete(r.cpu, h)
		}
	default:
		t.Errorf("cpu event %v", ev.Kind)
	}
}

func (r *rig) req(at time.Duration, tokens []uint32, out int) *active {
	return &active{req: &Request{Arrival: at, Tokens: tokens, OutputLen: out}}
}

// run feeds the requests (sorted by arrival) and steps until idle.
func (r *rig) run(as ...*active) {
	for len(as) > 0 || r.w.busy {
		if len(as) > 0 && (!r.w.busy || as[0].req.Arrival < r.w.end) {
			r.now = max(r.now, as[0].req.Arrival)
			r.w.enqueue(as[0], r.now)
			as = as[1:]
			continue
		}
		r.now = r.w.end
		r.steps = append(r.steps, r.w.kind)
		r.w.stepEnd(r.now)
		if r.check != nil {
			r.check()
		}
	}
}

// sameAsEvents checks that the events describe the cache.
func (r *rig) sameAsEvents() {
	r.t.Helper()
	if len(r.cached) != len(r.w.cache.index) {
		r.t.Fatalf("events say %d blocks cached, the cache has %d", len(r.cached), len(r.w.cache.index))
	}
	for h := range r.w.cache.index {
		if !r.cached[h] {
			r.t.Fatalf("block %x cached without a stored event", h)
		}
	}
}

func TestPrefixReuse(t *testing.T) {
	r := newRig(t, WorkerConfig{BlockSize: 16})
	prompt := seq(100, 1) // 6 full blocks + 4 tokens
	a, b := r.req(0, prompt, 5), r.req(time.Second, prompt, 5)
	r.run(a, b)
	if a.cached != 0 || b.cached != 96 {
		t.Fatalf("cached tokens: first %d, second %d (want 0, 96)", a.cached, b.cached)
	}
	// A prompt of whole blocks still recomputes its last token: vLLM caps
	// the hit at the prompt minus one token.
	whole := seq(64, 1)
	c := r.req(2*time.Second, whole, 1)
	r.run(c)
	if c.cached != 48 {
		t.Fatalf("whole-block prompt cached %d tokens, want 48", c.cached)
	}
	// A shared prefix then a different suffix reuses the prefix only.
	d := r.req(3*time.Second, cat(seq(40, 1), seq(60, 9000)), 1)
	r.run(d)
	if d.cached != 32 {
		t.Fatalf("diverging prompt cached %d tokens, want 32", d.cached)
	}
	r.sameAsEvents()
	if r.w.cache.pinned != 0 || r.w.cache.anon != 0 || r.w.activeTokens != 0 {
		t.Fatalf("idle worker holds blocks: pinned %d anon %d tokens %d", r.w.cache.pinned, r.w.cache.anon, r.w.activeTokens)
	}
}

func TestLRUEviction(t *testing.T) {
	// 10 blocks of 4 tokens; each request reserves 3 prompt blocks + 1
	// for its output.
	r := newRig(t, WorkerConfig{KVBlocks: 10, BlockSize: 4})
	A, B, C, D := seq(12, 100), seq(12, 200), seq(12, 300), seq(12, 400)
	r.run(r.req(0, A, 2), r.req(time.Second, B, 2), r.req(2*time.Second, C, 2))
	// 9 cached blocks, 1 free.
	if len(r.w.cache.index) != 9 || r.w.cache.free() != 1 {
		t.Fatalf("cached blocks %d, free %d; want 9 and 1", len(r.w.cache.index), r.w.cache.free())
	}
	r.sameAsEvents()
	var removed []uint64
	next := r.w.onEvent
	r.w.onEvent = func(ev kvindex.Event) {
		removed = append(removed, ev.RemovedHashes...)
		next(ev)
	}
	// D needs 4 blocks: the 3 least recently used go, which are A's.
	r.run(r.req(3*time.Second, D, 2))
	aKeys := kvindex.AppendBlockKeys(nil, A, 4, kvindex.BaseSeed)
	slices.Sort(aKeys)
	slices.Sort(removed)
	if !slices.Equal(removed, aKeys) {
		t.Fatalf("evicted %x, want A's blocks %x", removed, aKeys)
	}
	a2, c2 := r.req(4*time.Second, A, 2), r.req(5*time.Second, C, 2)
	r.run(a2, c2)
	if a2.cached != 0 || c2.cached != 8 {
		t.Fatalf("after eviction: A cached %d tokens (want 0), C %d (want 8)", a2.cached, c2.cached)
	}
	r.sameAsEvents()
	// Blocks held by a running request are never evicted: a request that
	// needs more than the unpinned blocks waits.
	r3 := newRig(t, WorkerConfig{KVBlocks: 10, BlockSize: 4})
	long, short := r3.req(0, seq(20, 1), 20), r3.req(0, seq(12, 500), 2) // 10 blocks, then 4
	r3.run(long, short)
	if short.firstAt <= long.firstAt || len(r3.done) != 2 || r3.done[0] != long {
		t.Fatalf("a request was admitted into pinned blocks (long first token %v, short %v)", long.firstAt, short.firstAt)
	}
}

func TestMaxNumSeqs(t *testing.T) {
	r := newRig(t, WorkerConfig{MaxNumSeqs: 2})
	var as []*active
	for i := range 6 {
		as = append(as, r.req(0, seq(100, uint32(1000*i)), 50))
	}
	peak := 0
	r.check = func() { peak = max(peak, len(r.w.running)) }
	r.run(as...)
	if peak != 2 || len(r.done) != 6 {
		t.Fatalf("peak running %d (want 2), done %d", peak, len(r.done))
	}
	// FCFS: the first two finish first.
	if r.done[0] != as[0] && r.done[0] != as[1] {
		t.Fatal("not first come, first served")
	}
}

func TestChunkedPrefill(t *testing.T) {
	r := newRig(t, WorkerConfig{})
	a := r.req(0, seq(20_000, 1), 1)
	r.run(a)
	if !slices.Equal(r.steps, []stepKind{stepPrefill, stepPrefill, stepPrefill}) {
		t.Fatalf("steps %v, want 3 prefill steps", r.steps)
	}
	want := 2*MockerPrefill(8192) + MockerPrefill(20_000-2*8192)
	if a.firstAt != want {
		t.Fatalf("TTFT %v, want %v", a.firstAt, want)
	}
	// The step budget is shared: two 5000-token prompts take two steps.
	r2 := newRig(t, WorkerConfig{})
	r2.run(r2.req(0, seq(5000, 1), 1), r2.req(0, seq(5000, 100_000), 1))
	if len(r2.steps) != 2 || r2.w.stats.PrefillTokens != 10_000 {
		t.Fatalf("steps %v, prefill tokens %d", r2.steps, r2.w.stats.PrefillTokens)
	}
}

func TestDecodeSteps(t *testing.T) {
	r := newRig(t, WorkerConfig{})
	a := r.req(0, seq(1000, 1), 100)
	r.run(a)
	// One prefill step (first token) then 99 decode steps at a KV
	// utilisation growing by one token per step.
	want := MockerPrefill(1000)
	for i := range 99 {
		want += MockerDecode(float64(1001+i) / float64(DefaultKVBlocks*DefaultBlockSize))
	}
	if r.now != want || a.generated != 100 {
		t.Fatalf("finished at %v with %d tokens, want %v and 100", r.now, a.generated, want)
	}
	if len(r.steps) != 2 {
		t.Fatalf("decode steps were not batched: %d events", len(r.steps))
	}
	// An arrival during a decode run cuts it at the step in progress; the
	// result is the same as stepping one token at a time.
	r2 := newRig(t, WorkerConfig{})
	b := r2.req(0, seq(1000, 1), 100)
	c := r2.req(500*time.Millisecond, seq(1000, 50_000), 10)
	r2.run(b, c)
	r3 := newRig(t, WorkerConfig{})
	b3 := r3.req(0, seq(1000, 1), 100)
	c3 := r3.req(500*time.Millisecond, seq(1000, 50_000), 10)
	r3.w.onFirst = func(*active, time.Duration) {}
	singleSteps(r3, b3, c3)
	if b.firstAt != b3.firstAt || c.firstAt != c3.firstAt || r2.now != r3.now {
		t.Fatalf("batched: b %v c %v end %v; single steps: b %v c %v end %v", b.firstAt, c.firstAt, r2.now, b3.firstAt, c3.firstAt, r3.now)
	}
}

// singleSteps runs like rig.run but cuts every decode run after one step.
func singleSteps(r *rig, as ...*active) {
	for len(as) > 0 || r.w.busy {
		if r.w.busy && r.w.kind == stepDecode {
			r.w.truncate(r.w.start)
		}
		if len(as) > 0 && (!r.w.busy || as[0].req.Arrival < r.w.end) {
			r.now = max(r.now, as[0].req.Arrival)
			r.w.enqueue(as[0], r.now)
			as = as[1:]
			continue
		}
		r.now = r.w.end
		r.w.stepEnd(r.now)
	}
}

func TestSpeedFactor(t *testing.T) {
	times := map[float64]time.Duration{}
	for _, speed := range []float64{1, 2} {
		r := newRig(t, WorkerConfig{Speed: speed})
		r.run(r.req(0, seq(3000, 1), 50))
		times[speed] = r.now
	}
	if d := times[1] - 2*times[2]; d < -50 || d > 50 {
		t.Fatalf("speed 2 took %v, speed 1 %v", times[2], times[1])
	}
}

func TestKVEventsMatchCache(t *testing.T) {
	r := newRig(t, WorkerConfig{KVBlocks: 64, BlockSize: 16})
	reqs := synthetic(300, 5, 200, 60, 50, 3)
	as := make([]*active, len(reqs))
	for i := range reqs {
		as[i] = &active{req: &reqs[i]}
	}
	r.check = func() {
		// Between steps, every cached block was announced and not removed.
		for h := range r.w.cache.index {
			if !r.cached[h] {
				t.Fatalf("cached block %x never stored", h)
			}
		}
		if len(r.cached) != len(r.w.cache.index) {
			t.Fatalf("events: %d blocks, cache: %d", len(r.cached), len(r.w.cache.index))
		}
	}
	r.run(as...)
	if len(r.done) != len(reqs) {
		t.Fatalf("done %d of %d", len(r.done), len(reqs))
	}
	r.sameAsEvents()
}
