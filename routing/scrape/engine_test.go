package scrape_test

import (
	"errors"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/scrape"
)

func TestEngineAdapters(t *testing.T) {
	t.Parallel()
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New("least_loaded", policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	e := engine.Must(p, engine.Options{}, engine.Deps{Rand: rnd, Clock: clock.NewVirtual(time.Unix(0, 0))})
	t.Cleanup(e.Close)
	w := newWorker(t, serve(sglangMetrics))
	key := w.target().Key
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: []routing.Endpoint{{Key: routing.EndpointKey(key)}}}); err != nil {
		t.Fatal(err)
	}
	if got := scrape.EngineTargets(e)(); !cmp.Equal(got, []scrape.Target{{Key: key}}) {
		t.Fatalf("EngineTargets = %v", got)
	}
	publish := scrape.EnginePublish(e)
	s := scrape.New(scrape.Config{}, scrape.Deps{
		Client:  newClient(t),
		Clock:   clock.NewVirtual(time.Unix(0, 0)),
		Targets: scrape.EngineTargets(e),
		Publish: publish,
	})
	s.ScrapeOnce(t.Context())
	publish(scrape.Target{Key: "10.9.9.9:1"}, scrape.Sample{Known: true}) // departed: dropped
	if st := s.Stats(); st.OK != 1 {
		t.Errorf("Stats() = %+v", st)
	}
}

// loraMetrics is a vLLM /metrics page with LoRA adapters in use: its newest
// vllm:lora_requests_info series (not the last one listed) runs chat-lora
// and sql-lora and queues tool-lora.
func loraMetrics(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "vllm_lora.metrics"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestParseLoRAAdapters(t *testing.T) {
	t.Parallel()
	s, err := scrape.Parse(strings.NewReader(loraMetrics(t)), 0)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"chat-lora", "sql-lora", "tool-lora"}; !cmp.Equal(s.Adapters, want) || s.MaxLoRA != 4 {
		t.Fatalf("Adapters = %v, MaxLoRA = %d; want %v, 4", s.Adapters, s.MaxLoRA, want)
	}
	if s.Running != 3 || s.Waiting != 1 || s.BlockSize != 16 || !s.Known {
		t.Fatalf("sample %+v", s)
	}
}

// healthEngine is a round-robin engine on a virtual clock.
func healthEngine(t *testing.T, opts engine.Options, eps ...routing.Endpoint) *engine.Engine {
	t.Helper()
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New("round_robin", policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	opts.SyncIndex = true
	e := engine.Must(p, opts, engine.Deps{Rand: rnd, Clock: clock.NewVirtual(time.Unix(1_700_000_000, 0)), Logger: slog.New(slog.DiscardHandler)})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return e
}

func ejected(e *engine.Engine, key string) bool {
	for _, st := range e.Endpoints() {
		if string(st.Key) == key {
			return e.Ejected(st.Key, e.Clock().Now())
		}
	}
	return false
}

// TestEngineRoutesScrapedAdapters: an adapter only the worker's metrics
// mention routes its model to that worker alone.
func TestEngineRoutesScrapedAdapters(t *testing.T) {
	t.Parallel()
	w := newWorker(t, serve(loraMetrics(t)))
	key := w.target().Key
	const other = "10.0.0.9:8000"
	e := healthEngine(t, engine.Options{},
		routing.Endpoint{Key: routing.EndpointKey(key), Models: []routing.ModelName{"meta-llama/Llama-3.1-8B-Instruct"}},
		routing.Endpoint{Key: other, Models: []routing.ModelName{"meta-llama/Llama-3.1-8B-Instruct"}})
	sql := &routing.Request{Model: "sql-lora"}
	if _, err := e.Pick(t.Context(), sql); !errors.Is(err, routing.ErrModelNotFound) {
		t.Fatalf("before scraping: err = %v", err)
	}
	s := scrape.New(scrape.Config{}, scrape.Deps{
		Client:  newClient(t),
		Clock:   clock.NewVirtual(time.Unix(0, 0)),
		Logger:  slog.New(slog.DiscardHandler),
		Targets: func() []scrape.Target { return []scrape.Target{w.target()} },
		Publish: scrape.EnginePublish(e),
	})
	s.ScrapeOnce(t.Context())
	for _, m := range []routing.ModelName{"sql-lora", "chat-lora", "tool-lora"} {
		for range 4 {
			d, err := e.Pick(t.Context(), &routing.Request{Model: m})
			if err != nil {
				t.Fatalf("%s: %v", m, err)
			}
			if string(d.Endpoint) != key {
				t.Fatalf("%s routed to %s, want %s", m, d.Endpoint, key)
			}
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
		}
	}
	if _, err := e.Pick(t.Context(), &routing.Request{Model: "no-such-lora"}); !errors.Is(err, routing.ErrModelNotFound) {
		t.Fatalf("unknown model: err = %v, want ErrModelNotFound", err)
	}
}

// TestEngineFailureEjects: every kind of bad metrics answer counts as a
// failed scrape; three in a row eject the endpoint and a good scrape
// brings it back.
func TestEngineFailureEjects(t *testing.T) {
	t.Parallel()
	chunk := strings.Repeat("# padding comment line to make the body large\n", 1<<20/47)
	modes := map[string]http.HandlerFunc{
		"garbage":    serve("<html><body>502 Bad Gateway</body></html>\n"),
		"status_500": func(rw http.ResponseWriter, _ *http.Request) { http.Error(rw, "boom", http.StatusInternalServerError) },
		"not_worker": serve("go_goroutines 12\n"),
		"10MB":       serve(strings.Repeat(chunk, 11)),
		"hang": func(_ http.ResponseWriter, r *http.Request) {
			<-r.Context().Done()
		},
		"hang_in_body": func(rw http.ResponseWriter, r *http.Request) {
			_, _ = rw.Write([]byte("vllm:num_requests_running 1\nvllm:num_requests_wait"))
			rw.(http.Flusher).Flush()
			<-r.Context().Done()
		},
	}
	for name, bad := range modes {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var good atomic.Bool
			w := newWorker(t, func(rw http.ResponseWriter, r *http.Request) {
				if good.Load() {
					serve(vllmMetrics(1))(rw, r)
					return
				}
				bad(rw, r)
			})
			key := w.target().Key
			e := healthEngine(t, engine.Options{}, routing.Endpoint{Key: routing.EndpointKey(key)}, routing.Endpoint{Key: "10.0.0.9:8000"})
			var logged atomic.Int64
			s := scrape.New(scrape.Config{Timeout: 300 * time.Millisecond}, scrape.Deps{
				Client:  newClient(t),
				Clock:   clock.NewVirtual(time.Unix(0, 0)),
				Logger:  slog.New(slog.DiscardHandler),
				Targets: func() []scrape.Target { return []scrape.Target{w.target()} },
				Publish: scrape.EnginePublish(e),
				OnError: scrape.EngineFailure(e, func(scrape.Target, error) { logged.Add(1) }),
			})
			for i := range 3 {
				if ejected(e, key) {
					t.Fatalf("ejected after %d failed scrapes", i)
				}
				s.ScrapeOnce(t.Context())
			}
			if !ejected(e, key) || logged.Load() != 3 {
				t.Fatalf("after 3 failed scrapes: ejected %v, OnError chained %d times", ejected(e, key), logged.Load())
			}
			for range 4 {
				d, err := e.Pick(t.Context(), &routing.Request{})
				if err != nil {
					t.Fatal(err)
				}
				if string(d.Endpoint) == key {
					t.Fatal("ejected endpoint chosen")
				}
				d.Done(routing.NoUsage(routing.OutcomeSuccess))
			}
			good.Store(true)
			s.ScrapeOnce(t.Context())
			if ejected(e, key) {
				t.Fatal("a good scrape did not restore the endpoint")
			}
		})
	}
}

// TestEnginePublishRankLoads: a data-parallel worker's per-rank series reach
// the engine's ranks.
func TestEnginePublishRankLoads(t *testing.T) {
	t.Parallel()
	s, err := scrape.Parse(strings.NewReader(vllmMetrics(2)), 0)
	if err != nil {
		t.Fatal(err)
	}
	var rec rankRecorder
	scrape.EnginePublish(&rec)(scrape.Target{Key: "10.0.0.1:8000"}, s)
	want := []routing.Load{{Waiting: 1, Running: 3, KVUsage: 0.1, Known: true, Finished: 51, FinishedKnown: true}, {Waiting: 3, Running: 4, KVUsage: 0.2, Known: true, Finished: 51, FinishedKnown: true}}
	if !cmp.Equal(rec.ranks, want) || !rec.load.Known || rec.load.Finished != 102 || !rec.load.FinishedKnown || !cmp.Equal(rec.adapters, []routing.ModelName{"chat-lora", "sql-lora", "tool-lora"}) {
		t.Fatalf("published ranks %+v, load %+v, adapters %v", rec.ranks, rec.load, rec.adapters)
	}
	rec = rankRecorder{}
	s.Stale = true
	scrape.EnginePublish(&rec)(scrape.Target{Key: "10.0.0.1:8000"}, s)
	if rec.ranks != nil || rec.adapters != nil || !rec.load.Stale {
		t.Fatalf("stale mark published %+v", rec)
	}
}

type rankRecorder struct {
	load     routing.Load
	ranks    []routing.Load
	adapters []routing.ModelName
}

func (r *rankRecorder) ReportLoad(_ routing.EndpointKey, ld routing.Load, _ int) bool {
	r.load = ld
	return true
}

func (r *rankRecorder) ReportAdapters(_ routing.EndpointKey, a []routing.ModelName) bool {
	r.adapters = a
	return true
}

func (r *rankRecorder) ReportRankLoads(_ routing.EndpointKey, ranks []routing.Load) bool {
	r.ranks = ranks
	return true
}
