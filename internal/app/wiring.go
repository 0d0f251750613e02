package app

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"

	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/internal/buildinfo"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/burst"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/decisionlog"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/policy/kvbandit"
	"github.com/kvbandit/kvbandit/routing/policy/thompson"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
	"github.com/kvbandit/kvbandit/routing/slo"
	rsync "github.com/kvbandit/kvbandit/routing/sync"
)

// engineParts is what buildEngine wires up; close releases it in order.
type engineParts struct {
	engine *engine.Engine
	policy routing.Policy
	// sync shares state with the pool's other replicas; nil without
	// --sync-nats / sync.nats.servers.
	sync *rsync.Syncer
	// kvTarget receives peers' republished KV events (Serve sets it once
	// the fleet exists); nil: KV events off or not yet.
	kvTarget atomic.Pointer[kvFleet]
	closes   []func()
}

// pushKVEvents is the Syncer's OnKVEvents: a peer's republished KV-event
// message goes to this replica's subscriber for the endpoint. An endpoint
// without one here (unknown, no kv_events, KV events off) is refused as
// routing.ErrUnknownEndpoint, which the Syncer counts.
func (p *engineParts) pushKVEvents(endpoint string, seq uint64, payload []byte) error {
	f := p.kvTarget.Load()
	if f == nil {
		return fmt.Errorf("%w: %s: KV events are off", routing.ErrUnknownEndpoint, endpoint)
	}
	return f.Push(routing.EndpointKey(endpoint), seq, payload)
}

func (p *engineParts) close() {
	for i := len(p.closes) - 1; i >= 0; i-- {
		p.closes[i]()
	}
}

// routingMetrics are the engine-level metrics fed by decision hooks.
type routingMetrics struct {
	overlap        prometheus.Histogram
	cachedPred     prometheus.Counter
	cachedReported prometheus.Counter
	rewards        prometheus.Histogram
	queueWait      prometheus.Histogram
	outcomes       *prometheus.CounterVec
	overhead       *prometheus.HistogramVec
	hashedBlocks   prometheus.Counter

	phHash, phLookup, phScore, phTotal prometheus.Observer
}

func newRoutingMetrics(reg prometheus.Registerer) *routingMetrics {
	m := &routingMetrics{
		overlap: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvbandit_predicted_overlap_blocks", Help: "Cached prefix blocks the index predicted on the chosen endpoint, per decision.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 14),
		}),
		cachedPred: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_cached_tokens_predicted_total", Help: "Prompt tokens the index predicted cached, for requests whose worker reported cached tokens.",
		}),
		cachedReported: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_cached_tokens_reported_total", Help: "Cached prompt tokens the workers reported (usage.prompt_tokens_details.cached_tokens).",
		}),
		rewards: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvbandit_reward", Help: "Rewards applied by the learning policy (thompson), in [0, 1].",
			Buckets: prometheus.LinearBuckets(0, 0.1, 11),
		}),
		queueWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvbandit_queue_wait_seconds", Help: "Time requests spent in the admission queue.",
			Buckets: []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30},
		}),
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_session_decisions_total", Help: "Decisions of requests with a prefix id under a policy that keeps sessions (kvbandit, thompson): first (the session had no endpoint yet), sticky (stayed on the session's previous endpoint) or switch (moved to another).",
		}, []string{"outcome"}),
		hashedBlocks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_hashed_blocks_total", Help: "Prompt blocks the engine hashed into block keys while routing (blocks whose keys came with the request, from the tokenizer's prefix cache, are not counted).",
		}),
	}
	m.overhead = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "kvbandit_routing_overhead_seconds", Help: "Routing cost per decision by phase: hash (block keys), lookup (KV index and in-flight walks), score (the policy), total.",
		Buckets: []float64{1e-6, 2.5e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3},
	}, []string{"phase"})
	reg.MustRegister(m.overlap, m.cachedPred, m.cachedReported, m.rewards, m.queueWait, m.outcomes, m.overhead, m.hashedBlocks)
	m.phHash, m.phLookup = m.overhead.WithLabelValues("hash"), m.overhead.WithLabelValues("lookup")
	m.phScore, m.phTotal = m.overhead.WithLabelValues("score"), m.overhead.WithLabelValues("total")
	return m
}

// buildEngine makes the policy, the engine and the decision log from the
// options and the config file.
func buildEngine(o ServeOptions, cfg *FileConfig, log *slog.Logger, reg prometheus.Registerer, clk clock.Clock) (*engineParts, error) {
	parts := &engineParts{}
	if err := parts.build(o, cfg, log, reg, clk); err != nil {
		parts.close()
		return nil, err
	}
	return parts, nil
}

// build fills p in, in order: the policy over the prefix store, the
// decision log, the syncer, the engine with the hooks that feed them and
// the metrics, then the syncer's start and the metrics collectors. On an
// error, what was built is in p.closes.
func (p *engineParts) build(o ServeOptions, cfg *FileConfig, log *slog.Logger, reg prometheus.Registerer, clk clock.Clock) error {
	rm := newRoutingMetrics(reg)
	rnd := routing.NewRand(o.Seed)
	if err := p.newPolicy(o.Policy, cfg, policy.Deps{Logger: log, Rand: rnd, Clock: clk, OnReward: func(v float64) { rm.rewards.Observe(v) }}); err != nil {
		return err
	}
	dlog, err := p.openDecisionLog(cfg, log)
	if err != nil {
		return err
	}
	if p.sync, err = newSyncer(o, cfg, log, reg, p.pushKVEvents, warmSource{p}); err != nil {
		return err
	}
	opts := cfg.engineOptions(o.Fallbacks)
	if p.sync != nil && cfg.Sync.turns() {
		opts.Burst = burst.Config{Delay: p.sync.ApplyDelay(), Step: time.Duration(cfg.Sync.TurnStepMs * float64(time.Millisecond))}
	}
	opts.Admission.OnWait = func(d time.Duration) { rm.queueWait.Observe(d.Seconds()) }
	gate, err := slo.New(slo.Config{})
	if err != nil {
		return err
	}
	disagg, err := pd.New(cfg.PD)
	if err != nil {
		return err
	}
	h := &engineHooks{metrics: rm, dlog: dlog, sync: p.sync, gate: gate, blockSize: float64(cfg.Router.BlockSize)}
	eng, err := engine.New(p.policy, opts, engine.Deps{
		Logger: log, Rand: rnd, Clock: clk, Gate: gate, PD: disagg,
		OnDecision: h.onDecision, OnFirst: h.onFirst, OnTimings: h.onTimings, OnDone: h.onDone,
	})
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	p.closes = append(p.closes, eng.Close)
	p.engine = eng
	if err := p.startSync(log); err != nil {
		return err
	}
	reg.MustRegister(engine.NewCollector(eng), gate)
	if p.sync != nil {
		reg.MustRegister(engine.NewBurstCollector(eng))
	}
	if kb, ok := p.policy.(*kvbandit.Policy); ok {
		reg.MustRegister(posteriorCollector{kb})
	}
	if tp, ok := p.policy.(*thompson.Policy); ok {
		reg.MustRegister(thompsonCollector{tp})
	}
	return nil
}

// newPolicy makes the named policy, with deps completed by the prefix
// store it shares and the config's policy sections.
func (p *engineParts) newPolicy(name string, cfg *FileConfig, deps policy.Deps) error {
	// The reference router never expires prefix state; thompson's compat
	// switch asks for that behaviour from the shared store too.
	th := cfg.Config.Thompson
	noExpiry := th.ReferenceCompat || th.Compat.NoPrefixExpiry
	store, err := prefixstate.New(prefixstate.Config{TTL: secs(cfg.PrefixState.TTLSecs), MaxEntries: cfg.PrefixState.MaxEntries, NoExpiry: noExpiry}, deps.Clock)
	if err != nil {
		return err
	}
	p.closes = append(p.closes, store.Close)
	polCfg := cfg.Config
	deps.Config, deps.Prefixes = &polCfg, store
	pol, err := policy.Builtin().New(name, deps)
	if err != nil {
		return fmt.Errorf("%w: --policy: %w", ErrUsage, err)
	}
	if c, ok := pol.(interface{ Close() error }); ok {
		p.closes = append(p.closes, func() { _ = c.Close() })
	}
	p.policy = pol
	return nil
}

// openDecisionLog opens the decision log; nil when none is configured.
func (p *engineParts) openDecisionLog(cfg *FileConfig, log *slog.Logger) (*decisionlog.Log, error) {
	if cfg.DecisionLog.Path == "" {
		return nil, nil
	}
	f, err := decisionlog.ParseFormat(cfg.DecisionLog.Format)
	var dlog *decisionlog.Log
	if err == nil {
		dlog, err = decisionlog.Open(cfg.DecisionLog.Path, f, decisionlog.Options{MaxBytes: cfg.DecisionLog.MaxBytes, Logger: log})
	}
	if err != nil {
		return nil, fmt.Errorf("decision log: %w", err)
	}
	p.closes = append(p.closes, func() { _ = dlog.Close() })
	return dlog, nil
}

// startSync starts sharing state with the pool's other replicas, when
// there are any.
func (p *engineParts) startSync(log *slog.Logger) error {
	sy := p.sync
	if sy == nil {
		return nil
	}
	// Closed before the engine (closes run in reverse): a peer's
	// decision applied after the engine's Close would panic.
	p.closes = append(p.closes, func() { _ = sy.Close() })
	if err := sy.Start(p.engine); err != nil {
		return fmt.Errorf("%w: sync: %w", ErrUsage, err)
	}
	log.Info("active-active replicas: sharing state over NATS", "replica", sy.Status().Replica, "pool", sy.Status().Pool, "subject", sy.Subject())
	return nil
}

// engineHooks are the engine's decision hooks: they feed the routing
// metrics, the decision log, the SLO gate and the syncer (dlog and sync
// may be nil).
type engineHooks struct {
	metrics   *routingMetrics
	dlog      *decisionlog.Log
	sync      *rsync.Syncer
	gate      *slo.Gate
	blockSize float64
}

func (h *engineHooks) onDecision(req *routing.Request, d *routing.Decision) {
	h.metrics.overlap.Observe(float64(d.Overlap))
	if d.Session != routing.SessionUntracked {
		h.metrics.outcomes.WithLabelValues(d.Session.String()).Inc()
	}
	if h.dlog != nil {
		h.dlog.Record(record(req, d))
	}
	if h.sync != nil {
		h.sync.OnDecision(req, d)
	}
}

func (h *engineHooks) onFirst(d *routing.Decision) {
	if h.sync != nil {
		h.sync.OnFirst(d)
	}
}

func (h *engineHooks) onTimings(tm engine.Timings) {
	rm := h.metrics
	rm.phHash.Observe(tm.Hash.Seconds())
	rm.hashedBlocks.Add(float64(tm.HashedBlocks))
	rm.phLookup.Observe(tm.Lookup.Seconds())
	rm.phScore.Observe(tm.Score.Seconds())
	rm.phTotal.Observe(tm.Total.Seconds())
}

func (h *engineHooks) onDone(d *routing.Decision, out routing.Outcome) {
	if out.CachedTokens >= 0 && out.Kind == routing.OutcomeSuccess {
		h.metrics.cachedPred.Add(float64(d.Overlap) * h.blockSize)
		h.metrics.cachedReported.Add(float64(out.CachedTokens))
	}
	h.gate.Observe(d, out)
	if h.sync != nil {
		h.sync.OnDone(d, out)
	}
}

// newSyncer makes the routing/sync Syncer when NATS servers are given
// (--sync-nats, else sync.nats.servers); nil otherwise. The pool is
// --pool-name, else --etcd-pool with etcd discovery, else "default".
func newSyncer(o ServeOptions, cfg *FileConfig, log *slog.Logger, reg prometheus.Registerer, onKV func(string, uint64, []byte) error, state rsync.StateSource) (*rsync.Syncer, error) {
	sc := cfg.Sync
	servers := sc.NATS.Servers
	if o.SyncNATS != "" {
		servers = nil
		for _, u := range strings.Split(o.SyncNATS, ",") {
			if u = strings.TrimSpace(u); u != "" {
				servers = append(servers, u)
			}
		}
	}
	if len(servers) == 0 {
		return nil, nil
	}
	pool := "default"
	switch {
	case o.PoolName != "":
		pool = o.PoolName
	case o.EtcdEndpoints != "" && o.EtcdPool != "":
		pool = o.EtcdPool
	}
	replica := o.ReplicaID
	if replica == "" {
		host, _ := os.Hostname()
		if host == "" {
			host = "kvbandit"
		}
		var b [3]byte
		_, _ = crand.Read(b[:])
		replica = fmt.Sprintf("%.120s-%x", host, b)
	}
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	n := syncCredentialsFromEnv(sc.NATS)
	sy, err := rsync.New(rsync.Config{
		Servers: servers, Pool: pool, Replica: replica, SubjectPrefix: n.SubjectPrefix,
		CredsFile: n.CredsFile, User: n.User, Password: n.Password, Token: n.Token, NkeyFile: n.NkeyFile,
		AllowAnonymous: sc.AllowAnonymous,
		TLS:            rsync.TLSConfig{CA: n.TLS.CA, Cert: n.TLS.Cert, Key: n.TLS.Key, ServerName: n.TLS.ServerName, InsecureSkipVerify: n.TLS.InsecureSkipVerify},
		BatchInterval:  ms(sc.BatchIntervalMs), SnapshotInterval: ms(sc.SnapshotIntervalMs),
		HeartbeatInterval: ms(sc.HeartbeatIntervalMs), PeerTTL: ms(sc.PeerTTLMs),
		// A peer claims no more prompt tokens for one decision than this
		// replica would accept in one body: a token takes at least a byte.
		MaxRemoteTokens: int(min(o.MaxBodyBytes, int64(routing.MaxRemoteTokens))),
		// A replica holds at most --max-inflight ext_proc streams and as
		// many proxy requests; each may claim MaxRemoteTokens to prefill.
		MaxPeerInFlight: cmp.Or(sc.MaxPeerInFlight, 2*o.MaxInflight), MaxPeerPrefillTokens: sc.MaxPeerPrefillTokens,
		// A scrape is fresh for two intervals (and its timeout).
		Claims: rsync.ClaimCheck{MaxLoadAge: 2*o.ScrapeInterval + o.ScrapeTimeout},
		Warm:   sc.WarmStart.syncConfig(),
	}, rsync.Deps{Logger: log, Registry: reg, OnKVEvents: onKV, State: state})
	if err != nil {
		return nil, syncConfigError(err)
	}
	return sy, nil
}

// record turns a decision into a decision-log record.
func record(req *routing.Request, d *routing.Decision) decisionlog.Record {
	r := decisionlog.Record{
		Time: d.At, TokensLen: req.TokenCount, PrefixID: req.Hints.PrefixID, ChosenWorker: string(d.Endpoint),
		OverlapChosen: float64(d.Overlap), IATLevel: req.Hints.IAT.String(), DecisionID: d.ID, Policy: d.Policy,
		Tenant: req.Tenant, DPRank: d.DPRank, EstimatedTokens: req.Estimated,
	}
	if d.Sticky {
		r.Stickiness = 1
	}
	for _, s := range d.Scores {
		k := string(s.Endpoint)
		if s.DPRank >= 0 {
			k += "/" + strconv.Itoa(s.DPRank)
		}
		r.Scores = append(r.Scores, decisionlog.Score{Endpoint: k, Score: s.Score})
	}
	return r
}

// posteriorCollector exports kvbandit's learned speed factors.
type posteriorCollector struct{ p *kvbandit.Policy }

var posteriorDesc = prometheus.NewDesc("kvbandit_posterior_speed_factor", "kvbandit's learned speed factor per endpoint rank relative to the fleet's geometric mean: 1 average, 2 twice as slow, 0.5 twice as fast (posterior mean; about 1 everywhere on an even fleet).", []string{"endpoint", "dp_rank"}, nil)

func (posteriorCollector) Describe(ch chan<- *prometheus.Desc) { ch <- posteriorDesc }
func (c posteriorCollector) Collect(ch chan<- prometheus.Metric) {
	for _, p := range c.p.Posteriors() {
		ch <- prometheus.MustNewConstMetric(posteriorDesc, prometheus.GaugeValue, p.Relative, string(p.Endpoint), strconv.Itoa(p.DPRank))
	}
}

// thompsonCollector exports the thompson policy's learning state.
type thompsonCollector struct{ p *thompson.Policy }

var (
	thMeanDesc     = prometheus.NewDesc("kvbandit_thompson_beta_mean", "thompson's Beta posterior mean α/(α+β) per endpoint.", []string{"endpoint"}, nil)
	thPendingDesc  = prometheus.NewDesc("kvbandit_thompson_pending_decisions", "thompson decisions awaiting an outcome.", nil, nil)
	thTimeoutsDesc = prometheus.NewDesc("kvbandit_thompson_feedback_timeouts_total", "thompson decisions that learned the timeout reward.", nil, nil)
	thPrefixDesc   = prometheus.NewDesc("kvbandit_prefix_state_entries", "Prefix (session) entries held.", nil, nil)
)

func (thompsonCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- thMeanDesc
	ch <- thPendingDesc
	ch <- thTimeoutsDesc
	ch <- thPrefixDesc
}

func (c thompsonCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.p.Stats()
	ch <- prometheus.MustNewConstMetric(thPendingDesc, prometheus.GaugeValue, float64(st.Pending))
	ch <- prometheus.MustNewConstMetric(thTimeoutsDesc, prometheus.CounterValue, float64(st.Timeouts))
	ch <- prometheus.MustNewConstMetric(thPrefixDesc, prometheus.GaugeValue, float64(st.PrefixEntries))
	for _, e := range st.Endpoints {
		ch <- prometheus.MustNewConstMetric(thMeanDesc, prometheus.GaugeValue, e.Mean, string(e.Endpoint))
	}
}

// traceFlushTimeout bounds the flush of the last spans when serve exits.
const traceFlushTimeout = 5 * time.Second

// newTracer builds the tracer from the OTEL_* environment (docs/tracing.md):
// nil when tracing is off; a bad value is a usage error.
func newTracer(ctx context.Context, log *slog.Logger) (*tracing.Tracer, error) {
	c, err := tracing.FromEnv(os.Getenv)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUsage, err)
	}
	t, err := tracing.New(ctx, c, buildinfo.Read().Version)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUsage, err)
	}
	if t != nil {
		otelLogsTo(log)
		log.Info("tracing on", "protocol", c.Protocol, "endpoint", c.Endpoint, "sampler", c.Sampler, "ratio", c.Ratio, "service", c.ServiceName)
	}
	return t, nil
}

// otelLogsTo sends OpenTelemetry's own errors (failed exports, dropped
// spans) and its internal log to log, so that they follow --log-format
// instead of going to Go's plain log package. OpenTelemetry reports them
// only through its process-wide handler and logger: this is the one place
// kvbandit sets OpenTelemetry globals, and only with tracing on.
func otelLogsTo(log *slog.Logger) {
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) { log.Warn("tracing: OpenTelemetry error", "err", err) }))
	otel.SetLogger(logr.FromSlogHandler(log.With("component", "opentelemetry").Handler()))
}

// shutdownTracer flushes the spans not yet exported, within
// traceFlushTimeout.
func shutdownTracer(t *tracing.Tracer, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), traceFlushTimeout)
	defer cancel()
	if err := t.Shutdown(ctx); err != nil {
		log.Warn("tracing: spans not flushed", "err", err)
	}
}
