package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// errHelp: -h was asked for and printed.
var errHelp = errors.New("help requested")

// options are the command's flags.
type options struct {
	Duration    time.Duration
	ReportEvery time.Duration
	Seed        uint64
	CSV         string
	Bin         string
	WorkDir     string
	Keep        bool
	List        bool

	Workers     int
	BindWorkers int
	SpeedUp     float64

	// Load.
	Rate         float64 // normal requests per second through envoysim
	HostileScale float64 // multiplies every non-normal class's rate
	Skip, Only   string  // comma lists of class names
	ChurnEvery   time.Duration
	RestartEvery time.Duration
	KVFloodRate  float64

	// kvbandit.
	DecisionTimeout time.Duration
	MaxBodyBytes    int64
	Policy          string
	LogLevel        string
	ServeArgs       string

	// Verdict.
	Warmup          float64
	WarmupMin       time.Duration
	RSSTolerance    float64
	RSSSlackMiB     float64
	GorTolerance    float64
	GorSlack        float64
	QuiesceTimeout  time.Duration
	MinSuccess      float64
	RequestTimeout  time.Duration
	StopLoadTimeout time.Duration
	RSSLimitMiB     float64

	// set records the flags given on the command line.
	set map[string]bool
}

func parseOptions(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("soak", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: soak [flags]   (make soak; SOAK_DURATION=3m make soak)")
		fs.PrintDefaults()
	}
	dur := 30 * time.Minute
	if v := os.Getenv("SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			return o, fmt.Errorf("SOAK_DURATION=%q: %w", v, err)
		}
		dur = d
	}
	fs.DurationVar(&o.Duration, "duration", dur, "how long the load runs (default $SOAK_DURATION, else 30m)")
	fs.DurationVar(&o.ReportEvery, "report-every", 30*time.Second, "sampling interval: one table row (and CSV row) per sample")
	fs.Uint64Var(&o.Seed, "seed", 1, "random seed of the load (and kvbandit's --seed)")
	fs.StringVar(&o.CSV, "csv", "", "also write the samples to this CSV file")
	fs.StringVar(&o.Bin, "bin", "", "kvbandit binary to run (default: go build ./cmd/kvbandit into the work directory)")
	fs.StringVar(&o.WorkDir, "work-dir", "", "directory for the binary, the endpoints file and kvbandit's log (default: a new temporary directory, removed after a passing run)")
	fs.BoolVar(&o.Keep, "keep", false, "keep the work directory after a passing run")
	fs.BoolVar(&o.List, "list", false, "list the load classes and exit")

	fs.IntVar(&o.Workers, "workers", 6, "simulated workers (plus one endpoint fed by the KV-event flood)")
	fs.IntVar(&o.BindWorkers, "bind-workers", 2, "of --workers, how many publish KV events in bind mode (kvbandit binds, the worker connects)")
	fs.Float64Var(&o.SpeedUp, "speed-up", 20, "simulated workers run this many times faster than the model's real time")

	fs.Float64Var(&o.Rate, "rate", 6, "normal requests per second through envoysim (the proxy's normal classes get a third of it)")
	fs.Float64Var(&o.HostileScale, "hostile-scale", 1, "multiplies the rate of every class that is not normal traffic")
	fs.StringVar(&o.Skip, "skip", "", "comma list of load classes to leave out (see -list)")
	fs.StringVar(&o.Only, "only", "", "comma list of the only load classes to run (normal traffic always runs: it measures service)")
	fs.DurationVar(&o.ChurnEvery, "churn-every", 5*time.Second, "discovery churn: rewrite the endpoints file this often (0: never)")
	fs.DurationVar(&o.RestartEvery, "restart-every", 90*time.Second, "kill and restart a random worker about this often (0: never)")
	fs.Float64Var(&o.KVFloodRate, "kv-flood-rate", 200, "valid KV-event messages per second to the flood endpoint's bound SUB socket")

	fs.DurationVar(&o.DecisionTimeout, "decision-timeout", 2*time.Second, "kvbandit --decision-timeout")
	fs.Int64Var(&o.MaxBodyBytes, "max-body-bytes", 16<<20, "kvbandit --max-body-bytes (the oversized classes send more)")
	fs.StringVar(&o.Policy, "policy", "", "kvbandit --policy (default: kvbandit's default)")
	fs.StringVar(&o.LogLevel, "log-level", "info", "kvbandit --log-level (its log goes to kvbandit.log in the work directory)")
	fs.StringVar(&o.ServeArgs, "serve-args", "", "extra `kvbandit serve` arguments, space-separated")

	fs.Float64Var(&o.Warmup, "warmup", 0.1, "fraction of the run left out of the growth analysis (at least 2 samples)")
	fs.DurationVar(&o.WarmupMin, "warmup-min", 2*time.Minute, "the warm-up lasts at least this long (the heap takes a minute or two to reach its working size under the full load), but at most half the run")
	fs.Float64Var(&o.RSSTolerance, "rss-tolerance", 0.25, "fail when RSS grows by more than this fraction after the warm-up")
	fs.Float64Var(&o.RSSSlackMiB, "rss-slack-mib", 16, "RSS growth below this many MiB never fails (small processes)")
	fs.Float64Var(&o.GorTolerance, "goroutine-tolerance", 0.10, "fail when goroutines grow by more than this fraction after the warm-up")
	fs.Float64Var(&o.GorSlack, "goroutine-slack", 20, "goroutine growth below this count never fails")
	fs.DurationVar(&o.QuiesceTimeout, "quiesce-timeout", 60*time.Second, "after the load: how long streams and in-flight requests get to drain to 0")
	fs.Float64Var(&o.MinSuccess, "min-success", 0.5, "fail when less than this fraction of normal traffic succeeded in the last third of the run (0: off)")
	fs.DurationVar(&o.RequestTimeout, "request-timeout", 30*time.Second, "client-side bound on one request of any class (a request still open then failed: the server hung)")
	fs.Float64Var(&o.RSSLimitMiB, "rss-limit-mib", 4096, "kill kvbandit (and fail) as soon as its RSS passes this many MiB, checked twice a second: a shared machine must not run out of memory (0: no limit)")
	fs.DurationVar(&o.StopLoadTimeout, "stop-load-timeout", 45*time.Second, "after the load is stopped: how long its goroutines get to return")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return o, errHelp
		}
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	o.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	return o, o.validate()
}

func (o *options) validate() error {
	var errs []error
	check := func(ok bool, format string, args ...any) {
		if !ok {
			errs = append(errs, fmt.Errorf(format, args...))
		}
	}
	check(o.Duration > 0, "--duration must be > 0")
	check(o.ReportEvery > 0 && o.ReportEvery <= o.Duration, "--report-every must be in (0, --duration]")
	check(o.Workers >= 3 && o.Workers <= 64, "--workers must be in [3, 64]")
	check(o.BindWorkers >= 0 && o.BindWorkers < o.Workers, "--bind-workers must be in [0, --workers)")
	check(o.SpeedUp > 0 && o.SpeedUp <= 1000, "--speed-up must be in (0, 1000]")
	check(o.Rate > 0 && o.Rate <= 1000, "--rate must be in (0, 1000]")
	check(o.HostileScale >= 0 && o.HostileScale <= 100, "--hostile-scale must be in [0, 100]")
	check(o.ChurnEvery >= 0, "--churn-every must be >= 0")
	check(o.RestartEvery >= 0, "--restart-every must be >= 0")
	check(o.KVFloodRate >= 0 && o.KVFloodRate <= 100000, "--kv-flood-rate must be in [0, 100000]")
	check(o.DecisionTimeout > 0, "--decision-timeout must be > 0")
	check(o.MaxBodyBytes >= 1<<10 && o.MaxBodyBytes <= 1<<30, "--max-body-bytes must be in [1 KiB, 1 GiB]")
	check(o.Warmup >= 0 && o.Warmup < 0.5, "--warmup must be in [0, 0.5)")
	check(o.WarmupMin >= 0, "--warmup-min must be >= 0")
	check(o.RSSTolerance > 0, "--rss-tolerance must be > 0")
	check(o.GorTolerance > 0, "--goroutine-tolerance must be > 0")
	check(o.RSSSlackMiB >= 0 && o.GorSlack >= 0, "slacks must be >= 0")
	check(o.QuiesceTimeout > 0, "--quiesce-timeout must be > 0")
	check(o.MinSuccess >= 0 && o.MinSuccess <= 1, "--min-success must be in [0, 1]")
	check(o.RequestTimeout >= time.Second, "--request-timeout must be >= 1s")
	check(o.StopLoadTimeout > 0, "--stop-load-timeout must be > 0")
	check(o.RSSLimitMiB >= 0, "--rss-limit-mib must be >= 0")
	known := map[string]bool{}
	for _, c := range classCatalog(*o) {
		known[c.name] = true
	}
	for _, list := range []string{o.Skip, o.Only} {
		for _, n := range splitList(list) {
			check(known[n], "unknown load class %q (see -list)", n)
		}
	}
	return errors.Join(errs...)
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// selected reports whether the class runs with these options.
func (o *options) selected(c *class) bool {
	for _, n := range splitList(o.Skip) {
		if n == c.name {
			return false
		}
	}
	only := splitList(o.Only)
	if len(only) == 0 || c.group == groupNormal {
		return true
	}
	for _, n := range only {
		if n == c.name {
			return true
		}
	}
	return false
}
