package app

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"time"
)

// demoNoBaseline is the --baseline value that skips the baseline run.
const demoNoBaseline = "none"

// runDemoBaseline runs the burst again with the baseline policy, on a
// fresh fleet (empty caches) behind a serve of its own on ephemeral
// loopback ports, with the same seed and workload, then prints the two
// runs side by side. res is the main run's burst. Both are stopped
// before it returns, leaving the main fleet and serve as they were.
func runDemoBaseline(ctx context.Context, w io.Writer, o DemoOptions, dir string, log *slog.Logger, res []turnResult) error {
	switch o.Baseline {
	case demoNoBaseline:
		return nil
	case o.Policy:
		fmt.Fprintf(w, "\n(no baseline run: --policy is the baseline policy, %s)\n", o.Baseline)
		return nil
	}
	fmt.Fprintf(w, "\nBaseline: the same %d sessions x %d turns (seed %d) with --policy %s, on a fresh fleet of %d simulated workers (empty caches)...\n",
		o.Sessions, o.Turns, o.Seed, o.Baseline, len(demoSpeeds))
	base, err := demoBaselineBurst(ctx, o, dir, log.With("run", "baseline"))
	if err != nil {
		return err
	}
	printComparison(w, o, statsOf(res), statsOf(base))
	return nil
}

// demoBaselineBurst starts the baseline's fleet and serve, sends the
// burst and stops them again.
func demoBaselineBurst(ctx context.Context, o DemoOptions, dir string, log *slog.Logger) ([]turnResult, error) {
	bo := o
	bo.Policy = o.Baseline
	bo.HTTPAddr, bo.GRPCAddr, bo.HealthAddr, bo.MetricsAddr = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	workers, err := startDemoFleet(ctx, o.SpeedUp, log)
	defer func() {
		for _, wk := range workers {
			wk.Close()
		}
	}()
	if err != nil {
		return nil, err
	}
	so, err := demoServeOptions(bo, filepath.Join(dir, "baseline.json"), workers)
	if err != nil {
		return nil, err
	}
	ls, err := bindDemoListeners(bo)
	if err != nil {
		return nil, err
	}
	d := startDemoServe(ctx, so, log, ls)
	if ready, err := d.waitReady(ctx); !ready { // serve has ended
		if err == nil {
			err = ctx.Err()
		}
		return nil, err
	}
	res, err := d.sendBurst(ctx, bo)
	d.stop()
	if err != nil {
		return nil, err
	}
	return res, allFailed(res)
}

// printComparison prints the main run and the baseline side by side.
func printComparison(w io.Writer, o DemoOptions, main, base burstStats) {
	row := func(name, a, b string) {
		fmt.Fprintf(w, "  %-22s %14s %14s\n", name, a, b)
	}
	ttft := func(d time.Duration) string { return modelTime(d, o.SpeedUp).String() }
	fmt.Fprintln(w)
	row("", o.Policy, o.Baseline)
	row("KV hit rate", hitRate(main.cached, main.prompt), hitRate(base.cached, base.prompt))
	row("session stickiness", main.stickiness(), base.stickiness())
	row("sessions on 1 worker", fmt.Sprintf("%d of %d", main.whole, main.sessions), fmt.Sprintf("%d of %d", base.whole, base.sessions))
	row("TTFT p50 (model time)", ttft(main.ttftP50), ttft(base.ttftP50))
	row("TTFT p90 (model time)", ttft(main.ttftP90), ttft(base.ttftP90))
	if main.failed > 0 || base.failed > 0 {
		row("failed requests", fmt.Sprint(main.failed), fmt.Sprint(base.failed))
	}
	fmt.Fprintf(w, "(model time = this machine's wall clock x %g; with a burst this small, TTFT varies from run to run, and so does the hit rate of a policy blind to sessions)\n", o.SpeedUp)
}
