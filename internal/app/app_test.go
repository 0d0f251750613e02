package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvbandit/kvbandit/envoy"
	"github.com/kvbandit/kvbandit/internal/buildinfo"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/tokenizer/tokenizertest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-zeromq v0.17.0 PUB sockets (the worker side, tests only) can
		// leave their writer goroutine behind after Close.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
		// klog (imported by client-go) starts its flush daemon at init and
		// never stops it.
		goleak.IgnoreTopFunction("k8s.io/klog/v2.(*flushDaemon).run.func1"),
	)
}

func run(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	var out, errw bytes.Buffer
	err := Run(t.Context(), args, &out, &errw)
	return out.String(), errw.String(), err
}

func TestVersionAndUsage(t *testing.T) {
	// version and --version print the version, commit, build date and
	// toolchain (this test binary has no link-time values: Go's build info
	// or "unknown" fill them).
	bi := buildinfo.Read()
	want := fmt.Sprintf("kvbandit %s\ncommit: %s\nbuilt:  %s\ngo:     %s %s/%s\n", bi.Version, bi.Commit, bi.Date, bi.GoVersion, runtime.GOOS, runtime.GOARCH)
	for _, args := range [][]string{{"version"}, {"--version"}, {"-version"}} {
		out, _, err := run(t, args...)
		if err != nil || out != want {
			t.Fatalf("%v: %q %v, want %q", args, out, err, want)
		}
	}
	for _, args := range [][]string{{"version", "x"}, {"--version", "x"}} {
		if _, _, err := run(t, args...); ExitCode(err) != 2 {
			t.Fatalf("%v: exit %d (%v), want 2", args, ExitCode(err), err)
		}
	}
	if _, _, err := run(t); ExitCode(err) != 2 {
		t.Fatalf("no command: exit %d", ExitCode(err))
	}
	if _, stderr, err := run(t, "frobnicate"); ExitCode(err) != 2 || !strings.Contains(stderr, "serve") {
		t.Fatalf("unknown command: %v %q", err, stderr)
	}
	if _, _, err := run(t, "help"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := run(t, "serve", "-h"); err != nil {
		t.Fatalf("serve -h: %v", err)
	}
}

func TestServeFlagValidation(t *testing.T) {
	cases := [][]string{
		{},                                // no workers
		{"--endpoints", "local..host:80"}, // neither an IP nor a host name
		{"--endpoints", "127.0.0.1:1", "--max-body-bytes", "0"},
		{"--endpoints", "127.0.0.1:1", "--max-inflight", "-1"},
		{"--endpoints", "127.0.0.1:1", "--fallbacks", "-1"},
		{"--endpoints", "127.0.0.1:1", "--decision-timeout", "0s"},
		{"--endpoints", "127.0.0.1:1", "--policy", "nope"},
		{"--endpoints", "127.0.0.1:1", "--log-level", "loud"},
		{"--endpoints", "127.0.0.1:1", "--max-buffered-bytes", "10"},
		{"--endpoints", "127.0.0.1:1", "stray"},
		{"--no-such-flag"},
	}
	for _, c := range cases {
		args := append([]string{"serve", "--grpc-addr", "127.0.0.1:0", "--health-addr", "127.0.0.1:0", "--metrics-addr", ""}, c...)
		_, _, err := run(t, args...)
		if err == nil {
			t.Errorf("%v: accepted", c)
			continue
		}
		if ExitCode(err) != 2 {
			t.Errorf("%v: exit %d (%v), want 2", c, ExitCode(err), err)
		}
	}
}

func TestConfigIsStrict(t *testing.T) {
	if _, err := ParseConfig([]byte("endpoints:\n- address: 10.0.0.1:8000\n  modles: [x]\n")); err == nil {
		t.Fatal("unknown field accepted")
	}
	if _, err := ParseConfig([]byte("endpoints:\n- address: 10.0.0.1:8000\n- address: 10.0.0.1:8000\n")); err == nil {
		t.Fatal("duplicate endpoint accepted")
	}
	c, err := ParseConfig([]byte("endpoints:\n- address: 10.0.0.1:8000\n  models: [qwen]\n  block_size: 16\npass_through_unknown_models: true\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Endpoints) != 1 || c.Endpoints[0].Models[0] != "qwen" || !c.PassThroughUnknownModels {
		t.Fatalf("%+v", c)
	}
	path := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(path, []byte("endpoints:\n- address: 10.0.0.1:8000\n"), 0o644)
	if _, _, err := run(t, "serve", "--config", path, "--endpoints", "10.0.0.2:1", "--grpc-addr", "127.0.0.1:0", "--health-addr", "127.0.0.1:0", "--metrics-addr", ""); ExitCode(err) != 2 {
		t.Fatalf("config + --endpoints: %v", err)
	}
}

func TestEnvoyConfigCommand(t *testing.T) {
	out, _, err := run(t, "envoy-config", "--endpoints", "10.0.0.1:8000, [fd00::1]:8000", "--body-mode", "buffered")
	if err != nil {
		t.Fatal(err)
	}
	if err := envoy.Validate([]byte(out)); err != nil {
		t.Fatalf("rendered config does not validate: %v", err)
	}
	if !strings.Contains(out, "BUFFERED") || !strings.Contains(out, "fd00::1") {
		t.Fatal("rendered config lacks the requested settings")
	}
	out, _, err = run(t, "envoy-config", "--endpoints", "10.0.0.1:8000,workers.llm.svc:8000", "--dns-refresh", "10s")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "type: STRICT_DNS") || !strings.Contains(out, "dns_refresh_rate: 10s") || !strings.Contains(out, `"workers.llm.svc"`) {
		t.Fatal("a host name did not make a STRICT_DNS cluster")
	}
	// Worker URLs, as serve --endpoints takes them.
	out, _, err = run(t, "envoy-config", "--endpoints", "http://10.0.0.7:8000/,http://10.0.0.8:8001")
	if err != nil || !strings.Contains(out, "10.0.0.7") || strings.Contains(out, "http://10.0.0.7") {
		t.Fatalf("worker URLs: %v\n%s", err, out)
	}
	for _, bad := range [][]string{{}, {"--endpoints", "bad..host:1"}, {"--endpoints", "0.0.0.0:8000"}, {"--endpoints", "https://10.0.0.1:8443"}, {"--endpoints", "host:1", "--dns-refresh", "-1s"}, {"--endpoints", "10.0.0.1:1", "--body-mode", "x"}} {
		if _, _, err := run(t, append([]string{"envoy-config"}, bad...)...); ExitCode(err) != 2 {
			t.Errorf("%v: %v", bad, err)
		}
	}
}

// TestServeLifecycle starts serve on loopback, checks health and metrics,
// then cancels the context and expects a clean, prompt shutdown.
func TestServeLifecycle(t *testing.T) {
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	ready := make(chan [3]string, 1)
	ls := &Listeners{GRPC: listen(), Health: listen(), Metrics: listen(), Ready: func(g, h, m string) { ready <- [3]string{g, h, m} }}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	o := ServeOptions{Endpoints: "127.0.0.1:8001,127.0.0.1:8002", Policy: "round_robin", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second, DrainTimeout: 100 * time.Millisecond, StopGrace: 100 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text", MetricsAddr: "x"}
	done := make(chan error, 1)
	logs := &syncBuffer{}
	go func() { done <- Serve(ctx, o, slog.New(slog.NewJSONHandler(logs, nil)), ls) }()
	var addrs [3]string
	select {
	case addrs = <-ready:
	case err := <-done:
		t.Fatalf("serve exited: %v", err)
	}
	// The start-up line says which build is serving.
	bi := buildinfo.Read()
	var started bool
	for line := range strings.Lines(logs.String()) {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) != nil || rec["msg"] != "kvbandit serving" {
			continue
		}
		started = true
		if rec["version"] != bi.Version || rec["commit"] != bi.Commit || rec["built"] != bi.Date {
			t.Fatalf("start-up line %s lacks the build %+v", line, bi)
		}
	}
	if !started {
		t.Fatalf("no start-up line in:\n%s", logs)
	}
	conn, err := grpc.NewClient(addrs[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	for _, svc := range []string{"liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"} {
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
		if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("%s: %v %v", svc, r, err)
		}
	}
	resp, err := http.Get("http://" + addrs[2] + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `kvbandit_endpoint_inflight{endpoint="127.0.0.1:8001"} 0`) {
		t.Fatalf("metrics lack the endpoint gauge:\n%s", body)
	}
	buildInfo := fmt.Sprintf(`kvbandit_build_info{commit=%q,date=%q,goversion=%q,version=%q} 1`, bi.Commit, bi.Date, bi.GoVersion, bi.Version)
	if !strings.Contains(string(body), buildInfo) {
		t.Fatalf("metrics lack %s:\n%s", buildInfo, body)
	}
	// The profiler is off unless --pprof asks for it (it exposes heap
	// contents).
	if resp, err := http.Get("http://" + addrs[2] + "/debug/pprof/heap?debug=1"); err != nil || resp.StatusCode != http.StatusNotFound {
		t.Fatalf("pprof without --pprof: %v %v, want 404", resp, err)
	} else {
		resp.Body.Close()
	}
	cancel()
	select {
	case err := <-done:
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("serve returned %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not stop")
	}
}

func TestConfigNamesTheBadField(t *testing.T) {
	cases := map[string]string{
		"router:\n  block_size: 0\n":                  "router.block_size",
		"router:\n  queue_policy: lifo\n":             "router.queue_policy",
		"router:\n  prune_target_ratio: 1.5\n":        "router.prune_target_ratio",
		"router:\n  max_event_blocks_per_worker: 0\n": "router.max_event_blocks_per_worker",
		"kv:\n  overlap_score_weight: -1\n":           "kv.overlap_score_weight",
		"kvbandit:\n  speed:\n    forget: 2\n":        "kvbandit.speed.forget",
		"thompson:\n  lints:\n    forget_rate: 1.5\n": "thompson.lints.forget_rate",
		"thompson:\n  affinity:\n    base: -1\n":      "thompson.affinity.base",
		"prefix_state:\n  max_entries: -5\n":          "prefix_state.max_entries",
		"decision_log:\n  format: xml\n":              "decision_log.format",
	}
	for yaml, field := range cases {
		_, err := ParseConfig([]byte(yaml))
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%q: error %v does not name %s", yaml, err, field)
		}
	}
	c, err := ParseConfig([]byte("router:\n  block_size: 32\nthompson:\n  affinity:\n    base: 0.5\n"))
	if err != nil {
		t.Fatal(err)
	}
	if c.Router.BlockSize != 32 || c.Thompson.Affinity.Base != 0.5 || c.Thompson.LinTS.Lambda == 0 || c.KVBandit.Speed.ObsSigma == 0 {
		t.Fatalf("defaults lost or overrides ignored: %+v", c)
	}
}

func TestRouterFlagsOverrideTheFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(path, []byte("router:\n  block_size: 32\n  queue_threshold: 2\n"), 0o644)
	o := ServeOptions{ConfigPath: path, set: map[string]string{"router-block-size": "64"}}
	c, err := LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.applyFlags(c); err != nil {
		t.Fatal(err)
	}
	if c.Router.BlockSize != 64 || c.Router.QueueThreshold != 2 {
		t.Fatalf("router = %+v", c.Router)
	}
	o = ServeOptions{set: map[string]string{"router-block-size": "-1"}}
	d := DefaultFileConfig()
	if err := o.applyFlags(&d); err == nil {
		t.Fatal("negative --router-block-size accepted")
	}
}

// TestEveryPolicyServes starts the engine for each policy and routes a
// request through its Pick, with the decision log on.
func TestEveryPolicyServes(t *testing.T) {
	for _, name := range []string{"kvbandit", "kv", "thompson", "round_robin", "least_loaded", "random"} {
		t.Run(name, func(t *testing.T) {
			cfg := DefaultFileConfig()
			logPath := filepath.Join(t.TempDir(), "decisions.csv")
			cfg.DecisionLog.Path = logPath
			reg := prometheus.NewRegistry()
			parts, err := buildEngine(ServeOptions{Policy: name, Seed: 3}, &cfg, slog.New(slog.DiscardHandler), reg, nil)
			if err != nil {
				t.Fatal(err)
			}
			set, _ := routing.ParseEndpointList("127.0.0.1:8001,127.0.0.1:8002")
			if err := parts.engine.Update(set); err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				r := &routing.Request{Model: "m", Tokens: []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}, TokenCount: 17}
				r.Hints.PrefixID = "session"
				r.Hints.TotalRequests = 3
				d, err := parts.engine.Pick(t.Context(), r)
				if err != nil {
					t.Fatal(err)
				}
				d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, Latency: time.Duration(10+i) * time.Millisecond, CompletionTokens: 5, CachedTokens: 16})
			}
			if _, err := reg.Gather(); err != nil {
				t.Fatal(err)
			}
			parts.close()
			raw, err := os.ReadFile(logPath)
			if err != nil {
				t.Fatal(err)
			}
			lines := strings.Split(strings.TrimSpace(string(raw)), "\n")
			if len(lines) != 4 || !strings.HasPrefix(lines[0], "ts_epoch_ms,tokens_len,prefix_id,reuse_after,chosen_worker") || !strings.Contains(lines[1], "session") {
				t.Fatalf("decision log:\n%s", raw)
			}
		})
	}
}

func TestTokenizeCommand(t *testing.T) {
	tok := filepath.Join(tokenizertest.Require(t, "qwen3/tokenizer.json"), "qwen3")
	run := func(stdin string, args ...string) []uint32 {
		t.Helper()
		var out, errw bytes.Buffer
		if err := RunIO(t.Context(), append([]string{"tokenize", "--tokenizer", tok}, args...), strings.NewReader(stdin), &out, &errw); err != nil {
			t.Fatalf("%v: %s", err, errw.String())
		}
		var ids []uint32
		if err := json.Unmarshal(out.Bytes(), &ids); err != nil {
			t.Fatalf("output %q: %v", out.String(), err)
		}
		return ids
	}
	// Qwen3: "Hello, world!" is Hello , Ġworld !
	if got := run("Hello, world!"); !slices.Equal(got, []uint32{9707, 11, 1879, 0}) {
		t.Fatalf("text ids %v", got)
	}
	chatIDs := run(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`, "--chat")
	// <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n
	if want := []uint32{151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198}; !slices.Equal(chatIDs, want) {
		t.Fatalf("chat ids %v, want %v", chatIDs, want)
	}
	if err := RunIO(t.Context(), []string{"tokenize"}, strings.NewReader(""), io.Discard, io.Discard); ExitCode(err) != 2 {
		t.Fatalf("no --tokenizer: %v", err)
	}
	if err := RunIO(t.Context(), []string{"tokenize", "--tokenizer", tok, "--chat"}, strings.NewReader("{"), io.Discard, io.Discard); err == nil {
		t.Fatal("bad chat JSON accepted")
	}
}

// FuzzParseConfig: a config file either fails with an error or parses into
// a config that validates (ParseConfig never panics).
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte("router:\n  block_size: 16\nendpoints:\n  - address: 10.0.0.1:8000\n    models: [m]\n"))
	f.Add([]byte("kvbandit:\n  speed:\n    forget: 0.5\nthompson:\n  lints:\n    forget_rate: 0.9\n"))
	f.Add([]byte("discovery:\n  etcd:\n    endpoints: [127.0.0.1:2379]\n"))
	f.Add([]byte("a: &a [x, x]\nb: &b [*a, *a]\n"))
	f.Add([]byte("{\"router\": {\"block_size\": 32}}"))
	f.Fuzz(func(t *testing.T, raw []byte) {
		c, err := ParseConfig(raw)
		if err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("ParseConfig accepted a config that fails Validate: %v", err)
		}
	})
}

// TestUsageErrorsSayUsageOnce: a usage error names itself once ("kvbandit:
// usage: ..."), never "usage: usage:".
func TestUsageErrorsSayUsageOnce(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{
		{},
		{"frobnicate"},
		{"tokenize"},
		{"tokenize", "--tokenizer", "x", "extra"},
		{"register"},
		{"register", "--etcd-endpoints", "127.0.0.1:1", "extra"},
		{"envoy-config"},
		{"bench", "--bogus"},
		{"demo", "--bogus"},
		{"serve", "--bogus"},
	} {
		_, _, err := run(t, args...)
		if !errors.Is(err, ErrUsage) {
			t.Errorf("%q: %v, want a usage error", args, err)
			continue
		}
		if n := strings.Count(strings.ToLower(err.Error()), "usage"); n != 1 {
			t.Errorf("%q: %q says usage %d times", args, err, n)
		}
	}
}

// TestFlagHelpValueNames: every flag's help line shows a type as its value
// name. The flag package takes the first `backquoted` word of a usage
// string as the value name, so a usage quoting a command would print
// "-etcd-endpoints kvbandit register".
func TestFlagHelpValueNames(t *testing.T) {
	t.Parallel()
	types := map[string]bool{"string": true, "int": true, "uint": true, "int64": true, "uint64": true, "float": true, "duration": true, "value": true}
	flagLine := regexp.MustCompile(`^  -([a-z0-9-]+)(?: (.+))?$`)
	for name := range commands() {
		if name == "version" {
			continue
		}
		_, stderr, err := run(t, name, "-h")
		if err != nil {
			t.Fatalf("%s -h: %v", name, err)
		}
		flags := 0
		for _, line := range strings.Split(stderr, "\n") {
			m := flagLine.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			flags++
			if m[2] != "" && !types[m[2]] {
				t.Errorf("%s -h: -%s shows value name %q:\n%s", name, m[1], m[2], line)
			}
		}
		if flags == 0 {
			t.Errorf("%s -h lists no flags:\n%s", name, stderr)
		}
	}
}
