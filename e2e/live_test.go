package e2e

// The machinery of the live benchmark (issue 21): `make bench-live` runs
// TestBenchLive (bench_live_test.go, tag benchlive), a measurement; the
// suite runs TestBenchLiveSmoke below, a short run of two pickers that
// checks the plumbing, not the ranking. A fleet of llm-d-inference-sim workers, each
// on its own loopback address (127.0.0.2–9, one port, through
// e2e/loopfwd), behind e2e/envoysim; the same requests (e2e/livebench) go
// through each picker in turn, the fleet restarted before each run so that
// every picker starts on cold caches.
//
// Pickers: round_robin (envoysim's own balancing: the ext_proc server
// closes every stream at once), kvbandit (defaults, with the Qwen3
// tokenizer), kvbandit-x3 (three replicas synced over a real
// nats-server), gie and gie-x3 (GIE's EPP v1.5.0 on an InferencePool, one
// or three replicas each with its own state). With several replicas each
// has its own envoysim and every request enters through one of them at
// random. llmd is llm-d's EPP in its approximate configuration
// (live_llmd_test.go).

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/livebench"
	"github.com/kvbandit/kvbandit/e2e/loopfwd"
	"github.com/kvbandit/kvbandit/routing/sim/trace"
)

// The binaries the benchmark's setup builds (bench_live_test.go): a
// non-race kvbandit, GIE's EPP and llm-d's EPP. Without them (the suite's
// smoke test) the race build of kvbandit runs, and gie and llmd cannot.
const (
	envLiveBin  = "KVBANDIT_LIVE_BIN"
	envLiveEPP  = "KVBANDIT_LIVE_EPP"
	envLiveLLMD = "KVBANDIT_LIVE_LLMD"
)

// liveProfile is the deployment every worker models: an 8B model on one
// H100 (SXM, 80 GB). Prefill: 16 GFLOP a token (2 FLOPs per parameter)
// at a third of the H100's 989 TFLOP/s dense BF16 peak is 20k tokens a
// second, 50 µs a token, plus llm-d-inference-sim's own 8b-h100 profile's
// 30 ms overhead (its manifests/latency-profiles; that profile's 250 µs a
// token, 4k tokens a second, is a fifth of what the FLOPs allow). Decode:
// the same profile's 12 ms a token, a load factor of 2.0 at 16 sequences.
// KV cache: 80 GB less 16 GB of FP16 weights, 90% of it for KV, at 128 KiB
// a token for Llama-3.1-8B (2 × 32 layers × 8 KV heads × 128 dims × 2
// bytes) is about 440k tokens: 27,500 blocks of 16. Every latency is
// divided by the time scale, and arrivals come that much faster, so the
// load is the deployment's.
type liveProfile struct {
	prefillOverhead, perToken, itl time.Duration
	loadFactor                     float64
	maxSeqs, kvBlocks, blockSize   int
}

var h100x8B = liveProfile{
	prefillOverhead: 30 * time.Millisecond, perToken: 50 * time.Microsecond, itl: 12 * time.Millisecond,
	loadFactor: 2.0, maxSeqs: 16, kvBlocks: 27500, blockSize: 16,
}

func (p liveProfile) args(port int, scale float64) []string {
	d := func(x time.Duration) string { return time.Duration(float64(x) / scale).String() }
	return []string{"--model", simModel, "--force-dummy-tokenizer", "--port", strconv.Itoa(port),
		"--latency-calculator", "per-token", "--prefill-overhead", d(p.prefillOverhead),
		"--prefill-time-per-token", d(p.perToken), "--inter-token-latency", d(p.itl),
		"--time-factor-under-load", fmt.Sprint(p.loadFactor), "--max-num-seqs", strconv.Itoa(p.maxSeqs),
		"--enable-kvcache", "--kv-cache-size", strconv.Itoa(p.kvBlocks), "--block-size", strconv.Itoa(p.blockSize),
		"--max-model-len", "131072"}
}

// liveFleet is the workers of one run: sims on 127.0.0.1 ports, each
// reached at its own loopback address on port 8000.
type liveFleet struct {
	sims  []*sim
	hosts []string
}

func startLiveFleet(t *testing.T, n int, scale float64) *liveFleet {
	t.Helper()
	f := &liveFleet{}
	for i := range n {
		addr := freeAddr(t)
		_, port, _ := net.SplitHostPort(addr)
		f.sims = append(f.sims, runSim(t, addr, h100x8B.args(atoiLive(port), scale)))
		fw, err := loopfwd.Listen(fmt.Sprintf("127.0.0.%d:8000", i+2), addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = fw.Close() })
		f.hosts = append(f.hosts, fw.Addr())
	}
	return f
}

// prefixHitRate is the fleet's own prefix-cache hit rate, from the
// workers' vllm:prefix_cache_hits_total and _queries_total.
func (f *liveFleet) prefixHitRate(ctx context.Context) (float64, error) {
	var hits, queries float64
	for _, s := range f.sims {
		samples, err := scrapeURL(ctx, "http://"+s.addr+"/metrics")
		if err != nil {
			return 0, err
		}
		// The sim's counters have no _total suffix (v0.10.2); vLLM's do.
		hits += metric(samples, "vllm:prefix_cache_hits", nil) + metric(samples, "vllm:prefix_cache_hits_total", nil)
		queries += metric(samples, "vllm:prefix_cache_queries", nil) + metric(samples, "vllm:prefix_cache_queries_total", nil)
	}
	if queries == 0 {
		return 0, nil
	}
	return hits / queries, nil
}

// liveRun is one picker's measurement of one workload, in the shape of
// BENCH_LIVE_OUT.
type liveRun struct {
	Workload      string  `json:"workload"`
	Picker        string  `json:"picker"`
	Replicas      int     `json:"replicas"`
	Requests      int     `json:"requests"`
	Failed        int     `json:"failed"`
	TTFTP50       float64 `json:"ttft_p50_s"`
	TTFTP90       float64 `json:"ttft_p90_s"`
	TTFTP99       float64 `json:"ttft_p99_s"`
	ITLP90        float64 `json:"itl_p90_s"`
	E2EP90        float64 `json:"e2e_p90_s"`
	PrefixHitRate float64 `json:"prefix_hit_rate"`
	CPUPerReq     float64 `json:"picker_cpu_s_per_req"`

	// reqPerS and ttfts are in the deployment's time too.
	reqPerS float64
	ttfts   []time.Duration
}

// livePickers are the pickers a run can compare.
var livePickers = []string{"round_robin", "kvbandit", "kvbandit-x3", "gie", "gie-x3", "llmd"}

// liveKnobs are the BENCH_LIVE_* settings.
type liveKnobs struct {
	// minutes is the Mooncake slice; scale the time compression (0: each
	// workload's default, scaleOf); rate multiplies the arrival rate on
	// top of it (the load).
	minutes, scale, rate float64
	// traces are BENCH_LIVE_TRACES: more Mooncake-format workloads.
	traces  []liveTrace
	limit   int
	seed    uint64
	pickers []string
	// pprof, when set, makes kvbandit's runs write a CPU profile beside
	// out (BENCH_LIVE_PPROF=1).
	pprof string
	// idle is how long the picker is watched without traffic before a
	// run (its background CPU, reported beside the run's).
	idle time.Duration
	// workloads keeps these workloads only (nil: all).
	workloads []string
	out       string
	workers   int
}

func readLiveKnobs(t *testing.T) liveKnobs {
	k := liveKnobs{minutes: 10, rate: 1, seed: 1, workers: 8, out: "bench-live.json", pickers: livePickers}
	num := func(name string, dst *float64) {
		if v := os.Getenv(name); v != "" {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil || f <= 0 {
				t.Fatalf("%s=%q: want a positive number", name, v)
			}
			*dst = f
		}
	}
	num("BENCH_LIVE_MINUTES", &k.minutes)
	num("BENCH_LIVE_SCALE", &k.scale)
	num("BENCH_LIVE_RATE", &k.rate)
	if v := os.Getenv("BENCH_LIVE_LIMIT"); v != "" {
		k.limit, _ = strconv.Atoi(v)
	}
	if v := os.Getenv("BENCH_LIVE_SEED"); v != "" {
		k.seed, _ = strconv.ParseUint(v, 10, 64)
	}
	k.pprof = os.Getenv("BENCH_LIVE_PPROF")
	if v := os.Getenv("BENCH_LIVE_IDLE"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 {
			t.Fatalf("BENCH_LIVE_IDLE=%q: want a duration", v)
		}
		k.idle = d
	}
	if v := os.Getenv("BENCH_LIVE_WORKLOADS"); v != "" {
		k.workloads = strings.Split(v, ",")
	}
	if v := os.Getenv("BENCH_LIVE_TRACES"); v != "" {
		var err error
		if k.traces, err = parseLiveTraces(v); err != nil {
			t.Fatalf("BENCH_LIVE_TRACES: %v", err)
		}
	}
	if v := os.Getenv("BENCH_LIVE_PICKERS"); v != "" {
		k.pickers = strings.Split(v, ",")
	}
	for _, p := range k.pickers {
		if !slices.Contains(livePickers, p) {
			t.Fatalf("BENCH_LIVE_PICKERS: %q is none of %s", p, strings.Join(livePickers, ", "))
		}
	}
	k.out = cmp.Or(os.Getenv("BENCH_LIVE_OUT"), k.out)
	return k
}

// liveTrace is one BENCH_LIVE_TRACES entry: a Mooncake-format file run
// as the workload name.
type liveTrace struct {
	name, path string
}

// parseLiveTraces reads BENCH_LIVE_TRACES, "path:format,...": format is
// mooncake (the one format whose hash ids become shared text); the
// workload is named after the file, without its extension.
func parseLiveTraces(v string) ([]liveTrace, error) {
	var out []liveTrace
	for _, e := range strings.Split(v, ",") {
		i := strings.LastIndexByte(e, ':')
		if i <= 0 {
			return nil, fmt.Errorf("%q: want path:mooncake", e)
		}
		path, format := e[:i], e[i+1:]
		if format != "mooncake" {
			return nil, fmt.Errorf("%q: format %q, want mooncake", e, format)
		}
		name := strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
		if slices.Contains([]string{"mooncake", "agentic", "agentic-nohints"}, name) ||
			slices.ContainsFunc(out, func(t liveTrace) bool { return t.name == name }) {
			name = fmt.Sprintf("trace%d-%s", len(out)+1, name)
		}
		out = append(out, liveTrace{name: name, path: path})
	}
	return out, nil
}

// scaleOf is the time compression of workload w: BENCH_LIVE_SCALE, or by
// default 5 for the agentic workloads and 1 (real time) for traces. On 2
// cores the Mooncake slice compressed 5x overloaded every picker alike
// (the workers and the proxy need more CPU than the machine has), while
// the agentic workloads' shorter prompts keep up at 5x.
func (k liveKnobs) scaleOf(w string) float64 {
	switch {
	case k.scale > 0:
		return k.scale
	case strings.HasPrefix(w, "agentic"):
		return 5
	}
	return 1
}

// liveWorkloads are the workloads of issue 21: a slice of the Mooncake
// conversation trace, the agentic generator with and without hints, and
// any BENCH_LIVE_TRACES.
func liveWorkloads(t *testing.T, k liveKnobs) map[string]livebench.Workload {
	t.Helper()
	opt := func(w string) livebench.Options {
		return livebench.Options{Window: time.Duration(k.minutes * float64(time.Minute)), RateScale: k.scaleOf(w) * k.rate,
			Seed: k.seed, Limit: k.limit, Model: simModel}
	}
	out := map[string]livebench.Workload{}
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	traces := append([]liveTrace{{name: "mooncake", path: filepath.Join(root, "traces", "mooncake", "conversation_trace.jsonl")}}, k.traces...)
	for _, tr := range traces {
		f, err := os.Open(tr.path)
		if err != nil {
			t.Fatal(err)
		}
		out[tr.name], _, err = livebench.ReadMooncake(f, opt(tr.name))
		f.Close()
		if err != nil {
			t.Fatalf("%s: %v", tr.path, err)
		}
	}
	// Half a session a second: about 3 requests a second in steady state
	// (6 turns 10 s apart), of some 2k-8k prompt tokens, within the fleet's
	// prefill capacity (8 × 20,000 tokens a second at 50 µs a token) once
	// prefixes are reused.
	ag := trace.AgenticConfig{Sessions: max(int(k.minutes*60*0.5), 1), SessionRate: 0.5, Turns: 6, ThinkTime: 10 * time.Second,
		Seed: int64(k.seed), Model: simModel}
	for _, strip := range []bool{false, true} {
		name := "agentic"
		if strip {
			name = "agentic-nohints"
		}
		o := opt(name)
		o.Window, o.StripHints = 0, strip
		if out[name], err = livebench.Agentic(ag, o); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

func runLive(t *testing.T, k liveKnobs, wname, pname string, w livebench.Workload) liveRun {
	scale := k.scaleOf(wname)
	fleet := startLiveFleet(t, k.workers, scale)
	var p livePicker
	switch pname {
	case "round_robin":
		p = startRoundRobin(t)
	case "kvbandit":
		admin := ""
		if k.pprof != "" {
			admin = freeAddr(t)
		}
		p = startLiveKvbandit(t, fleet.hosts, admin, admin != "")
	case "kvbandit-x3":
		p = startLiveKvbanditSynced(t, fleet.hosts, 3)
	case "gie":
		p = startLiveGIE(t, fleet.hosts, 1)
	case "gie-x3":
		p = startLiveGIE(t, fleet.hosts, 3)
	case "llmd":
		p = startLiveLLMD(t, fleet.hosts)
	}
	// One envoysim per replica: each request enters through one of them
	// at random (livebench.Client.URLs).
	var urls []string
	for _, addr := range p.addrs {
		px, err := envoysim.New(envoysim.Config{ExtProcAddr: addr, Hosts: fleet.hosts, DiscardHistory: true,
			MessageTimeout: 10 * time.Second, RequestBodyMode: p.mode, ResponseBodyMode: p.mode})
		if err != nil {
			t.Fatal(err)
		}
		if err := px.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = px.Close() })
		urls = append(urls, px.URL()+"/v1/chat/completions")
	}
	idle, err := idleCPU(p, k.idle) // the picker's CPU share with no traffic (cores)
	if err != nil {
		t.Fatal(err)
	}
	before, err := p.cpu()
	if err != nil {
		t.Fatal(err)
	}
	c := &livebench.Client{URLs: urls, Seed: k.seed}
	profiled := make(chan struct{})
	if p.admin != "" {
		go func() {
			defer close(profiled)
			profileCPU(t, p.admin, w.Span()*9/10, strings.TrimSuffix(k.out, ".json")+"-"+wname+"-"+pname+".pprof")
		}()
	} else {
		close(profiled)
	}
	run, err := c.Run(t.Context(), w.Requests)
	<-profiled
	if err != nil {
		t.Fatal(err)
	}
	s := livebench.Summarize(run)
	// Times are reported in the deployment's time: the run's × scale.
	sec := func(ms float64) float64 { return ms / 1e3 * scale }
	r := liveRun{Workload: wname, Picker: pname, Replicas: len(p.addrs), Requests: s.Requests, Failed: s.Failed,
		TTFTP50: sec(s.TTFTP50Ms), TTFTP90: sec(s.TTFTP90Ms), TTFTP99: sec(s.TTFTP99Ms),
		ITLP90: sec(s.ITLP90Ms), E2EP90: sec(s.E2EP90Ms), reqPerS: s.RequestsPerS / scale}
	for _, d := range livebench.TTFTs(run) {
		r.ttfts = append(r.ttfts, time.Duration(float64(d)*scale))
	}
	if len(p.pids) > 0 {
		after, err := p.cpu()
		if err != nil {
			t.Fatal(err)
		}
		r.CPUPerReq = (after - before).Seconds() / float64(max(s.Requests, 1))
		t.Logf("%s: %.3f cores idle before the run (%v), %.3f cores during it (%d requests in %v)", pname, idle, k.idle,
			(after-before).Seconds()/run.Elapsed.Seconds(), s.Requests, run.Elapsed.Round(time.Second))
	}
	if r.PrefixHitRate, err = fleet.prefixHitRate(t.Context()); err != nil {
		t.Fatal(err)
	}
	if s.Failed > 0 {
		t.Errorf("%s on %s: %d of %d requests failed: %v", pname, wname, s.Failed, s.Requests, s.Failures)
	}
	return r
}

func reportLive(t *testing.T, k liveKnobs, names []string, runs []liveRun) {
	if err := os.MkdirAll(filepath.Dir(k.out), 0o755); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\n%d workers modelling an 8B model on one H100 each (liveProfile); times in the deployment's time\n", k.workers)
	for _, wname := range names {
		fmt.Fprintf(&b, "\n%s (time compressed %gx)\n%-14s %9s %9s %9s %9s %9s %8s %7s %8s %12s\n", wname, k.scaleOf(wname), "picker", "TTFT p50", "p90", "p99",
			"ITL p90", "E2E p90", "req/s", "failed", "hit rate", "CPU ms/req")
		var series []livebench.Series
		for _, r := range runs {
			if r.Workload != wname {
				continue
			}
			sec := func(v float64) string {
				return time.Duration(v * float64(time.Second)).Round(time.Millisecond).String()
			}
			fmt.Fprintf(&b, "%-14s %9s %9s %9s %9s %9s %8.1f %7d %7.1f%% %12.2f\n", liveLabel(r.Picker), sec(r.TTFTP50), sec(r.TTFTP90),
				sec(r.TTFTP99), sec(r.ITLP90), sec(r.E2EP90), r.reqPerS, r.Failed, 100*r.PrefixHitRate, 1e3*r.CPUPerReq)
			series = append(series, livebench.Series{Name: liveLabel(r.Picker), TTFT: r.ttfts})
		}
		if err := livebench.WriteTTFTCDF(strings.TrimSuffix(k.out, ".json")+"-"+wname+".png", series); err != nil {
			t.Error(err)
		}
	}
	t.Log(b.String())
	js, err := json.MarshalIndent(map[string]any{"runs": runs}, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(k.out), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(k.out, js, 0o644); err != nil {
		t.Fatal(err)
	}
}

// liveLabel is a picker's name in the tables and plots: llmd's row says
// that it runs llm-d's approximate configuration (the JSON keeps the name).
func liveLabel(picker string) string {
	if picker == "llmd" {
		return "llmd-approx"
	}
	return picker
}

func atoiLive(s string) int {
	n, _ := strconv.Atoi(s)
	return n
}

// TestBenchLiveSmoke runs the live benchmark small: two pickers, a minute
// of each workload cut to 120 requests, time compressed 10x. It checks the
// plumbing (every request answered, the report and its JSON written, the
// workers' caches reused under kvbandit), not the ranking.
func TestBenchLiveSmoke(t *testing.T) {
	dir := t.TempDir()
	// A small Mooncake-format file, as BENCH_LIVE_TRACES adds one: 40
	// requests a second apart, sharing a 1,024-token prefix in pairs.
	var tr strings.Builder
	for i := range 40 {
		fmt.Fprintf(&tr, `{"timestamp": %d, "input_length": 1200, "output_length": 40, "hash_ids": [0, %d, %d]}`+"\n", i*1000, 1+i/2, 100+i)
	}
	extra := filepath.Join(dir, "pairs.jsonl")
	if err := os.WriteFile(extra, []byte(tr.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	traces, err := parseLiveTraces(extra + ":mooncake")
	if err != nil {
		t.Fatal(err)
	}
	k := liveKnobs{minutes: 1, scale: 10, rate: 1, limit: 120, seed: 1, workers: 8, traces: traces,
		pickers: []string{"round_robin", "kvbandit"}, out: filepath.Join(dir, "bench-live.json")}
	runs := benchLive(t, k)
	if t.Failed() {
		return
	}
	b, err := os.ReadFile(k.out)
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Runs []liveRun `json:"runs"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Runs) != 8 || len(runs) != 8 {
		t.Fatalf("%d runs in %s, want 8 (4 workloads x 2 pickers)", len(got.Runs), k.out)
	}
	for _, r := range got.Runs {
		if r.Requests == 0 || r.Failed != 0 || r.TTFTP50 <= 0 {
			t.Errorf("%s/%s: %d requests, %d failed, TTFT p50 %vs", r.Workload, r.Picker, r.Requests, r.Failed, r.TTFTP50)
		}
		if r.Workload == "agentic" && r.Picker == "kvbandit" && r.PrefixHitRate <= 0 {
			t.Errorf("agentic/kvbandit: the workers report no prefix-cache hit")
		}
	}
	for _, w := range []string{"agentic", "agentic-nohints", "mooncake", "pairs"} {
		if _, err := os.Stat(strings.TrimSuffix(k.out, ".json") + "-" + w + ".png"); err != nil {
			t.Error(err)
		}
	}
}

// TestLiveKnobs: BENCH_LIVE_TRACES entries and the time compression of
// each workload.
func TestLiveKnobs(t *testing.T) {
	got, err := parseLiveTraces("/a/b/conv.jsonl:mooncake,/c/mooncake.jsonl:mooncake,/d/conv.json:mooncake")
	if err != nil {
		t.Fatal(err)
	}
	want := []liveTrace{{"conv", "/a/b/conv.jsonl"}, {"trace2-mooncake", "/c/mooncake.jsonl"}, {"trace3-conv", "/d/conv.json"}}
	if !slices.Equal(got, want) {
		t.Errorf("parseLiveTraces: %v, want %v", got, want)
	}
	for _, bad := range []string{"x.jsonl", "x.jsonl:azure", ":mooncake"} {
		if _, err := parseLiveTraces(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
	k := liveKnobs{}
	if k.scaleOf("agentic-nohints") != 5 || k.scaleOf("mooncake") != 1 || k.scaleOf("conv") != 1 {
		t.Errorf("default scales: agentic %v, mooncake %v", k.scaleOf("agentic"), k.scaleOf("mooncake"))
	}
	k.scale = 3
	if k.scaleOf("agentic") != 3 || k.scaleOf("mooncake") != 3 {
		t.Error("BENCH_LIVE_SCALE is not every workload's")
	}
}

// benchLive runs every workload through every picker (the order rotating
// with the workload and the seed), on a fresh fleet each time, and reports a table per
// workload, k.out and a TTFT CDF per workload.
func benchLive(t *testing.T, k liveKnobs) []liveRun {
	workloads := liveWorkloads(t, k)
	names := slices.Sorted(maps.Keys(workloads))
	if k.workloads != nil {
		names = slices.DeleteFunc(names, func(n string) bool { return !slices.Contains(k.workloads, n) })
		if len(names) == 0 {
			t.Fatalf("BENCH_LIVE_WORKLOADS=%s: none of %s", strings.Join(k.workloads, ","), strings.Join(slices.Sorted(maps.Keys(workloads)), ", "))
		}
	}
	var runs []liveRun
	for wi, wname := range names {
		w := workloads[wname]
		for pi := range k.pickers {
			p := k.pickers[(pi+wi+int(k.seed%uint64(len(k.pickers))))%len(k.pickers)]
			t.Run(wname+"/"+p, func(t *testing.T) {
				runs = append(runs, runLive(t, k, wname, p, w))
			})
		}
	}
	reportLive(t, k, names, runs)
	return runs
}
