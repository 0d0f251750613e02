//go:build gie

package e2e

// The side-by-side benchmark of kvbandit and GIE's endpoint picker (issue
// 7): `make bench-vs-gie`. Not part of CI: it is a measurement, and it needs
// the GIE EPP built from the module proxy.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/kvbandit/kvbandit/e2e/extprocload"
	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/gateway-api/kubetest"
	"github.com/kvbandit/kvbandit/tokenizer/tokenizertest"
)

const envFastBin = "KVBANDIT_E2E_FAST_BIN"

func init() {
	extraSetup = append(extraSetup, func(root, dir string) ([]string, error) {
		// A normal (non-race) build: the benchmark measures CPU.
		bin := filepath.Join(dir, "kvbandit-fast")
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/kvbandit")
		cmd.Dir, cmd.Stdout, cmd.Stderr = root, os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return nil, fmt.Errorf("building kvbandit: %w", err)
		}
		tools := exec.Command("bash", filepath.Join(root, "tools", "build.sh"), "epp")
		tools.Stderr = os.Stderr
		out, err := tools.Output()
		paths := strings.Fields(string(out))
		if err != nil || len(paths) != 1 {
			return nil, fmt.Errorf("tools/build.sh epp: %v", err)
		}
		return []string{envFastBin + "=" + bin, "KVBANDIT_EPP=" + paths[0]}, nil
	})
}

// picker is one endpoint-picker process under test.
type picker struct {
	name string
	addr string
	cmd  *exec.Cmd
	out  *syncBuffer
}

func startPicker(t *testing.T, name, addr, health string, env []string, bin string, args ...string) *picker {
	t.Helper()
	p := &picker{name: name, addr: addr, out: &syncBuffer{}}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s output:\n%s", name, p.out)
		}
	})
	waitPicking(t, name, addr, p.out)
	return p
}

// TestBenchVsGIE drives kvbandit (default engine, no tokenizer; then with
// a real tokenizer) and GIE's EPP v1.5.0 with the same open-loop load of
// distinct 4 KB chat bodies against the same InferencePool on a real API
// server, and reports requests/s, latency, CPU per 1000 requests and peak
// RSS of each. Rate and duration: KVBANDIT_GIE_RATE (2000), _SECONDS (10).
func TestBenchVsGIE(t *testing.T) {
	rate, secs := 2000.0, 10.0
	if v := os.Getenv("KVBANDIT_GIE_RATE"); v != "" {
		fmt.Sscan(v, &rate)
	}
	if v := os.Getenv("KVBANDIT_GIE_SECONDS"); v != "" {
		fmt.Sscan(v, &secs)
	}
	c := kubetest.Start(t)
	const ns, pool = "default", "sim-pool"
	for i := range 4 {
		ip := fmt.Sprintf("127.0.0.%d", i+2)
		w := worker.New(worker.Config{Addr: ip + ":18000"})
		if err := w.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = w.Close() })
		name := fmt.Sprintf("sim-%d", i)
		c.CreatePod(t, ns, name, map[string]string{"app": "sim"}, nil)
		c.SetPodStatus(t, ns, name, ip, true)
	}
	eppAddr, eppHealth := freeAddr(t), freeAddr(t)
	_, eppPort, _ := strings.Cut(eppAddr, ":")
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": pool, "namespace": ns},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": map[string]any{"app": "sim"}},
			"targetPorts":       []any{map[string]any{"number": int64(18000)}},
			"endpointPickerRef": map[string]any{"name": "epp", "port": map[string]any{"number": int64(atoi(eppPort))}},
		},
	}}
	gvr := schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}
	if _, err := c.Dynamic(t).Resource(gvr).Namespace(ns).Create(t.Context(), u, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	kubeconfig := c.Kubeconfig(t, "admin")
	fast := os.Getenv(envFastBin)

	type row struct {
		name string
		res  *extprocload.Result
		cpu  time.Duration
		rss  int64
	}
	var rows []row
	measure := func(p *picker) {
		t.Helper()
		before, err := extprocload.ReadUsage(p.cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		res, err := extprocload.Run(t.Context(), extprocload.Config{Addr: p.addr, Rate: rate, Duration: time.Duration(secs * float64(time.Second)),
			Bodies: extprocload.ChatBodies(int(rate*secs), 4096, "test-model")})
		if err != nil {
			t.Fatal(err)
		}
		after, err := extprocload.ReadUsage(p.cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		rows = append(rows, row{p.name, res, after.CPU - before.CPU, after.PeakRSS})
		if res.OK != res.Sent {
			t.Errorf("%s: %d of %d answered with a valid destination (dropped %d, errors %v)", p.name, res.OK, res.Sent, res.Dropped, res.Errors)
		}
	}
	kvArgs := func(extra ...string) []string {
		return append([]string{"serve", "--grpc-addr", "", "--health-addr", freeAddr(t), "--metrics-addr", "",
			"--pool-name", pool, "--pool-namespace", ns, "--kubeconfig", kubeconfig, "--log-level", "warn"}, extra...)
	}
	{
		addr := freeAddr(t)
		args := kvArgs()
		args[2] = addr
		p := startPicker(t, "kvbandit", addr, "", nil, fast, args...)
		measure(p)
	}
	{
		addr := freeAddr(t)
		tok := filepath.Join(tokenizertest.Dir(t), "qwen3", "tokenizer.json")
		args := kvArgs("--tokenizer", tok)
		args[2] = addr
		p := startPicker(t, "kvbandit+tokenizer", addr, "", nil, fast, args...)
		measure(p)
	}
	{
		env := []string{"POD_NAME=epp-5d8f7c9b4-x2k9p", "POD_NAMESPACE=" + ns, "KUBECONFIG=" + kubeconfig}
		_, hp, _ := strings.Cut(eppHealth, ":")
		p := startPicker(t, "gie-epp v1.5.0", eppAddr, "", env, os.Getenv("KVBANDIT_EPP"),
			"--pool-name", pool, "--pool-namespace", ns, "--secure-serving=false", "--tracing=false",
			"--metrics-endpoint-auth=false", "--grpc-port", eppPort, "--grpc-health-port", hp, "--metrics-port", fmt.Sprint(atoi(hp)+1))
		measure(p)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nopen loop %.0f req/s for %.0f s, distinct 4 KB chat bodies, 4 pods in one InferencePool\n", rate, secs)
	fmt.Fprintf(&b, "%-20s %10s %10s %10s %12s %10s\n", "picker", "req/s", "p50", "p99", "CPU ms/1k", "peak RSS")
	for _, r := range rows {
		fmt.Fprintf(&b, "%-20s %10.0f %10v %10v %12.1f %7d MiB\n", r.name, r.res.Throughput(), r.res.Quantile(0.5).Round(10*time.Microsecond),
			r.res.Quantile(0.99).Round(10*time.Microsecond), float64(r.cpu.Microseconds())/1000*1000/float64(max(r.res.OK, 1)), r.rss>>20)
	}
	if len(rows) == 3 {
		g := float64(rows[2].cpu) / float64(max(rows[2].res.OK, 1))
		fmt.Fprintf(&b, "CPU per request vs GIE: kvbandit %.2fx (goal <= 0.5), with tokenizer %.2fx (goal <= 1)\n",
			float64(rows[0].cpu)/float64(max(rows[0].res.OK, 1))/g, float64(rows[1].cpu)/float64(max(rows[1].res.OK, 1))/g)
	}
	t.Log(b.String())
}

func atoi(s string) int {
	n := 0
	fmt.Sscan(s, &n)
	return n
}
