package app

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"reflect"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/admission"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/etcd"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// FileConfig is the YAML file given with --config. It is decoded on top of
// the defaults, and unknown fields are refused, so a typo is an error and
// not a silently ignored setting.
type FileConfig struct {
	// Endpoints is a static endpoint list with metadata (models, block
	// size, ...). It is an alternative to --endpoints.
	Endpoints []routing.Endpoint `json:"endpoints,omitempty"`
	// PassThroughUnknownModels routes requests for a model that no endpoint
	// declares to any endpoint, instead of answering 404 model_not_found.
	PassThroughUnknownModels bool `json:"pass_through_unknown_models,omitempty"`
	// Router holds Dynamo-compatible router settings; --router-* flags
	// override them.
	Router RouterConfig `json:"router"`
	// Policies: the kv, kvbandit and thompson parameters (the thompson keys
	// follow the reference router's config.yaml: affinity.*,
	// switching_cost.*, load_balancing.*, lints.*, exploration.*,
	// feedback.*, prefill.*).
	policy.Config `json:",inline"`
	// PrefixState bounds the per-(tenant, prefix id) state of the
	// hint-aware policies.
	PrefixState PrefixStateConfig `json:"prefix_state"`
	// DecisionLog writes one record per decision (off when path is empty).
	DecisionLog DecisionLogConfig `json:"decision_log"`
	// Models maps served model names to their tokenizer (tokenizer.json or
	// a model directory with tokenizer_config.json); --tokenizer is the
	// default for the others.
	Models map[string]ModelConfig `json:"models,omitempty"`
	// Tokenizer tunes tokenization.
	Tokenizer TokenizerConfig `json:"tokenizer"`
	// Health tunes endpoint ejection (passive: failed outcomes; active:
	// failed scrapes).
	Health HealthConfig `json:"health"`
	// Discovery selects a dynamic source of endpoints (instead of the
	// static endpoints list) and the EDS server.
	Discovery DiscoveryConfig `json:"discovery"`
	// Sync shares in-flight decisions and outcomes with the other
	// replicas of the pool over NATS (active-active; off without servers).
	Sync SyncConfig `json:"sync"`
	// PD tunes prefill/decode disaggregation in pools with prefill-role
	// endpoints (routing/pd); --pd-threshold-tokens overrides it.
	PD pd.Config `json:"pd"`
}

// SyncConfig configures routing/sync. --sync-nats overrides
// nats.servers.
type SyncConfig struct {
	NATS SyncNATSConfig `json:"nats"`
	// BatchIntervalMs, SnapshotIntervalMs, HeartbeatIntervalMs and
	// PeerTTLMs tune publishing and peer expiry (0: routing/sync's
	// defaults, 2, 1000, 500 and 3000).
	BatchIntervalMs     int `json:"batch_interval_ms,omitempty"`
	SnapshotIntervalMs  int `json:"snapshot_interval_ms,omitempty"`
	HeartbeatIntervalMs int `json:"heartbeat_interval_ms,omitempty"`
	PeerTTLMs           int `json:"peer_ttl_ms,omitempty"`
	// Turns lets the replicas decide a burst in turn (routing/burst):
	// while arrivals come in bursts, a decision waits rank × TurnStepMs
	// (at most 7 steps) so that it sees the pool's earlier decisions of
	// the burst. Default true; false decides at once, blind to peers'
	// simultaneous decisions.
	Turns *bool `json:"turns,omitempty"`
	// TurnStepMs is the wait between two replicas' turns (0: the sync
	// delay, batch_interval_ms + 1 ms, plus an eighth).
	TurnStepMs float64 `json:"turn_step_ms,omitempty"`
	// AllowAnonymous connects without credentials (--sync-allow-anonymous):
	// without it, sync needs nats.user/password, token, nkey_file,
	// creds_file or an mTLS client certificate.
	AllowAnonymous bool `json:"allow_anonymous,omitempty"`
	// MaxPeerInFlight and MaxPeerPrefillTokens bound what one peer may
	// claim at once: open decisions and prompt tokens not prefilled yet
	// (0: what one replica could hold, 2 x --max-inflight decisions of
	// --max-body-bytes tokens each).
	MaxPeerInFlight      int   `json:"max_peer_inflight,omitempty"`
	MaxPeerPrefillTokens int64 `json:"max_peer_prefill_tokens,omitempty"`
	// WarmStart is the state a starting replica takes from a peer
	// (warm.go).
	WarmStart SyncWarmConfig `json:"warm_start"`
}

// turns reports whether sync.turns is on (the default).
func (c *SyncConfig) turns() bool { return c.Turns == nil || *c.Turns }

// SyncNATSConfig is the NATS connection of routing/sync.
type SyncNATSConfig struct {
	Servers []string `json:"servers,omitempty"`
	// CredsFile, User/Password, Token and NkeyFile (an nkey seed) are
	// exclusive.
	CredsFile string        `json:"creds_file,omitempty"`
	User      string        `json:"user,omitempty"`
	Password  string        `json:"password,omitempty"`
	Token     string        `json:"token,omitempty"`
	NkeyFile  string        `json:"nkey_file,omitempty"`
	TLS       SyncTLSConfig `json:"tls"`
	// SubjectPrefix defaults to kvbandit.<pool>.
	SubjectPrefix string `json:"subject_prefix,omitempty"`
}

// SyncTLSConfig is the client TLS of the NATS connection: the CA to trust,
// a client certificate and key for mTLS, the server name to verify.
type SyncTLSConfig struct {
	CA                 string `json:"ca,omitempty"`
	Cert               string `json:"cert,omitempty"`
	Key                string `json:"key,omitempty"`
	ServerName         string `json:"server_name,omitempty"`
	InsecureSkipVerify bool   `json:"insecure_skip_verify,omitempty"`
}

func (c *SyncConfig) validate() error {
	switch {
	case c.BatchIntervalMs < 0 || c.SnapshotIntervalMs < 0 || c.HeartbeatIntervalMs < 0 || c.PeerTTLMs < 0:
		return fmt.Errorf("sync: batch_interval_ms, snapshot_interval_ms, heartbeat_interval_ms and peer_ttl_ms must be >= 0")
	case math.IsNaN(c.TurnStepMs) || c.TurnStepMs < 0 || c.TurnStepMs > 1000:
		return fmt.Errorf("sync.turn_step_ms: %v out of range (0 to 1000)", c.TurnStepMs)
	case c.MaxPeerInFlight < 0 || c.MaxPeerPrefillTokens < 0:
		return fmt.Errorf("sync: max_peer_inflight and max_peer_prefill_tokens must be >= 0 (0: the default)")
	case (c.NATS.TLS.Cert == "") != (c.NATS.TLS.Key == ""):
		return fmt.Errorf("sync.nats.tls: cert and key go together")
	}
	n := 0
	for _, set := range []bool{c.NATS.CredsFile != "", c.NATS.User != "" || c.NATS.Password != "", c.NATS.Token != "", c.NATS.NkeyFile != ""} {
		if set {
			n++
		}
	}
	if n > 1 {
		return fmt.Errorf("sync.nats: creds_file, user/password, token and nkey_file are exclusive")
	}
	return c.WarmStart.validate()
}

// HealthConfig tunes endpoint ejection.
type HealthConfig struct {
	// ConsecutiveErrors upstream failures (5xx, 408, connect failure) in a
	// row eject an endpoint for BaseEjectionSecs, doubling per repeat up to
	// MaxEjectionSecs; < 0 turns passive ejection off.
	ConsecutiveErrors int     `json:"consecutive_errors"`
	BaseEjectionSecs  float64 `json:"base_ejection_secs"`
	MaxEjectionSecs   float64 `json:"max_ejection_secs"`
	// ScrapeFailures failed /metrics scrapes in a row eject an endpoint
	// until a scrape succeeds; < 0 turns active ejection off.
	ScrapeFailures int `json:"scrape_failures"`
	// Disabled turns ejection off entirely.
	Disabled bool `json:"disabled"`
	// AdapterRetentionSecs keeps a LoRA adapter a worker reported (in
	// vllm:lora_requests_info) routable this long after its last report.
	AdapterRetentionSecs float64 `json:"adapter_retention_secs"`
}

// DiscoveryConfig selects where the endpoints come from. At most one of
// File and Etcd is set, and then the static endpoints list is empty.
type DiscoveryConfig struct {
	// File is a YAML/JSON file of endpoint records, reloaded on change.
	File *FileDiscoveryConfig `json:"file,omitempty"`
	// Etcd watches endpoint records under <prefix>/<pool>/endpoints/.
	Etcd *etcd.Config `json:"etcd,omitempty"`
	// Kube watches an InferencePool and its Pods (or, without a pool, a
	// Pod selector) in Kubernetes.
	Kube *KubeDiscoveryConfig `json:"kube,omitempty"`
	// EDS serves the endpoint set to Envoy as its workers cluster.
	EDS *EDSConfig `json:"eds,omitempty"`
	// DNS paces and bounds the resolution of endpoint host names.
	DNS *DNSConfig `json:"dns,omitempty"`
	// AllowLinkLocal accepts endpoints at link-local addresses
	// (169.254.0.0/16, fe80::/10, where clouds serve instance metadata and
	// credentials; --discovery-allow-link-local). Without it a static list
	// naming one is refused and discovered ones are dropped.
	AllowLinkLocal bool `json:"allow_link_local,omitempty"`
}

// DNSConfig is routing/discovery/dns's configuration; zero fields take its
// defaults (refresh 5 s, as Envoy's dns_refresh_rate; timeout 5 s; 64
// addresses per name).
type DNSConfig struct {
	// RefreshSecs is how often names are resolved again (--dns-refresh
	// wins).
	RefreshSecs float64 `json:"refresh_secs"`
	// TimeoutSecs bounds one lookup.
	TimeoutSecs float64 `json:"timeout_secs"`
	// MaxAddresses is the most addresses kept per name.
	MaxAddresses int `json:"max_addresses"`
}

// FileDiscoveryConfig is the file source.
type FileDiscoveryConfig struct {
	Path         string  `json:"path"`
	IntervalSecs float64 `json:"interval_secs"`
}

// KubeDiscoveryConfig is the Kubernetes source (routing/discovery/kube):
// Pool, or Selector and TargetPorts (standalone mode).
type KubeDiscoveryConfig struct {
	Pool        string            `json:"pool"`
	Namespace   string            `json:"namespace"`
	Selector    map[string]string `json:"selector"`
	TargetPorts []int             `json:"target_ports"`
	// Kubeconfig is the client configuration file (--kubeconfig wins;
	// empty: in-cluster).
	Kubeconfig string `json:"kubeconfig"`
}

// EDSConfig is the EDS (xDS) server.
type EDSConfig struct {
	// Addr is the xDS gRPC listen address (e.g. 127.0.0.1:18000).
	Addr string `json:"addr"`
	// Cluster is the workers cluster's EDS service name.
	Cluster string `json:"cluster"`
}

// ModelConfig is one served model's settings.
type ModelConfig struct {
	Tokenizer string `json:"tokenizer"`
}

// TokenizerConfig tunes tokenization.
type TokenizerConfig struct {
	// CacheBytes bounds each tokenizer's prefix cache (< 0: off).
	CacheBytes int64 `json:"cache_bytes"`
	// TimeoutSecs bounds one request's tokenization (--tokenizer-timeout).
	TimeoutSecs float64 `json:"timeout_secs"`
}

// RouterConfig mirrors Dynamo's --router-* flags.
type RouterConfig struct {
	BlockSize            int     `json:"block_size"`
	KVOverlapScoreWeight float64 `json:"kv_overlap_score_weight"`
	Temperature          float64 `json:"temperature"`
	KVEvents             bool    `json:"kv_events"`
	TTLSecs              float64 `json:"ttl_secs"`
	MaxTreeSize          int     `json:"max_tree_size"`
	PruneTargetRatio     float64 `json:"prune_target_ratio"`
	QueueThreshold       float64 `json:"queue_threshold"`
	QueuePolicy          string  `json:"queue_policy"`
	QueueMaxWaitSecs     float64 `json:"queue_max_wait_secs"`
	TrackActiveBlocks    bool    `json:"track_active_blocks"`
	// StaleRequestSecs releases decisions whose outcome never came.
	StaleRequestSecs float64 `json:"stale_request_secs"`
	// MaxEventBlocksPerWorker caps one worker's (rank's) event-fed index
	// blocks; beyond it, events are refused and the view is approximate.
	MaxEventBlocksPerWorker int `json:"max_event_blocks_per_worker"`
	// TierWeights price a cached block by its KV tier (GPU, host memory,
	// disk) for the kv and weighted policies; see routing.TierWeights.
	TierWeights routing.TierWeights `json:"tier_weights"`
	// KVCacheBlocks is a worker's GPU cache in blocks (per rank) for the
	// workers that do not report vllm:cache_config_info's
	// num_gpu_blocks: an untrusted KV view is trusted again once the
	// worker has stored that many blocks since (routing/kvevents
	// warm.go); 0: only the scraped size.
	KVCacheBlocks int `json:"kv_cache_blocks,omitempty"`
	// SessionHeader names the request headers that carry the session id
	// (the prefix id hint), the first present winning (a name or a list;
	// --session-header); default x-prefix-id. See hints.SessionHeaders.
	SessionHeader HeaderNames `json:"session_header"`
	// ClientPriority is what becomes of the priority a client gives itself
	// (x-request-priority, nvext.agent_hints priority and
	// latency_sensitivity) against its InferenceObjective's: cap (default),
	// allow or ignore (--client-priority; hints.ResolvePriority).
	ClientPriority string `json:"client_priority"`
	// ClientPriorityMax is cap mode's ceiling for a client's priority when
	// no InferenceObjective applies, in [0, 1000] (--client-priority-max;
	// default 1000: no ceiling beyond the hint bound).
	ClientPriorityMax int `json:"client_priority_max"`
}

// PriorityPolicy is the client-priority policy of router.client_priority
// and router.client_priority_max (validated by Validate).
func (r RouterConfig) PriorityPolicy() hints.PriorityPolicy {
	mode, _ := hints.ParseClientPriority(r.ClientPriority)
	return hints.PriorityPolicy{Mode: mode, Max: r.ClientPriorityMax, HasMax: true}
}

// clientPriorityErr checks router.client_priority and
// router.client_priority_max; the error names the key.
func clientPriorityErr(r RouterConfig) error {
	if _, err := hints.ParseClientPriority(r.ClientPriority); err != nil || r.ClientPriority == "" {
		return fmt.Errorf("router.client_priority: want allow, cap or ignore, got %q", r.ClientPriority)
	}
	if r.ClientPriorityMax < 0 || r.ClientPriorityMax > hints.MaxPriority {
		return fmt.Errorf("router.client_priority_max: must be in [0, %d], got %d", hints.MaxPriority, r.ClientPriorityMax)
	}
	return nil
}

// HeaderNames is a list of header names, written in YAML as one name or a
// list, and as a flag as comma-separated names.
type HeaderNames []string

// UnmarshalJSON accepts a string or a list of strings.
func (h *HeaderNames) UnmarshalJSON(b []byte) error {
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*h = HeaderNames{one}
		return nil
	}
	var list []string
	if err := json.Unmarshal(b, &list); err != nil {
		// A type error, so that the config error names the key and line.
		got := "object"
		switch t := bytes.TrimSpace(b); {
		case len(t) > 0 && (t[0] == '-' || t[0] >= '0' && t[0] <= '9'):
			got = "number"
		case bytes.Equal(t, []byte("true")) || bytes.Equal(t, []byte("false")):
			got = "bool"
		case bytes.Equal(t, []byte("null")):
			got = "null"
		case len(t) > 0 && t[0] == '[':
			got = "a list of non-strings"
		}
		return &json.UnmarshalTypeError{Value: got, Type: reflect.TypeFor[[]string]()}
	}
	*h = list
	return nil
}

// String implements flag.Value.
func (h *HeaderNames) String() string {
	if h == nil {
		return ""
	}
	return strings.Join(*h, ",")
}

// Set implements flag.Value: comma-separated names, replacing the list.
func (h *HeaderNames) Set(v string) error {
	names := strings.Split(v, ",")
	for i := range names {
		names[i] = strings.TrimSpace(names[i])
	}
	*h = names
	return nil
}

// PrefixStateConfig bounds the prefix state.
type PrefixStateConfig struct {
	TTLSecs    float64 `json:"ttl_secs"`
	MaxEntries int     `json:"max_entries"`
}

// DecisionLogConfig configures the decision log.
type DecisionLogConfig struct {
	Path     string `json:"path"`
	Format   string `json:"format"`
	MaxBytes int64  `json:"max_bytes"`
}

// DefaultFileConfig is what an absent config file means.
func DefaultFileConfig() FileConfig {
	return FileConfig{
		Router: RouterConfig{
			BlockSize: routing.DefaultBlockSize, KVOverlapScoreWeight: 1, KVEvents: true, TTLSecs: 120,
			MaxTreeSize: 1 << 20, PruneTargetRatio: 0.8, MaxEventBlocksPerWorker: kvindex.DefaultMaxEventEntries,
			QueuePolicy: string(admission.PolicyFCFS), QueueMaxWaitSecs: 10,
			TrackActiveBlocks: true, StaleRequestSecs: 300,
			TierWeights:    routing.DefaultTierWeights(),
			SessionHeader:  hints.DefaultSessionHeaders(),
			ClientPriority: string(hints.ClientPriorityCap), ClientPriorityMax: hints.MaxPriority,
		},
		Config:      policy.DefaultConfig(),
		PD:          pd.DefaultConfig(),
		PrefixState: PrefixStateConfig{TTLSecs: prefixstate.DefaultTTL.Seconds(), MaxEntries: prefixstate.DefaultMaxEntries},
		DecisionLog: DecisionLogConfig{Format: "csv"},
		Tokenizer:   TokenizerConfig{CacheBytes: 64 << 20, TimeoutSecs: 5},
		Health: HealthConfig{ConsecutiveErrors: engine.DefaultConsecutiveErrors, BaseEjectionSecs: engine.DefaultBaseEjection.Seconds(),
			MaxEjectionSecs: engine.DefaultMaxEjection.Seconds(), ScrapeFailures: engine.DefaultScrapeFailures,
			AdapterRetentionSecs: engine.DefaultAdapterRetention.Seconds()},
	}
}

// LoadConfig reads, strictly decodes and validates a config file. Errors
// wrap [ErrConfig] and name the file, the line and the key path.
func LoadConfig(path string) (*FileConfig, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	defer f.Close()
	raw, err := io.ReadAll(io.LimitReader(f, MaxConfigBytes+1))
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrConfig, path, err)
	}
	return parseConfig(path, raw)
}

// ParseConfig strictly decodes config YAML over the defaults and validates
// it (errors name the file "config").
func ParseConfig(raw []byte) (*FileConfig, error) {
	return parseConfig("config", raw)
}

func parseConfig(file string, raw []byte) (*FileConfig, error) {
	c := DefaultFileConfig()
	root, err := decodeConfig(file, raw, &c)
	if err != nil {
		return nil, err
	}
	if err := c.Validate(); err != nil {
		return nil, locate(file, root, err)
	}
	return &c, nil
}

// Validate checks every section, naming the bad field.
func (c *FileConfig) Validate() error {
	if len(c.Endpoints) > 0 {
		// Addresses may be host names (resolved by routing/discovery/dns).
		if err := discovery.CheckSet(c.Endpoints); err != nil {
			return fmt.Errorf("endpoints: %w", err)
		}
	}
	r := c.Router
	switch {
	case r.BlockSize <= 0:
		return fmt.Errorf("router.block_size: must be > 0, got %d", r.BlockSize)
	case !(r.KVOverlapScoreWeight >= 0):
		return fmt.Errorf("router.kv_overlap_score_weight: must be >= 0, got %v", r.KVOverlapScoreWeight)
	case !(r.Temperature >= 0):
		return fmt.Errorf("router.temperature: must be >= 0, got %v", r.Temperature)
	case !(r.TTLSecs > 0):
		return fmt.Errorf("router.ttl_secs: must be > 0, got %v", r.TTLSecs)
	case r.MaxTreeSize <= 0:
		return fmt.Errorf("router.max_tree_size: must be > 0, got %d", r.MaxTreeSize)
	case !(r.PruneTargetRatio > 0 && r.PruneTargetRatio <= 1):
		return fmt.Errorf("router.prune_target_ratio: must be in (0, 1], got %v", r.PruneTargetRatio)
	case r.MaxEventBlocksPerWorker <= 0:
		return fmt.Errorf("router.max_event_blocks_per_worker: must be > 0, got %d", r.MaxEventBlocksPerWorker)
	case r.KVCacheBlocks < 0:
		return fmt.Errorf("router.kv_cache_blocks: must be >= 0, got %d", r.KVCacheBlocks)
	case !(r.QueueThreshold >= 0):
		return fmt.Errorf("router.queue_threshold: must be >= 0, got %v", r.QueueThreshold)
	case r.QueuePolicy != string(admission.PolicyFCFS) && r.QueuePolicy != string(admission.PolicyWSPT):
		return fmt.Errorf("router.queue_policy: want fcfs or wspt, got %q", r.QueuePolicy)
	case !(r.QueueMaxWaitSecs > 0):
		return fmt.Errorf("router.queue_max_wait_secs: must be > 0, got %v", r.QueueMaxWaitSecs)
	case !(r.StaleRequestSecs > 0):
		return fmt.Errorf("router.stale_request_secs: must be > 0, got %v", r.StaleRequestSecs)
	case r.TierWeights.Validate() != nil:
		return fmt.Errorf("router.%w", r.TierWeights.Validate())
	case sessionHeaderErr(r.SessionHeader) != nil:
		return fmt.Errorf("router.session_header: %w", sessionHeaderErr(r.SessionHeader))
	case clientPriorityErr(r) != nil:
		return clientPriorityErr(r)
	case !(c.PrefixState.TTLSecs > 0):
		return fmt.Errorf("prefix_state.ttl_secs: must be > 0, got %v", c.PrefixState.TTLSecs)
	case c.PrefixState.MaxEntries <= 0:
		return fmt.Errorf("prefix_state.max_entries: must be > 0, got %d", c.PrefixState.MaxEntries)
	case c.DecisionLog.Format != "csv" && c.DecisionLog.Format != "jsonl":
		return fmt.Errorf("decision_log.format: want csv or jsonl, got %q", c.DecisionLog.Format)
	case c.DecisionLog.MaxBytes < 0:
		return fmt.Errorf("decision_log.max_bytes: must be >= 0")
	case !(c.Health.BaseEjectionSecs > 0) || !(c.Health.MaxEjectionSecs >= c.Health.BaseEjectionSecs):
		return fmt.Errorf("health: base_ejection_secs must be > 0 and max_ejection_secs >= it")
	case !(c.Health.AdapterRetentionSecs >= 0):
		return fmt.Errorf("health.adapter_retention_secs: must be >= 0")
	case !(c.Tokenizer.TimeoutSecs > 0):
		return fmt.Errorf("tokenizer.timeout_secs: must be > 0, got %v", c.Tokenizer.TimeoutSecs)
	}
	if err := c.Discovery.validate(len(c.Endpoints) > 0); err != nil {
		return err
	}
	if err := c.Sync.validate(); err != nil {
		return err
	}
	if err := c.PD.Validate(); err != nil {
		return err
	}
	for name, m := range c.Models {
		if m.Tokenizer == "" {
			return fmt.Errorf("models[%q].tokenizer: must not be empty", name)
		}
	}
	return c.Config.Validate()
}

func (d *DiscoveryConfig) validate(static bool) error {
	var sources []string // the keys that set a source
	if static {
		sources = append(sources, "endpoints")
	}
	if d.File != nil {
		sources = append(sources, "discovery.file")
		if d.File.Path == "" {
			return fmt.Errorf("discovery.file.path: must not be empty")
		}
		if d.File.IntervalSecs < 0 {
			return fmt.Errorf("discovery.file.interval_secs: must be >= 0")
		}
	}
	if d.Etcd != nil {
		sources = append(sources, "discovery.etcd")
		d.Etcd.Defaults()
		if err := d.Etcd.Validate(); err != nil {
			return fmt.Errorf("discovery.etcd: %w", err)
		}
	}
	if k := d.Kube; k != nil {
		sources = append(sources, "discovery.kube")
		if k.Pool == "" && len(k.Selector) == 0 {
			return fmt.Errorf("discovery.kube: give pool, or selector and target_ports")
		}
	}
	if len(sources) > 1 {
		return &sourcesError{keys: sources}
	}
	if n := d.DNS; n != nil && (!(n.RefreshSecs >= 0) || !(n.TimeoutSecs >= 0) || n.MaxAddresses < 0 || n.MaxAddresses > routing.MaxEndpoints) {
		return fmt.Errorf("discovery.dns: refresh_secs and timeout_secs must be >= 0, max_addresses in 0..%d", routing.MaxEndpoints)
	}
	if d.EDS != nil && d.EDS.Addr == "" {
		return fmt.Errorf("discovery.eds.addr: must not be empty")
	}
	return nil
}

// sourcesError is a file that sets more than one source of endpoints;
// [locate] points at the key that comes second in the file.
type sourcesError struct{ keys []string }

const oneSource = "give one source of endpoints (endpoints, discovery.file, discovery.etcd or discovery.kube)"

func (e *sourcesError) Error() string {
	return fmt.Sprintf("%s: %s, not %s", e.keys[len(e.keys)-1], oneSource, strings.Join(e.keys, " and "))
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// engineOptions turns the file's router section into engine options.
func (c *FileConfig) engineOptions(fallbacks int) engine.Options {
	r := c.Router
	return engine.Options{
		Fallbacks:                fallbacks,
		PassThroughUnknownModels: c.PassThroughUnknownModels,
		BlockSize:                r.BlockSize,
		DisableActiveBlocks:      !r.TrackActiveBlocks,
		StaleAfter:               secs(r.StaleRequestSecs),
		Index: kvindex.Options{
			TTL:              secs(r.TTLSecs),
			MaxEntries:       r.MaxTreeSize,
			PruneTargetRatio: r.PruneTargetRatio,
			MaxEventEntries:  r.MaxEventBlocksPerWorker,
		},
		Ejection: engine.EjectionOptions{
			ConsecutiveErrors: c.Health.ConsecutiveErrors, BaseEjection: secs(c.Health.BaseEjectionSecs),
			MaxEjection: secs(c.Health.MaxEjectionSecs), ScrapeFailures: c.Health.ScrapeFailures, Disabled: c.Health.Disabled,
		},
		AdapterRetention: secs(c.Health.AdapterRetentionSecs),
		TierWeights:      r.TierWeights,
		Admission: admission.Config{
			Threshold: r.QueueThreshold,
			Policy:    admission.Policy(r.QueuePolicy),
			MaxWait:   secs(r.QueueMaxWaitSecs),
		},
	}
}

// sessionHeaderErr checks router.session_header (hints.SessionHeaders).
func sessionHeaderErr(names HeaderNames) error {
	if len(names) == 0 {
		return fmt.Errorf("%w: no name (the default is %s)", hints.ErrSessionHeader, hints.HeaderPrefixID)
	}
	_, err := hints.SessionHeaders(names)
	return err
}
