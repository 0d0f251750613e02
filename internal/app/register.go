package app

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"time"

	"sigs.k8s.io/yaml"

	"github.com/kvbandit/kvbandit/internal/cmdline"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/etcd"
)

// registerUsage is the synopsis printed with usage errors.
const registerUsage = "kvbandit register --etcd-endpoints HOST:PORT[,...] --address IP:PORT [--model M ...] [flags]"

// listFlag is a repeatable flag whose values may also be comma lists.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }

func (l *listFlag) Set(v string) error {
	for f := range strings.SplitSeq(v, ",") {
		if f = strings.TrimSpace(f); f != "" {
			*l = append(*l, f)
		}
	}
	return nil
}

// labelFlag is a repeatable k=v flag.
type labelFlag map[string]string

func (m labelFlag) String() string {
	var b strings.Builder
	for k, v := range m {
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k + "=" + v)
	}
	return b.String()
}

func (m labelFlag) Set(v string) error {
	k, val, ok := strings.Cut(v, "=")
	if !ok || strings.TrimSpace(k) == "" {
		return fmt.Errorf("label %q: want key=value", v)
	}
	m[strings.TrimSpace(k)] = val
	return nil
}

// registerOptions are `kvbandit register`'s flags.
type registerOptions struct {
	etcd           etcd.Config
	etcdEndpoints  string
	id             string
	address        string
	healthURL      string
	healthInterval time.Duration
	healthTimeout  time.Duration
	ttl            time.Duration
	recordFile     string

	models, adapters                       listFlag
	labels                                 labelFlag
	engine, metricsURL, kvEvents, kvReplay string
	kvFirstSeq                             uint64
	blockSize, maxBatched, dpSize          int
	weight                                 float64
	kvBind                                 bool
	role                                   routing.Role
}

func (o *registerOptions) addFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.etcdEndpoints, "etcd-endpoints", "", "etcd servers, comma-separated host:port or URLs (required)")
	fs.StringVar(&o.etcd.Prefix, "etcd-prefix", etcd.DefaultPrefix, "root of kvbandit's keys in etcd")
	fs.StringVar(&o.etcd.Pool, "etcd-pool", etcd.DefaultPool, "worker pool: the record goes to <prefix>/<pool>/endpoints/<id>")
	fs.StringVar(&o.etcd.Username, "etcd-username", "", "etcd user")
	fs.StringVar(&o.etcd.Password, "etcd-password", "", "etcd password (default $KVBANDIT_ETCD_PASSWORD)")
	fs.StringVar(&o.etcd.TLS.CA, "etcd-ca", "", "PEM file of the CAs of the etcd servers (turns TLS on)")
	fs.StringVar(&o.etcd.TLS.Cert, "etcd-cert", "", "PEM client certificate for etcd (with --etcd-key)")
	fs.StringVar(&o.etcd.TLS.Key, "etcd-key", "", "PEM client key for etcd")
	fs.StringVar(&o.id, "id", "", "record id, the last element of the key (default: the host name)")
	fs.StringVar(&o.address, "address", "", "the worker's ip:port (or name:port, resolved by the router into one endpoint per address) as the router reaches it (required unless --record has it)")
	fs.StringVar(&o.healthURL, "health-url", "", "URL that answers 200 when the worker is ready (default http://<address>/health)")
	fs.DurationVar(&o.healthInterval, "health-interval", time.Second, "how often to poll --health-url while waiting")
	fs.DurationVar(&o.healthTimeout, "health-timeout", 10*time.Minute, "how long to wait for the worker to become healthy before giving up (0: forever)")
	fs.DurationVar(&o.ttl, "ttl", etcd.DefaultTTL, "lease TTL: the record disappears this long after kvbandit register dies")
	fs.StringVar(&o.recordFile, "record", "", "JSON or YAML endpoint record to start from; the record flags (--model, --engine, ...) override its fields")
	fs.Var(&o.models, "model", "model served (repeatable or comma-separated; none: every model)")
	fs.Var(&o.adapters, "adapters", "LoRA adapters served (repeatable or comma-separated)")
	fs.StringVar(&o.engine, "engine", "", "worker engine: vllm or sglang")
	fs.IntVar(&o.blockSize, "block-size", 0, "KV block size in tokens (0: the router's default)")
	fs.IntVar(&o.maxBatched, "max-num-batched-tokens", 0, "prefill tokens per step (0: the router's default)")
	fs.IntVar(&o.dpSize, "data-parallel-size", 0, "data-parallel ranks (0 or 1: one)")
	fs.Float64Var(&o.weight, "weight", 0, "share for weighted policies (0: 1)")
	fs.StringVar(&o.metricsURL, "metrics-url", "", "Prometheus endpoint (default http://<address>/metrics)")
	fs.StringVar(&o.kvEvents, "kv-events", "", "KV-events ZMQ address, tcp://host:port")
	fs.BoolVar(&o.kvBind, "kv-events-bind", false, "the router binds --kv-events and the worker connects (llm-d-inference-sim)")
	fs.StringVar(&o.kvReplay, "kv-events-replay", "", "KV-events replay address (vLLM replay_endpoint)")
	fs.Uint64Var(&o.kvFirstSeq, "kv-events-first-seq", 0, "sequence number of the worker's first KV-event message (vLLM 0, llm-d-inference-sim 1)")
	fs.Var(o.labels, "label", "discovery label key=value (repeatable)")
	fs.TextVar(&o.role, "role", routing.RoleBoth, "prefill/decode role: prefill, decode or both (prefill-decode)")
}

// record builds the endpoint record: the --record file, then the flags
// that were set on the command line.
func (o *registerOptions) record(set map[string]bool) (routing.Endpoint, error) {
	var ep routing.Endpoint
	if o.recordFile != "" {
		data, err := os.ReadFile(o.recordFile)
		if err != nil {
			return ep, fmt.Errorf("--record: %w", err)
		}
		if err := yaml.UnmarshalStrict(data, &ep); err != nil {
			return ep, fmt.Errorf("--record %s: %w", o.recordFile, err)
		}
	}
	if set["address"] {
		ep.Key = routing.EndpointKey(o.address)
	}
	if set["model"] {
		ep.Models = toModels(o.models)
	}
	if set["adapters"] {
		ep.Adapters = toModels(o.adapters)
	}
	if set["engine"] {
		ep.Engine = o.engine
	}
	if set["block-size"] {
		ep.BlockSize = o.blockSize
	}
	if set["max-num-batched-tokens"] {
		ep.MaxBatchedTokens = o.maxBatched
	}
	if set["data-parallel-size"] {
		ep.DataParallelSize = o.dpSize
	}
	if set["weight"] {
		ep.Weight = o.weight
	}
	if set["metrics-url"] {
		ep.MetricsURL = o.metricsURL
	}
	if set["kv-events"] {
		ep.KVEvents = o.kvEvents
	}
	if set["kv-events-bind"] {
		ep.KVEventsBind = o.kvBind
	}
	if set["kv-events-replay"] {
		ep.KVEventsReplay = o.kvReplay
	}
	if set["kv-events-first-seq"] {
		ep.KVEventsFirstSeq = o.kvFirstSeq
	}
	if set["role"] {
		ep.Role = o.role
	}
	if len(o.labels) > 0 {
		if ep.Labels == nil {
			ep.Labels = map[string]string{}
		}
		for k, v := range o.labels {
			ep.Labels[k] = v
		}
	}
	if err := discovery.CheckRecord(&ep); err != nil {
		return ep, fmt.Errorf("endpoint record: %w", err)
	}
	return ep, nil
}

func toModels(l listFlag) []routing.ModelName {
	out := make([]routing.ModelName, len(l))
	for i, m := range l {
		out[i] = routing.ModelName(m)
	}
	return out
}

// runRegister is `kvbandit register`: wait for the worker to be healthy,
// then keep its endpoint record in etcd under a lease until ctx ends
// (SIGTERM), and delete it on the way out.
func runRegister(ctx context.Context, args []string, _, stderr io.Writer) error {
	fs := flag.NewFlagSet("register", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o := &registerOptions{labels: labelFlag{}}
	o.addFlags(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: %s\n\nWait until the worker answers 200 on --health-url, then keep its endpoint record at\n<prefix>/<pool>/endpoints/<id> in etcd under a lease until stopped (SIGTERM), and delete it.\n\nFlags:\n", registerUsage)
		fs.PrintDefaults()
	}
	if err := cmdline.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %q (%s)", ErrUsage, fs.Args(), registerUsage)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	for e := range strings.SplitSeq(o.etcdEndpoints, ",") {
		if e = strings.TrimSpace(e); e != "" {
			o.etcd.Endpoints = append(o.etcd.Endpoints, e)
		}
	}
	if len(o.etcd.Endpoints) == 0 {
		return fmt.Errorf("%w: --etcd-endpoints is required (%s)", ErrUsage, registerUsage)
	}
	if o.etcd.Password == "" {
		o.etcd.Password = os.Getenv("KVBANDIT_ETCD_PASSWORD")
	}
	if o.etcd.Prefix == "" || o.etcd.Pool == "" {
		return fmt.Errorf("%w: --etcd-prefix and --etcd-pool must not be empty", ErrUsage)
	}
	o.etcd.Defaults()
	if err := o.etcd.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	ep, err := o.record(set)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	if o.id == "" {
		if o.id, err = os.Hostname(); err != nil || o.id == "" {
			return fmt.Errorf("%w: --id: no host name to default to (%v)", ErrUsage, err)
		}
	}
	if strings.Contains(o.id, "/") {
		return fmt.Errorf("%w: --id %q must not contain /", ErrUsage, o.id)
	}
	switch {
	case o.ttl <= 0:
		return fmt.Errorf("%w: --ttl must be positive", ErrUsage)
	case o.healthInterval <= 0:
		return fmt.Errorf("%w: --health-interval must be positive", ErrUsage)
	case o.healthTimeout < 0:
		return fmt.Errorf("%w: --health-timeout must not be negative", ErrUsage)
	}
	if o.healthURL == "" {
		o.healthURL = "http://" + string(ep.Key) + "/health"
	}

	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo})).With("id", o.id, "address", ep.Key)
	reg, err := etcd.NewRegistrar(o.etcd, etcd.Registration{ID: o.id, Endpoint: ep, TTL: o.ttl}, etcd.Deps{Logger: log})
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	log.Info("waiting for the worker to be healthy", "health_url", o.healthURL)
	if err := waitHealthy(ctx, o.healthURL, o.healthInterval, o.healthTimeout); err != nil {
		if ctx.Err() != nil {
			return nil // stopped before the worker came up: nothing to undo
		}
		return err
	}
	log.Info("worker healthy: registering", "key", reg.Key())
	return reg.Run(ctx)
}

// waitHealthy polls url until it answers 200, ctx ends, or timeout (0:
// none) passes.
func waitHealthy(ctx context.Context, url string, interval, timeout time.Duration) error {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr, Timeout: max(interval, time.Second)}
	t := time.NewTicker(interval)
	defer t.Stop()
	var last error
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return fmt.Errorf("%w: --health-url: %w", ErrUsage, err)
		}
		resp, err := hc.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<16))
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("status %s", resp.Status)
		}
		last = err
		select {
		case <-ctx.Done():
			return fmt.Errorf("worker not healthy at %s after %v: %w", url, timeout, last)
		case <-t.C:
		}
	}
}
