package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime/debug"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/extproc/tracing"
	"github.com/kvbandit/kvbandit/internal/buildinfo"
	"github.com/kvbandit/kvbandit/internal/cmdline"
	"github.com/kvbandit/kvbandit/internal/tlsconfig"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/eds"
	"github.com/kvbandit/kvbandit/routing/discovery/kube/objectives"
)

// This file holds `kvbandit serve`'s start-up sequence: the config, the
// discovery sources, the engine and what feeds it, and the ext_proc server
// and proxy in front of it. The servers and their listeners are in
// serve_servers.go, the drain and shutdown in serve_shutdown.go, the flags
// in serve_options.go.

func runServe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o ServeOptions
	o.AddFlags(fs)
	if err := cmdline.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %q", ErrUsage, fs.Args())
	}
	o.set = map[string]string{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = f.Value.String() })
	if err := o.Validate(); err != nil {
		return err
	}
	if o.DryRun {
		return checkConfig(o, stdout, stderr, true)
	}
	return Serve(ctx, o, newLogger(stderr, o.LogLevel, o.LogFormat), nil)
}

// Listeners lets a caller (tests, demo) pass listeners it already bound;
// nil fields are bound from the options' addresses.
type Listeners struct {
	GRPC, Health, Metrics net.Listener
	// EDS, when set, serves xDS EDS (as --eds-addr does).
	EDS net.Listener
	// HTTP, when set, serves the standalone OpenAI proxy (as --http-addr
	// does).
	HTTP net.Listener
	// Ready, when set, receives the bound addresses once serving.
	Ready func(grpc, health, metrics string)
}

// Serve runs the ext_proc server until ctx ends, then shuts down
// gracefully: readiness goes NOT_SERVING, open streams get DrainTimeout to
// finish, then request-phase streams are answered 503 and response-phase
// streams are closed after echoing what they received.
func Serve(ctx context.Context, o ServeOptions, log *slog.Logger, ls *Listeners) error {
	s := newServing(o, log, ls)
	defer s.cleanup()
	if err := s.loadConfig(); err != nil {
		return err
	}
	if err := s.startTracing(ctx); err != nil {
		return err
	}
	if err := s.discover(); err != nil {
		return err
	}
	if err := s.startEngine(); err != nil {
		return err
	}
	if err := s.startHub(); err != nil {
		return err
	}
	if err := s.buildFrontends(); err != nil {
		return err
	}
	if err := s.buildServers(); err != nil {
		return err
	}
	if err := s.listen(); err != nil {
		return err
	}
	s.startScraper()
	if err := s.startEDS(); err != nil {
		return err
	}
	errc := s.start()
	s.becomeReady()
	runErr := s.wait(ctx, errc)
	s.shutdown()
	return runErr
}

// serving is one run of Serve: each step fills in what the later ones
// use.
type serving struct {
	o     ServeOptions
	log   *slog.Logger
	ls    *Listeners
	build buildinfo.Info
	reg   *prometheus.Registry
	// deferred run in reverse order when Serve returns, as defers would.
	deferred []func()

	cfg    FileConfig
	tracer *tracing.Tracer
	// The discovery sources: a static set (checked at start-up), the
	// dynamic sources, and the InferenceObjectives watcher (pool mode).
	static     *routing.EndpointSet
	sources    []discovery.Source
	objWatcher *objectives.Watcher

	parts *engineParts
	// bgCtx ends the background goroutines (bg) when Serve returns.
	bgCtx context.Context
	bg    sync.WaitGroup

	hub    *discovery.Hub
	edsSrv *eds.Server // nil without EDS
	edsCfg *EDSConfig
	fleet  *kvFleet   // nil with KV events off
	warm   *warmStart // nil without sync (warm.go)

	ep *extproc.Server
	px *proxy.Proxy // nil without the standalone proxy

	tlsSrc   *tlsconfig.Source
	gate     *readyGate
	le       *leaderRun
	stopping atomic.Bool
	// gs serves ext_proc, hgs the gRPC health service hs, xgs EDS (nil
	// without); hsrv the admin port (nil without), psrv the proxy.
	gs, hgs, xgs *grpc.Server
	hs           *health.Server
	hh           *httpHealth
	hsrv, psrv   *http.Server
	// The bound listeners: ext_proc, health, admin, proxy.
	gl, hl, ml, pl net.Listener
	stopLeader     func()
}

func newServing(o ServeOptions, log *slog.Logger, ls *Listeners) *serving {
	if ls == nil {
		ls = &Listeners{}
	}
	return &serving{o: o, log: log, ls: ls}
}

// onExit registers f to run when Serve returns, after the functions
// registered later.
func (s *serving) onExit(f func()) { s.deferred = append(s.deferred, f) }

func (s *serving) cleanup() {
	for i := len(s.deferred) - 1; i >= 0; i-- {
		s.deferred[i]()
	}
}

// loadConfig reads the config file, if any, and applies the flags given
// explicitly on top of it.
func (s *serving) loadConfig() error {
	s.cfg = DefaultFileConfig()
	if s.o.ConfigPath != "" {
		c, err := LoadConfig(s.o.ConfigPath)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrUsage, err)
		}
		s.cfg = *c
	}
	if err := s.o.applyFlags(&s.cfg); err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	return nil
}

// startTracing starts the tracer (off without OTEL_* settings); it is
// flushed last, once every span has ended.
func (s *serving) startTracing(ctx context.Context) error {
	tracer, err := newTracer(ctx, s.log)
	if err != nil {
		return err
	}
	s.tracer = tracer
	s.onExit(func() { shutdownTracer(tracer, s.log) })
	return nil
}

// discover sets up the discovery sources, and the metrics registry with
// DNS re-resolution of the sources' host names.
func (s *serving) discover() error {
	var err error
	s.static, s.sources, s.objWatcher, err = discoverySources(s.o, &s.cfg, s.log)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	if !s.cfg.Router.KVEvents {
		s.log.Debug("KV events off: every endpoint uses the approximate index")
	}
	s.build = buildinfo.Read()
	s.reg = prometheus.NewRegistry()
	s.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), s.build.Collector())
	return withDNS(s.o, &s.cfg, s.log, s.reg, s.sources)
}

// startEngine builds the policy and the engine, and the context of the
// background goroutines that feed it.
func (s *serving) startEngine() error {
	parts, err := buildEngine(s.o, &s.cfg, s.log, s.reg, nil)
	if err != nil {
		return err
	}
	s.parts = parts
	s.onExit(parts.close)
	pol := parts.policy
	if aware, ok := pol.(routing.OutcomeAware); ok && aware.NeedsOutcomes() && !s.o.ResponseProcessing {
		s.log.Warn("response processing is off: decisions end at pick time, so in-flight counts, rewards and TTFT are not observed; the policy works blind", "policy", pol.Name())
	}
	bgCtx, stopBackground := context.WithCancel(context.Background())
	s.bgCtx = bgCtx
	s.onExit(func() { stopBackground(); s.bg.Wait() })
	return nil
}

// startHub makes the discovery hub that publishes endpoint sets to the
// engine (gated by the EDS server's acknowledgements when there is one),
// and the KV-event subscribers that follow its sets; a static set is
// published now.
func (s *serving) startHub() error {
	s.edsCfg = s.cfg.Discovery.EDS
	if s.o.EDSAddr != "" {
		s.edsCfg = &EDSConfig{Addr: s.o.EDSAddr}
		if s.cfg.Discovery.EDS != nil {
			s.edsCfg.Cluster = s.cfg.Discovery.EDS.Cluster
		}
	}
	if s.edsCfg != nil || s.ls.EDS != nil {
		if s.edsCfg == nil {
			s.edsCfg = &EDSConfig{}
		}
		s.edsSrv = eds.New(eds.Config{Cluster: s.edsCfg.Cluster}, eds.Deps{Logger: s.log, OnChange: func() { s.hub.Refresh() }})
		s.reg.MustRegister(edsCollector{s.edsSrv})
	}
	hubDeps := discovery.HubDeps{Engine: s.parts.engine, Logger: s.log, AllowLinkLocal: allowLinkLocal(s.o, &s.cfg)}
	if s.edsSrv != nil {
		hubDeps.Gate = s.edsSrv
	}
	s.hub = discovery.NewHub(hubDeps)
	s.reg.MustRegister(hubCollector{s.hub})
	s.warm = s.newWarm()
	s.startFleet()
	if s.static != nil {
		// A static set is checked now: a bad one is a start-up error.
		if err := s.hub.Publish(*s.static); err != nil {
			return err
		}
		if s.fleet != nil {
			if errs := s.fleet.Follow(*s.static); len(errs) > 0 {
				return fmt.Errorf("kv_events: %w", errors.Join(errs...))
			}
		}
	}
	if s.fleet != nil {
		s.hub.Follow(func(set routing.EndpointSet) { s.fleet.Follow(set) })
	}
	s.runWarm()
	return nil
}

// startFleet starts the KV-event subscribers when KV events are on.
func (s *serving) startFleet() {
	if !s.cfg.Router.KVEvents {
		return
	}
	s.fleet = newKVFleet(s.bgCtx, s.parts.engine, s.log)
	s.fleet.cacheBlocks = s.cfg.Router.KVCacheBlocks
	if w := s.warm; w.holds() {
		s.fleet.hold, s.fleet.onResumeGap = true, w.resumeGap
	}
	s.onExit(s.fleet.Close)
	s.reg.MustRegister(s.fleet)
	if s.parts.sync != nil {
		// Workers that dial this replica's bound socket reach no other
		// replica: republish their events, and take the peers'.
		s.fleet.publish = s.parts.sync.PublishKVEvents
		s.parts.kvTarget.Store(s.fleet)
	}
}

// buildFrontends makes what takes requests to the engine: the ext_proc
// server, and the standalone proxy with --http-addr, sharing the
// tokenizers and one buffer budget.
func (s *serving) buildFrontends() error {
	tok, err := s.loadTokenizer()
	if err != nil {
		return err
	}
	// One budget for the request bytes the ext_proc streams and the proxy
	// buffer: --max-buffered-bytes bounds them together.
	maxBuffered := s.o.MaxBufferedBytes
	if maxBuffered == 0 {
		maxBuffered = extproc.DefaultMaxBufferedBytes(s.o.MaxBodyBytes)
	}
	budget := extproc.NewBudget(maxBuffered)
	prios := s.startObjectives()
	o, engine := s.o, s.parts.engine
	s.ep = extproc.NewServer(extproc.Config{
		MaxBodyBytes:        o.MaxBodyBytes,
		MaxInflight:         o.MaxInflight,
		MaxBufferedBytes:    o.MaxBufferedBytes,
		DecisionTimeout:     o.DecisionTimeout,
		StreamHeaderTimeout: o.StreamHeaderTimeout,
		StreamIdleTimeout:   o.StreamIdleTimeout,
		ResponseProcessing:  o.ResponseProcessing,
		TenantHeader:        o.TenantHeader,
		SessionHeaders:      s.cfg.Router.SessionHeader,
		ClientPriority:      s.cfg.Router.PriorityPolicy(),
		TokenizerTimeout:    secs(s.cfg.Tokenizer.TimeoutSecs),
		// Read at start-up: a reload does not change it.
		StripKVTransferParams: s.cfg.PD.StripKVTransferParams,
	}, extproc.Deps{Picker: engine, Tokenizer: tok, Logger: s.log, Registry: s.reg, Budget: budget, Objectives: prios, Tracer: s.tracer})
	if s.ls.HTTP == nil && o.HTTPAddr == "" {
		return nil
	}
	pdMode, err := proxy.ParsePDMode(o.PDProxyMode)
	if err != nil {
		return err
	}
	s.px = proxy.New(proxy.Config{
		PDMode:                pdMode,
		PrefillTimeout:        o.PDPrefillTimeout,
		MaxBodyBytes:          o.MaxBodyBytes,
		MaxInflight:           o.MaxInflight,
		DecisionTimeout:       o.DecisionTimeout,
		TenantHeader:          o.TenantHeader,
		TokenizerTimeout:      secs(s.cfg.Tokenizer.TimeoutSecs),
		StripKVTransferParams: s.cfg.PD.StripKVTransferParams,
		SessionHeaders:        s.cfg.Router.SessionHeader,
		ClientPriority:        s.cfg.Router.PriorityPolicy(),
	}, proxy.Deps{Engine: engine, Tokenizer: tok, Logger: s.log, Registry: s.reg, Clock: engine.Clock(), Budget: budget, Objectives: prios, Tracer: s.tracer})
	s.onExit(s.px.CloseIdleConnections)
	return nil
}

// loadTokenizer loads every configured tokenizer now; nil when none is
// configured (prompts are then hashed from a byte estimate).
func (s *serving) loadTokenizer() (extproc.Tokenizer, error) {
	treg := tokenizerRegistry(s.o.Tokenizer, &s.cfg, s.log)
	if !treg.Enabled() {
		s.log.Info("no tokenizer configured: prompts are hashed from a byte estimate (give --tokenizer or models.<name>.tokenizer)")
		return nil, nil
	}
	tok := extproc.ModelTokenizer{Registry: treg, KeyBlockSize: s.parts.engine.KeyBlockSize}
	s.reg.MustRegister(tokenizerCacheCollector{treg})
	// Load every configured tokenizer now: a bad path is a start-up
	// error, not a log line on the first request.
	if _, err := loadTokenizers(treg, s.o.Tokenizer, &s.cfg); err != nil {
		return nil, err
	}
	// Decoding a tokenizer.json (11 MB for Qwen3) leaves several times
	// the tokenizer's own size as garbage, which the runtime would hand
	// back to the OS only slowly: return it now, so that the resident
	// set at idle is what the tokenizers keep.
	debug.FreeOSMemory()
	return tok, nil
}

// startObjectives starts the InferenceObjectives watcher (pool mode only),
// which gives priorities by name; nil without.
func (s *serving) startObjectives() hints.Priorities {
	w := s.objWatcher
	if w == nil {
		return nil
	}
	s.reg.MustRegister(objectivesCollector{w})
	s.bg.Add(1)
	go func() { defer s.bg.Done(); _ = w.Run(s.bgCtx) }()
	return w
}
