package app

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/sim"
	"github.com/kvbandit/kvbandit/routing/sim/trace"
	"github.com/kvbandit/kvbandit/routing/slo"
)

// benchPolicies is the default --policy list: every baseline, then ours.
const benchPolicies = "random,round_robin,least_loaded,weighted,kv,thompson,kvbandit"

// defaultMooncakeRateScale puts the Mooncake conversation trace on 8
// default workers in the loaded regime: round_robin's TTFT p90 above 2 s
// (measured, see docs/bench.md).
const defaultMooncakeRateScale = 6

// Worker model defaults (Dynamo's mocker), for the finite-cache bound.
const (
	defaultKVBlocks  = 16384
	defaultBlockSize = 64
)

// benchOptions are the flags of `kvbandit bench`.
type benchOptions struct {
	trace, format, policies, speeds, jsonOut, plotOut string
	config                                            string
	workers, routerBlock, limit, kvBlocks, blockSize  int
	rateScale                                         float64
	seed                                              int64
	kvEvents, strict, quiet, progress                 bool
	agentic                                           trace.AgenticConfig
	replicas                                          int
	sync                                              string
	syncDelay, scrapeInterval                         time.Duration
	objective                                         objectiveOptions
	speedSchedule                                     string
	tier                                              benchTier
	pd                                                benchPD
}

func (o *benchOptions) addFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.trace, "trace", "", "trace file (required unless --format agentic)")
	fs.StringVar(&o.config, "config", "", "serve's YAML config file: its policy sections (kv, kvbandit, thompson, weighted) parameterise the policies")
	fs.StringVar(&o.format, "format", "mooncake", "trace format: mooncake, azure or agentic (generated, no file)")
	fs.IntVar(&o.workers, "workers", 8, "simulated workers")
	fs.StringVar(&o.policies, "policy", benchPolicies, "comma-separated policies to compare (unknown names are skipped with a warning)")
	fs.StringVar(&o.speeds, "speed-factors", "", "comma-separated speed factor per worker, > 0 (default all 1; 0.5 = half speed)")
	fs.StringVar(&o.speedSchedule, "speed-schedule", "", `speed changes "T:W:S,...": at virtual time T (duration or seconds) worker W (0-based) runs at speed S (0 stops it); e.g. "300s:3:0.5,600s:3:1"`)
	fs.Float64Var(&o.rateScale, "rate-scale", 0, fmt.Sprintf("divide arrival times by this (0: %d for mooncake, 1 for azure)", defaultMooncakeRateScale))
	fs.IntVar(&o.routerBlock, "router-block-size", 0, "the router's block size in tokens (0: the workers' block size)")
	fs.IntVar(&o.kvBlocks, "kv-blocks", defaultKVBlocks, "KV cache blocks per worker")
	fs.IntVar(&o.blockSize, "block-size", defaultBlockSize, "KV block size of the workers, in tokens")
	fs.Int64Var(&o.seed, "seed", 1, "seed for the policies and the agentic generator")
	fs.StringVar(&o.jsonOut, "json", "", "write the results as JSON to this file")
	fs.StringVar(&o.plotOut, "plot", "", "write the TTFT CDF per policy to this PNG (or .svg, .pdf), and the waiting requests per worker under the policy with the best TTFT p90 to <name>-queue.png")
	fs.IntVar(&o.limit, "limit", 0, "replay only the first N requests (0: all)")
	fs.BoolVar(&o.kvEvents, "kv-events", true, "workers publish KV events into the engine's index (false: the router's approximate index only)")
	fs.BoolVar(&o.strict, "strict", false, "a malformed trace line is fatal (default: skipped, counted and reported)")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress line on stderr")
	fs.BoolVar(&o.progress, "progress", false, "show progress on stderr even when it is not a terminal (a line every 5s)")
	fs.IntVar(&o.replicas, "replicas", 1, fmt.Sprintf("pickers: independent routing engines in front of the fleet, each request entering through one at random (1 to %d)", sim.MaxReplicas))
	fs.StringVar(&o.sync, "sync", "none", "what the replicas share: none, or nats (a model of serve --sync-nats: every decision's start, first token, end and outcome applied on the other replicas after --sync-delay)")
	fs.DurationVar(&o.syncDelay, "sync-delay", sim.DefaultSyncDelay, "--sync nats: publish-to-apply latency, in virtual time")
	fs.DurationVar(&o.scrapeInterval, "scrape-interval", 0, "how often the workers' load reaches the engines (serve scrapes every 1s); 0: after every change")
	o.objective.addFlags(fs)
	o.tier.addFlags(fs)
	o.pd.addFlags(fs)
	a := &o.agentic
	fs.IntVar(&a.Sessions, "sessions", 800, "agentic: number of sessions")
	fs.Float64Var(&a.SessionRate, "session-rate", 8, "agentic: session arrivals per second (Poisson)")
	fs.IntVar(&a.Turns, "turns", 8, "agentic: requests per session")
	fs.DurationVar(&a.ThinkTime, "think-time", 10*time.Second, "agentic: time between two turns' arrivals")
	fs.IntVar(&a.SystemPromptLen, "system-prompt-len", 2048, "agentic: shared system prompt tokens (negative: none)")
	fs.IntVar(&a.SystemPrompts, "system-prompts", 4, "agentic: distinct system prompts")
	fs.IntVar(&a.Tenants, "tenants", 1, "agentic: tenants (sessions spread round-robin)")
	fs.IntVar(&a.InputLen, "input-len", 1024, "agentic: mean new user tokens per turn")
	fs.IntVar(&a.OutputLen, "output-len", 256, "agentic: mean output tokens per turn")
}

// validate checks the flags and returns the speed factors.
func (o *benchOptions) validate() ([]float64, error) {
	if o.workers <= 0 {
		return nil, fmt.Errorf("--workers %d: need at least one worker", o.workers)
	}
	switch o.format {
	case "mooncake", "azure":
		if o.trace == "" {
			return nil, fmt.Errorf("--trace is required with --format %s", o.format)
		}
	case "agentic":
	default:
		return nil, fmt.Errorf("--format %q: want mooncake, azure or agentic", o.format)
	}
	if o.rateScale < 0 || math.IsNaN(o.rateScale) || math.IsInf(o.rateScale, 0) {
		return nil, fmt.Errorf("--rate-scale %v: must be > 0", o.rateScale)
	}
	if o.routerBlock < 0 || o.kvBlocks <= 0 || o.blockSize <= 0 || o.limit < 0 {
		return nil, errors.New("--router-block-size and --limit must be >= 0, --kv-blocks and --block-size > 0")
	}
	if o.replicas < 1 || o.replicas > sim.MaxReplicas {
		return nil, fmt.Errorf("--replicas %d: want 1 to %d", o.replicas, sim.MaxReplicas)
	}
	if _, err := sim.ParseSync(o.sync); err != nil {
		return nil, fmt.Errorf("--sync %q: want none or nats", o.sync)
	}
	if o.syncDelay < 0 || o.syncDelay > sim.MaxSyncDelay {
		return nil, fmt.Errorf("--sync-delay %v: want 0 to %v", o.syncDelay, sim.MaxSyncDelay)
	}
	if o.scrapeInterval < 0 || o.scrapeInterval > time.Hour {
		return nil, fmt.Errorf("--scrape-interval %v: want 0 to 1h", o.scrapeInterval)
	}
	if _, _, err := o.objective.validate(); err != nil {
		return nil, err
	}
	if err := o.tier.validate(); err != nil {
		return nil, err
	}
	if err := o.pd.validate(o.workers); err != nil {
		return nil, err
	}
	speeds := make([]float64, o.workers)
	for i := range speeds {
		speeds[i] = 1
	}
	if o.speeds != "" {
		parts := strings.Split(o.speeds, ",")
		if len(parts) != o.workers {
			return nil, fmt.Errorf("--speed-factors has %d values for %d workers", len(parts), o.workers)
		}
		for i, p := range parts {
			f, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
			if err != nil || !(f > 0) || math.IsInf(f, 0) {
				return nil, fmt.Errorf("--speed-factors: value %d (%q) must be a number > 0", i+1, p)
			}
			speeds[i] = f
		}
	}
	return speeds, nil
}

// runBench is `kvbandit bench`: replay a trace on a simulated fleet under
// each policy and compare.
func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o benchOptions
	o.addFlags(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: bench takes no arguments, got %q", ErrUsage, fs.Args())
	}
	speeds, err := o.validate()
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	schedule, err := parseSpeedSchedule(o.speedSchedule, o.workers)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	names := benchPolicyNames(o.policies, stderr)
	if len(names) == 0 {
		return fmt.Errorf("%w: --policy %q names no known policy (known: %s)", ErrUsage, o.policies, strings.Join(policy.Builtin().Names(), ", "))
	}
	reqs, desc, err := o.load(stderr)
	if err != nil {
		return err
	}
	if err := o.objective.apply(reqs, o.seed); err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	workers := make([]sim.WorkerConfig, o.workers)
	for i := range workers {
		workers[i] = sim.WorkerConfig{KVBlocks: o.kvBlocks, BlockSize: o.blockSize, Speed: speeds[i]}
		o.tier.apply(&workers[i])
	}
	var policies *policy.Config
	var tierWeights routing.TierWeights // zero: the defaults
	if o.config != "" {
		c, err := LoadConfig(o.config)
		if err != nil {
			return fmt.Errorf("%w: --config: %w", ErrUsage, err)
		}
		policies, tierWeights = &c.Config, c.Router.TierWeights
	}
	bounds := trace.ComputeBounds(reqs, o.blockSize, o.workers*o.kvBlocks)
	rep := benchReport{
		Trace: desc, Format: o.format, Requests: len(reqs), Workers: o.workers, SpeedFactors: speeds,
		RateScale: o.effectiveRateScale(), KVBlocks: o.kvBlocks, BlockSize: o.blockSize, RouterBlockSize: o.routerBlock,
		KVEvents: o.kvEvents, Seed: o.seed, ScrapeIntervalSec: o.scrapeInterval.Seconds(), SpeedSchedule: o.speedSchedule,
		Bounds: benchBounds{Infinite: bounds.Infinite, Finite: bounds.Finite, FiniteCapacityTokens: int64(bounds.CapacityBlocks) * int64(bounds.BlockSize), PromptTokens: bounds.PromptTokens},
	}
	if o.replicas > 1 {
		rep.Replicas, rep.Sync, rep.SyncDelaySec = o.replicas, o.sync, o.syncDelay.Seconds()
	}
	o.tier.report(&rep)
	o.pd.report(&rep)
	// What is replayed is known now: say it before the run.
	rep.printHeader(stdout)
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	sync, _ := sim.ParseSync(o.sync) // checked by validate
	runs := o.pd.runs(names, o.workers)
	labels := make([]string, len(runs))
	for i, r := range runs {
		labels[i] = r.label
	}
	prog := newBenchProgress(stderr, o.quiet, o.progress, labels, len(reqs), nil)
	prog.start()
	results, err := runPolicies(ctx, labels, func(i int, _ string) sim.Config {
		return sim.Config{
			Roles: runs[i].roles, PD: runs[i].pd, Transfer: o.pd.transfer(),
			Workers: workers, Policy: runs[i].policy, Policies: policies, RouterBlockSize: o.routerBlock, KVEvents: o.kvEvents, Seed: o.seed, Logger: logger,
			Replicas: o.replicas, Sync: sync, SyncDelay: o.syncDelay, ScrapeInterval: o.scrapeInterval, TierWeights: tierWeights,
			SLO:      slo.Config{Headroom: o.objective.headroom, Off: o.objective.off},
			Schedule: schedule,
			Progress: prog.arrivedFunc(i),
		}
	}, reqs, prog.done)
	prog.close()
	if err != nil {
		return err
	}
	for i, r := range results {
		r.Policy = labels[i]
		s := summarize(r, reqs, bounds)
		summarizePD(&s, r)
		rep.Policies = append(rep.Policies, s)
	}
	rep.printTable(stdout)
	if o.jsonOut != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(o.jsonOut, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	if o.plotOut != "" {
		if err := plotTTFT(o.plotOut, results); err != nil {
			return fmt.Errorf("plot: %w", err)
		}
		best := bestPolicy(rep.Policies)
		if err := plotQueue(queuePlotPath(o.plotOut), results[best], "best TTFT p90"); err != nil {
			return fmt.Errorf("plot: %w", err)
		}
	}
	return nil
}

// benchPolicyNames splits the --policy list and drops unknown names with a
// warning.
func benchPolicyNames(list string, stderr io.Writer) []string {
	known := policy.Builtin().Names()
	var names []string
	for _, n := range strings.Split(list, ",") {
		n = strings.TrimSpace(n)
		switch {
		case n == "":
		case !slices.Contains(known, n):
			fmt.Fprintf(stderr, "bench: skipping policy %q: not registered (known: %s)\n", n, strings.Join(known, ", "))
		case !slices.Contains(names, n):
			names = append(names, n)
		}
	}
	return names
}

func (o *benchOptions) effectiveRateScale() float64 {
	switch {
	case o.format == "agentic":
		return 1
	case o.rateScale > 0:
		return o.rateScale
	case o.format == "mooncake":
		return defaultMooncakeRateScale
	}
	return 1
}

// load reads or generates the requests and describes where they came from.
func (o *benchOptions) load(stderr io.Writer) ([]sim.Request, string, error) {
	if o.format == "agentic" {
		cfg := o.agentic
		cfg.Seed = o.seed
		reqs, err := trace.Agentic(cfg)
		if err != nil {
			return nil, "", fmt.Errorf("%w: %w", ErrUsage, err)
		}
		if o.limit > 0 && len(reqs) > o.limit {
			reqs = reqs[:o.limit]
		}
		c := cfg.Defaults()
		return reqs, fmt.Sprintf("agentic: %d sessions × %d turns at %g sessions/s, think %v, %d system prompts of %d tokens", c.Sessions, c.Turns, c.SessionRate, c.ThinkTime, c.SystemPrompts, c.SystemPromptLen), nil
	}
	f, err := os.Open(o.trace)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, "", fmt.Errorf("%w: --trace: %w", ErrUsage, err)
		}
		return nil, "", err
	}
	defer f.Close()
	// A trace in the other format would fail on every line: say which
	// --format it wants instead.
	br := bufio.NewReaderSize(f, trace.DetectSize)
	head, err := br.Peek(trace.DetectSize)
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, bufio.ErrBufferFull) {
		return nil, "", fmt.Errorf("%s: %w", o.trace, err)
	}
	if got := trace.Detect(head); got != "" && got != o.format {
		return nil, "", fmt.Errorf("%w: %s looks like a%s %s trace, not %s: run with --format %s", ErrUsage, o.trace, article(got), got, o.format, got)
	}
	opt := trace.Options{Strict: o.strict, RateScale: o.effectiveRateScale(), Limit: o.limit}
	read := trace.ReadMooncake
	if o.format == trace.FormatAzure {
		read = trace.ReadAzure
	}
	reqs, rep, err := read(br, opt)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", o.trace, err)
	}
	if rep.Skipped > 0 {
		fmt.Fprintf(stderr, "bench: %s: skipped %d of %d lines:\n", o.trace, rep.Skipped, rep.Lines)
		for _, e := range rep.Errors {
			fmt.Fprintf(stderr, "  %v\n", e)
		}
		if rep.Skipped > len(rep.Errors) {
			fmt.Fprintf(stderr, "  ... and %d more\n", rep.Skipped-len(rep.Errors))
		}
	}
	return reqs, o.trace, nil
}

// article is "n" before a vowel, for "a"+article(w)+" "+w.
func article(w string) string {
	if w != "" && strings.ContainsRune("aeiou", rune(w[0])) {
		return "n"
	}
	return ""
}

// runPolicies runs one simulation per policy, up to GOMAXPROCS at once,
// each with its own engine. Results keep the order of names.
// done (optional) is called with a policy's index when its run ends.
func runPolicies(ctx context.Context, names []string, config func(int, string) sim.Config, reqs []sim.Request, done func(int)) ([]*sim.Result, error) {
	results := make([]*sim.Result, len(names))
	errs := make([]error, len(names))
	sem := make(chan struct{}, max(1, runtime.GOMAXPROCS(0)))
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			results[i], errs[i] = sim.Run(ctx, config(i, name), reqs)
			if done != nil {
				done(i)
			}
			if errs[i] != nil {
				errs[i] = fmt.Errorf("policy %s: %w", name, errs[i])
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return results, nil
}

// benchReport is the --json output.
type benchReport struct {
	Trace           string    `json:"trace"`
	Format          string    `json:"format"`
	Requests        int       `json:"requests"`
	Workers         int       `json:"workers"`
	SpeedFactors    []float64 `json:"speed_factors"`
	RateScale       float64   `json:"rate_scale"`
	KVBlocks        int       `json:"kv_blocks_per_worker"`
	BlockSize       int       `json:"block_size"`
	RouterBlockSize int       `json:"router_block_size"`
	KVEvents        bool      `json:"kv_events"`
	Seed            int64     `json:"seed"`
	// ScrapeIntervalSec is --scrape-interval (0: load after every change).
	ScrapeIntervalSec float64 `json:"scrape_interval_s,omitempty"`
	SpeedSchedule     string  `json:"speed_schedule,omitempty"`
	// Replicas, Sync and SyncDelaySec are --replicas, --sync and
	// --sync-delay, with several replicas only (one replica is the run
	// without replicas).
	Replicas     int     `json:"replicas,omitempty"`
	Sync         string  `json:"sync,omitempty"`
	SyncDelaySec float64 `json:"sync_delay_s,omitempty"`
	// CPUBlocks and CPUReloadTokensSec are --cpu-blocks and
	// --cpu-reload-bandwidth, with a CPU tier only.
	CPUBlocks          int     `json:"cpu_blocks_per_worker,omitempty"`
	CPUReloadTokensSec float64 `json:"cpu_reload_tokens_per_s,omitempty"`
	// PrefillWorkers and the rest are --prefill-workers and its flags,
	// with P/D only.
	PrefillWorkers     int             `json:"prefill_workers,omitempty"`
	PDThresholdTokens  int             `json:"pd_threshold_tokens,omitempty"`
	TransferLatencySec float64         `json:"kv_transfer_latency_s,omitempty"`
	TransferGBps       float64         `json:"kv_transfer_gb_per_s,omitempty"`
	KVBytesPerToken    int             `json:"kv_bytes_per_token,omitempty"`
	Bounds             benchBounds     `json:"bounds"`
	Policies           []policySummary `json:"policies"`
}

type benchBounds struct {
	Infinite             float64 `json:"infinite_cache_hit_rate"`
	Finite               float64 `json:"finite_cache_hit_rate"`
	FiniteCapacityTokens int64   `json:"finite_cache_tokens"`
	PromptTokens         int64   `json:"prompt_tokens"`
}

// policySummary is one policy's row; durations are in seconds.
type policySummary struct {
	Policy  string  `json:"policy"`
	Served  int     `json:"served"`
	Failed  int     `json:"failed"`
	TTFTP50 float64 `json:"ttft_p50_s"`
	TTFTP90 float64 `json:"ttft_p90_s"`
	TTFTP99 float64 `json:"ttft_p99_s"`
	E2EP50  float64 `json:"e2e_p50_s"`
	E2EP99  float64 `json:"e2e_p99_s"`
	// ITLP50 and ITLP90 are percentiles of the requests' mean inter-token
	// latency (requests with more than one output token).
	ITLP50 float64 `json:"itl_p50_s"`
	ITLP90 float64 `json:"itl_p90_s"`
	// Disaggregated is the share of served requests whose prefill ran on
	// a prefill worker.
	Disaggregated   float64 `json:"disaggregated,omitempty"`
	OutputTokensSec float64 `json:"output_tokens_per_s"`
	HitRate         float64 `json:"kv_hit_rate"`
	// CPUHitRate is the part of HitRate loaded back from a CPU tier.
	CPUHitRate   float64 `json:"cpu_hit_rate,omitempty"`
	OfFinite     float64 `json:"hit_rate_of_finite_bound"`
	Imbalance    float64 `json:"load_imbalance"`
	DecisionsSec float64 `json:"decisions_per_s"`
	// Objective is the TTFT-objective attainment (--objective-ttft).
	Objective *objectiveSummary `json:"objective,omitempty"`
	// Affinity is the share of requests with a PrefixID hint served by
	// their session's most used worker (0 when no request has one).
	Affinity float64 `json:"session_affinity,omitempty"`
	// PredErr is the p50 absolute error of the predicted TTFT as a share
	// of the actual TTFT p50 (policies that predict: Predicts).
	PredErr  float64 `json:"ttft_prediction_error,omitempty"`
	Predicts bool    `json:"predicts,omitempty"`
	// With several replicas: the requests that entered through each,
	// and, with sync, the sync items and messages (batched over the sync
	// delay) per decision and the items a peer refused.
	EnteredPerReplica   []int     `json:"requests_per_replica,omitempty"`
	ItemsPerDecision    float64   `json:"sync_items_per_decision,omitempty"`
	MessagesPerDecision float64   `json:"sync_messages_per_decision,omitempty"`
	SyncErrors          int       `json:"sync_errors,omitempty"`
	SpanSec             float64   `json:"span_s"`
	WallSec             float64   `json:"wall_s"`
	RequestsPerWorker   []int     `json:"requests_per_worker"`
	BusyPerWorker       []float64 `json:"busy_s_per_worker"`
}

func summarize(r *sim.Result, reqs []sim.Request, b trace.Bounds) policySummary {
	s := policySummary{Policy: r.Policy, SpanSec: r.Span.Seconds(), WallSec: r.Wall.Seconds()}
	var ttft, e2e []time.Duration
	var out int
	for _, q := range r.Requests {
		if q.Err != "" {
			s.Failed++
			continue
		}
		s.Served++
		ttft = append(ttft, q.TTFT)
		e2e = append(e2e, q.E2E)
		out += q.OutputTokens
	}
	slices.Sort(ttft)
	slices.Sort(e2e)
	s.TTFTP50, s.TTFTP90, s.TTFTP99 = pct(ttft, 50), pct(ttft, 90), pct(ttft, 99)
	s.E2EP50, s.E2EP99 = pct(e2e, 50), pct(e2e, 99)
	if r.Span > 0 {
		s.OutputTokensSec = float64(out) / r.Span.Seconds()
	}
	s.HitRate = r.HitRate()
	s.CPUHitRate = r.CPUHitRate()
	if b.Finite > 0 {
		s.OfFinite = s.HitRate / b.Finite
	}
	var sum, most time.Duration
	for _, w := range r.Workers {
		s.RequestsPerWorker = append(s.RequestsPerWorker, w.Requests)
		s.BusyPerWorker = append(s.BusyPerWorker, w.Busy.Seconds())
		sum += w.Busy
		most = max(most, w.Busy)
	}
	if sum > 0 {
		s.Imbalance = float64(most) / (float64(sum) / float64(len(r.Workers)))
	}
	if r.DecisionTime > 0 {
		s.DecisionsSec = float64(r.Decisions) / r.DecisionTime.Seconds()
	}
	s.Affinity = affinity(r, reqs)
	s.Objective = summarizeObjectives(r, reqs)
	s.PredErr, s.Predicts = predErr(r)
	if r.Replicas > 1 {
		s.EnteredPerReplica = r.Entered
		s.MessagesPerDecision = r.MessagesPerDecision()
		if r.Decisions > 0 {
			s.ItemsPerDecision = float64(r.SyncItems) / float64(r.Decisions)
		}
		s.SyncErrors = r.SyncErrors
	}
	return s
}

// affinity is the share of hinted requests served by their prefix group's
// most used worker.
func affinity(r *sim.Result, reqs []sim.Request) float64 {
	counts := map[string]map[int]int{}
	for i, q := range r.Requests {
		if i >= len(reqs) || q.Err != "" || reqs[i].Hints.PrefixID == "" {
			continue
		}
		id := reqs[i].Hints.PrefixID
		if counts[id] == nil {
			counts[id] = map[int]int{}
		}
		counts[id][q.Worker]++
	}
	var top, all int
	for _, byWorker := range counts {
		m := 0
		for _, n := range byWorker {
			all += n
			m = max(m, n)
		}
		top += m
	}
	if all == 0 {
		return 0
	}
	return float64(top) / float64(all)
}

// pct is the nearest-rank percentile of sorted, in seconds.
func pct(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))].Seconds()
}

// printHeader prints what is replayed: the trace, the fleet and the
// cache bounds.
func (rep *benchReport) printHeader(w io.Writer) {
	fmt.Fprintf(w, "trace %s (%s): %d requests, rate scale %g; %d workers (speed %s), %d KV blocks of %d tokens each\n",
		rep.Trace, rep.Format, rep.Requests, rep.RateScale, rep.Workers, fmtSpeeds(rep.SpeedFactors), rep.KVBlocks, rep.BlockSize)
	if rep.Replicas > 1 {
		fmt.Fprintf(w, "%d replicas, sync %s", rep.Replicas, rep.Sync)
		if rep.Sync != "none" {
			fmt.Fprintf(w, " (delay %v)", time.Duration(rep.SyncDelaySec*float64(time.Second)))
		}
		fmt.Fprintln(w)
	}
	if rep.SpeedSchedule != "" {
		fmt.Fprintf(w, "speed schedule %s\n", rep.SpeedSchedule)
	}
	if rep.ScrapeIntervalSec > 0 {
		fmt.Fprintf(w, "load scraped every %v\n", time.Duration(rep.ScrapeIntervalSec*float64(time.Second)))
	}
	fmt.Fprint(w, rep.tierLine())
	fmt.Fprint(w, rep.pdLine())
	fmt.Fprintf(w, "KV hit-rate bounds: infinite cache %.1f%%, finite cache (one LRU of %d tokens) %.1f%%\n\n",
		100*rep.Bounds.Infinite, rep.Bounds.FiniteCapacityTokens, 100*rep.Bounds.Finite)
}

// printTable prints a row per policy.
func (rep *benchReport) printTable(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	hinted, objectives, predicts := false, false, false
	for _, p := range rep.Policies {
		hinted = hinted || p.Affinity > 0
		objectives = objectives || p.Objective != nil
		predicts = predicts || p.Predicts
	}
	head := "policy\tTTFT p50\tp90\tp99\tE2E p50\tp99\tout tok/s\tKV hit\tof finite\timbalance\tdecisions/s\tfailed\t"
	if hinted {
		head += "affinity\t"
	}
	synced := rep.Replicas > 1 && rep.Sync != "none"
	if synced {
		head += "msgs/decision\t"
	}
	if rep.CPUBlocks > 0 {
		head += "cpu hit\t"
	}
	if objectives {
		head += objectiveColumns
	}
	if predicts {
		head += "pred err\t"
	}
	pdRows := rep.PrefillWorkers > 0
	if pdRows {
		head += "ITL p50\tp90\tdisagg\t"
	}
	fmt.Fprintln(tw, head)
	for _, p := range rep.Policies {
		line := fmt.Sprintf("%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t%.1f%%\t%.0f%%\t%.2f\t%.0f\t%d\t",
			p.Policy, fmtSec(p.TTFTP50), fmtSec(p.TTFTP90), fmtSec(p.TTFTP99), fmtSec(p.E2EP50), fmtSec(p.E2EP99),
			p.OutputTokensSec, 100*p.HitRate, 100*p.OfFinite, p.Imbalance, p.DecisionsSec, p.Failed)
		if hinted {
			line += fmt.Sprintf("%.1f%%\t", 100*p.Affinity)
		}
		if synced {
			line += fmt.Sprintf("%.2f\t", p.MessagesPerDecision)
		}
		if rep.CPUBlocks > 0 {
			line += fmt.Sprintf("%.1f%%\t", 100*p.CPUHitRate)
		}
		if objectives {
			line += p.Objective.cells()
		}
		if predicts {
			line += fmtPredErr(p)
		}
		if pdRows {
			line += fmt.Sprintf("%.1fms\t%.1fms\t%.0f%%\t", 1000*p.ITLP50, 1000*p.ITLP90, 100*p.Disaggregated)
		}
		fmt.Fprintln(tw, line)
	}
	tw.Flush()
}

func fmtSec(s float64) string {
	if s < 1 {
		return fmt.Sprintf("%.0fms", s*1000)
	}
	return fmt.Sprintf("%.2fs", s)
}

func fmtSpeeds(f []float64) string {
	if !slices.ContainsFunc(f, func(v float64) bool { return v != 1 }) {
		return "all 1"
	}
	s := make([]string, len(f))
	for i, v := range f {
		s[i] = strconv.FormatFloat(v, 'g', -1, 64)
	}
	return strings.Join(s, ",")
}
