package app

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/internal/cmdline"
	"github.com/kvbandit/kvbandit/internal/simworker"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/sim"
)

// DemoOptions are the `kvbandit demo` flags.
type DemoOptions struct {
	Policy         string
	HTTPAddr       string
	GRPCAddr       string
	HealthAddr     string
	MetricsAddr    string
	SpeedUp        float64
	Sessions       int
	Turns          int
	Baseline       string
	NoBurst        bool
	ExitAfterBurst bool
	Seed           int64
	LogLevel       string
}

// AddFlags registers the options on fs with their defaults.
func (o *DemoOptions) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.Policy, "policy", policy.Default, "routing policy: "+strings.Join(policy.Builtin().Names(), " | "))
	fs.StringVar(&o.HTTPAddr, "http-addr", "127.0.0.1:8080", "standalone OpenAI-compatible proxy listen address")
	fs.StringVar(&o.GRPCAddr, "grpc-addr", "127.0.0.1:9002", "ext_proc gRPC listen address (for an Envoy in front)")
	fs.StringVar(&o.HealthAddr, "health-addr", "127.0.0.1:9003", "gRPC health listen address")
	fs.StringVar(&o.MetricsAddr, "metrics-addr", "127.0.0.1:9090", "Prometheus /metrics and /debug/endpoints listen address")
	fs.Float64Var(&o.SpeedUp, "speed-up", 10, "run the simulated workers this many times faster than the model's real time")
	fs.IntVar(&o.Sessions, "sessions", 8, "agent sessions in the burst")
	fs.IntVar(&o.Turns, "turns", 4, "requests per session (each resends the growing history)")
	fs.StringVar(&o.Baseline, "baseline", "round_robin", "after the burst, run it again with this policy on a fresh fleet and print both side by side ("+demoNoBaseline+" to skip)")
	fs.BoolVar(&o.NoBurst, "no-burst", false, "skip the burst of agent sessions; just serve")
	fs.BoolVar(&o.ExitAfterBurst, "exit-after-burst", false, "exit after the burst's summary instead of serving until Ctrl-C (tests, CI)")
	fs.Int64Var(&o.Seed, "seed", 1, "random seed of the routing policy (0 = random)")
	fs.StringVar(&o.LogLevel, "log-level", "warn", "serve's log level: debug | info | warn | error")
}

// Validate checks the options.
func (o *DemoOptions) Validate() error {
	var errs []error
	if !(o.SpeedUp > 0) || o.SpeedUp > 1e6 {
		errs = append(errs, fmt.Errorf("--speed-up must be in (0, 1e6], got %v", o.SpeedUp))
	}
	if o.Sessions < 1 || o.Sessions > 1000 {
		errs = append(errs, fmt.Errorf("--sessions must be in [1, 1000], got %d", o.Sessions))
	}
	if o.Turns < 1 || o.Turns > 100 {
		errs = append(errs, fmt.Errorf("--turns must be in [1, 100], got %d", o.Turns))
	}
	if o.NoBurst && o.ExitAfterBurst {
		errs = append(errs, errors.New("--no-burst and --exit-after-burst together leave nothing to do"))
	}
	if o.HTTPAddr == "" || o.GRPCAddr == "" || o.HealthAddr == "" || o.MetricsAddr == "" {
		errs = append(errs, errors.New("--http-addr, --grpc-addr, --health-addr and --metrics-addr must not be empty"))
	}
	if !slices.Contains(policy.Builtin().Names(), o.Policy) {
		errs = append(errs, fmt.Errorf("--policy %q: want one of %s", o.Policy, strings.Join(policy.Builtin().Names(), ", ")))
	}
	if o.Baseline != demoNoBaseline && !slices.Contains(policy.Builtin().Names(), o.Baseline) {
		errs = append(errs, fmt.Errorf("--baseline %q: want %s or one of %s", o.Baseline, demoNoBaseline, strings.Join(policy.Builtin().Names(), ", ")))
	}
	if _, err := parseLevel(o.LogLevel); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	return nil
}

// The demo fleet: four workers, the last at half speed. Small caches and
// 16-token blocks keep prefix reuse visible with short prompts.
const (
	demoModel     = "sim-model"
	demoBlockSize = 16
	demoKVBlocks  = 8192
)

var demoSpeeds = []float64{1, 1, 1, 0.5}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o DemoOptions
	o.AddFlags(fs)
	if err := cmdline.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%w: unexpected arguments %q", ErrUsage, fs.Args())
	}
	if err := o.Validate(); err != nil {
		return err
	}
	return Demo(ctx, o, stdout, stderr)
}

// Demo starts a simulated fleet and serve in front of it, sends a burst of
// agent sessions through the standalone proxy, prints a summary, runs the
// same burst against the baseline policy on a fresh fleet and prints both
// side by side, and keeps serving until ctx ends (or returns after the
// burst with ExitAfterBurst).
func Demo(ctx context.Context, o DemoOptions, stdout, stderr io.Writer) error {
	log := newLogger(stderr, o.LogLevel, "text")
	workers, err := startDemoFleet(ctx, o.SpeedUp, log)
	defer func() {
		for _, w := range workers {
			w.Close()
		}
	}()
	if err != nil {
		return err
	}
	// serve, on listeners bound here so that a busy port fails now.
	dir, err := os.MkdirTemp("", "kvbandit-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	so, err := demoServeOptions(o, filepath.Join(dir, "config.json"), workers)
	if err != nil {
		return err
	}
	ls, err := bindDemoListeners(o)
	if err != nil {
		return err
	}
	d := startDemoServe(ctx, so, log, ls)
	defer d.cancel()
	if ready, err := d.waitReady(ctx); !ready {
		return err
	}
	d.printFleet(stdout, o, workers)
	if !o.NoBurst {
		res, end, err := d.burst(ctx, stdout, o, workers)
		if end {
			return err
		}
		if err := runDemoBaseline(ctx, stdout, o, dir, log, res); err != nil {
			if ctx.Err() != nil {
				return d.stop()
			}
			fmt.Fprintf(stdout, "\nbaseline: %v\n", err)
			if o.ExitAfterBurst {
				d.stop()
				return err
			}
		}
	}
	if o.ExitAfterBurst {
		return d.stop()
	}
	printTryIt(stdout, d.proxyURL, d.grpcAddr, d.metricsAddr, workers)
	<-ctx.Done()
	fmt.Fprintln(stdout, "stopping")
	return d.stop()
}

// startDemoFleet starts the simulated workers. On an error it returns the
// ones started, for the caller to close.
func startDemoFleet(ctx context.Context, speedUp float64, log *slog.Logger) ([]*simworker.Server, error) {
	workers := make([]*simworker.Server, 0, len(demoSpeeds))
	for i, speed := range demoSpeeds {
		w, err := simworker.New(simworker.Config{
			Model: demoModel, Addr: "127.0.0.1:0", KVEventsAddr: "tcp://127.0.0.1:0",
			Speed: speed, SpeedUp: speedUp, DefaultMaxTokens: 32,
			Worker: sim.WorkerConfig{KVBlocks: demoKVBlocks, BlockSize: demoBlockSize},
			Logger: log.With("worker", i+1),
		})
		if err != nil {
			return workers, err
		}
		if err := w.Start(ctx); err != nil {
			return workers, err
		}
		workers = append(workers, w)
	}
	return workers, nil
}

// demoServeOptions writes the fleet's endpoints to a config file at
// cfgPath and returns serve's options over it.
func demoServeOptions(o DemoOptions, cfgPath string, workers []*simworker.Server) (ServeOptions, error) {
	var so ServeOptions
	eps := make([]routing.Endpoint, 0, len(workers))
	for _, w := range workers {
		eps = append(eps, routing.Endpoint{
			Key: routing.EndpointKey(w.Addr()), Models: []routing.ModelName{demoModel}, Engine: "vllm",
			BlockSize: demoBlockSize, MaxBatchedTokens: w.Config().Worker.MaxBatchedTokens, KVEvents: w.KVEventsAddr(),
		})
	}
	cfgJSON, err := json.Marshal(map[string]any{"endpoints": eps})
	if err != nil {
		return so, err
	}
	if err := os.WriteFile(cfgPath, cfgJSON, 0o600); err != nil {
		return so, err
	}
	so.AddFlags(flag.NewFlagSet("serve", flag.ContinueOnError)) // serve's defaults
	so.ConfigPath, so.Policy, so.Seed = cfgPath, o.Policy, o.Seed
	so.GRPCAddr, so.HealthAddr, so.MetricsAddr, so.HTTPAddr = o.GRPCAddr, o.HealthAddr, o.MetricsAddr, o.HTTPAddr
	so.ScrapeInterval, so.DrainTimeout, so.StopGrace = 250*time.Millisecond, 2*time.Second, time.Second
	so.LogLevel = o.LogLevel
	return so, so.Validate()
}

// bindDemoListeners binds the proxy, ext_proc, health and metrics
// listeners; on an error it closes the ones bound.
func bindDemoListeners(o DemoOptions) (*Listeners, error) {
	var ls Listeners
	var bound []net.Listener
	for _, b := range []struct {
		l    *net.Listener
		addr string
		flag string
	}{{&ls.HTTP, o.HTTPAddr, "--http-addr"}, {&ls.GRPC, o.GRPCAddr, "--grpc-addr"}, {&ls.Health, o.HealthAddr, "--health-addr"}, {&ls.Metrics, o.MetricsAddr, "--metrics-addr"}} {
		l, err := net.Listen("tcp", b.addr)
		if err != nil {
			for _, l := range bound {
				l.Close()
			}
			return nil, fmt.Errorf("%s: %w", b.flag, err)
		}
		*b.l = l
		bound = append(bound, l)
	}
	return &ls, nil
}

// demoServe is serve running in the background for the demo.
type demoServe struct {
	// ctx is serve's context, which cancel ends.
	ctx    context.Context
	cancel context.CancelFunc
	served chan error
	ready  chan struct{}

	proxyURL, grpcAddr, metricsAddr string
}

// startDemoServe runs Serve on ls in the background.
func startDemoServe(ctx context.Context, so ServeOptions, log *slog.Logger, ls *Listeners) *demoServe {
	d := &demoServe{
		served: make(chan error, 1), ready: make(chan struct{}),
		proxyURL: "http://" + ls.HTTP.Addr().String(), grpcAddr: ls.GRPC.Addr().String(), metricsAddr: ls.Metrics.Addr().String(),
	}
	ls.Ready = func(string, string, string) { close(d.ready) }
	d.ctx, d.cancel = context.WithCancel(ctx)
	go func() { d.served <- Serve(d.ctx, so, log, ls) }()
	return d
}

// stop stops serve and returns what Serve returned.
func (d *demoServe) stop() error {
	d.cancel()
	return <-d.served
}

// waitReady waits until serve is serving. When it is not (serve failed,
// or ctx ended and serve was stopped), it returns false and the error the
// demo ends with.
func (d *demoServe) waitReady(ctx context.Context) (bool, error) {
	select {
	case <-d.ready:
		return true, nil
	case err := <-d.served:
		return false, err
	case <-ctx.Done():
		return false, d.stop()
	}
}

// printFleet prints the workers and serve's addresses.
func (d *demoServe) printFleet(w io.Writer, o DemoOptions, workers []*simworker.Server) {
	fmt.Fprintf(w, "kvbandit demo: %d simulated vLLM workers (model %q, %d-token blocks, %gx real time), policy %s\n",
		len(workers), demoModel, demoBlockSize, o.SpeedUp, o.Policy)
	for i, wk := range workers {
		fmt.Fprintf(w, "  worker-%d  http://%s  speed %.1f  kv events %s\n", i+1, wk.Addr(), demoSpeeds[i], wk.KVEventsAddr())
	}
	fmt.Fprintf(w, "  proxy     %s  (ext_proc %s, metrics http://%s/metrics)\n", d.proxyURL, d.grpcAddr, d.metricsAddr)
}

// burst sends the agent sessions through the proxy and prints their
// summary; it returns the requests' results. It reports whether the demo
// ends here (ctx ended, or every request failed), serve then being
// stopped, and with what error.
func (d *demoServe) burst(ctx context.Context, w io.Writer, o DemoOptions, workers []*simworker.Server) ([]turnResult, bool, error) {
	fmt.Fprintf(w, "\nSending %d agent sessions x %d turns through the proxy (each turn resends the growing history, with x-prefix-id / x-prefix-total-requests)...\n", o.Sessions, o.Turns)
	res, err := d.sendBurst(ctx, o)
	if err != nil {
		return nil, true, d.stop()
	}
	names := make(map[string]string, len(workers))
	for i, wk := range workers {
		names[wk.Addr()] = fmt.Sprintf("worker-%d", i+1)
	}
	printSummary(w, res, workers, names, o.SpeedUp)
	if err := allFailed(res); err != nil {
		d.stop()
		return nil, true, fmt.Errorf("demo: %w", err)
	}
	return res, false, nil
}

// sendBurst runs the agent sessions through serve's proxy and returns
// their results, or ctx's error when it ended first.
func (d *demoServe) sendBurst(ctx context.Context, o DemoOptions) ([]turnResult, error) {
	// Give the KV event subscribers and the first scrape a moment, so
	// the burst starts on an exact, event-fed index.
	select {
	case <-time.After(300 * time.Millisecond):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	res := runBurst(d.ctx, d.proxyURL, o.Sessions, o.Turns)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return res, nil
}

// allFailed returns an error when no request of the burst succeeded.
func allFailed(res []turnResult) error {
	if slices.ContainsFunc(res, func(r turnResult) bool { return r.err == nil }) {
		return nil
	}
	return fmt.Errorf("every request of the burst failed: %w", res[0].err)
}

// demoSystemPrompt is shared by every session, like an agent's tool
// definitions.
var demoSystemPrompt = "You are a coding agent. You can call these tools: " + strings.Repeat("read_file(path), write_file(path, text), run_tests(pattern), search(query); ", 8)

// turnResult is one request of the burst.
type turnResult struct {
	session, turn          int
	endpoint               string
	ttft, latency          time.Duration
	prompt, cached, output int
	err                    error
}

// runBurst runs the agent sessions concurrently, each one turn after the
// other, and returns every request's result.
func runBurst(ctx context.Context, base string, sessions, turns int) []turnResult {
	client := &http.Client{}
	defer client.CloseIdleConnections()
	res := make([]turnResult, sessions*turns)
	var wg sync.WaitGroup
	for s := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Stagger the sessions' starts a little.
			select {
			case <-time.After(time.Duration(s) * 40 * time.Millisecond):
			case <-ctx.Done():
			}
			msgs := []map[string]string{
				{"role": "system", "content": demoSystemPrompt},
				{"role": "user", "content": demoTask(s)},
			}
			for t := range turns {
				r := &res[s*turns+t]
				r.session, r.turn = s, t
				if ctx.Err() != nil {
					r.err = ctx.Err()
					continue
				}
				answer := demoTurn(ctx, client, base, fmt.Sprintf("demo-session-%d", s), turns, msgs, r)
				msgs = append(msgs,
					map[string]string{"role": "assistant", "content": answer},
					map[string]string{"role": "user", "content": demoToolOutput(s, t)})
				select {
				case <-time.After(20 * time.Millisecond): // think time
				case <-ctx.Done():
				}
			}
		}()
	}
	wg.Wait()
	return res
}

// demoTask is a session's first user message: a task and the file it is
// about, a context of about a thousand tokens that only this session has.
func demoTask(s int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Task %d: fix the failing test in package p%d. Here is p%d/main.go:\n", s, s, s)
	for i := range 60 {
		fmt.Fprintf(&b, "func f%d_%d(x int) int { return x*%d + %d }\n", s, i, i+s, i*s)
	}
	return b.String()
}

// demoToolOutput is a tool result of a few hundred tokens.
func demoToolOutput(s, t int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Tool output (session %d, turn %d):\n", s, t)
	for i := range 12 {
		fmt.Fprintf(&b, "p%d/file_%d.go:%d: ok, %d assertions checked\n", s, t, 10*i+s, i*t+1)
	}
	return b.String()
}

// demoTurn sends one streamed chat request and fills r; it returns the
// assistant's answer.
func demoTurn(ctx context.Context, c *http.Client, base, session string, total int, msgs []map[string]string, r *turnResult) string {
	body, _ := json.Marshal(map[string]any{
		"model": demoModel, "messages": msgs, "max_tokens": 64 + 32*(r.turn%3),
		"stream": true, "stream_options": map[string]any{"include_usage": true},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		r.err = err
		return ""
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("x-prefix-id", session)
	req.Header.Set("x-prefix-total-requests", strconv.Itoa(total))
	t0 := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		r.err = err
		return ""
	}
	defer resp.Body.Close()
	r.endpoint = resp.Header.Get(proxy.HeaderEndpoint)
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		r.err = fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(b))
		return ""
	}
	var answer strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens        int `json:"prompt_tokens"`
				CompletionTokens    int `json:"completion_tokens"`
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			continue
		}
		for _, ch := range chunk.Choices {
			if ch.Delta.Content != "" && r.ttft == 0 {
				r.ttft = time.Since(t0)
			}
			answer.WriteString(ch.Delta.Content)
		}
		if u := chunk.Usage; u != nil {
			r.prompt, r.cached, r.output = u.PromptTokens, u.PromptTokensDetails.CachedTokens, u.CompletionTokens
		}
	}
	r.latency = time.Since(t0)
	if err := sc.Err(); err != nil {
		r.err = err
	} else if r.output == 0 {
		r.err = errors.New("no usage in the response")
	}
	return answer.String()
}

func percentile(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(p*float64(len(s))+0.5) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// burstStats are the figures of one burst that the summary and the
// side-by-side comparison print.
type burstStats struct {
	requests, failed, prompt, cached int
	ttftP50, ttftP90                 time.Duration
	// stuck requests went to their session's most used worker, of
	// sessionRequests; whole of sessions stayed on one worker.
	stuck, sessionRequests, whole, sessions int
}

func statsOf(res []turnResult) burstStats {
	var st burstStats
	var ttfts []time.Duration
	perSession := map[int]map[string]int{}
	for _, r := range res {
		if r.err != nil {
			st.failed++
			continue
		}
		st.requests++
		st.prompt += r.prompt
		st.cached += r.cached
		ttfts = append(ttfts, r.ttft)
		if perSession[r.session] == nil {
			perSession[r.session] = map[string]int{}
		}
		perSession[r.session][r.endpoint]++
	}
	st.ttftP50, st.ttftP90 = percentile(ttfts, 0.5), percentile(ttfts, 0.9)
	for _, eps := range perSession {
		n, top := 0, 0
		for _, c := range eps {
			n += c
			top = max(top, c)
		}
		st.stuck += top
		st.sessionRequests += n
		if len(eps) == 1 {
			st.whole++
		}
	}
	st.sessions = len(perSession)
	return st
}

// hitRate is the share of prompt tokens served from a prefix cache, "-"
// without prompt tokens.
func hitRate(cached, prompt int) string {
	if prompt == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(cached)/float64(prompt))
}

// stickiness is the share of a session's requests served by its most used
// worker, over all sessions; "-" without requests.
func (st burstStats) stickiness() string {
	if st.sessionRequests == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(st.stuck)/float64(st.sessionRequests))
}

// modelTime turns a wall-clock duration at speedUp into the model's time.
func modelTime(d time.Duration, speedUp float64) time.Duration {
	return time.Duration(float64(d) * speedUp).Round(time.Millisecond)
}

func printSummary(w io.Writer, res []turnResult, workers []*simworker.Server, names map[string]string, speedUp float64) {
	type agg struct{ requests, prompt, cached int }
	per := map[string]*agg{}
	for _, r := range res {
		if r.err != nil {
			continue
		}
		a := per[r.endpoint]
		if a == nil {
			a = &agg{}
			per[r.endpoint] = a
		}
		a.requests++
		a.prompt += r.prompt
		a.cached += r.cached
	}
	st := statsOf(res)
	fmt.Fprintf(w, "\n%-10s %-21s %5s %9s %13s %13s %9s\n", "worker", "address", "speed", "requests", "prompt tok", "cached tok", "hit rate")
	for i, wk := range workers {
		a := per[wk.Addr()]
		if a == nil {
			a = &agg{}
		}
		fmt.Fprintf(w, "%-10s %-21s %5.1f %9d %13d %13d %9s\n", names[wk.Addr()], wk.Addr(), demoSpeeds[i], a.requests, a.prompt, a.cached, hitRate(a.cached, a.prompt))
	}
	fmt.Fprintf(w, "%-10s %-21s %5s %9d %13d %13d %9s\n", "total", "", "", st.requests, st.prompt, st.cached, hitRate(st.cached, st.prompt))
	if st.failed > 0 {
		fmt.Fprintf(w, "failed requests: %d\n", st.failed)
	}
	fmt.Fprintf(w, "\nKV hit rate: %s of prompt tokens were served from a worker's prefix cache (usage.prompt_tokens_details.cached_tokens / prompt_tokens)\n", hitRate(st.cached, st.prompt))
	fmt.Fprintf(w, "TTFT: p50 %v, p90 %v wall clock (model time at %gx: p50 %v, p90 %v)\n",
		st.ttftP50.Round(100*time.Microsecond), st.ttftP90.Round(100*time.Microsecond), speedUp,
		modelTime(st.ttftP50, speedUp), modelTime(st.ttftP90, speedUp))
	if st.sessionRequests > 0 {
		fmt.Fprintf(w, "Session stickiness: %s of requests went to their session's main worker; %d of %d sessions stayed on one worker\n",
			st.stickiness(), st.whole, st.sessions)
	}
}

func printTryIt(w io.Writer, proxyURL, grpcAddr, metricsAddr string, workers []*simworker.Server) {
	addrs := make([]string, len(workers))
	for i, wk := range workers {
		addrs[i] = wk.Addr()
	}
	msgs := `[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Plan a three-day trip to Lisbon."}]`
	fmt.Fprintf(w, `
Try it (kvbandit keeps serving until Ctrl-C):

  # a one-shot request through the proxy (the x-kvbandit-endpoint response header names the worker)
  curl -si %[1]s/v1/chat/completions -H 'content-type: application/json' \
    -d '{"model":"%[2]s","messages":%[3]s,"max_tokens":16}'

  # an agent session: the same x-prefix-id keeps its turns on the worker holding its cache
  curl -sN %[1]s/v1/chat/completions -H 'content-type: application/json' \
    -H 'x-prefix-id: my-session' -H 'x-prefix-total-requests: 4' \
    -d '{"model":"%[2]s","messages":%[3]s,"max_tokens":16,"stream":true,"stream_options":{"include_usage":true}}'

  # which worker would take it, with every worker's score (nothing is sent)
  curl -s %[1]s/v1/route -H 'content-type: application/json' -d '{"model":"%[2]s","messages":%[3]s}'

  # kvbandit's view of the workers, and its metrics
  curl -s http://%[4]s/debug/endpoints
  curl -s http://%[4]s/metrics | grep ^kvbandit_

With Envoy: the ext_proc server listens on %[5]s. Point an Envoy ext_proc filter at it as
envoy/sidecar.yaml does, or print a validated bootstrap for this fleet with
  kvbandit envoy-config --endpoints %[6]s --ext-proc-addr %[5]s
`, proxyURL, demoModel, msgs, metricsAddr, grpcAddr, strings.Join(addrs, ","))
}
