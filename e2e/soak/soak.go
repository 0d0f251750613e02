package main

import (
	"context"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
)

// soak is one run.
type soak struct {
	o              options
	lim            limits
	stdout, stderr io.Writer

	dir     string
	ownDir  bool
	classes []*class // the selected ones
	fleet   *fleet
	k       *kvbProc
	proxy   *envoysim.Proxy
	env     *env
	conn    *grpc.ClientConn
	metrics *http.Client
	csv     *os.File
	start   time.Time

	mu      sync.Mutex
	samples []sample
	died    string // why the process is gone, once it is
	killed  string // why the watchdog killed it
}

func newSoak(o options, stdout, stderr io.Writer) (*soak, error) {
	if !o.set["report-every"] && o.Duration/o.ReportEvery < 12 {
		o.ReportEvery = max(o.Duration/12, time.Second)
		fmt.Fprintf(stdout, "soak: short run: sampling every %v (give --report-every to choose)\n", o.ReportEvery)
	}
	return &soak{o: o, lim: defaultLimits(o), stdout: stdout, stderr: stderr,
		metrics: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}, nil
}

func (s *soak) logf(format string, args ...any) {
	fmt.Fprintf(s.stdout, "soak: "+format+"\n", args...)
}

// run is the whole soak; it returns the exit code.
func (s *soak) run(ctx context.Context) int {
	passed := false
	defer func() { s.cleanup(passed) }()
	if err := s.setUp(ctx); err != nil {
		if ctx.Err() != nil {
			fmt.Fprintln(s.stderr, "soak: interrupted during set-up")
			return exitInterrupted
		}
		fmt.Fprintln(s.stderr, "soak: set-up failed:", err)
		if s.k != nil {
			fmt.Fprintf(s.stderr, "kvbandit log (last lines, %s):\n%s\n", s.k.logPath, s.k.logTail(30))
		}
		return exitFail
	}

	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	go s.watchdog(watchCtx)
	fmt.Fprintln(s.stdout, tableHeader)
	s.record(s.sample(ctx, "idle"))
	s.start = time.Now()
	loadCtx, stopLoad := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, c := range s.classes {
		h := fnv.New64a()
		h.Write([]byte(c.name))
		wg.Add(1)
		go func() {
			defer wg.Done()
			runClass(loadCtx, c, s.o.Seed^h.Sum64(), s.o.RequestTimeout)
		}()
	}
	s.sampleLoop(ctx)
	stopLoad()
	stopped := make(chan struct{})
	go func() {
		wg.Wait()
		close(stopped)
	}()
	var failures []string
	select {
	case <-stopped:
	case <-time.After(s.o.StopLoadTimeout):
		failures = append(failures, fmt.Sprintf("the load did not stop within %v (a client is stuck: a soak bug, or a server that never answers)", s.o.StopLoadTimeout))
	}
	if ctx.Err() != nil {
		fmt.Fprintln(s.stdout, "\nsoak: interrupted; no verdict")
		s.summary(verdict{})
		return exitInterrupted
	}

	// Quiescence: every worker back, the full endpoint set, nothing in
	// flight, and no idle keep-alive connection of ours left open.
	s.env.http.CloseIdleConnections()
	if s.died == "" {
		if err := s.fleet.restoreAll(); err != nil {
			failures = append(failures, "bringing the workers back: "+err.Error())
		}
		final, quietErr := s.quiesce(ctx)
		if quietErr != "" {
			failures = append(failures, fmt.Sprintf("not quiescent %v after the load stopped: %s", s.o.QuiesceTimeout, quietErr))
		}
		v := judge(s.snapshot(), s.lim)
		if quietErr == "" {
			afterLoad(&v, final)
		}
		v.failures = append(failures, v.failures...)
		if err := s.k.stop(30 * time.Second); err != nil {
			v.failures = append(v.failures, "shutdown: "+err.Error())
		}
		s.summary(v)
		passed = len(v.failures) == 0
	} else {
		v := judge(s.snapshot(), s.lim)
		v.failures = append([]string{s.died}, append(failures, v.failures...)...)
		s.summary(v)
	}
	if passed {
		return exitPass
	}
	return exitFail
}

// setUp builds and starts everything.
func (s *soak) setUp(ctx context.Context) error {
	o := s.o
	s.dir = o.WorkDir
	if s.dir == "" {
		d, err := os.MkdirTemp("", "kvbandit-soak-")
		if err != nil {
			return err
		}
		s.dir, s.ownDir = d, true
	} else if err := os.MkdirAll(s.dir, 0o755); err != nil {
		return err
	}
	bin := o.Bin
	if bin == "" {
		s.logf("building kvbandit into %s", s.dir)
		b, err := buildKvbandit(ctx, s.dir, s.stderr)
		if err != nil {
			return err
		}
		bin = b
	}
	if o.CSV != "" {
		f, err := os.Create(o.CSV)
		if err != nil {
			return err
		}
		s.csv = f
	}

	// The fleet and its endpoints file.
	fl, err := newFleet(o.Workers, o.BindWorkers, o.SpeedUp, filepath.Join(s.dir, "endpoints.json"))
	if err != nil {
		return err
	}
	s.fleet = fl
	if err := fl.start(ctx); err != nil {
		return err
	}
	if err := fl.writeAll(); err != nil {
		return err
	}

	// kvbandit.
	addrs, err := freeAddrs(4)
	if err != nil {
		return err
	}
	args := []string{"serve", "--grpc-addr", addrs[0], "--health-addr", addrs[1], "--metrics-addr", addrs[2], "--http-addr", addrs[3],
		"--endpoints-file", fl.file, "--decision-timeout", o.DecisionTimeout.String(), "--tenant-header", tenantHeader,
		"--max-body-bytes", fmt.Sprint(o.MaxBodyBytes), "--seed", fmt.Sprint(o.Seed % math.MaxInt64), "--log-level", o.LogLevel,
		"--drain-timeout", "5s", "--stop-grace", "2s"}
	if o.Policy != "" {
		args = append(args, "--policy", o.Policy)
	}
	args = append(args, strings.Fields(o.ServeArgs)...)
	k, err := startKvbandit(bin, args, filepath.Join(s.dir, "kvbandit.log"))
	if err != nil {
		return err
	}
	k.grpcAddr, k.healthAddr, k.metricsAddr, k.httpAddr = addrs[0], addrs[1], addrs[2], addrs[3]
	s.k = k
	if err := k.waitReady(ctx, 60*time.Second); err != nil {
		return err
	}
	if err := s.waitFleetSeen(ctx, 20*time.Second); err != nil {
		return err
	}

	// envoysim in front of ext_proc.
	px, err := envoysim.New(envoysim.Config{ExtProcAddr: k.grpcAddr, Hosts: fl.httpAddrs(), DiscardHistory: true})
	if err != nil {
		return err
	}
	if err := px.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	s.proxy = px

	conn, err := grpc.NewClient(k.grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20), grpc.MaxCallRecvMsgSize(64<<20)))
	if err != nil {
		return err
	}
	s.conn = conn
	s.env = &env{
		envoyURL: px.URL(), envoyAddr: px.Addr(), proxyURL: "http://" + k.httpAddr, proxyAddr: k.httpAddr,
		grpcAddr: k.grpcAddr, metricsAddr: k.metricsAddr, fleet: fl,
		http: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, IdleConnTimeout: 30 * time.Second,
			DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext}},
		extproc: extprocv3.NewExternalProcessorClient(conn), maxBody: o.MaxBodyBytes,
		churnEvery: o.ChurnEvery, restartEvery: o.RestartEvery, kvFloodRate: o.KVFloodRate, seed: o.Seed,
	}
	for _, c := range catalog(o, s.env) {
		if o.selected(c) {
			s.classes = append(s.classes, c)
		}
	}
	if s.csv != nil {
		fmt.Fprintln(s.csv, csvHeader(s.classes, fl.httpAddrs()))
	}

	s.logf("kvbandit pid %d: ext_proc %s, proxy http://%s, admin http://%s, log %s", k.pid(), k.grpcAddr, k.httpAddr, k.metricsAddr, k.logPath)
	s.logf("fleet: %d workers + 1 flood-fed endpoint (%s), envoysim %s, endpoints file %s", o.Workers, describeMode(fl), px.URL(), fl.file)
	names := make([]string, len(s.classes))
	for i, c := range s.classes {
		names[i] = c.name
	}
	s.logf("%d load classes for %v, a sample every %v: %s", len(s.classes), o.Duration, o.ReportEvery, strings.Join(names, " "))
	return nil
}

// waitFleetSeen waits until kvbandit has every endpoint and a KV-event
// subscriber for each.
func (s *soak) waitFleetSeen(ctx context.Context, within time.Duration) error {
	want := float64(len(s.fleet.workers))
	deadline := time.Now().Add(within)
	var last string
	for {
		p, err := scrapeMetrics(ctx, s.metrics, s.k.metricsAddr)
		if err == nil {
			eps, _ := p.sum("kvbandit_endpoints")
			subs, _ := p.sum("kvbandit_kv_events_subscribers")
			if eps == want && subs == want {
				return nil
			}
			last = fmt.Sprintf("%g endpoints and %g KV-event subscribers, want %g", eps, subs, want)
		} else {
			last = err.Error()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("kvbandit did not take up the endpoints file within %v: %s", within, last)
		}
		if !sleepCtx(ctx, 200*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// sampleLoop samples every ReportEvery until the duration is over, ctx
// ends or the process dies.
func (s *soak) sampleLoop(ctx context.Context) {
	end := s.start.Add(s.o.Duration)
	tick := time.NewTicker(s.o.ReportEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.k.exited:
			s.processDied()
			return
		case <-tick.C:
		}
		s.record(s.sample(ctx, "load"))
		if !s.k.alive() {
			s.processDied()
			return
		}
		if !time.Now().Before(end.Add(-s.o.ReportEvery / 2)) {
			return
		}
	}
}

// watchdog kills kvbandit (by PID) the moment its RSS passes the limit,
// so that a hostile pattern that makes it allocate gigabytes fails the
// soak instead of exhausting a shared machine.
func (s *soak) watchdog(ctx context.Context) {
	if s.o.RSSLimitMiB <= 0 {
		return
	}
	limit := int64(s.o.RSSLimitMiB * (1 << 20))
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.k.exited:
			return
		case <-tick.C:
		}
		ps, err := readProc(s.k.pid())
		if err != nil || ps.RSS <= limit {
			continue
		}
		s.mu.Lock()
		s.killed = fmt.Sprintf("kvbandit's RSS reached %s %v into the load (--rss-limit-mib %.0f): killed; requests open then, besides normal traffic: %s",
			mib(float64(ps.RSS)), fmtElapsed(time.Since(s.start)), s.o.RSSLimitMiB, s.openHostile())
		s.mu.Unlock()
		fmt.Fprintln(s.stdout, "soak: "+s.killed)
		_ = syscall.Kill(s.k.pid(), syscall.SIGKILL)
		return
	}
}

// openHostile lists the classes other than normal traffic with requests
// open now: the suspects when the process dies.
func (s *soak) openHostile() string {
	var open []string
	for _, c := range s.classes {
		if n := c.t.open.Load(); n > 0 && c.group != groupNormal {
			open = append(open, fmt.Sprintf("%s %d", c.name, n))
		}
	}
	if len(open) == 0 {
		return "none"
	}
	return strings.Join(open, ", ")
}

func (s *soak) processDied() {
	open := s.openHostile() // at once: the clients see the process go soon
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.killed != "" {
		s.died = s.killed
		return
	}
	s.died = fmt.Sprintf("kvbandit died %v into the load (%v); requests open then (best effort), besides normal traffic: %s; its log:\n%s",
		fmtElapsed(time.Since(s.start)), s.k.waitErr, open, indent(crashExcerpt(s.k.logTail(5000))))
	fmt.Fprintf(s.stdout, "soak: kvbandit (pid %d) is gone: %v\n", s.k.pid(), s.k.waitErr)
}

// crashExcerpt is the start of a Go crash report in log (the panic or
// fatal error and the first goroutine's stack), else the log's last lines.
func crashExcerpt(log string) string {
	lines := strings.Split(log, "\n")
	for i, l := range lines {
		if !strings.HasPrefix(l, "panic: ") && !strings.HasPrefix(l, "fatal error: ") {
			continue
		}
		out := []string{l}
		// The first goroutine's stack: the one that crashed.
		for j := i + 1; j < len(lines); j++ {
			if !strings.HasPrefix(lines[j], "goroutine ") {
				continue
			}
			end := j
			for end < len(lines) && lines[end] != "" && end-j < 40 {
				end++
			}
			return strings.Join(append(out, lines[j:end]...), "\n")
		}
		return strings.Join(lines[i:min(i+30, len(lines))], "\n")
	}
	return strings.Join(lines[max(0, len(lines)-25):], "\n")
}

func indent(s string) string { return "      " + strings.ReplaceAll(s, "\n", "\n      ") }

// quiesce samples every second until nothing is in flight or the timeout
// passes; it returns the last sample and, when not quiet, what is busy.
func (s *soak) quiesce(ctx context.Context) (sample, string) {
	deadline := time.Now().Add(s.o.QuiesceTimeout)
	for {
		sm := s.sample(ctx, "quiesce")
		quietNow, busy := quiet(sm)
		if quietNow || time.Now().After(deadline) || ctx.Err() != nil || !s.k.alive() {
			s.record(sm)
			if !s.k.alive() {
				return sm, "kvbandit exited"
			}
			return sm, busy
		}
		time.Sleep(time.Second)
	}
}

// sample measures the process and the load counters now.
func (s *soak) sample(ctx context.Context, phase string) sample {
	sm := sample{phase: phase}
	if !s.start.IsZero() {
		sm.at = time.Since(s.start)
	}
	for _, c := range s.classes {
		cc := classCount{c.t.okN.Load(), c.t.failedN.Load(), c.t.skippedN.Load()}
		sm.perClass = append(sm.perClass, cc)
		sm.ok += cc.ok
		sm.failed += cc.failed
		sm.skipped += cc.skipped
		if c.group == groupNormal {
			sm.normalOK += cc.ok
			sm.normalNOK += cc.failed
		}
	}
	ps, err := readProc(s.k.pid())
	if err != nil {
		sm.scrapeErr = "/proc: " + err.Error()
		return sm
	}
	sm.rss, sm.threads, sm.fds = ps.RSS, ps.Threads, ps.FDs
	p, err := scrapeMetrics(ctx, s.metrics, s.k.metricsAddr)
	if err != nil {
		sm.scrapeErr = err.Error()
		return sm
	}
	sm.metricsBytes = p.bytes
	sm.goroutines, _ = p.sum("go_goroutines")
	sm.heapInuse, _ = p.sum("go_memstats_heap_inuse_bytes")
	sm.streams, _ = p.sum("kvbandit_extproc_streams_inflight")
	sm.proxyInflight, _ = p.sum("kvbandit_proxy_requests_inflight")
	sm.epInflight, _ = p.sum("kvbandit_endpoint_inflight")
	sm.epBusy = p.nonZero("kvbandit_endpoint_inflight", "endpoint")
	for _, w := range s.fleet.workers {
		v, ok := p.byLabel("kvbandit_endpoint_inflight", "endpoint", w.httpAddr)
		if !ok {
			v = -1
		}
		sm.epInflights = append(sm.epInflights, v)
	}
	sm.buffered, _ = p.sum("kvbandit_buffered_body_bytes")
	sm.kvSubs, _ = p.sum("kvbandit_kv_events_subscribers")
	sm.startTime, _ = p.sum("process_start_time_seconds")
	return sm
}

func (s *soak) record(sm sample) {
	s.mu.Lock()
	s.samples = append(s.samples, sm)
	s.mu.Unlock()
	fmt.Fprintln(s.stdout, sm.row())
	if s.csv != nil {
		fmt.Fprintln(s.csv, sm.csv())
	}
}

func (s *soak) snapshot() []sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]sample(nil), s.samples...)
}

// summary prints the figures, the requests by class and the verdict.
func (s *soak) summary(v verdict) {
	w := s.stdout
	ss := s.snapshot()
	fmt.Fprintln(w, "\n== summary")
	fmt.Fprintf(w, "RSS:        %s\n", minMedMax(ss, func(x sample) float64 { return float64(x.rss) }, mib))
	fmt.Fprintf(w, "goroutines: %s\n", minMedMax(ss, func(x sample) float64 { return x.goroutines }, num))
	fmt.Fprintf(w, "open fds:   %s\n", minMedMax(ss, func(x sample) float64 { return float64(x.fds) }, num))
	fmt.Fprintf(w, "/metrics:   %s\n", minMedMax(ss, func(x sample) float64 { return float64(x.metricsBytes) }, func(v float64) string { return fmt.Sprintf("%.0f KiB", v/1024) }))
	if s.fleet != nil {
		fmt.Fprintf(w, "faults:     %d endpoints-file generations, %d worker restarts\n", s.fleet.gen.Load(), s.fleet.restarts.Load())
	}
	fmt.Fprintf(w, "\n%-24s %-16s %9s %8s %8s  %s\n", "class", "group", "ok", "failed", "skipped", "top failure reasons")
	for _, c := range s.classes {
		reasons := strings.Join(c.t.topReasons(2), " | ")
		fmt.Fprintf(w, "%-24s %-16s %9d %8d %8d  %s\n", c.name, c.group, c.t.okN.Load(), c.t.failedN.Load(), c.t.skippedN.Load(), reasons)
	}
	fmt.Fprintln(w)
	for _, g := range []growth{v.rss, v.gor} {
		if g.name != "" && !g.notJudged {
			fmt.Fprintln(w, "growth:", g)
		}
	}
	for _, n := range v.notes {
		fmt.Fprintln(w, "note:", n)
	}
	if len(v.failures) == 0 && v.rss.name != "" {
		fmt.Fprintln(w, "PASS")
		return
	}
	for _, f := range v.failures {
		fmt.Fprintln(w, "FAIL:", f)
	}
	if s.k != nil {
		fmt.Fprintf(w, "kvbandit log: %s\n", s.k.logPath)
	}
}

// cleanup stops everything that was started, kvbandit first (by PID).
func (s *soak) cleanup(passed bool) {
	if s.k != nil && s.k.alive() {
		_ = s.k.stop(30 * time.Second)
	}
	if s.proxy != nil {
		_ = s.proxy.Close()
	}
	if s.conn != nil {
		_ = s.conn.Close()
	}
	if s.env != nil {
		s.env.http.CloseIdleConnections()
	}
	if s.fleet != nil {
		s.fleet.stop()
	}
	if s.csv != nil {
		_ = s.csv.Close()
	}
	if s.ownDir && passed && !s.o.Keep {
		_ = os.RemoveAll(s.dir)
	} else if s.dir != "" {
		fmt.Fprintf(s.stdout, "soak: work directory kept: %s\n", s.dir)
	}
}
