//go:build syncbench

package e2e

// The sync cost benchmark of issue 12: `make bench-sync`. Not part of CI:
// it is a measurement (CPU per request of a normal build under open-loop
// load), side by side in one run.

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/extprocload"
	"github.com/kvbandit/kvbandit/e2e/worker"
)

const envSyncFastBin = "KVBANDIT_E2E_SYNC_FAST_BIN"

func init() {
	extraSetup = append(extraSetup, func(root, dir string) ([]string, error) {
		bin := filepath.Join(dir, "kvbandit-sync-fast")
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/kvbandit")
		cmd.Dir, cmd.Stdout, cmd.Stderr = root, os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return nil, fmt.Errorf("building kvbandit: %w", err)
		}
		return []string{envSyncFastBin + "=" + bin}, nil
	})
}

// fastPicker is a normal build of kvbandit serve.
type fastPicker struct {
	grpc, metrics string
	cmd           *exec.Cmd
	out           *syncBuffer
}

func startFastPicker(t *testing.T, endpoints []string, extra ...string) *fastPicker {
	t.Helper()
	p := &fastPicker{grpc: freeAddr(t), metrics: freeAddr(t), out: &syncBuffer{}}
	args := append([]string{"serve", "--grpc-addr", p.grpc, "--health-addr", freeAddr(t), "--metrics-addr", p.metrics,
		"--endpoints", strings.Join(endpoints, ","), "--policy", "kvbandit", "--scrape-interval", "0", "--seed", "1"}, extra...)
	p.cmd = exec.Command(os.Getenv(envSyncFastBin), args...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("kvbandit output:\n%s", p.out)
		}
	})
	waitPicking(t, "kvbandit", p.grpc, p.out)
	return p
}

// metric sums the samples of a metric family on the picker's /metrics
// whose line contains every filter.
func (p *fastPicker) metric(t *testing.T, name string, filters ...string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + p.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum := 0.0
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.HasPrefix(l, name+"{") && !strings.HasPrefix(l, name+" ") {
			continue
		}
		ok := true
		for _, f := range filters {
			ok = ok && strings.Contains(l, f)
		}
		if ok {
			var v float64
			fmt.Sscan(l[strings.LastIndexByte(l, ' ')+1:], &v)
			sum += v
		}
	}
	return sum
}

// TestBenchSyncCPU compares the CPU per request of a replica with sync on
// (publishing every decision to a real nats-server, a peer replica applying
// them) to one with sync off, under the same open-loop load of distinct
// 4 KB chat bodies, alternating runs (KVBANDIT_SYNC_RATE, default 2000
// req/s; KVBANDIT_SYNC_SECONDS, default 10; 3 rounds). It reports the median
// ratio and the sync messages per decision.
func TestBenchSyncCPU(t *testing.T) {
	rate, secs := 2000.0, 10.0
	if v := os.Getenv("KVBANDIT_SYNC_RATE"); v != "" {
		fmt.Sscan(v, &rate)
	}
	if v := os.Getenv("KVBANDIT_SYNC_SECONDS"); v != "" {
		fmt.Sscan(v, &secs)
	}
	_, addrs := startWorkers(t, 4, worker.Config{})
	nats := startSyncNATS(t)
	creds := syncConfigFile(t, "")
	off := startFastPicker(t, addrs)
	on := startFastPicker(t, addrs, "--sync-nats", nats.URL(), "--replica-id", "bench-on", "--config", creds)
	startFastPicker(t, addrs, "--sync-nats", nats.URL(), "--replica-id", "bench-peer", "--config", creds)
	bodies := extprocload.ChatBodies(2000, 4096, "test-model")

	run := func(p *fastPicker) (cpuPerReq time.Duration, res *extprocload.Result) {
		before, err := extprocload.ReadUsage(p.cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		res, err = extprocload.Run(t.Context(), extprocload.Config{Addr: p.grpc, Rate: rate, Duration: time.Duration(secs * float64(time.Second)), Bodies: bodies})
		if err != nil {
			t.Fatal(err)
		}
		after, err := extprocload.ReadUsage(p.cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		if res.OK == 0 {
			t.Fatalf("no request answered: %v", res.Errors)
		}
		return (after.CPU - before.CPU) / time.Duration(res.OK), res
	}
	var ratios []float64
	for round := range 3 {
		cOff, rOff := run(off)
		sentBefore := on.metric(t, "kvbandit_sync_messages_total", `direction="sent"`)
		cOn, rOn := run(on)
		sent := on.metric(t, "kvbandit_sync_messages_total", `direction="sent"`) - sentBefore
		ratio := float64(cOn) / float64(cOff)
		ratios = append(ratios, ratio)
		t.Logf("round %d at %.0f req/s for %.0f s: sync off %v CPU/request (%d ok, p99 %v); sync on %v CPU/request (%d ok, p99 %v), %.3f messages/decision; ratio %.3f",
			round+1, rate, secs, cOff, rOff.OK, rOff.Quantile(0.99), cOn, rOn.OK, rOn.Quantile(0.99), sent/float64(rOn.OK), ratio)
	}
	slices.Sort(ratios)
	t.Logf("median CPU ratio sync on / off: %.3f (goal <= 1.15)", ratios[1])
}
