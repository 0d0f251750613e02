// Package benchcmd is `kvbandit bench`: it replays a request trace
// (Mooncake or Azure, or a generated agentic workload) on a simulated vLLM
// fleet, in virtual time, once per routing policy with the same engine serve
// runs, and compares them: TTFT and end-to-end percentiles, output
// throughput, KV hit rate against the trace's cache bounds, load imbalance
// and decision rate, plus session affinity, TTFT objectives, replicas with
// sync, a CPU KV tier and prefill/decode disaggregation when asked. It
// prints a table, and optionally writes JSON and TTFT/queue plots.
package benchcmd

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
	"time"

	"github.com/kvbandit/kvbandit/internal/cmdline"
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
	syncDelay                                         time.Duration
	noTurns                                           bool
	scrape                                            scrapeFlag
	objective                                         objectiveOptions
	speedSchedule                                     string
	jitter                                            time.Duration
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
	fs.DurationVar(&o.jitter, "arrival-jitter", 0, "spread each request's arrival later by a uniform draw in [0, D) of trace time (before --rate-scale; seeded by --seed), e.g. 3s spreads the Mooncake trace's bursts over its 3 s timestamp grid (0: as stamped)")
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
	fs.BoolVar(&o.noTurns, "no-turns", false, "--sync nats: replicas decide a burst blind to each other instead of in turn (serve's sync.turns: false; the baseline of routing/burst)")
	fs.Var(&o.scrape, "scrape-interval", fmt.Sprintf("how often the workers' load reaches the engines; 0: after every change (default: as each is deployed: weighted every %v, GIE's EPP --refresh-metrics-interval; the others every %v, as serve scrapes)", gieScrapeInterval, serveScrapeInterval))
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
	fs.BoolVar(&a.NoTotals, "no-totals", false, "agentic: sessions send only their id (x-prefix-id), no x-prefix-total-requests")
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
		if o.jitter != 0 {
			return nil, errors.New("--arrival-jitter applies to a trace file (mooncake, azure), not --format agentic")
		}
	default:
		return nil, fmt.Errorf("--format %q: want mooncake, azure or agentic", o.format)
	}
	if o.jitter < 0 {
		return nil, fmt.Errorf("--arrival-jitter %v: must be >= 0", o.jitter)
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
	if d := o.scrape.d; o.scrape.set && (d < 0 || d > time.Hour) {
		return nil, fmt.Errorf("--scrape-interval %v: want 0 to 1h", d)
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

// ConfigFile is what bench takes from serve's config file (--config): the
// policy sections (kv, kvbandit, thompson, weighted) and the cache-tier
// weights.
type ConfigFile struct {
	Policies    *policy.Config
	TierWeights routing.TierWeights
}

// LoadConfig reads serve's config file for --config. The caller passes
// serve's own loader, so that bench reads the file exactly as serve does.
type LoadConfig func(path string) (ConfigFile, error)

// Run is `kvbandit bench`, args being the flags after the command name:
// replay a trace on a simulated fleet under each policy and compare.
// Command-line mistakes are errors wrapping [cmdline.ErrUsage]; -h gives
// flag.ErrHelp after the usage.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer, load LoadConfig) error {
	var o benchOptions
	if err := o.parse(args, stderr); err != nil {
		return err
	}
	speeds, schedule, names, err := o.check(stderr)
	if err != nil {
		return err
	}
	reqs, desc, err := o.load(stderr)
	if err != nil {
		return err
	}
	if err := o.objective.apply(reqs, o.seed); err != nil {
		return fmt.Errorf("%w: %w", cmdline.ErrUsage, err)
	}
	var cfg ConfigFile // zero: the default policy parameters and tier weights
	if o.config != "" {
		if cfg, err = load(o.config); err != nil {
			return fmt.Errorf("%w: --config: %w", cmdline.ErrUsage, err)
		}
	}
	bounds := trace.ComputeBounds(reqs, o.blockSize, o.workers*o.kvBlocks)
	rep := o.report(desc, len(reqs), speeds, bounds)
	// What is replayed is known now: say it before the run.
	rep.printHeader(stdout)
	runs := o.pd.runs(names, o.workers)
	results, err := o.replay(ctx, stderr, runs, o.fleet(speeds), cfg, schedule, reqs)
	if err != nil {
		return err
	}
	for i, r := range results {
		r.Policy = runs[i].label
		s := summarize(r, reqs, bounds)
		summarizePD(&s, r)
		rep.Policies = append(rep.Policies, s)
	}
	rep.printTable(stdout)
	return o.write(rep, results)
}

// parse reads the flags into o.
func (o *benchOptions) parse(args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	o.addFlags(fs)
	if err := cmdline.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: bench takes no arguments, got %q", cmdline.ErrUsage, fs.Args())
	}
	return nil
}

// check validates the flags and returns the speed factors, the speed
// schedule and the known policies of the --policy list.
func (o *benchOptions) check(stderr io.Writer) ([]float64, []sim.Change, []string, error) {
	speeds, err := o.validate()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%w: %w", cmdline.ErrUsage, err)
	}
	schedule, err := parseSpeedSchedule(o.speedSchedule, o.workers)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%w: %w", cmdline.ErrUsage, err)
	}
	names := benchPolicyNames(o.policies, stderr)
	if len(names) == 0 {
		return nil, nil, nil, fmt.Errorf("%w: --policy %q names no known policy (known: %s)", cmdline.ErrUsage, o.policies, strings.Join(policy.Builtin().Names(), ", "))
	}
	return speeds, schedule, names, nil
}

// fleet is the simulated workers' configuration.
func (o *benchOptions) fleet(speeds []float64) []sim.WorkerConfig {
	workers := make([]sim.WorkerConfig, o.workers)
	for i := range workers {
		workers[i] = sim.WorkerConfig{KVBlocks: o.kvBlocks, BlockSize: o.blockSize, Speed: speeds[i]}
		o.tier.apply(&workers[i])
	}
	return workers
}

// report starts the report with what is replayed; the policies' rows come
// after the run.
func (o *benchOptions) report(desc string, requests int, speeds []float64, bounds trace.Bounds) *benchReport {
	rep := &benchReport{
		Trace: desc, Format: o.format, Requests: requests, Workers: o.workers, SpeedFactors: speeds,
		RateScale: o.effectiveRateScale(), KVBlocks: o.kvBlocks, BlockSize: o.blockSize, RouterBlockSize: o.routerBlock,
		ArrivalJitterSec: o.jitter.Seconds(),
		KVEvents:         o.kvEvents, Seed: o.seed, ScrapeIntervalSec: o.scrape.d.Seconds(), ScrapeAsDeployed: !o.scrape.set, SpeedSchedule: o.speedSchedule,
		Bounds: benchBounds{Infinite: bounds.Infinite, Finite: bounds.Finite, FiniteCapacityTokens: int64(bounds.CapacityBlocks) * int64(bounds.BlockSize), PromptTokens: bounds.PromptTokens},
	}
	if o.replicas > 1 {
		rep.Replicas, rep.Sync, rep.SyncDelaySec = o.replicas, o.sync, o.syncDelay.Seconds()
		rep.Turns = o.sync == "nats" && !o.noTurns
	}
	o.tier.report(rep)
	o.pd.report(rep)
	return rep
}

// replay runs every row's simulation, with the progress line on stderr.
func (o *benchOptions) replay(ctx context.Context, stderr io.Writer, runs []benchRun, workers []sim.WorkerConfig, cfg ConfigFile, schedule []sim.Change, reqs []sim.Request) ([]*sim.Result, error) {
	logger := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	sync, _ := sim.ParseSync(o.sync) // checked by validate
	labels := make([]string, len(runs))
	for i, r := range runs {
		labels[i] = r.label
	}
	prog := newBenchProgress(stderr, o.quiet, o.progress, labels, len(reqs), nil)
	prog.start()
	results, err := runPolicies(ctx, labels, func(i int, _ string) sim.Config {
		return sim.Config{
			Roles: runs[i].roles, PD: runs[i].pd, Transfer: o.pd.transfer(),
			Workers: workers, Policy: runs[i].policy, Policies: cfg.Policies, RouterBlockSize: o.routerBlock, KVEvents: o.kvEvents, Seed: o.seed, Logger: logger,
			Replicas: o.replicas, Sync: sync, SyncDelay: o.syncDelay, NoTurns: o.noTurns, ScrapeInterval: o.scrape.interval(runs[i].policy), TierWeights: cfg.TierWeights,
			SLO:      slo.Config{Headroom: o.objective.headroom, Off: o.objective.off},
			Schedule: schedule,
			Progress: prog.arrivedFunc(i),
		}
	}, reqs, prog.done)
	prog.close()
	return results, err
}

// write writes the --json report and the --plot images.
func (o *benchOptions) write(rep *benchReport, results []*sim.Result) error {
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
		if err := plotQueue(queuePlotPath(o.plotOut), results, rep.Policies, best); err != nil {
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
			return nil, "", fmt.Errorf("%w: %w", cmdline.ErrUsage, err)
		}
		if o.limit > 0 && len(reqs) > o.limit {
			reqs = reqs[:o.limit]
		}
		c := cfg.Defaults()
		desc := fmt.Sprintf("agentic: %d sessions × %d turns at %g sessions/s, think %v, %d system prompts of %d tokens", c.Sessions, c.Turns, c.SessionRate, c.ThinkTime, c.SystemPrompts, c.SystemPromptLen)
		if c.NoTotals {
			desc += ", session ids without totals"
		}
		return reqs, desc, nil
	}
	f, err := os.Open(o.trace)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, "", fmt.Errorf("%w: --trace: %w", cmdline.ErrUsage, err)
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
		return nil, "", fmt.Errorf("%w: %s looks like a%s %s trace, not %s: run with --format %s", cmdline.ErrUsage, o.trace, article(got), got, o.format, got)
	}
	opt := trace.Options{Strict: o.strict, RateScale: o.effectiveRateScale(), Limit: o.limit, Jitter: o.jitter, JitterSeed: uint64(o.seed)}
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
