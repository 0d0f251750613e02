package sim

import (
	"fmt"
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// Worker is one simulated worker driven by its caller instead of [Run]:
// the caller submits requests and advances the worker's clock (an offset
// from the worker's start, which the caller may map to real time), and the
// worker reports its KV cache changes, admissions and completions through
// [WorkerHooks]. The model is Run's (continuous batching, chunked prefill,
// prefix cache with LRU eviction, the mocker's step times), except that
// decode steps are taken one at a time, so that every generated token has
// its own step end.
//
// A Worker is not safe for concurrent use: one goroutine drives it, and
// the hooks run on that goroutine, inside Submit and Advance.
type Worker struct {
	w     *worker
	now   time.Duration
	hooks WorkerHooks
	jobs  map[*active]*Job
}

// WorkerHooks are a Worker's callbacks; nil ones are skipped. They must
// not call the Worker.
type WorkerHooks struct {
	// KVEvent receives each change of the worker's prefix cache, in order:
	// blocks stored (with their chained block keys as engine hashes and
	// their token ids) and blocks evicted. The event's slices are only
	// valid during the call.
	KVEvent func(kvindex.Event)
	// Admitted is called when a job joins the running batch; its cached
	// prompt tokens are known from then on.
	Admitted func(j *Job)
	// Finished is called when a job has generated all its output tokens.
	Finished func(j *Job)
}

// Job is one request on a Worker. Its accessors read the worker's state:
// call them from the goroutine that drives the Worker (the hooks
// included).
type Job struct {
	a        active
	admitted bool
	done     bool
	// Value is the caller's, untouched by the Worker.
	Value any
}

// Prompt is the job's prompt length in tokens.
func (j *Job) Prompt() int { return len(j.a.req.Tokens) }

// Cached is the prompt tokens found in the worker's prefix cache at
// admission (0 before).
func (j *Job) Cached() int { return j.a.cached }

// Admitted reports whether the job has joined the running batch.
func (j *Job) Admitted() bool { return j.admitted }

// Generated is the output tokens generated so far (the first one comes
// with the end of the prefill).
func (j *Job) Generated() int { return j.a.generated }

// Done reports whether the job has finished.
func (j *Job) Done() bool { return j.done }

// NewWorker returns a stopped-clock worker (time 0) with cfg's zero fields
// defaulted.
func NewWorker(cfg WorkerConfig, hooks WorkerHooks) (*Worker, error) {
	wc, err := cfg.withDefaults(0)
	if err != nil {
		return nil, err
	}
	sw := &Worker{w: newWorker(wc), hooks: hooks, jobs: make(map[*active]*Job)}
	sw.w.maxRun = 1
	sw.w.onEvent = hooks.KVEvent
	sw.w.onAdmit = func(a *active) {
		if j := sw.jobs[a]; j != nil {
			j.admitted = true
			if hooks.Admitted != nil {
				hooks.Admitted(j)
			}
		}
	}
	sw.w.onFinish = func(a *active, _ time.Duration) {
		j := sw.jobs[a]
		if j == nil {
			return
		}
		delete(sw.jobs, a)
		j.done = true
		if hooks.Finished != nil {
			hooks.Finished(j)
		}
	}
	return sw, nil
}

// Config is the worker's configuration with defaults applied.
func (sw *Worker) Config() WorkerConfig { return sw.w.cfg }

// Now is the worker's clock: the latest time given to Submit or Advance.
func (sw *Worker) Now() time.Duration { return sw.now }

// Advance completes every step that ends at or before now, in order, each
// at its own end time, and moves the clock to now. Times before the
// worker's clock are taken as its clock.
func (sw *Worker) Advance(now time.Duration) {
	w := sw.w
	for w.busy && w.end <= now {
		w.stepEnd(w.end)
	}
	sw.now = max(sw.now, now)
}

// Next returns when the step in progress ends; ok is false when the worker
// is idle (or stopped).
func (sw *Worker) Next() (end time.Duration, ok bool) {
	if !sw.w.busy {
		return 0, false
	}
	return sw.w.end, true
}

// Submit advances the worker to now and queues r on it. r's Arrival is
// ignored and r must not be modified afterwards. It fails (wrapping
// ErrInvalidRequest) for an empty prompt, an output length below 1, or a
// request that needs more KV blocks than the worker has.
func (sw *Worker) Submit(now time.Duration, r *Request) (*Job, error) {
	switch {
	case len(r.Tokens) == 0:
		return nil, fmt.Errorf("%w: empty prompt", ErrInvalidRequest)
	case r.OutputLen < 1:
		return nil, fmt.Errorf("%w: output length %d < 1", ErrInvalidRequest, r.OutputLen)
	case !sw.w.fits(r, false):
		return nil, fmt.Errorf("%w: request needs %d KV blocks, the worker has %d", ErrInvalidRequest, sw.w.blocksFor(r, false), sw.w.cfg.KVBlocks)
	}
	sw.Advance(now)
	j := &Job{a: active{req: r}}
	sw.jobs[&j.a] = j
	sw.w.enqueue(&j.a, sw.now)
	return j, nil
}

// SetSpeed changes the worker's speed factor at now (after advancing to
// it); 0 stops the worker after the step in progress.
func (sw *Worker) SetSpeed(now time.Duration, speed float64) error {
	if speed < 0 || math.IsNaN(speed) || math.IsInf(speed, 0) {
		return fmt.Errorf("%w: speed must be >= 0, got %v", ErrWorkerConfig, speed)
	}
	sw.Advance(now)
	sw.w.setSpeed(speed, sw.now)
	return nil
}

// Load is the worker's load as its metrics endpoint reports it.
func (sw *Worker) Load() routing.Load { return sw.w.load() }

// Stats sums up the worker so far.
func (sw *Worker) Stats() WorkerResult { return sw.w.stats }
