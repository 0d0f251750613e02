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
	"strings"
	"sync"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/internal/buildinfo"
	"github.com/kvbandit/kvbandit/internal/cmdline"
	"github.com/kvbandit/kvbandit/internal/tlsconfig"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/dns"
	"github.com/kvbandit/kvbandit/routing/discovery/eds"
	"github.com/kvbandit/kvbandit/routing/discovery/etcd"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/scrape"
)

// ext_proc server keepalive: how long a connection may be quiet before
// the server pings it, and how long it waits for the ack.
const (
	grpcKeepaliveTime    = time.Minute
	grpcKeepaliveTimeout = 20 * time.Second
)

// Health service names (GIE endpoint picker protocol).
const (
	healthLiveness  = "liveness"
	healthReadiness = "readiness"
	healthExtProc   = "envoy.service.ext_proc.v3.ExternalProcessor"
)

// ServeOptions are the `kvbandit serve` flags.
type ServeOptions struct {
	GRPCAddr           string
	HealthAddr         string
	MetricsAddr        string
	HTTPAddr           string
	Endpoints          string
	DNSRefresh         time.Duration
	EndpointsFile      string
	EDSAddr            string
	EtcdEndpoints      string
	EtcdPool           string
	EtcdPrefix         string
	ConfigPath         string
	Policy             string
	Seed               int64
	MaxBodyBytes       int64
	MaxInflight        int
	MaxBufferedBytes   int64
	Fallbacks          int
	PDThresholdTokens  int
	PDProxyMode        string
	PDPrefillTimeout   time.Duration
	DecisionTimeout    time.Duration
	DrainTimeout       time.Duration
	StopGrace          time.Duration
	TenantHeader       string
	ResponseProcessing bool
	LogLevel           string
	LogFormat          string

	// StreamHeaderTimeout and StreamIdleTimeout bound an ext_proc stream
	// before its request headers and, once decided, between messages.
	StreamHeaderTimeout time.Duration
	StreamIdleTimeout   time.Duration

	// Router flags (Dynamo's names); they override the config file's
	// router section when given.
	Router            RouterConfig
	NoRouterKVEvents  bool
	NoTrackActive     bool
	DecisionLogPath   string
	DecisionLogFormat string
	Tokenizer         string
	TokenizerTimeout  time.Duration
	ScrapeInterval    time.Duration
	ScrapeTimeout     time.Duration
	// TLS are the --tls-* flags (internal/app/tls.go).
	TLS tlsconfig.Options
	// Admin are the admin and health ports' flags (internal/app/admin.go).
	Admin AdminOptions
	// Kubeconfig is the API server client configuration file shared by
	// the Kubernetes features (empty: in-cluster, then $KUBECONFIG).
	Kubeconfig string
	// LeaderElect are the --leader-elect* flags (internal/app/leader.go).
	LeaderElect LeaderOptions
	// Kubernetes discovery (internal/app/discovery.go): an InferencePool,
	// or a Pod selector and target ports (standalone mode).
	PoolName        string
	PoolNamespace   string
	KubeSelector    string
	KubeTargetPorts string
	// SyncNATS are the NATS servers shared with the other replicas of the
	// pool (comma list; overrides the config's sync.nats.servers), and
	// ReplicaID this replica's id among them (default: hostname and a
	// random suffix).
	SyncNATS  string
	ReplicaID string
	// DryRun (--dry-run) runs `kvbandit config check` on these options
	// and exits instead of serving.
	DryRun bool
	// set records the flags given explicitly, with their values.
	set map[string]string
}

// AddFlags registers the options on fs with their defaults.
func (o *ServeOptions) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.GRPCAddr, "grpc-addr", ":9002", "ext_proc gRPC listen address")
	fs.StringVar(&o.HealthAddr, "health-addr", ":9003", "gRPC health listen address (services liveness, readiness, "+healthExtProc+")")
	fs.StringVar(&o.MetricsAddr, "metrics-addr", ":9090", "Prometheus /metrics and /debug admin listen address; empty disables")
	fs.StringVar(&o.HTTPAddr, "http-addr", "", "standalone OpenAI-compatible proxy (POST /v1/chat/completions, /v1/completions, other /v1/* passed through, POST /v1/route) routing in-process; off when empty")
	fs.StringVar(&o.Endpoints, "endpoints", "", "static workers \"host:port[,host:port...]\" (the same list as the Envoy cluster's hosts); a host is an IP or a DNS name, re-resolved every --dns-refresh, every A/AAAA address an endpoint")
	fs.DurationVar(&o.DNSRefresh, "dns-refresh", dns.DefaultRefresh, "how often endpoint host names (--endpoints, endpoints file, etcd records, config endpoints) are resolved again (Envoy's dns_refresh_rate default); a failed lookup keeps the name's last addresses")
	fs.StringVar(&o.EndpointsFile, "endpoints-file", "", "YAML/JSON file of endpoint records (address, models, engine, block_size, kv_events, ...), reloaded on change")
	fs.StringVar(&o.EDSAddr, "eds-addr", "", "serve the endpoint set to Envoy over xDS EDS on this address (envoy/eds.yaml; e.g. "+eds.DefaultAddr+"); a new endpoint is picked only after the connected Envoys acknowledged it")
	fs.StringVar(&o.EtcdEndpoints, "etcd-endpoints", "", "discover workers from etcd (comma list of host:port); records under <prefix>/<pool>/endpoints/<id>, written by kvbandit register (TLS and auth: the config's discovery.etcd)")
	fs.StringVar(&o.EtcdPool, "etcd-pool", etcd.DefaultPool, "etcd discovery: pool name")
	fs.StringVar(&o.EtcdPrefix, "etcd-prefix", etcd.DefaultPrefix, "etcd discovery: key prefix")
	fs.StringVar(&o.ConfigPath, "config", "", "YAML config file (endpoints with metadata, policy parameters)")
	fs.StringVar(&o.Policy, "policy", policy.Default, "routing policy: "+strings.Join(policy.Builtin().Names(), " | "))
	fs.Int64Var(&o.Seed, "seed", 0, "random seed for reproducible decisions (0 = random)")
	fs.Int64Var(&o.MaxBodyBytes, "max-body-bytes", extproc.DefaultMaxBodyBytes, "largest request body accepted (413 beyond, on the first chunk that crosses it)")
	fs.IntVar(&o.MaxInflight, "max-inflight", extproc.DefaultMaxInflight, "concurrent ext_proc streams, and (counted apart) concurrent --http-addr proxy requests (503 beyond, before any buffering)")
	fs.Int64Var(&o.MaxBufferedBytes, "max-buffered-bytes", 0, "request body bytes buffered at once by the ext_proc streams and the --http-addr proxy together (503 server_busy beyond); 0 = max(4 x max-body-bytes, 256 MiB)")
	fs.IntVar(&o.Fallbacks, "fallbacks", 0, "extra endpoints appended to the destination list; keep 0 with ORIGINAL_DST data planes")
	fs.IntVar(&o.PDThresholdTokens, "pd-threshold-tokens", pd.DefaultThresholdTokens, "P/D pools (endpoints with role prefill): prompts with fewer uncached tokens on the chosen decode endpoint stay aggregated (config pd.threshold_tokens; 0 disaggregates every prompt)")
	fs.StringVar(&o.PDProxyMode, "pd-proxy-mode", string(proxy.PDModeSidecar), "P/D with --http-addr: sidecar (send x-prefiller-host-port; llm-d's pd-sidecar in front of each decode worker runs the prefill stage) | direct (the proxy runs the prefill stage itself, for decode workers without a sidecar; a failed prefill stage is served aggregated)")
	fs.DurationVar(&o.PDPrefillTimeout, "pd-prefill-timeout", proxy.DefaultPrefillTimeout, "--pd-proxy-mode direct: bound on the prefill stage; beyond it the request is served aggregated")
	fs.DurationVar(&o.DecisionTimeout, "decision-timeout", extproc.DefaultDecisionTimeout, "request headers -> decision deadline (503 decision_timeout beyond); never applies to the response")
	fs.DurationVar(&o.StreamHeaderTimeout, "stream-header-timeout", extproc.DefaultStreamHeaderTimeout, "ext_proc stream open -> request headers deadline; a stream that sends none is closed (DEADLINE_EXCEEDED) and never holds a --max-inflight slot (0 = the default)")
	fs.DurationVar(&o.StreamIdleTimeout, "stream-idle-timeout", extproc.DefaultStreamIdleTimeout, "a decided ext_proc stream that receives no message for this long is closed cleanly and its decision released (abandoned); every response chunk resets it; 0 = off")
	fs.DurationVar(&o.DrainTimeout, "drain-timeout", 25*time.Second, "on SIGTERM: readiness goes NOT_SERVING, open streams get this long to finish before they are closed")
	fs.DurationVar(&o.StopGrace, "stop-grace", 5*time.Second, "after the drain deadline: how long streams that already have a decision may keep streaming their response before they are cut")
	fs.StringVar(&o.TenantHeader, "tenant-header", "", "request header, set by the gateway, that scopes prefix state per tenant")
	fs.BoolVar(&o.ResponseProcessing, "response-processing", true, "keep the ext_proc stream for the response (outcomes, TTFT, load accounting); false closes it after the request phase")
	o.Router = DefaultFileConfig().Router
	routerFlags(fs, &o.Router)
	fs.BoolVar(&o.NoRouterKVEvents, "no-router-kv-events", false, "approximate index only: ignore KV events")
	fs.BoolVar(&o.NoTrackActive, "no-router-track-active-blocks", false, "do not count in-flight blocks")
	fs.StringVar(&o.Tokenizer, "tokenizer", "", "tokenizer.json or a model directory (with tokenizer_config.json and its chat template) for models without their own entry in the config's models map; without any, prompts are hashed from a byte estimate")
	fs.DurationVar(&o.TokenizerTimeout, "tokenizer-timeout", 5*time.Second, "per-request tokenization deadline; past it the request is routed on the byte estimate")
	fs.DurationVar(&o.ScrapeInterval, "scrape-interval", time.Second, "how often each worker's Prometheus /metrics (vLLM or SGLang names) is scraped for load and block size; 0 disables")
	fs.DurationVar(&o.ScrapeTimeout, "scrape-timeout", time.Second, "per-scrape timeout; a worker without a good scrape for 3 intervals counts as stale")
	fs.StringVar(&o.DecisionLogPath, "decision-log", "", "write one record per decision to this file (off when empty)")
	fs.StringVar(&o.DecisionLogFormat, "decision-log-format", "csv", "decision log format: csv | jsonl")
	fs.StringVar(&o.LogLevel, "log-level", "info", "debug | info | warn | error")
	fs.StringVar(&o.LogFormat, "log-format", "text", "text | json")
	o.TLS.AddFlags(fs)
	o.Admin.AddFlags(fs)
	fs.StringVar(&o.PoolName, "pool-name", "", "discover workers from this Gateway API Inference Extension InferencePool and the Pods it selects (Pod annotations: routing/discovery/kube)")
	fs.StringVar(&o.PoolNamespace, "pool-namespace", "", "Kubernetes discovery: the pool's (or the Pods') namespace (default $POD_NAMESPACE, else default)")
	fs.StringVar(&o.KubeSelector, "kube-selector", "", "Kubernetes discovery without an InferencePool: Pod label selector k=v[,k=v...] (with --kube-target-ports)")
	fs.StringVar(&o.KubeTargetPorts, "kube-target-ports", "", "Kubernetes discovery without an InferencePool: worker ports of each Pod, comma list")
	fs.StringVar(&o.Kubeconfig, "kubeconfig", "", "kubeconfig file for the Kubernetes API server (discovery, --leader-elect); empty: in-cluster service account, else $KUBECONFIG or ~/.kube/config")
	o.LeaderElect.AddFlags(fs)
	fs.StringVar(&o.SyncNATS, "sync-nats", "", "active-active replicas: NATS URL[,URL...] shared by the replicas of the pool (in-flight decisions, outcomes); auth, TLS and intervals in the config's sync section; off when empty")
	fs.BoolVar(&o.DryRun, "dry-run", false, "load and validate the config and flags, resolve tokenizers and discovery settings (nothing contacted), print the effective config, and exit (as kvbandit config check does)")
	fs.StringVar(&o.ReplicaID, "replica-id", "", "this replica's id among the --sync-nats peers, unique in the pool (default: hostname-<6 random hex>)")
}

// Validate checks the options.
func (o *ServeOptions) Validate() error {
	var errs []error
	if o.GRPCAddr == "" {
		errs = append(errs, errors.New("--grpc-addr must not be empty"))
	}
	if o.HealthAddr == "" {
		errs = append(errs, errors.New("--health-addr must not be empty"))
	}
	if o.MaxBodyBytes <= 0 {
		errs = append(errs, errors.New("--max-body-bytes must be > 0"))
	}
	if o.MaxInflight <= 0 {
		errs = append(errs, errors.New("--max-inflight must be > 0"))
	}
	if o.MaxBufferedBytes < 0 {
		errs = append(errs, errors.New("--max-buffered-bytes must be >= 0"))
	}
	if o.MaxBufferedBytes > 0 && o.MaxBufferedBytes < o.MaxBodyBytes {
		errs = append(errs, errors.New("--max-buffered-bytes must be >= --max-body-bytes"))
	}
	if o.Fallbacks < 0 {
		errs = append(errs, errors.New("--fallbacks must be >= 0"))
	}
	if o.DecisionTimeout <= 0 {
		errs = append(errs, errors.New("--decision-timeout must be > 0"))
	}
	if o.StreamHeaderTimeout < 0 {
		errs = append(errs, errors.New("--stream-header-timeout must be >= 0 (0 = the default)"))
	}
	if o.StreamIdleTimeout < 0 {
		errs = append(errs, errors.New("--stream-idle-timeout must be >= 0 (0 = off)"))
	}
	if o.DrainTimeout < 0 {
		errs = append(errs, errors.New("--drain-timeout must be >= 0"))
	}
	if o.StopGrace < 0 {
		errs = append(errs, errors.New("--stop-grace must be >= 0"))
	}
	if o.Endpoints == "" && o.ConfigPath == "" && o.EndpointsFile == "" && o.EtcdEndpoints == "" && o.PoolName == "" && o.KubeSelector == "" {
		errs = append(errs, errors.New("no workers: give --endpoints, --endpoints-file, --etcd-endpoints, --pool-name, --kube-selector or --config with endpoints or a discovery source"))
	}
	if o.DNSRefresh < 0 {
		errs = append(errs, errors.New("--dns-refresh must be >= 0 (0 = the default)"))
	}
	if o.Endpoints != "" && o.EndpointsFile != "" {
		errs = append(errs, errors.New("give --endpoints or --endpoints-file, not both"))
	}
	if _, err := parseLevel(o.LogLevel); err != nil {
		errs = append(errs, err)
	}
	if o.LogFormat != "text" && o.LogFormat != "json" {
		errs = append(errs, fmt.Errorf("--log-format %q: want text or json", o.LogFormat))
	}
	if err := o.TLS.Validate(); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, o.Admin.Validate(o.TLS)...)
	if err := o.LeaderElect.Validate(); err != nil {
		errs = append(errs, err)
	}
	if len(o.ReplicaID) > 128 {
		errs = append(errs, errors.New("--replica-id: at most 128 bytes"))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	return nil
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("--log-level %q: %w", s, err)
	}
	return l, nil
}

func newLogger(w io.Writer, level, format string) *slog.Logger {
	l, _ := parseLevel(level)
	ho := &slog.HandlerOptions{Level: l}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, ho))
	}
	return slog.New(slog.NewTextHandler(w, ho))
}

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

// routerFlags binds the Dynamo-named --router-* flags to r (their defaults
// are r's current values). serve binds them to its options for parsing and
// help, then binds them again to the loaded config file to apply the ones
// given explicitly on top of it.
func routerFlags(fs *flag.FlagSet, r *RouterConfig) {
	fs.IntVar(&r.BlockSize, "router-block-size", r.BlockSize, "KV block size in tokens (an endpoint's own block size overrides it)")
	fs.Float64Var(&r.KVOverlapScoreWeight, "router-kv-overlap-score-weight", r.KVOverlapScoreWeight, "weight of prefill work against decode blocks in the kv cost (kv and kvbandit)")
	fs.Float64Var(&r.Temperature, "router-temperature", r.Temperature, "kv policy: 0 picks the lowest cost, > 0 samples a softmax over normalised costs")
	fs.BoolVar(&r.KVEvents, "router-kv-events", r.KVEvents, "use workers' KV events where they are configured (endpoints without events stay approximate)")
	fs.Float64Var(&r.TTLSecs, "router-ttl-secs", r.TTLSecs, "approximate index: seconds a routed prefix is assumed cached")
	fs.IntVar(&r.MaxTreeSize, "router-max-tree-size", r.MaxTreeSize, "approximate index: entries before pruning")
	fs.Float64Var(&r.PruneTargetRatio, "router-prune-target-ratio", r.PruneTargetRatio, "approximate index: fraction of the cap kept when pruning")
	fs.Float64Var(&r.QueueThreshold, "router-queue-threshold", r.QueueThreshold, "admission queue: hold requests while every endpoint's active prefill tokens exceed this × its max_num_batched_tokens (0 = off)")
	fs.StringVar(&r.QueuePolicy, "router-queue-policy", r.QueuePolicy, "admission queue order: fcfs | wspt")
	fs.Float64Var(&r.QueueMaxWaitSecs, "router-queue-max-wait", r.QueueMaxWaitSecs, "admission queue: seconds a request may wait before 429")
	fs.BoolVar(&r.TrackActiveBlocks, "router-track-active-blocks", r.TrackActiveBlocks, "count KV blocks held by in-flight requests in the cost")
}

// applyFlags lets explicitly given flags override the config file, then
// validates the result.
func (o *ServeOptions) applyFlags(c *FileConfig) error {
	file := flag.NewFlagSet("router", flag.ContinueOnError)
	file.SetOutput(io.Discard)
	routerFlags(file, &c.Router)
	for name, v := range o.set {
		if file.Lookup(name) != nil {
			if err := file.Set(name, v); err != nil {
				return fmt.Errorf("--%s: %w", name, err)
			}
		}
	}
	r := &c.Router
	if o.NoRouterKVEvents {
		r.KVEvents = false
	}
	if o.NoTrackActive {
		r.TrackActiveBlocks = false
	}
	if v, ok := o.set["decision-log"]; ok {
		c.DecisionLog.Path = v
	}
	if v, ok := o.set["decision-log-format"]; ok {
		c.DecisionLog.Format = v
	}
	if _, ok := o.set["pd-threshold-tokens"]; ok {
		c.PD.ThresholdTokens = o.PDThresholdTokens
	}
	if _, ok := o.set["tokenizer-timeout"]; ok {
		c.Tokenizer.TimeoutSecs = o.TokenizerTimeout.Seconds()
	}
	// The Dynamo-named knobs also parameterise the policies.
	if _, ok := o.set["router-kv-overlap-score-weight"]; ok || r.KVOverlapScoreWeight != 1 {
		c.KV.OverlapScoreWeight = r.KVOverlapScoreWeight
		c.KVBandit.OverlapScoreWeight = r.KVOverlapScoreWeight
	}
	if _, ok := o.set["router-temperature"]; ok || r.Temperature != 0 {
		c.KV.Temperature = r.Temperature
	}
	return c.Validate()
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
	if ls == nil {
		ls = &Listeners{}
	}
	fileCfg := DefaultFileConfig()
	if o.ConfigPath != "" {
		c, err := LoadConfig(o.ConfigPath)
		if err != nil {
			return fmt.Errorf("%w: %w", ErrUsage, err)
		}
		fileCfg = *c
	}
	if err := o.applyFlags(&fileCfg); err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	tracer, err := newTracer(ctx, log)
	if err != nil {
		return err
	}
	// Deferred first, so it runs last: every span has ended by then.
	defer shutdownTracer(tracer, log)
	static, sources, objWatcher, err := discoverySources(o, &fileCfg, log)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	if !fileCfg.Router.KVEvents {
		log.Debug("KV events off: every endpoint uses the approximate index")
	}

	build := buildinfo.Read()
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), build.Collector())
	if err := withDNS(o, &fileCfg, log, reg, sources); err != nil {
		return err
	}

	parts, err := buildEngine(o, &fileCfg, log, reg, nil)
	if err != nil {
		return err
	}
	defer parts.close()
	engine, pol := parts.engine, parts.policy
	if aware, ok := pol.(routing.OutcomeAware); ok && aware.NeedsOutcomes() && !o.ResponseProcessing {
		log.Warn("response processing is off: decisions end at pick time, so in-flight counts, rewards and TTFT are not observed; the policy works blind", "policy", pol.Name())
	}
	bgCtx, stopBackground := context.WithCancel(context.Background())
	var bg sync.WaitGroup
	defer func() { stopBackground(); bg.Wait() }()
	var edsSrv *eds.Server
	var hub *discovery.Hub
	edsCfg := fileCfg.Discovery.EDS
	if o.EDSAddr != "" {
		edsCfg = &EDSConfig{Addr: o.EDSAddr}
		if fileCfg.Discovery.EDS != nil {
			edsCfg.Cluster = fileCfg.Discovery.EDS.Cluster
		}
	}
	if edsCfg != nil || ls.EDS != nil {
		if edsCfg == nil {
			edsCfg = &EDSConfig{}
		}
		edsSrv = eds.New(eds.Config{Cluster: edsCfg.Cluster}, eds.Deps{Logger: log, OnChange: func() { hub.Refresh() }})
		reg.MustRegister(edsCollector{edsSrv})
	}
	hubDeps := discovery.HubDeps{Engine: engine, Logger: log}
	if edsSrv != nil {
		hubDeps.Gate = edsSrv
	}
	hub = discovery.NewHub(hubDeps)
	reg.MustRegister(hubCollector{hub})
	var fleet *kvFleet
	if fileCfg.Router.KVEvents {
		fleet = newKVFleet(bgCtx, engine, log)
		defer fleet.Close()
		reg.MustRegister(fleet)
		if parts.sync != nil {
			// Workers that dial this replica's bound socket reach no other
			// replica: republish their events, and take the peers'.
			fleet.publish = parts.sync.PublishKVEvents
			parts.kvTarget.Store(fleet)
		}
	}
	if static != nil {
		// A static set is checked now: a bad one is a start-up error.
		if err := hub.Publish(*static); err != nil {
			return err
		}
		if fleet != nil {
			if errs := fleet.Follow(*static); len(errs) > 0 {
				return fmt.Errorf("kv_events: %w", errors.Join(errs...))
			}
		}
	}
	if fleet != nil {
		hub.Follow(func(set routing.EndpointSet) { fleet.Follow(set) })
	}

	var tok extproc.Tokenizer
	if treg := tokenizerRegistry(o.Tokenizer, &fileCfg, log); treg.Enabled() {
		tok = extproc.ModelTokenizer{Registry: treg, KeyBlockSize: engine.KeyBlockSize}
		reg.MustRegister(tokenizerCacheCollector{treg})
		// Load every configured tokenizer now: a bad path is a start-up
		// error, not a log line on the first request.
		if _, err := loadTokenizers(treg, o.Tokenizer, &fileCfg); err != nil {
			return err
		}
		// Decoding a tokenizer.json (11 MB for Qwen3) leaves several times
		// the tokenizer's own size as garbage, which the runtime would hand
		// back to the OS only slowly: return it now, so that the resident
		// set at idle is what the tokenizers keep.
		debug.FreeOSMemory()
	} else {
		log.Info("no tokenizer configured: prompts are hashed from a byte estimate (give --tokenizer or models.<name>.tokenizer)")
	}
	// One budget for the request bytes the ext_proc streams and the proxy
	// buffer: --max-buffered-bytes bounds them together.
	maxBuffered := o.MaxBufferedBytes
	if maxBuffered == 0 {
		maxBuffered = extproc.DefaultMaxBufferedBytes(o.MaxBodyBytes)
	}
	budget := extproc.NewBudget(maxBuffered)
	// InferenceObjectives (pool mode only) give priorities by name.
	var prios hints.Priorities
	if objWatcher != nil {
		prios = objWatcher
		reg.MustRegister(objectivesCollector{objWatcher})
		bg.Add(1)
		go func() { defer bg.Done(); _ = objWatcher.Run(bgCtx) }()
	}
	ep := extproc.NewServer(extproc.Config{
		MaxBodyBytes:        o.MaxBodyBytes,
		MaxInflight:         o.MaxInflight,
		MaxBufferedBytes:    o.MaxBufferedBytes,
		DecisionTimeout:     o.DecisionTimeout,
		StreamHeaderTimeout: o.StreamHeaderTimeout,
		StreamIdleTimeout:   o.StreamIdleTimeout,
		ResponseProcessing:  o.ResponseProcessing,
		TenantHeader:        o.TenantHeader,
		TokenizerTimeout:    secs(fileCfg.Tokenizer.TimeoutSecs),
	}, extproc.Deps{Picker: engine, Tokenizer: tok, Logger: log, Registry: reg, Budget: budget, Objectives: prios, Tracer: tracer})
	var px *proxy.Proxy
	if ls.HTTP != nil || o.HTTPAddr != "" {
		pdMode, err := proxy.ParsePDMode(o.PDProxyMode)
		if err != nil {
			return err
		}
		px = proxy.New(proxy.Config{
			PDMode:           pdMode,
			PrefillTimeout:   o.PDPrefillTimeout,
			MaxBodyBytes:     o.MaxBodyBytes,
			MaxInflight:      o.MaxInflight,
			DecisionTimeout:  o.DecisionTimeout,
			TenantHeader:     o.TenantHeader,
			TokenizerTimeout: secs(fileCfg.Tokenizer.TimeoutSecs),
		}, proxy.Deps{Engine: engine, Tokenizer: tok, Logger: log, Registry: reg, Clock: engine.Clock(), Budget: budget, Objectives: prios, Tracer: tracer})
		defer px.CloseIdleConnections()
	}

	// BUFFERED mode sends the whole body in one message: the receive limit
	// must hold the largest body plus the message framing.
	maxMsg := int(min(o.MaxBodyBytes, 1<<30)) + 64<<10
	tlsSrc, err := newTLSSource(o.TLS, log)
	if err != nil {
		return err
	}
	gate := &readyGate{}
	le, err := newLeaderElection(o, log, reg, gate)
	if err != nil {
		return err
	}
	gs := grpc.NewServer(
		grpcTLS(tlsSrc),
		grpc.MaxRecvMsgSize(maxMsg),
		grpc.MaxConcurrentStreams(uint32(min(o.MaxInflight*2, 1<<20))),
		// Envoy's connection_keepalive pings (every 30 s in envoy/*.yaml)
		// are allowed down to one per 10 s; faster ones end the
		// connection with GOAWAY too_many_pings.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		// Ping a connection that has been quiet for a minute and close it
		// when the ack does not come within 20 s: a dead peer (host gone,
		// partition) then ends its streams, which release their decisions,
		// instead of holding them until the idle timeout. Envoy answers
		// pings as any HTTP/2 peer must, and a quiet connection is pinged
		// at most once a minute.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: grpcKeepaliveTime, Timeout: grpcKeepaliveTimeout}),
	)
	extprocv3.RegisterExternalProcessorServer(gs, ep)
	reflection.Register(gs)

	hs := health.NewServer()
	hgs := grpc.NewServer(healthServerOptions(o.Admin, tlsSrc)...)
	healthpb.RegisterHealthServer(hgs, hs)
	reflection.Register(hgs)
	setReady := func(ready bool) {
		st := healthpb.HealthCheckResponse_NOT_SERVING
		if ready {
			st = healthpb.HealthCheckResponse_SERVING
		}
		hs.SetServingStatus(healthReadiness, st)
		hs.SetServingStatus(healthExtProc, st)
		hs.SetServingStatus("", st)
	}
	hs.SetServingStatus(healthLiveness, healthpb.HealthCheckResponse_SERVING)
	setReady(false)
	hh := &httpHealth{hs: hs, gate: gate} // /healthz, /readyz on the admin and proxy ports

	listen := func(l net.Listener, addr string) (net.Listener, error) {
		if l != nil {
			return l, nil
		}
		return net.Listen("tcp", addr)
	}
	gl, err := listen(ls.GRPC, o.GRPCAddr)
	if err != nil {
		return fmt.Errorf("--grpc-addr: %w", err)
	}
	hl, err := listen(ls.Health, o.HealthAddr)
	if err != nil {
		gl.Close()
		return fmt.Errorf("--health-addr: %w", err)
	}
	var ml net.Listener
	var hsrv *http.Server
	if ls.Metrics != nil || o.MetricsAddr != "" {
		if ml, err = listen(ls.Metrics, o.MetricsAddr); err != nil {
			gl.Close()
			hl.Close()
			return fmt.Errorf("--metrics-addr: %w", err)
		}
		if o.Admin.TLS {
			ml = httpTLS(ml, tlsSrc)
		}
		hsrv = newAdminServer(o.Admin, adminState{reg: reg, engine: engine, hub: hub, policy: pol.Name(), ep: ep, sync: parts.sync, health: hh})
	}
	var pl net.Listener
	var psrv *http.Server
	if px != nil {
		if pl, err = listen(ls.HTTP, o.HTTPAddr); err != nil {
			gl.Close()
			hl.Close()
			if ml != nil {
				ml.Close()
			}
			return fmt.Errorf("--http-addr: %w", err)
		}
		pl = httpTLS(pl, tlsSrc)
		// No whole-request read or write timeout: a long SSE generation
		// must not be cut. The proxy bounds the body read itself (the
		// decision deadline), and headers by time and size.
		psrv = &http.Server{Handler: withHealth(px, hh), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: proxy.MaxHeaderBytes,
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	}

	if o.ScrapeInterval > 0 {
		sc := scrape.New(scrape.Config{Interval: o.ScrapeInterval, Timeout: o.ScrapeTimeout}, scrape.Deps{
			Logger: log, Targets: scrape.EngineTargets(engine), Publish: scrape.EnginePublish(engine),
			OnError: scrape.EngineFailure(engine, func(t scrape.Target, err error) { log.Debug("scrape failed", "endpoint", t.Key, "err", err) }),
		})
		reg.MustRegister(scrapeCollector{sc})
		bg.Add(1)
		go func() { defer bg.Done(); _ = sc.Run(bgCtx) }()
	}
	var xgs *grpc.Server
	if edsSrv != nil {
		xl, err := listen(ls.EDS, edsCfg.Addr)
		if err != nil {
			gl.Close()
			hl.Close()
			if ml != nil {
				ml.Close()
			}
			if pl != nil {
				pl.Close()
			}
			return fmt.Errorf("--eds-addr: %w", err)
		}
		xgs = grpc.NewServer(grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}))
		edsSrv.Register(xgs)
		reflection.Register(xgs)
		go func() {
			if err := serveGRPC(xgs, xl, "eds"); err != nil {
				log.Error("EDS server stopped", "err", err)
			}
		}()
		log.Info("EDS serving", "addr", xl.Addr().String())
	}
	errc := make(chan error, 5)
	bg.Add(2)
	go func() { defer bg.Done(); hub.Run(bgCtx, 0) }()
	go func() {
		defer bg.Done()
		if err := discovery.RunSources(bgCtx, hub, sources...); err != nil {
			errc <- fmt.Errorf("discovery: %w", err)
		}
	}()
	go func() { errc <- serveGRPC(gs, gl, "ext_proc") }()
	go func() { errc <- serveGRPC(hgs, hl, "health") }()
	if hsrv != nil {
		go func() {
			if err := hsrv.Serve(ml); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("metrics: %w", err)
			}
		}()
	}
	paddr := ""
	if psrv != nil {
		paddr = pl.Addr().String()
		go func() {
			if err := psrv.Serve(pl); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("http proxy: %w", err)
			}
		}()
	}
	// Ready once discovery has published a set, and from then on through
	// discovery outages (the last known set keeps serving).
	// Under --leader-elect, also only while leading (leader.go).
	var stopping atomic.Bool
	gate.bind(setReady, &stopping)
	hub.Follow(func(routing.EndpointSet) { gate.setSynced() })
	stopLeader := le.start()
	defer stopLeader()
	maddr := ""
	if ml != nil {
		maddr = ml.Addr().String()
	}
	log.Info("kvbandit serving", "version", build.Version, "commit", build.Commit, "built", build.Date, "grpc", gl.Addr().String(), "health", hl.Addr().String(), "metrics", maddr, "http", paddr, "policy", pol.Name(), "endpoints", len(engine.Endpoints()))
	if ls.Ready != nil {
		ls.Ready(gl.Addr().String(), hl.Addr().String(), maddr)
	}

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-errc:
	}

	// Shutdown: readiness first, so Envoy stops sending new streams; open
	// streams get DrainTimeout to finish on their own. Then streams still
	// waiting for a decision are answered 503 and new ones refused, while
	// decided streams keep echoing their responses (an early close would
	// drop chunks Envoy has in flight) until StopGrace runs out.
	log.Info("shutting down", "drain_timeout", o.DrainTimeout, "streams", ep.Streams())
	stopping.Store(true)
	setReady(false)
	hs.Shutdown()
	// Release the Lease now, so a standby takes over while this replica
	// drains.
	stopLeader()
	// The standalone proxy drains alongside: it stops accepting at once,
	// proxied requests get DrainTimeout to finish, then the ones left are
	// cut (their decisions end as abandoned).
	proxyDone := make(chan struct{})
	go func() {
		defer close(proxyDone)
		if psrv == nil {
			return
		}
		pctx, cancel := context.WithTimeout(context.Background(), o.DrainTimeout)
		defer cancel()
		if err := psrv.Shutdown(pctx); err != nil {
			log.Warn("drain deadline reached; cutting proxied requests", "requests", px.InFlight())
			px.Stop()
			psrv.Close()
		}
		wctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := px.Wait(wctx); err != nil {
			log.Warn("proxied requests still running after stop", "requests", px.InFlight())
		}
		px.Stop()
	}()
	drainCtx, cancel := context.WithTimeout(context.Background(), o.DrainTimeout)
	if err := ep.Wait(drainCtx); err != nil {
		log.Warn("drain deadline reached; refusing undecided streams", "streams", ep.Streams())
	}
	cancel()
	ep.Drain()
	closeCtx, cancel := context.WithTimeout(context.Background(), o.StopGrace)
	if err := ep.Wait(closeCtx); err != nil {
		log.Warn("streams still open after the stop grace period; closing them", "streams", ep.Streams())
	}
	cancel()
	ep.Stopping()
	stopped := make(chan struct{})
	go func() { gs.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(time.Second):
		gs.Stop()
		<-stopped
	}
	hgs.Stop()
	if xgs != nil {
		// xDS streams last as long as Envoy runs: end them, then stop.
		edsSrv.Close()
		xgs.Stop()
	}
	<-proxyDone
	if hsrv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		hsrv.Shutdown(sctx)
		cancel()
	}
	log.Info("stopped")
	return runErr
}

func serveGRPC(s *grpc.Server, l net.Listener, name string) error {
	if err := s.Serve(l); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// scrapeCollector exports the load scraper's results.
type scrapeCollector struct{ s *scrape.Scraper }

var scrapeDesc = prometheus.NewDesc("kvbandit_scrapes_total", "Worker /metrics scrapes, by result.", []string{"result"}, nil)

func (scrapeCollector) Describe(ch chan<- *prometheus.Desc) { ch <- scrapeDesc }
func (c scrapeCollector) Collect(ch chan<- prometheus.Metric) {
	for reason, n := range c.s.Stats().ByReason() {
		ch <- prometheus.MustNewConstMetric(scrapeDesc, prometheus.CounterValue, float64(n), reason)
	}
}
