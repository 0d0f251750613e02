package app

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/internal/tlsconfig"
	"github.com/kvbandit/kvbandit/routing/discovery/dns"
	"github.com/kvbandit/kvbandit/routing/discovery/eds"
	"github.com/kvbandit/kvbandit/routing/discovery/etcd"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
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
	PDStripKVTransfer  bool
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
	// SyncAllowAnonymous lets --sync-nats connect without credentials
	// (config sync.allow_anonymous).
	SyncAllowAnonymous bool
	// DiscoveryAllowLinkLocal lets endpoints at link-local addresses
	// through (config discovery.allow_link_local).
	DiscoveryAllowLinkLocal bool
	// SyncWarmStart, true by default: a starting replica takes a peer's
	// state (sync.warm_start; false sets sync.warm_start.disabled).
	SyncWarmStart bool
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
	fs.BoolVar(&o.PDStripKVTransfer, "pd-strip-kv-transfer-params", false, "remove a client's kv_transfer_params from request bodies in every pool (config pd.strip_kv_transfer_params); pools with prefill endpoints always remove it")
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
	fs.BoolVar(&o.SyncAllowAnonymous, "sync-allow-anonymous", false, "let --sync-nats connect without credentials (warned at start-up): any client the NATS server lets in can then act as a peer replica (as sync.allow_anonymous)")
	fs.BoolVar(&o.DiscoveryAllowLinkLocal, "discovery-allow-link-local", false, "accept endpoints at link-local addresses (169.254.0.0/16, fe80::/10, where clouds serve instance metadata); without it they are refused in a static list and dropped from discovered sets (as discovery.allow_link_local)")
	fs.BoolVar(&o.DryRun, "dry-run", false, "load and validate the config and flags, resolve tokenizers and discovery settings (nothing contacted), print the effective config, and exit (as kvbandit config check does)")
	fs.StringVar(&o.ReplicaID, "replica-id", "", "this replica's id among the --sync-nats peers, unique in the pool (default: hostname-<6 random hex>)")
	fs.BoolVar(&o.SyncWarmStart, "sync-warm-start", true, "with --sync-nats: at start, take a live peer's state (KV index with its trust and sequence, latency model, posteriors, sessions) and answer peers that start; false: neither (config sync.warm_start)")
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
	fs.StringVar(&r.ClientPriority, "client-priority", r.ClientPriority, "what becomes of a client's own priority (x-request-priority, nvext.agent_hints priority/latency_sensitivity): cap (lower freely, raise at most to its InferenceObjective's priority, else --client-priority-max), allow (the client's wins over its objective's) or ignore (config router.client_priority)")
	fs.IntVar(&r.ClientPriorityMax, "client-priority-max", r.ClientPriorityMax, "--client-priority cap: the highest priority a client may give itself when no InferenceObjective applies, 0 to 1000 (config router.client_priority_max)")
	fs.Var(&r.SessionHeader, "session-header", "request header(s) carrying the session id (the prefix id hint), comma-separated, the first present winning (config router.session_header; at most 8 names)")
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
	if o.SyncAllowAnonymous {
		c.Sync.AllowAnonymous = true
	}
	if v, ok := o.set["decision-log-format"]; ok {
		c.DecisionLog.Format = v
	}
	if _, ok := o.set["pd-threshold-tokens"]; ok {
		c.PD.ThresholdTokens = o.PDThresholdTokens
	}
	if _, ok := o.set["pd-strip-kv-transfer-params"]; ok {
		c.PD.StripKVTransferParams = o.PDStripKVTransfer
	}
	if _, ok := o.set["tokenizer-timeout"]; ok {
		c.Tokenizer.TimeoutSecs = o.TokenizerTimeout.Seconds()
	}
	if _, ok := o.set["sync-warm-start"]; ok {
		c.Sync.WarmStart.Disabled = !o.SyncWarmStart
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
