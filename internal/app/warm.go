package app

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvevents"
	rsync "github.com/kvbandit/kvbandit/routing/sync"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file holds serve's warm start (issue 22): with --sync-nats, a
// replica that starts asks a live peer for its state and routes with it
// at once. The KV-event subscribers start holding their streams (what
// arrives is queued); the peer's state comes over NATS (routing/sync's
// FetchState); the policy's learning and the sessions are imported, then
// each endpoint's stream is resumed at the peer's sequence number with
// its trust (kvevents.Sub.Resume), fetching again, a bounded number of
// times, for the endpoints whose stream is ahead of the peer's state.
// Without a peer every stream is released: the first message decides
// trust as before, a replay fills the gap where configured, and an
// untrusted view is trusted again once the worker's cache has turned over
// (routing/kvevents warm.go). Readiness waits for it at most
// sync.warm_start.ready_wait_ms; requests are routed meanwhile with what
// the replica has.

// SyncWarmConfig is the config's sync.warm_start.
type SyncWarmConfig struct {
	// Disabled: the replica neither asks its peers for their state at
	// start nor answers theirs (--sync-warm-start=false).
	Disabled bool `json:"disabled,omitempty"`
	// MaxBytes bounds a state transfer, asked for and answered (default
	// 64 MiB).
	MaxBytes int `json:"max_bytes,omitempty"`
	// TimeoutMs bounds one fetch, every peer tried (default 5000).
	TimeoutMs int `json:"timeout_ms,omitempty"`
	// ReadyWaitMs is how long readiness waits for the warm start at most
	// (default 1000; routing goes on meanwhile).
	ReadyWaitMs int `json:"ready_wait_ms,omitempty"`
	// Attempts bounds the fetches for endpoints whose stream is ahead of
	// the peer's state (default 3).
	Attempts int `json:"attempts,omitempty"`
	// ServeEveryMs rate-limits the transfers this replica serves its
	// peers: two at once, then one per interval (default 1000).
	ServeEveryMs int `json:"serve_every_ms,omitempty"`
}

// Defaults of SyncWarmConfig.
const (
	defaultWarmReadyWait = time.Second
	defaultWarmAttempts  = 3
	// warmRefetchDelay is the pause before fetching again for endpoints
	// whose stream was ahead: the peer applies what it had queued.
	warmRefetchDelay = 100 * time.Millisecond
	// warmConnectWait bounds the wait for the subscribers' connections
	// to their workers before the first fetch.
	warmConnectWait = 500 * time.Millisecond
)

func (c *SyncWarmConfig) validate() error {
	if c.MaxBytes < 0 || c.MaxBytes > 1<<32 || c.TimeoutMs < 0 || c.ReadyWaitMs < 0 || c.Attempts < 0 || c.Attempts > 10 || c.ServeEveryMs < 0 {
		return fmt.Errorf("sync.warm_start: max_bytes in [0, 4 GiB], timeout_ms, ready_wait_ms and serve_every_ms >= 0, attempts in [0, 10]")
	}
	return nil
}

func (c *SyncWarmConfig) syncConfig() rsync.WarmConfig {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	return rsync.WarmConfig{Disabled: c.Disabled, MaxBytes: c.MaxBytes, Timeout: ms(c.TimeoutMs), ServeEvery: ms(c.ServeEveryMs)}
}

func (c *SyncWarmConfig) readyWait() time.Duration {
	if c.ReadyWaitMs > 0 {
		return time.Duration(c.ReadyWaitMs) * time.Millisecond
	}
	return defaultWarmReadyWait
}

func (c *SyncWarmConfig) attempts() int {
	if c.Attempts > 0 {
		return c.Attempts
	}
	return defaultWarmAttempts
}

// warmSource is the Syncer's StateSource: this replica's state for a peer
// that starts. The engine and the KV-event fleet are bound once built.
type warmSource struct{ p *engineParts }

// ExportState implements rsync.StateSource: the policy's state, then the
// KV-event streams and their index entries, each endpoint's exported
// between two of its messages; an endpoint whose blocks do not all fit
// in maxBytes is handed over untrusted.
func (w warmSource) ExportState(ctx context.Context, maxBytes int) (*warmstate.Snapshot, error) {
	e := w.p.engine
	if e == nil {
		return nil, errors.New("engine not started")
	}
	snap := &warmstate.Snapshot{}
	e.ExportState(snap)
	if f := w.p.kvTarget.Load(); f != nil {
		if err := f.exportKV(ctx, e, snap, maxBytes/16); err != nil {
			return nil, err
		}
	}
	return snap, nil
}

// exportKV adds every subscriber's stream and its endpoint's index
// entries to snap, at most maxBlocks blocks in all.
func (f *kvFleet) exportKV(ctx context.Context, e *engine.Engine, snap *warmstate.Snapshot, maxBlocks int) error {
	left := max(maxBlocks, 1)
	for _, k := range f.keys() {
		sub := f.sub(k)
		if sub == nil {
			continue
		}
		err := sub.Export(ctx, func(st kvevents.StreamState) {
			ws := warmstate.Stream{Endpoint: string(k), Started: st.Started, Trusted: st.Trusted, Seq: st.Seq}
			if st.Started {
				runs, complete := e.ExportKV(k, left)
				for i := range runs {
					left -= len(runs[i].Blocks)
				}
				ws.Trusted = ws.Trusted && complete
				snap.Blocks = append(snap.Blocks, runs...)
			}
			snap.Streams = append(snap.Streams, ws)
		})
		if err != nil && !errors.Is(err, kvevents.ErrClosed) {
			return err
		}
	}
	return nil
}

// keys returns the endpoints with a subscriber, sorted.
func (f *kvFleet) keys() []routing.EndpointKey {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]routing.EndpointKey, 0, len(f.subs))
	for k := range f.subs {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func (f *kvFleet) sub(k routing.EndpointKey) *kvevents.Sub {
	f.mu.Lock()
	defer f.mu.Unlock()
	if s, ok := f.subs[k]; ok {
		return s.sub
	}
	return nil
}

// allDialed reports whether every subscriber of eps that dials its
// worker (not kv_events_bind) has a connection.
func (f *kvFleet) allDialed(eps []routing.EndpointKey) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, k := range eps {
		if s, ok := f.subs[k]; ok && !s.ep.KVEventsBind && s.sub.Stats().Connections == 0 {
			return false
		}
	}
	return true
}

// setCacheBlocks passes a worker's scraped num_gpu_blocks to its
// subscriber (the turnover that regains trust).
func (f *kvFleet) setCacheBlocks(k routing.EndpointKey, n int) {
	if s := f.sub(k); s != nil {
		s.SetCacheBlocks(n)
	}
}

// holding returns the subscribers that hold their stream.
func (f *kvFleet) holding() []routing.EndpointKey {
	var out []routing.EndpointKey
	for _, k := range f.keys() {
		if s := f.sub(k); s != nil && s.Stats().Holding {
			out = append(out, k)
		}
	}
	return out
}

// stopHolding makes new subscribers start without holding (the warm start
// is over) and returns the ones that still hold.
func (f *kvFleet) stopHolding() []routing.EndpointKey {
	f.mu.Lock()
	f.hold = false
	f.mu.Unlock()
	return f.holding()
}

// WarmReport is what the warm start did (/debug/replicas, logs).
type WarmReport struct {
	// State is running, done (a peer's state imported), no_peer or off.
	State string `json:"state"`
	Peer  string `json:"peer,omitempty"`
	// Tried are the peers asked and why those given up failed.
	Tried   []string `json:"tried,omitempty"`
	Bytes   int      `json:"bytes"`
	Chunks  int      `json:"chunks"`
	Fetches int      `json:"fetches"`
	// Seconds is how long it took from the start of serve's sync;
	// FetchSeconds the first fetch (waiting to hear a peer included),
	// ResumeSeconds the import of the KV index and the streams' resume.
	Seconds       float64 `json:"seconds"`
	FetchSeconds  float64 `json:"fetch_seconds"`
	ResumeSeconds float64 `json:"resume_seconds"`
	// Endpoints is, per endpoint with a KV-event subscriber, how its
	// stream started: trusted or untrusted (resumed at a peer's state),
	// released (no state for it: its first message decides), behind (its
	// stream stayed ahead of every state fetched: released).
	Endpoints map[string]string  `json:"endpoints,omitempty"`
	Imported  warmstate.Imported `json:"imported"`
	Blocks    int                `json:"blocks"`
	Errors    map[string]string  `json:"errors,omitempty"`
}

// warmStart runs the warm start once, in the background.
type warmStart struct {
	cfg    SyncWarmConfig
	log    *slog.Logger
	engine *engine.Engine
	sync   *rsync.Syncer
	fleet  *kvFleet // nil with KV events off
	start  time.Time
	done   chan struct{}

	mu     sync.Mutex
	report WarmReport
	gaps   map[routing.EndpointKey]int // refetches after a resume gap
	// refetching are the endpoints a refetch holds (resumeGap): finish
	// leaves them to it.
	refetching map[routing.EndpointKey]bool
	m          *warmMetrics
}

type warmMetrics struct {
	seconds   prometheus.Gauge
	endpoints *prometheus.GaugeVec
	imported  *prometheus.GaugeVec
	refetches prometheus.Counter
}

func newWarmMetrics(reg prometheus.Registerer) *warmMetrics {
	m := &warmMetrics{
		seconds: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbandit_sync_warm_start_seconds", Help: "How long the warm start took from the start of serve (0 while it runs or when it is off).",
		}),
		endpoints: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbandit_sync_warm_start_endpoints", Help: "Endpoints with a KV-event subscriber by how the warm start started their stream: trusted or untrusted (resumed at a peer's state), released (no peer state for it), behind (its stream stayed ahead of every state fetched).",
		}, []string{"state"}),
		imported: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "kvbandit_sync_warm_start_imported", Help: "What the warm start imported from a peer: blocks, sessions, speeds, arms, betas, latency (1 with the pooled fit), skipped (known here or for endpoints not in the set), malformed (refused as out of range).",
		}, []string{"kind"}),
		refetches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_sync_warm_start_refetches_total", Help: "State fetches after the first, for endpoints whose stream was ahead of the peer's state or left a gap after it.",
		}),
	}
	reg.MustRegister(m.seconds, m.endpoints, m.imported, m.refetches)
	return m
}

// newWarm makes the warm start when sync is on (before the KV-event
// fleet, whose subscribers then hold their streams); nil without sync.
func (s *serving) newWarm() *warmStart {
	sy := s.parts.sync
	if sy == nil {
		return nil
	}
	w := &warmStart{cfg: s.cfg.Sync.WarmStart, log: s.log.With("component", "warm_start"), engine: s.parts.engine, sync: sy,
		start: time.Now(), done: make(chan struct{}), gaps: map[routing.EndpointKey]int{}, refetching: map[routing.EndpointKey]bool{},
		m: newWarmMetrics(s.reg)}
	w.report.State = "off"
	if !w.cfg.Disabled {
		w.report.State = "running"
	}
	return w
}

// holds reports whether the KV-event subscribers should start holding.
func (w *warmStart) holds() bool { return w != nil && !w.cfg.Disabled }

// runWarm runs the warm start in the background, once the fleet follows
// the endpoint set; readiness waits for it (becomeReady).
func (s *serving) runWarm() {
	w := s.warm
	if w == nil {
		return
	}
	w.fleet = s.fleet
	if w.cfg.Disabled {
		close(w.done)
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		defer close(w.done)
		w.run(s.bgCtx)
	}()
}

// waitReady holds readiness back until the warm start is done, at most
// sync.warm_start.ready_wait_ms.
func (w *warmStart) waitReady() {
	if w == nil {
		return
	}
	t := time.NewTimer(w.cfg.readyWait())
	defer t.Stop()
	select {
	case <-w.done:
	case <-t.C:
		w.log.Warn("warm start still running: ready without it, routing on what this replica has", "waited", w.cfg.readyWait())
	}
}

// Report returns what the warm start did so far.
func (w *warmStart) Report() WarmReport {
	w.mu.Lock()
	defer w.mu.Unlock()
	r := w.report
	r.Endpoints, r.Errors, r.Tried = maps.Clone(r.Endpoints), maps.Clone(r.Errors), slices.Clone(r.Tried)
	return r
}

// run is the warm start: wait for the endpoint set, fetch, import, resume.
func (w *warmStart) run(ctx context.Context) {
	timeout := time.Duration(w.cfg.TimeoutMs) * time.Millisecond
	if timeout <= 0 {
		timeout = rsync.DefaultWarmTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout+time.Duration(w.cfg.attempts())*timeout)
	defer cancel()
	w.waitEndpoints(ctx, timeout)
	w.waitConnected(ctx)
	snap, info, err := w.sync.FetchState(ctx)
	w.fetched(info)
	if err != nil {
		w.finish("no_peer", err)
		return
	}
	imported := w.engine.ImportState(snap)
	w.mu.Lock()
	w.report.Imported, w.report.Blocks = imported, snap.BlockCount()
	w.report.FetchSeconds = info.Took.Seconds()
	w.mu.Unlock()
	t0 := time.Now()
	behind := w.resume(ctx, snap, w.heldEndpoints())
	w.mu.Lock()
	w.report.ResumeSeconds = time.Since(t0).Seconds()
	w.mu.Unlock()
	for attempt := 1; len(behind) > 0 && attempt < w.cfg.attempts() && ctx.Err() == nil; attempt++ {
		time.Sleep(warmRefetchDelay)
		w.m.refetches.Inc()
		snap, info, err = w.sync.FetchState(ctx)
		w.fetched(info)
		if err != nil {
			break
		}
		behind = w.resume(ctx, snap, behind)
	}
	w.releaseBehind(behind)
	w.finish("done", nil)
}

// waitEndpoints waits (up to timeout) for discovery's first endpoint set:
// a peer's KV state can only be imported for endpoints in the set.
func (w *warmStart) waitEndpoints(ctx context.Context, timeout time.Duration) {
	end := time.Now().Add(timeout)
	for !w.engine.Ready() && time.Now().Before(end) && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
}

// waitConnected waits, at most warmConnectWait, until every held
// subscriber that dials its worker (connect mode) is connected: what the
// worker publishes before then reaches neither this replica's queue nor,
// perhaps, the peer's state, and would have to be fetched again.
func (w *warmStart) waitConnected(ctx context.Context) {
	if w.fleet == nil {
		return
	}
	end := time.Now().Add(warmConnectWait)
	for time.Now().Before(end) && ctx.Err() == nil {
		if w.fleet.allDialed(w.fleet.holding()) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (w *warmStart) heldEndpoints() []routing.EndpointKey {
	if w.fleet == nil {
		return nil
	}
	return w.fleet.holding()
}

func (w *warmStart) fetched(info rsync.FetchInfo) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.report.Fetches++
	w.report.Tried = append(w.report.Tried, info.Tried...)
	if info.Peer != "" {
		w.report.Peer, w.report.Bytes, w.report.Chunks = info.Peer, w.report.Bytes+info.Bytes, w.report.Chunks+info.Chunks
	}
}

// resume resumes each endpoint of eps at snap's stream for it (releasing
// those snap has none for), all at once (each on its own subscriber's
// goroutine), and returns those whose stream is ahead.
func (w *warmStart) resume(ctx context.Context, snap *warmstate.Snapshot, eps []routing.EndpointKey) []routing.EndpointKey {
	streams := make(map[string]warmstate.Stream, len(snap.Streams))
	for _, st := range snap.Streams {
		streams[st.Endpoint] = st
	}
	var mu sync.Mutex
	var behind []routing.EndpointKey
	var wg sync.WaitGroup
	for _, k := range eps {
		sub := w.fleet.sub(k)
		if sub == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if w.resumeOne(ctx, sub, k, streams[string(k)], snap.RunsOf(string(k))) {
				mu.Lock()
				behind = append(behind, k)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return behind
}

// resumeOne resumes one endpoint's stream at st, importing runs; it
// reports whether the stream is ahead of st.
func (w *warmStart) resumeOne(ctx context.Context, sub *kvevents.Sub, k routing.EndpointKey, st warmstate.Stream, runs []warmstate.Blocks) bool {
	if st.Endpoint == "" || !st.Started {
		w.setEndpoint(k, "released", sub.Release(ctx))
		return false
	}
	err := sub.Resume(ctx, kvevents.Resume{
		StreamState: kvevents.StreamState{Started: true, Trusted: st.Trusted, Seq: st.Seq},
		Restore:     func() error { return w.engine.ImportKV(k, runs) },
	})
	switch {
	case errors.Is(err, kvevents.ErrBehind):
		return true
	case err != nil:
		w.setEndpoint(k, "released", err)
	default:
		state := "untrusted"
		if sub.Stats().Trusted {
			state = "trusted"
		}
		w.setEndpoint(k, state, nil)
	}
	return false
}

// releaseBehind starts the streams still ahead of every state fetched as
// without a peer.
func (w *warmStart) releaseBehind(eps []routing.EndpointKey) {
	for _, k := range eps {
		if sub := w.fleet.sub(k); sub != nil {
			w.setEndpoint(k, "behind", sub.Release(context.Background()))
		}
	}
}

func (w *warmStart) setEndpoint(k routing.EndpointKey, state string, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.report.Endpoints == nil {
		w.report.Endpoints = map[string]string{}
	}
	w.report.Endpoints[string(k)] = state
	if err != nil {
		if w.report.Errors == nil {
			w.report.Errors = map[string]string{}
		}
		w.report.Errors[string(k)] = err.Error()
	}
}

// finish releases whatever still holds (no peer, endpoints that joined
// meanwhile), publishes the metrics and logs what the warm start got.
func (w *warmStart) finish(state string, err error) {
	if w.fleet != nil {
		for _, k := range w.fleet.stopHolding() {
			w.mu.Lock()
			mine := w.refetching[k]
			w.mu.Unlock()
			if sub := w.fleet.sub(k); sub != nil && !mine {
				w.setEndpoint(k, "released", sub.Release(context.Background()))
			}
		}
	}
	w.mu.Lock()
	w.report.State, w.report.Seconds = state, time.Since(w.start).Seconds()
	r := w.report
	w.mu.Unlock()
	w.m.seconds.Set(r.Seconds)
	counts := map[string]int{}
	for _, st := range r.Endpoints {
		counts[st]++
	}
	for _, st := range []string{"trusted", "untrusted", "released", "behind"} {
		w.m.endpoints.WithLabelValues(st).Set(float64(counts[st]))
	}
	im := r.Imported
	latency := 0.0
	if im.Latency {
		latency = 1
	}
	for kind, v := range map[string]float64{"blocks": float64(r.Blocks), "sessions": float64(im.Sessions), "speeds": float64(im.Speeds),
		"arms": float64(im.Arms), "betas": float64(im.Betas), "latency": latency, "skipped": float64(im.Skipped), "malformed": float64(im.Malformed)} {
		w.m.imported.WithLabelValues(kind).Set(v)
	}
	if err != nil {
		w.log.Info("warm start: no peer state; KV views start from the workers' streams (a replay where configured, else trusted once a worker's cache has turned over)",
			"reason", err, "tried", r.Tried, "endpoints", r.Endpoints, "took", time.Duration(r.Seconds*float64(time.Second)).Round(time.Millisecond))
		return
	}
	w.log.Info("warm start: routing with a peer's state", "peer", r.Peer, "bytes", r.Bytes, "chunks", r.Chunks, "fetches", r.Fetches,
		"endpoints", r.Endpoints, "blocks", r.Blocks, "sessions", im.Sessions, "speed_factors", im.Speeds, "latency_fit", im.Latency,
		"arms", im.Arms, "betas", im.Betas, "skipped", im.Skipped, "malformed", im.Malformed,
		"took", time.Duration(r.Seconds*float64(time.Second)).Round(time.Millisecond),
		"fetch", time.Duration(r.FetchSeconds*float64(time.Second)).Round(time.Millisecond),
		"resume", time.Duration(r.ResumeSeconds*float64(time.Second)).Round(time.Millisecond))
}

// resumeGap is the subscribers' OnResumeGap: the first message after a
// resume left a gap (the worker published between the peer's export and
// this replica's subscription). Within the warm start's attempts, hold
// the stream and resume it at a fresher state.
func (w *warmStart) resumeGap(endpoint string) {
	k := routing.EndpointKey(endpoint)
	w.mu.Lock()
	if w.gaps[k] >= w.cfg.attempts()-1 || w.refetching[k] {
		w.mu.Unlock()
		return
	}
	w.gaps[k]++
	w.refetching[k] = true
	w.mu.Unlock()
	go w.refetch(k) // not on the subscriber's goroutine
}

func (w *warmStart) refetch(k routing.EndpointKey) {
	defer func() {
		w.mu.Lock()
		delete(w.refetching, k)
		w.mu.Unlock()
	}()
	sub := w.fleet.sub(k)
	if sub == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*rsync.DefaultWarmTimeout)
	defer cancel()
	if err := sub.Hold(ctx); err != nil {
		return
	}
	w.m.refetches.Inc()
	time.Sleep(warmRefetchDelay)
	snap, info, err := w.sync.FetchState(ctx)
	w.fetched(info)
	if err != nil {
		w.setEndpoint(k, "released", sub.Release(ctx))
		return
	}
	if behind := w.resume(ctx, snap, []routing.EndpointKey{k}); len(behind) > 0 {
		w.releaseBehind(behind)
	}
}
