package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// buildKvbandit builds ./cmd/kvbandit of the module in the current
// directory's tree into dir (without -race: the soak measures the RSS a
// user would see).
func buildKvbandit(ctx context.Context, dir string, stderr io.Writer) (string, error) {
	out, err := exec.CommandContext(ctx, "go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("not inside the kvbandit module: run from the repository (or give --bin)")
	}
	bin := filepath.Join(dir, "kvbandit")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/kvbandit")
	cmd.Dir = filepath.Dir(gomod)
	cmd.Stdout, cmd.Stderr = stderr, stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("go build ./cmd/kvbandit: %w", err)
	}
	return bin, nil
}

// freeAddrs returns n loopback addresses that were free a moment ago (all
// listeners are held until every port is chosen, so they differ).
func freeAddrs(n int) ([]string, error) {
	var out []string
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, l)
		out = append(out, l.Addr().String())
	}
	return out, nil
}

// kvbProc is the `kvbandit serve` process.
type kvbProc struct {
	grpcAddr, healthAddr, metricsAddr, httpAddr string
	logPath                                     string

	cmd     *exec.Cmd
	logFile *os.File
	exited  chan struct{}
	waitErr error // valid once exited is closed
	stopped bool  // we sent SIGTERM
}

// startKvbandit starts bin with args; its output goes to logPath. The
// process gets its own process group, so a Ctrl-C on the terminal reaches
// only the soak, which then stops it by PID; and it is killed if the soak
// itself dies (Pdeathsig).
func startKvbandit(bin string, args []string, logPath string) (*kvbProc, error) {
	f, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	k := &kvbProc{logPath: logPath, logFile: f, exited: make(chan struct{})}
	k.cmd = exec.Command(bin, args...)
	k.cmd.Stdout, k.cmd.Stderr = f, f
	k.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := k.cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("starting %s: %w", bin, err)
	}
	go func() {
		k.waitErr = k.cmd.Wait()
		close(k.exited)
	}()
	return k, nil
}

func (k *kvbProc) pid() int { return k.cmd.Process.Pid }

// alive reports whether the process is still running.
func (k *kvbProc) alive() bool {
	select {
	case <-k.exited:
		return false
	default:
		return true
	}
}

// waitReady polls the gRPC readiness service until SERVING.
func (k *kvbProc) waitReady(ctx context.Context, within time.Duration) error {
	conn, err := grpc.NewClient(k.healthAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	last := "no answer"
	for {
		cctx, ccancel := context.WithTimeout(ctx, time.Second)
		resp, err := hc.Check(cctx, &healthpb.HealthCheckRequest{Service: "readiness"})
		ccancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		if err != nil {
			last = err.Error()
		} else {
			last = resp.GetStatus().String()
		}
		select {
		case <-k.exited:
			return fmt.Errorf("kvbandit exited before it was ready (%v); see %s", k.waitErr, k.logPath)
		case <-ctx.Done():
			return fmt.Errorf("kvbandit not ready after %v (last: %s); see %s", within, last, k.logPath)
		case <-tick.C:
		}
	}
}

// stop sends SIGTERM to the process (by PID) and waits up to grace for it
// to exit, then kills it. It returns how the process ended: nil for a clean
// exit after SIGTERM.
func (k *kvbProc) stop(grace time.Duration) error {
	defer k.logFile.Close()
	select {
	case <-k.exited:
		if k.stopped {
			return k.waitErr
		}
		return fmt.Errorf("kvbandit had already exited on its own: %v", k.waitErr)
	default:
	}
	k.stopped = true
	_ = syscall.Kill(k.pid(), syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-k.exited:
		if k.waitErr != nil {
			return fmt.Errorf("kvbandit exited with %v after SIGTERM", k.waitErr)
		}
		return nil
	case <-t.C:
		_ = syscall.Kill(k.pid(), syscall.SIGKILL)
		<-k.exited
		return fmt.Errorf("kvbandit still running %v after SIGTERM: killed", grace)
	}
}

// logTail returns the last n lines of the process's log.
func (k *kvbProc) logTail(n int) string {
	b, err := os.ReadFile(k.logPath)
	if err != nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// procStats are what /proc says about a process.
type procStats struct {
	RSS     int64 // VmRSS, bytes
	Threads int
	FDs     int
}

func readProc(pid int) (procStats, error) {
	var ps procStats
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ps, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "VmRSS":
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(v, "kB")), 10, 64)
			if err != nil {
				return ps, fmt.Errorf("/proc/%d/status: VmRSS %q", pid, v)
			}
			ps.RSS = kb << 10
		case "Threads":
			ps.Threads, _ = strconv.Atoi(v)
		}
	}
	if err := sc.Err(); err != nil {
		return ps, err
	}
	if ps.RSS == 0 {
		return ps, fmt.Errorf("/proc/%d/status: no VmRSS", pid)
	}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return ps, err
	}
	ps.FDs = len(ents)
	return ps, nil
}

// ---- /metrics -------------------------------------------------------------------

// metricsLimit bounds a /metrics page read (a page past it is itself a
// finding: the series grew without bound).
const metricsLimit = 256 << 20

// series is one sample line of a Prometheus text page.
type series struct {
	name   string
	labels map[string]string
	value  float64
}

// page is a parsed /metrics page.
type page struct {
	series []series
	bytes  int
}

// scrapeMetrics fetches and parses http://addr/metrics.
func scrapeMetrics(ctx context.Context, c *http.Client, addr string) (*page, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: %s", resp.Status)
	}
	return parseMetrics(io.LimitReader(resp.Body, metricsLimit))
}

// parseMetrics parses the Prometheus text format well enough for gauges
// and counters: comments are skipped, label values may not hold `",`.
func parseMetrics(r io.Reader) (*page, error) {
	p := &page{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		p.bytes += len(line) + 1
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		s := series{name: line[:i], value: v}
		if j := strings.IndexByte(s.name, '{'); j >= 0 {
			s.labels = map[string]string{}
			for _, kv := range strings.Split(strings.TrimSuffix(s.name[j+1:], "}"), ",") {
				if key, val, ok := strings.Cut(kv, "="); ok {
					s.labels[key] = strings.Trim(val, `"`)
				}
			}
			s.name = s.name[:j]
		}
		p.series = append(p.series, s)
	}
	return p, sc.Err()
}

// sum adds the values of name (every label set); ok is false when the page
// has no such series.
func (p *page) sum(name string) (v float64, ok bool) {
	for _, s := range p.series {
		if s.name == name {
			v += s.value
			ok = true
		}
	}
	return v, ok
}

// byLabel returns the value of name's series whose label is value, and
// whether there is one.
func (p *page) byLabel(name, label, value string) (float64, bool) {
	for _, s := range p.series {
		if s.name == name && s.labels[label] == value {
			return s.value, true
		}
	}
	return 0, false
}

// nonZero lists "label=value" for the series of name whose value is not 0.
func (p *page) nonZero(name, label string) []string {
	var out []string
	for _, s := range p.series {
		if s.name == name && s.value != 0 {
			out = append(out, fmt.Sprintf("%s=%g", s.labels[label], s.value))
		}
	}
	return out
}
