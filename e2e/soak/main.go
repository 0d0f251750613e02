// Command soak runs the real `kvbandit serve` binary under mixed, partly
// hostile load for a long time and fails when the process grows: `make
// soak` (SOAK_DURATION, default 30m). It is not part of `make test` or CI.
//
// # What it starts
//
// Everything binds 127.0.0.1 only. A fleet of simulated vLLM workers
// (internal/simworker: OpenAI HTTP and SSE, /metrics, ZMQ KV events), some
// publishing their KV events on a bound PUB socket (kvbandit connects) and
// some in bind mode (kv_events_bind: kvbandit binds, the worker connects),
// plus one endpoint whose KV events come from a flooding publisher; `kvbandit
// serve` (built with `go build` unless --bin is given) with ext_proc, the
// standalone proxy (--http-addr), the admin port, --endpoints-file,
// --tenant-header and a short --decision-timeout; and envoysim, the
// Envoy-faithful proxy of the e2e suites, in front of the ext_proc port.
//
// # The load
//
// Every load class runs concurrently for the whole duration, as an open-loop
// Poisson arrival process with a cap on its open requests (arrivals over the
// cap are counted as skipped): normal traffic through envoysim and the
// standalone proxy (chat and completions, JSON and SSE, multi-turn agent
// sessions with x-prefix-* hints and tenants); clients that cancel mid-body
// and mid-stream; unknown models, invalid JSON and oversized bodies;
// hostile HTTP on the proxy (a huge Content-Length with one byte sent, slow
// bodies, `..` and %2e paths, spoofed x-gateway-destination-endpoint
// headers, huge and many headers); hostile ext_proc streams (streams that
// send nothing, messages out of order, huge tenant header values, forged
// served-endpoint metadata, streams abandoned after the decision); KV-event
// floods (valid events at a high rate) and hostile ZMTP peers on the bound
// SUB sockets (huge declared frame lengths, hostile msgpack lengths,
// garbage, stalled handshakes); discovery churn (the endpoints file rewritten
// every few seconds: workers leave and come back, metadata changes, bad
// records); and workers killed and restarted on the same ports. `soak
// -list` prints the classes; --skip and --only select them.
//
// # Samples and verdict
//
// Every --report-every the soak samples the kvbandit process (VmRSS and open
// file descriptors from /proc, go_goroutines, the open ext_proc streams, the
// proxy's and every endpoint's in-flight requests and the buffered body
// bytes from /metrics) and the requests done and failed per class, prints a
// table row and, with --csv, writes a CSV row. At the end it stops the load,
// brings every worker back, waits for quiescence and fails (exit 1) when:
// kvbandit died or restarted; RSS or goroutines grew after the warm-up
// (both the least-squares slope over the run and the last third's median
// against the first third's must exceed the tolerance, so neither one late
// spike nor one early step fails the run on its own); streams or in-flight
// requests are not back to 0; goroutines after the load are above the
// early load level; normal traffic mostly failed; or kvbandit did not exit
// cleanly on SIGTERM. It prints a summary either way, and stops everything
// it started (by PID for the kvbandit process) on exit and on Ctrl-C.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// Exit codes.
const (
	exitPass        = 0
	exitFail        = 1
	exitUsage       = 2
	exitInterrupted = 130
)

// run is the whole command; it returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseOptions(args, stderr)
	if errors.Is(err, errHelp) {
		return exitPass
	}
	if err != nil {
		fmt.Fprintln(stderr, "soak:", err)
		return exitUsage
	}
	if o.List {
		for _, c := range classCatalog(o) {
			fmt.Fprintf(stdout, "%-24s %-16s %7.2f/s  max %3d open  %s\n", c.name, c.group, c.rate, c.maxOpen, c.about)
		}
		return exitPass
	}
	s, err := newSoak(o, stdout, stderr)
	if err != nil {
		fmt.Fprintln(stderr, "soak:", err)
		return exitUsage
	}
	return s.run(ctx)
}
