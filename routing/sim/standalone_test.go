package sim

import (
	"errors"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

func TestWorkerStepByStep(t *testing.T) {
	var events []kvindex.Event
	var admitted, finished []*Job
	w, err := NewWorker(WorkerConfig{KVBlocks: 64, BlockSize: 4}, WorkerHooks{
		KVEvent:  func(ev kvindex.Event) { events = append(events, ev) },
		Admitted: func(j *Job) { admitted = append(admitted, j) },
		Finished: func(j *Job) { finished = append(finished, j) },
	})
	if err != nil {
		t.Fatal(err)
	}
	prompt := seq(10, 1)
	j, err := w.Submit(0, &Request{Tokens: prompt, OutputLen: 3})
	if err != nil {
		t.Fatal(err)
	}
	if len(admitted) != 1 || !j.Admitted() || j.Cached() != 0 {
		t.Fatalf("admitted %d, cached %d", len(admitted), j.Cached())
	}
	end, ok := w.Next()
	if !ok || end != MockerPrefill(10) {
		t.Fatalf("first step ends at %v (%v), want %v", end, ok, MockerPrefill(10))
	}
	w.Advance(end - 1)
	if j.Generated() != 0 {
		t.Fatalf("generated %d before the prefill ended", j.Generated())
	}
	w.Advance(end)
	if j.Generated() != 1 || len(events) != 1 || len(events[0].Blocks) != 2 {
		t.Fatalf("after prefill: generated %d, events %+v", j.Generated(), events)
	}
	// Decode steps come one at a time.
	next, _ := w.Next()
	if next <= end {
		t.Fatalf("decode step ends at %v, not after %v", next, end)
	}
	w.Advance(next)
	if j.Generated() != 2 || j.Done() {
		t.Fatalf("after one decode step: generated %d, done %v", j.Generated(), j.Done())
	}
	w.Advance(time.Hour)
	if !j.Done() || j.Generated() != 3 || len(finished) != 1 {
		t.Fatalf("generated %d, done %v, finished %d", j.Generated(), j.Done(), len(finished))
	}
	if _, ok := w.Next(); ok {
		t.Fatal("worker still busy")
	}
	// The same prompt again hits the cache (two full blocks; the last
	// token is recomputed).
	j2, err := w.Submit(time.Hour, &Request{Tokens: prompt, OutputLen: 1})
	if err != nil {
		t.Fatal(err)
	}
	if j2.Cached() != 8 {
		t.Fatalf("cached %d, want 8", j2.Cached())
	}
	w.Advance(2 * time.Hour)
	if !j2.Done() || w.Stats().Requests != 2 || w.Stats().CachedTokens != 8 {
		t.Fatalf("done %v, stats %+v", j2.Done(), w.Stats())
	}
	if l := w.Load(); l.Waiting != 0 || l.Running != 0 || l.KVUsage != 0 {
		t.Fatalf("idle load %+v", l)
	}
}

func TestWorkerSubmitErrors(t *testing.T) {
	w, err := NewWorker(WorkerConfig{KVBlocks: 2, BlockSize: 4}, WorkerHooks{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []Request{{OutputLen: 1}, {Tokens: seq(2, 1)}, {Tokens: seq(20, 1), OutputLen: 1}} {
		if _, err := w.Submit(0, &r); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("Submit(%d tokens, %d out) = %v, want ErrInvalidRequest", len(r.Tokens), r.OutputLen, err)
		}
	}
	if _, err := NewWorker(WorkerConfig{Speed: -1}, WorkerHooks{}); !errors.Is(err, ErrWorkerConfig) {
		t.Errorf("negative speed: %v", err)
	}
	if err := w.SetSpeed(0, -2); !errors.Is(err, ErrWorkerConfig) {
		t.Errorf("SetSpeed(-2) = %v", err)
	}
}

// A slower worker takes proportionally longer per step.
func TestWorkerSpeed(t *testing.T) {
	w, err := NewWorker(WorkerConfig{Speed: 0.5}, WorkerHooks{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Submit(time.Second, &Request{Tokens: seq(100, 1), OutputLen: 2}); err != nil {
		t.Fatal(err)
	}
	end, _ := w.Next()
	if got, want := end-time.Second, 2*MockerPrefill(100); got != want {
		t.Fatalf("prefill at half speed took %v, want %v", got, want)
	}
}
