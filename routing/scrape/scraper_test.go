package scrape_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/scrape"
)

// worker is a fake inference worker's /metrics endpoint on 127.0.0.1.
type worker struct {
	srv  *httptest.Server
	hits atomic.Int64
}

func newWorker(t *testing.T, h http.HandlerFunc) *worker {
	t.Helper()
	w := &worker{}
	w.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w.hits.Add(1)
		if r.URL.Path != "/metrics" {
			http.NotFound(rw, r)
			return
		}
		h(rw, r)
	}))
	t.Cleanup(w.srv.Close)
	return w
}

func (w *worker) target() scrape.Target {
	return scrape.Target{Key: strings.TrimPrefix(w.srv.URL, "http://")}
}

func serve(body string) http.HandlerFunc {
	return func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_, _ = rw.Write([]byte(body))
	}
}

func newClient(t *testing.T) *http.Client {
	t.Helper()
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

type event struct {
	key    string
	sample scrape.Sample
	err    error
}

// recorder collects Publish and OnError calls.
type recorder struct {
	mu     sync.Mutex
	events []event
	ch     chan event
}

func newRecorder() *recorder { return &recorder{ch: make(chan event, 1024)} }

func (r *recorder) publish(t scrape.Target, s scrape.Sample) { r.add(event{key: t.Key, sample: s}) }
func (r *recorder) onError(t scrape.Target, err error)       { r.add(event{key: t.Key, err: err}) }
func (r *recorder) add(e event) {
	r.mu.Lock()
	r.events = append(r.events, e)
	r.mu.Unlock()
	r.ch <- e
}

// drain returns and forgets the events so far, by target.
func (r *recorder) drain() map[string][]event {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string][]event)
	for _, e := range r.events {
		out[e.key] = append(out[e.key], e)
	}
	r.events = nil
	for len(r.ch) > 0 {
		<-r.ch
	}
	return out
}

func TestScrapeOnceMixedTargets(t *testing.T) {
	t.Parallel()
	vllm := newWorker(t, serve(vllmMetrics(2)))
	sglang := newWorker(t, serve(sglangMetrics))
	fail := newWorker(t, func(rw http.ResponseWriter, _ *http.Request) { http.Error(rw, "boom", 500) })
	garbage := newWorker(t, serve("<html>\x00\x01 not metrics {{{\n"))
	gone := newWorker(t, serve(vllmMetrics(1)))
	gone.srv.Close() // connection refused

	targets := []scrape.Target{vllm.target(), sglang.target(), fail.target(), garbage.target(), gone.target()}
	rec := newRecorder()
	s := scrape.New(scrape.Config{}, scrape.Deps{
		Client:  newClient(t),
		Clock:   clock.NewVirtual(time.Unix(0, 0)),
		Targets: func() []scrape.Target { return targets },
		Publish: rec.publish,
		OnError: rec.onError,
	})
	s.ScrapeOnce(t.Context())
	got := rec.drain()

	if e := got[vllm.target().Key]; len(e) != 1 || e[0].err != nil || e[0].sample.Running != 7 || e[0].sample.BlockSize != 16 || len(e[0].sample.Ranks) != 2 {
		t.Errorf("vllm events = %+v", e)
	}
	if e := got[sglang.target().Key]; len(e) != 1 || e[0].err != nil || e[0].sample.Waiting != 2826 {
		t.Errorf("sglang events = %+v", e)
	}
	var se *scrape.StatusError
	checkErr(t, "500", got[fail.target().Key], func(err error) bool { return errors.As(err, &se) && se.Code == 500 })
	checkErr(t, "garbage", got[garbage.target().Key], func(err error) bool { return errors.Is(err, scrape.ErrMalformed) })
	checkErr(t, "gone", got[gone.target().Key], func(err error) bool { return err != nil })
	want := scrape.Stats{OK: 2, HTTPStatus: 1, Parse: 1, Other: 1}
	if st := s.Stats(); st != want {
		t.Errorf("Stats() = %+v, want %+v", st, want)
	}
	wantReasons := map[string]uint64{"ok": 2, "timeout": 0, "http_status": 1, "parse": 1, "too_large": 0, "other": 1}
	if d := cmp.Diff(wantReasons, s.Stats().ByReason()); d != "" {
		t.Errorf("ByReason (-want +got):\n%s", d)
	}
}

func checkErr(t *testing.T, name string, e []event, ok func(error) bool) {
	t.Helper()
	if len(e) != 1 || !ok(e[0].err) {
		t.Errorf("%s: events = %+v", name, e)
	}
}

// TestHungTargetDelaysNoOther: with one of two scrape slots held by a
// target that never answers, the others finish well before its timeout.
func TestHungTargetDelaysNoOther(t *testing.T) {
	t.Parallel()
	const timeout = 500 * time.Millisecond
	hang := newWorker(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	targets := []scrape.Target{hang.target()}
	for range 4 {
		targets = append(targets, newWorker(t, serve(sglangMetrics)).target())
	}
	rec := newRecorder()
	start := time.Now()
	var last atomic.Int64
	s := scrape.New(scrape.Config{Timeout: timeout, MaxInFlight: 2}, scrape.Deps{
		Client:  newClient(t),
		Clock:   clock.NewVirtual(time.Unix(0, 0)),
		Targets: func() []scrape.Target { return targets },
		Publish: func(tg scrape.Target, smp scrape.Sample) {
			last.Store(int64(time.Since(start)))
			rec.publish(tg, smp)
		},
		OnError: rec.onError,
	})
	s.ScrapeOnce(t.Context())
	if d := time.Duration(last.Load()); d == 0 || d >= timeout {
		t.Errorf("good targets published after %v; the hung one delayed them", d)
	}
	checkErr(t, "hang", rec.drain()[hang.target().Key], func(err error) bool { return errors.Is(err, context.DeadlineExceeded) })
	if st := s.Stats(); st != (scrape.Stats{OK: 4, Timeout: 1}) {
		t.Errorf("Stats() = %+v", st)
	}
}

// TestBodyTooLarge: 11 MB bodies against the 10 MB default, with and
// without a Content-Length.
func TestBodyTooLarge(t *testing.T) {
	t.Parallel()
	chunk := strings.Repeat("# padding comment line to make the body large\n", 1<<20/47)
	tooBig := newWorker(t, serve(strings.Repeat(chunk, 11)))
	chunked := newWorker(t, func(rw http.ResponseWriter, _ *http.Request) {
		for range 11 {
			if _, err := rw.Write([]byte(chunk)); err != nil {
				return
			}
			rw.(http.Flusher).Flush()
		}
	})
	rec := newRecorder()
	// The timeout only bounds the test: reading 10 MB twice under -race on
	// a loaded 2-core machine once took over 10 s (a Timeout, not TooLarge).
	s := scrape.New(scrape.Config{Timeout: 2 * time.Minute}, scrape.Deps{
		Client:  newClient(t),
		Clock:   clock.NewVirtual(time.Unix(0, 0)),
		Targets: func() []scrape.Target { return []scrape.Target{tooBig.target(), chunked.target()} },
		Publish: rec.publish,
		OnError: rec.onError,
	})
	s.ScrapeOnce(t.Context())
	got := rec.drain()
	for name, w := range map[string]*worker{"Content-Length": tooBig, "chunked": chunked} {
		checkErr(t, name, got[w.target().Key], func(err error) bool { return errors.Is(err, scrape.ErrTooLarge) })
	}
	if st := s.Stats(); st != (scrape.Stats{TooLarge: 2}) {
		t.Errorf("Stats() = %+v", st)
	}
}

func TestStaleMarking(t *testing.T) {
	t.Parallel()
	var failing atomic.Bool
	w := newWorker(t, func(rw http.ResponseWriter, r *http.Request) {
		if failing.Load() {
			http.Error(rw, "down", http.StatusServiceUnavailable)
			return
		}
		serve(sglangMetrics)(rw, r)
	})
	never := newWorker(t, func(rw http.ResponseWriter, _ *http.Request) { http.Error(rw, "starting", 503) })
	v := clock.NewVirtual(time.Unix(1000, 0))
	rec := newRecorder()
	s := scrape.New(scrape.Config{Interval: time.Second}, scrape.Deps{ // StaleAfter 3s
		Client:  newClient(t),
		Clock:   v,
		Targets: func() []scrape.Target { return []scrape.Target{w.target(), never.target()} },
		Publish: rec.publish,
		OnError: rec.onError,
	})
	key, neverKey := w.target().Key, never.target().Key

	s.ScrapeOnce(t.Context())
	if e := rec.drain()[key]; len(e) != 1 || !e[0].sample.Known || e[0].sample.Stale || !e[0].sample.At.Equal(time.Unix(1000, 0)) {
		t.Fatalf("first round = %+v", e)
	}
	failing.Store(true)
	for i := 1; i <= 2; i++ {
		v.Step(time.Second)
		s.ScrapeOnce(t.Context())
		if e := rec.drain()[key]; len(e) != 1 || e[0].err == nil {
			t.Fatalf("round %d: events = %+v, want one error and no stale mark", i, e)
		}
	}
	v.Step(time.Second) // 3s since the last success
	s.ScrapeOnce(t.Context())
	got := rec.drain()
	e := got[key]
	if len(e) != 2 || e[0].err == nil || e[1].err != nil {
		t.Fatalf("round 3: events = %+v, want an error then a stale mark", e)
	}
	if m := e[1].sample; !m.Stale || !m.Known || m.Waiting != 2826 || !m.At.Equal(time.Unix(1003, 0)) {
		t.Errorf("stale mark = %+v", m)
	}
	if n := got[neverKey]; len(n) != 2 || !n[1].sample.Stale || n[1].sample.Known {
		t.Errorf("never-answering target: events = %+v, want a stale mark with Known false", n)
	}

	failing.Store(false)
	v.Step(time.Second)
	s.ScrapeOnce(t.Context())
	if e := rec.drain()[key]; len(e) != 1 || e[0].err != nil || e[0].sample.Stale || !e[0].sample.Known {
		t.Fatalf("recovery: events = %+v", e)
	}
}

// waitFor steps the virtual clock one interval at a time until an event
// satisfying ok arrives.
func waitFor(t *testing.T, v *clock.Virtual, rec *recorder, ok func(event) bool) {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case e := <-rec.ch:
			if ok(e) {
				return
			}
		case <-time.After(20 * time.Millisecond):
			v.Step(time.Second)
		case <-deadline:
			t.Fatal("timed out waiting for an event")
		}
	}
}

func TestRunTargetsJoinAndLeave(t *testing.T) {
	t.Parallel()
	a := newWorker(t, serve(vllmMetrics(1)))
	b := newWorker(t, serve(sglangMetrics))
	var targets atomic.Pointer[[]scrape.Target]
	set := func(ts ...scrape.Target) { targets.Store(&ts) }
	set(a.target())

	v := clock.NewVirtual(time.Unix(0, 0))
	rec := newRecorder()
	s := scrape.New(scrape.Config{Interval: time.Second, StaleAfter: time.Hour}, scrape.Deps{
		Client:  newClient(t),
		Clock:   v,
		Targets: func() []scrape.Target { return *targets.Load() },
		Publish: rec.publish,
		OnError: rec.onError,
	})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error)
	go func() { done <- s.Run(ctx) }()

	is := func(k string) func(event) bool {
		return func(e event) bool { return e.key == k && e.err == nil }
	}
	waitFor(t, v, rec, is(a.target().Key))
	set(a.target(), b.target()) // b joins
	waitFor(t, v, rec, is(b.target().Key))
	set(a.target()) // b leaves
	waitFor(t, v, rec, is(a.target().Key))
	waitFor(t, v, rec, is(a.target().Key)) // a full round without b
	hits := b.hits.Load()
	for range 3 {
		waitFor(t, v, rec, is(a.target().Key))
	}
	if n := b.hits.Load(); n != hits {
		t.Errorf("departed target scraped %d more times", n-hits)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v", err)
	}
	if st := s.Stats(); st.OK < 6 || st.Timeout+st.HTTPStatus+st.Parse+st.TooLarge+st.Other != 0 {
		t.Errorf("Stats() = %+v", st)
	}
}

// TestRunDefaults runs with the real clock and the default client, whose
// idle connections Run closes (goleak checks).
func TestRunDefaults(t *testing.T) {
	t.Parallel()
	w := newWorker(t, serve(vllmMetrics(1)))
	got := make(chan scrape.Sample, 100)
	s := scrape.New(scrape.Config{Interval: 10 * time.Millisecond}, scrape.Deps{
		Targets: func() []scrape.Target {
			return []scrape.Target{{Key: "ignored", URL: w.srv.URL + "/metrics"}}
		},
		Publish: func(_ scrape.Target, smp scrape.Sample) { got <- smp },
	})
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error)
	go func() { done <- s.Run(ctx) }()
	for i := range 3 {
		select {
		case smp := <-got:
			if !smp.Known || smp.Running != 3 {
				t.Errorf("sample %d = %+v", i, smp)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no sample")
		}
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v", err)
	}
	if n := w.hits.Load(); n < 3 {
		t.Errorf("hits = %d", n)
	}
}
