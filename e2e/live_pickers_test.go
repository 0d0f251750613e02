package e2e

// The pickers of the live benchmark (live_test.go): how each is started on
// the fleet, as one or several ext_proc servers, and the CPU its
// processes use. llm-d's EPP is in live_llmd_test.go.

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/extprocload"
	"github.com/kvbandit/kvbandit/internal/testenv"
	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
	"github.com/kvbandit/kvbandit/tokenizer/tokenizertest"
)

// livePicker is the ext_proc servers of one run: one address per replica,
// each behind its own envoysim, and the processes whose CPU is the
// picker's (none for round_robin, which runs in the test process; the
// nats-server too for kvbandit-x3). mode is the body mode envoysim uses
// with it.
type livePicker struct {
	addrs []string
	pids  []int
	mode  envoysim.BodyMode
	// admin is kvbandit's admin address when it is profiled.
	admin string
}

// join adds q's replicas and processes to p.
func (p *livePicker) join(q livePicker) {
	p.addrs = append(p.addrs, q.addrs...)
	p.pids = append(p.pids, q.pids...)
	p.mode = q.mode
}

// cpu is the CPU time the picker's processes have used so far.
func (p livePicker) cpu() (time.Duration, error) {
	var sum time.Duration
	for _, pid := range p.pids {
		u, err := extprocload.ReadUsage(pid)
		if err != nil {
			return 0, err
		}
		sum += u.CPU
	}
	return sum, nil
}

// closeAtOnce is the round_robin picker: it ends every stream with gRPC OK
// before any message, so envoysim, like Envoy, carries on without it and
// balances over the cluster itself.
type closeAtOnce struct {
	extprocv3.UnimplementedExternalProcessorServer
}

func (closeAtOnce) Process(extprocv3.ExternalProcessor_ProcessServer) error { return nil }

func startRoundRobin(t *testing.T) livePicker {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(gs, closeAtOnce{})
	go gs.Serve(l)
	t.Cleanup(gs.Stop)
	// Headers only: the stream closes before any body byte went to it.
	return livePicker{addrs: []string{l.Addr().String()}, mode: envoysim.None}
}

// startLiveKvbandit runs kvbandit with its defaults and the Qwen3
// tokenizer; admin is its admin address ("" for none), served with
// --pprof when pprof is set; extra flags follow.
func startLiveKvbandit(t *testing.T, hosts []string, admin string, pprof bool, extra ...string) livePicker {
	t.Helper()
	addr := freeAddr(t)
	tok := filepath.Join(tokenizertest.Dir(t), "qwen3")
	args := []string{"serve", "--grpc-addr", addr, "--health-addr", freeAddr(t), "--metrics-addr", admin,
		"--endpoints", strings.Join(hosts, ","), "--tokenizer", tok, "--log-level", "warn"}
	if pprof {
		args = append(args, "--pprof")
	}
	p := startLiveProc(t, "kvbandit", addr, nil, cmp.Or(os.Getenv(envLiveBin), kvbanditBin), append(args, extra...)...)
	if pprof {
		p.admin = admin
	}
	return p
}

// startLiveKvbanditSynced runs n kvbandit replicas synced over a real
// nats-server (user and password, loopback), and waits until each hears
// the others. The nats-server's CPU counts as the picker's.
func startLiveKvbanditSynced(t *testing.T, hosts []string, n int) livePicker {
	t.Helper()
	ns := startSyncNATS(t)
	creds := syncConfigFile(t, "")
	p := livePicker{pids: []int{ns.PID()}}
	var reps []*kvb
	for i := range n {
		admin := freeAddr(t)
		p.join(startLiveKvbandit(t, hosts, admin, false, "--sync-nats", ns.URL(), "--replica-id", fmt.Sprintf("live-%d", i), "--config", creds))
		reps = append(reps, &kvb{metricsAddr: admin})
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for i, k := range reps {
		err := poll(ctx, func() (bool, string) {
			st, err := k.replicaStatus(ctx)
			if err != nil {
				return false, err.Error()
			}
			return st.Connected && len(st.Peers) == n-1, fmt.Sprintf("replica %d: connected %v, %d peers", i, st.Connected, len(st.Peers))
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return p
}

// profileCPU writes a CPU profile of the picker's next d to path
// (BENCH_LIVE_PPROF), from its admin port's /debug/pprof/profile.
func profileCPU(t *testing.T, admin string, d time.Duration, path string) {
	url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", admin, max(int(d.Seconds()), 1))
	resp, err := (&http.Client{Timeout: d + time.Minute}).Get(url)
	if err != nil {
		t.Errorf("profile: %v", err)
		return
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode == http.StatusOK {
		if err = os.MkdirAll(filepath.Dir(path), 0o755); err == nil {
			err = os.WriteFile(path, b, 0o644)
		}
	} else if err == nil {
		err = fmt.Errorf("%s", resp.Status)
	}
	if err != nil {
		t.Errorf("profile: %v", err)
		return
	}
	t.Logf("CPU profile of %v written to %s (go tool pprof -top %s)", d, path, path)
}

// startLiveGIE runs n replicas of GIE's EPP v1.5.0 with its default
// scheduling profile on one InferencePool of the fleet's addresses on a
// real kube-apiserver, as make bench-vs-gie does; each replica keeps its
// own state, as GIE runs them today.
func startLiveGIE(t *testing.T, hosts []string, n int) livePicker {
	t.Helper()
	// The pool's picker reference is what a gateway would dial; the EPPs
	// below listen on ports of their own.
	c, ns, pool := startLivePool(t, hosts, 9002)
	var p livePicker
	for i := range n {
		addr, health, metrics := freeAddr(t), freeAddr(t), freeAddr(t)
		_, port, _ := net.SplitHostPort(addr)
		_, hp, _ := net.SplitHostPort(health)
		_, mp, _ := net.SplitHostPort(metrics)
		// A pod name in a Deployment's form, one per replica.
		env := []string{fmt.Sprintf("POD_NAME=epp-5d8f7c9b4-x2k9%c", 'p'+i), "POD_NAMESPACE=" + ns, "KUBECONFIG=" + c.Kubeconfig(t, "admin")}
		p.join(startLiveProc(t, "gie", addr, env, os.Getenv(envLiveEPP), "--pool-name", pool, "--pool-namespace", ns,
			"--secure-serving=false", "--tracing=false", "--metrics-endpoint-auth=false", "--grpc-port", port,
			"--grpc-health-port", hp, "--metrics-port", mp))
	}
	return p
}

// startLivePool starts a kube-apiserver with a ready pod at each of the
// fleet's addresses and an InferencePool of them (target port 8000) whose
// endpoint picker serves on eppPort: what GIE's and llm-d's EPPs discover
// their endpoints from. It returns the cluster, the namespace and the
// pool's name.
func startLivePool(t *testing.T, hosts []string, eppPort int) (*kubeenv.Cluster, string, string) {
	t.Helper()
	c := kubeenv.Start(t)
	const ns, pool = "default", "live-pool"
	for i, h := range hosts {
		ip, _, _ := net.SplitHostPort(h)
		name := fmt.Sprintf("sim-%d", i)
		c.CreatePod(t, ns, name, map[string]string{"app": "live"}, nil)
		c.SetPodStatus(t, ns, name, ip, true)
	}
	u := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": pool, "namespace": ns},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": map[string]any{"app": "live"}},
			"targetPorts":       []any{map[string]any{"number": int64(8000)}},
			"endpointPickerRef": map[string]any{"name": "epp", "port": map[string]any{"number": int64(eppPort)}},
		},
	}}
	gvr := schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}
	if _, err := c.Dynamic(t).Resource(gvr).Namespace(ns).Create(t.Context(), u, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	return c, ns, pool
}

// startLiveProc runs a picker process serving ext_proc on addr, stops it
// at the end of the run (SIGTERM, SIGKILL after testenv.StopGrace) and waits until it
// answers ext_proc requests with a destination.
func startLiveProc(t *testing.T, name, addr string, env []string, bin string, args ...string) livePicker {
	t.Helper()
	out := &syncBuffer{}
	proc, err := testenv.StartEnv(bin, args, env, out)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		proc.Stop()
		if t.Failed() {
			t.Logf("%s output:\n%s", name, out)
		}
	})
	waitPicking(t, name, addr, out)
	return livePicker{addrs: []string{addr}, pids: []int{proc.PID()}}
}

// idleCPU is the CPU share (cores) the picker's processes use over d
// with no traffic; 0 for d = 0.
func idleCPU(p livePicker, d time.Duration) (float64, error) {
	if d <= 0 || len(p.pids) == 0 {
		return 0, nil
	}
	a, err := p.cpu()
	if err != nil {
		return 0, err
	}
	time.Sleep(d)
	b, err := p.cpu()
	if err != nil {
		return 0, err
	}
	return (b - a).Seconds() / d.Seconds(), nil
}
