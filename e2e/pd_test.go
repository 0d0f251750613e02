package e2e

// Prefill/decode disaggregation with llm-d's real P/D sidecar
// (tools/pd-sidecar, llm-d-inference-scheduler v0.4.0 cmd/pd-sidecar) in
// front of llm-d-inference-sim decode workers, and llm-d-inference-sim
// prefill workers. docs/pd.md describes the protocol these tests pin down.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
)

// The P/D sims' latencies. A decode sim answers a request that carries
// kv_transfer_params.do_remote_prefill after pdTransferLatency (the
// simulated KV transfer) instead of pdTTFT, and reports that as its time
// to first token: the TTFT histogram's bucket le=pdFastBucket tells
// aggregated requests (below it) from disaggregated ones (above it).
const (
	pdTTFT            = "10ms"
	pdTransferLatency = "100ms"
	pdFastBucket      = "0.06"
)

// headerPrefiller is llm-d's P/D header: the prefill worker ("ip:port")
// the sidecar sends the prefill stage to.
const headerPrefiller = "x-prefiller-host-port"

// startPDSim runs an llm-d-inference-sim for a P/D fleet (prefill or
// decode: the sim plays either role, by the request's kv_transfer_params)
// on a fresh loopback port.
func startPDSim(t *testing.T) *sim {
	t.Helper()
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	return runSim(t, addr, []string{"--model", simModel, "--force-dummy-tokenizer", "--port", port, "--mode", "echo",
		"--time-to-first-token", pdTTFT, "--inter-token-latency", "2ms", "--max-num-seqs", "8",
		"--kv-cache-transfer-latency", pdTransferLatency})
}

// sidecar is one pd-sidecar process.
type sidecar struct {
	addr   string // 127.0.0.1:port (it listens on every interface: the suite's namespace)
	decode *sim   // the decode sim behind it (--vllm-port)
	tls    bool   // serves HTTPS with its self-signed certificate
	proc
}

// startSidecar runs a pd-sidecar in front of decode with the NIXL v2
// connector, plain HTTP unless useTLS (then its self-signed certificate:
// --secure-proxy's default), SSRF protection off (it needs an
// InferencePool in a Kubernetes API server), and the log level that prints
// the bodies it sends (--zap-log-level=5), and waits for its /health.
func startSidecar(t *testing.T, decode *sim, useTLS bool) *sidecar {
	t.Helper()
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	_, vllmPort, _ := net.SplitHostPort(decode.addr)
	s := &sidecar{addr: addr, decode: decode, tls: useTLS}
	s.proc = startProc(t, "pd-sidecar "+addr, sidecarBin, []string{"--port", port, "--vllm-port", vllmPort,
		"--connector", "nixlv2", fmt.Sprintf("--secure-proxy=%v", useTLS), "--zap-log-level=5"}, s.client(t), s.url()+"/health")
	return s
}

func (s *sidecar) url() string {
	if s.tls {
		return "https://" + s.addr
	}
	return "http://" + s.addr
}

// client talks to the sidecar (its self-signed certificate is accepted).
func (s *sidecar) client(t *testing.T) *http.Client {
	tr := &http.Transport{DisableCompression: true}
	if s.tls {
		tr.TLSClientConfig = &tls.Config{InsecureSkipVerify: true}
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 60 * time.Second}
}

// sidecarStage is one request the sidecar logged sending (at log level 5).
type sidecarStage struct {
	Prefill bool           // the prefill stage ("Prefill request"); else the decode stage
	Body    map[string]any // the JSON body it sent
}

// stages returns the prefill and decode requests the sidecar has sent so
// far, in order, from its own log.
func (s *sidecar) stages(t *testing.T) []sidecarStage {
	t.Helper()
	var out []sidecarStage
	sc := bufio.NewScanner(strings.NewReader(s.out.String()))
	sc.Buffer(nil, 4<<20)
	for sc.Scan() {
		var line struct {
			Msg  string `json:"msg"`
			Body string `json:"body"`
		}
		if json.Unmarshal(sc.Bytes(), &line) != nil || line.Body == "" {
			continue
		}
		var st sidecarStage
		switch line.Msg {
		case "Prefill request":
			st.Prefill = true
		case "sending request to decoder":
		default:
			continue
		}
		if err := json.Unmarshal([]byte(line.Body), &st.Body); err != nil {
			t.Fatalf("pd-sidecar logged a body that is not JSON: %v: %s", err, line.Body)
		}
		out = append(out, st)
	}
	return out
}

// pdFleet is a P/D fleet: prefill sims, and decode sims each behind a
// sidecar (the decode endpoints a router sends requests to).
type pdFleet struct {
	prefill  []*sim
	sidecars []*sidecar
}

// startPDFleet starts nPrefill prefill sims and nDecode decode sims with
// their sidecars (plain HTTP), all on 127.0.0.1.
func startPDFleet(t *testing.T, nPrefill, nDecode int) *pdFleet {
	t.Helper()
	f := &pdFleet{}
	for range nPrefill {
		f.prefill = append(f.prefill, startPDSim(t))
	}
	for range nDecode {
		f.sidecars = append(f.sidecars, startSidecar(t, startPDSim(t), false))
	}
	return f
}

func (f *pdFleet) sidecarAddrs() []string {
	var out []string
	for _, s := range f.sidecars {
		out = append(out, s.addr)
	}
	return out
}

func (f *pdFleet) prefillAddrs() []string {
	var out []string
	for _, s := range f.prefill {
		out = append(out, s.addr)
	}
	return out
}

// sidecarAt returns the fleet's sidecar listening on addr.
func (f *pdFleet) sidecarAt(t *testing.T, addr string) *sidecar {
	t.Helper()
	for _, s := range f.sidecars {
		if s.addr == addr {
			return s
		}
	}
	t.Fatalf("no sidecar at %q (sidecars: %v)", addr, f.sidecarAddrs())
	return nil
}

// simCounts is what a sim has served, from its own /metrics.
type simCounts struct {
	requests     float64 // vllm:request_success_total, every finish reason
	remoteDecode float64 // ... with finish_reason remote_decode: prefill-only requests
	maxTokensSum float64 // vllm:request_params_max_tokens_sum
	ttft         float64 // vllm:time_to_first_token_seconds_count
	ttftFast     float64 // ... in buckets up to pdFastBucket (aggregated requests)
}

// disaggregated is how many requests were decoded after a remote prefill.
func (c simCounts) disaggregated() float64 { return c.ttft - c.ttftFast }

func (c simCounts) String() string {
	return fmt.Sprintf("requests %v (remote_decode %v, max_tokens sum %v), TTFT count %v (<= %ss: %v)",
		c.requests, c.remoteDecode, c.maxTokensSum, c.ttft, pdFastBucket, c.ttftFast)
}

func (s *sim) counts(ctx context.Context) (simCounts, error) {
	ss, err := scrapeURL(ctx, "http://"+s.addr+"/metrics")
	if err != nil {
		return simCounts{}, err
	}
	return simCounts{
		requests:     metric(ss, "vllm:request_success_total", nil),
		remoteDecode: metric(ss, "vllm:request_success_total", map[string]string{"finish_reason": "remote_decode"}),
		maxTokensSum: metric(ss, "vllm:request_params_max_tokens_sum", nil),
		ttft:         metric(ss, "vllm:time_to_first_token_seconds_count", nil),
		ttftFast:     metric(ss, "vllm:time_to_first_token_seconds_bucket", map[string]string{"le": pdFastBucket}),
	}, nil
}

// waitCounts waits until the sim's counts are want (the sim updates its
// metrics asynchronously, after the response).
func (s *sim) waitCounts(t *testing.T, want simCounts) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		got, err := s.counts(ctx)
		if err != nil {
			return false, err.Error()
		}
		return got == want, fmt.Sprintf("sim %s: %v, want %v", s.addr, got, want)
	}); err != nil {
		t.Fatal(err)
	}
}

// completion is a /v1/completions body with a token-id prompt (the sims
// and kvbandit count the same tokens), streamed with usage.
func completion(prompt []uint32, maxTokens int) []byte {
	b, _ := json.Marshal(map[string]any{"model": simModel, "prompt": prompt, "max_tokens": maxTokens,
		"stream": true, "stream_options": map[string]any{"include_usage": true}})
	return b
}

// checkStream checks a streamed completion: 200, SSE, ends with [DONE].
func checkStream(t *testing.T, r response) {
	t.Helper()
	if r.status != 200 || !strings.HasPrefix(r.header.Get("Content-Type"), "text/event-stream") ||
		!bytes.HasSuffix(bytes.TrimSpace(r.body), []byte("data: [DONE]")) {
		t.Fatalf("want a complete SSE stream, got %d %q: %s", r.status, r.header.Get("Content-Type"), r.body)
	}
}

// setHeader returns the value kvbandit set for name in the request-path
// header mutations of x, and whether it set it; removed reports whether it
// removed it.
func setHeader(x envoysim.Exchange, name string) (value string, set, removed bool) {
	for _, m := range x.Received() {
		mut := m.GetRequestHeaders().GetResponse().GetHeaderMutation()
		if mut == nil {
			mut = m.GetRequestBody().GetResponse().GetHeaderMutation()
		}
		for _, h := range mut.GetSetHeaders() {
			if strings.EqualFold(h.GetHeader().GetKey(), name) {
				value, set = string(h.GetHeader().GetRawValue()), true
			}
		}
		if slices.ContainsFunc(mut.GetRemoveHeaders(), func(k string) bool { return strings.EqualFold(k, name) }) {
			removed = true
		}
	}
	return value, set, removed
}

// TestPDSidecarProtocol pins down what llm-d's pd-sidecar v0.4.0 does with
// the NIXL v2 connector, against real sims, without kvbandit:
//   - with x-prefiller-host-port naming a prefill sim, it sends that sim
//     the request with max_tokens and max_completion_tokens 1, stream off,
//     stream_options dropped and kv_transfer_params {do_remote_decode:
//     true, do_remote_prefill: false}; the sim answers with finish reason
//     remote_decode and kv_transfer_params {do_remote_prefill: true,
//     remote_block_ids, remote_engine_id, remote_host, remote_port}, which
//     the sidecar forwards to its decode sim with the client's max_tokens,
//     stream and stream_options; the decode sim waits the simulated KV
//     transfer instead of a prefill, and the stream comes back whole;
//   - without the header it proxies straight to its decode sim;
//   - when the named prefill worker is down it answers 502 with an empty
//     body and does not fall back to a local prefill;
//   - with --secure-proxy (its default) it serves the same over HTTPS with
//     a self-signed certificate.
func TestPDSidecarProtocol(t *testing.T) {
	prefill := startPDSim(t)
	sc := startSidecar(t, startPDSim(t), false)
	c := sc.client(t)
	prompt := ids(1, 64)

	r := send(t, c, "POST", sc.url()+"/v1/completions", completion(prompt, 4), map[string]string{headerPrefiller: prefill.addr})
	checkStream(t, r)
	prefill.waitCounts(t, simCounts{requests: 1, remoteDecode: 1, maxTokensSum: 1, ttft: 1, ttftFast: 1})
	sc.decode.waitCounts(t, simCounts{requests: 1, maxTokensSum: 4, ttft: 1, ttftFast: 0})

	st := sc.stages(t)
	if len(st) != 2 || !st[0].Prefill || st[1].Prefill {
		t.Fatalf("sidecar stages %+v, want a prefill then a decode request", st)
	}
	p, d := st[0].Body, st[1].Body
	kvp, _ := p["kv_transfer_params"].(map[string]any)
	if p["max_tokens"] != 1.0 || p["max_completion_tokens"] != 1.0 || p["stream"] != false || p["stream_options"] != nil ||
		kvp["do_remote_decode"] != true || kvp["do_remote_prefill"] != false {
		t.Errorf("prefill request %v: want max_tokens 1, max_completion_tokens 1, stream false, no stream_options, do_remote_decode", p)
	}
	kvd, _ := d["kv_transfer_params"].(map[string]any)
	if d["max_tokens"] != 4.0 || d["max_completion_tokens"] != nil || d["stream"] != true || d["stream_options"] == nil ||
		kvd["do_remote_prefill"] != true || kvd["do_remote_decode"] != false || kvd["remote_block_ids"] == nil || kvd["remote_engine_id"] == nil {
		t.Errorf("decode request %v: want the client's max_tokens/stream/stream_options and the prefill's kv_transfer_params (do_remote_prefill)", d)
	}
	for _, b := range []map[string]any{p, d} {
		if got, _ := json.Marshal(b["prompt"]); string(got) != string(must(json.Marshal(prompt))) {
			t.Errorf("prompt changed on the way: %s", got)
		}
	}

	// No header: straight to the decode sim, which prefills itself.
	r = send(t, c, "POST", sc.url()+"/v1/completions", completion(ids(2, 64), 4), nil)
	checkStream(t, r)
	sc.decode.waitCounts(t, simCounts{requests: 2, maxTokensSum: 8, ttft: 2, ttftFast: 1})
	prefill.waitCounts(t, simCounts{requests: 1, remoteDecode: 1, maxTokensSum: 1, ttft: 1, ttftFast: 1})

	// A prefill worker that is down: 502, empty body, no local fallback.
	r = send(t, c, "POST", sc.url()+"/v1/completions", completion(ids(3, 64), 4), map[string]string{headerPrefiller: freeAddr(t)})
	if r.status != http.StatusBadGateway || len(r.body) != 0 {
		t.Errorf("dead prefiller: %d %q, want 502 and no body", r.status, r.body)
	}
	time.Sleep(200 * time.Millisecond) // the decode sim must not get it
	sc.decode.waitCounts(t, simCounts{requests: 2, maxTokensSum: 8, ttft: 2, ttftFast: 1})

	// The sidecar's default, HTTPS with a self-signed certificate.
	tsc := startSidecar(t, startPDSim(t), true)
	r = send(t, tsc.client(t), "POST", tsc.url()+"/v1/completions", completion(ids(4, 64), 4), map[string]string{headerPrefiller: prefill.addr})
	checkStream(t, r)
	prefill.waitCounts(t, simCounts{requests: 2, remoteDecode: 2, maxTokensSum: 2, ttft: 2, ttftFast: 2})
	tsc.decode.waitCounts(t, simCounts{requests: 1, maxTokensSum: 4, ttft: 1, ttftFast: 0})
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// TestPDSidecarEndpointsAggregated runs kvbandit as it is without endpoint
// roles in front of sidecars: requests through the Envoy-faithful proxy go
// to the sidecars, kvbandit sets no x-prefiller-host-port, so every request
// is served aggregated by the decode sims (the prefill sim sees nothing),
// and kvbandit scrapes the decode sims' metrics through the sidecars.
func TestPDSidecarEndpointsAggregated(t *testing.T) {
	f := startPDFleet(t, 1, 2)
	k := startKvbandit(t, f.sidecarAddrs(), "--scrape-interval", "200ms")
	k.waitScraped(t, k.endpoints)
	px := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)
	for i := range 4 {
		checkStream(t, send(t, c, "POST", px.URL()+"/v1/completions", completion(ids(uint32(10+i), 64), 3), nil))
	}
	xs, err := px.WaitExchanges(t.Context(), 4)
	if err != nil {
		t.Fatal(err)
	}
	served := map[string]float64{}
	for _, x := range xs {
		if x.Fallback || x.Upstream != x.Destination {
			t.Fatalf("exchange %d: destination %q upstream %q fallback %v", x.ID, x.Destination, x.Upstream, x.Fallback)
		}
		if v, set, _ := setHeader(x, headerPrefiller); set {
			t.Errorf("exchange %d: kvbandit set %s: %q with no prefill endpoints", x.ID, headerPrefiller, v)
		}
		served[x.Upstream]++
	}
	for _, s := range f.sidecars {
		n := served[s.addr]
		if n == 0 {
			t.Errorf("sidecar %s served nothing: %v", s.addr, served)
		}
		s.decode.waitCounts(t, simCounts{requests: n, maxTokensSum: 3 * n, ttft: n, ttftFast: n})
		if st := s.stages(t); len(st) != 0 {
			t.Errorf("sidecar %s ran the P/D protocol: %+v", s.addr, st)
		}
	}
	f.prefill[0].waitCounts(t, simCounts{})
	k.waitReleased(t)
}

// TestPDSpoofedPrefillerHeader: a client's x-prefiller-host-port never
// reaches a sidecar through kvbandit (here without endpoint roles; see
// TestPDSpoofedPrefillerHeaderWithRoles for the P/D pool). The header
// names a trap sim outside kvbandit's endpoint set: a sidecar that saw it
// would send the trap a prefill request (TestPDSidecarProtocol).
func TestPDSpoofedPrefillerHeader(t *testing.T) {
	f := startPDFleet(t, 0, 2)
	trap := startPDSim(t)
	k := startKvbandit(t, f.sidecarAddrs(), "--scrape-interval", "200ms")
	k.waitScraped(t, k.endpoints)
	px := startProxy(t, k, envoysim.Config{})
	c := httpClient(t)
	for i := range 4 {
		checkStream(t, send(t, c, "POST", px.URL()+"/v1/completions", completion(ids(uint32(20+i), 256), 3),
			map[string]string{headerPrefiller: trap.addr}))
	}
	xs, err := px.WaitExchanges(t.Context(), 4)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range xs {
		if v, set, removed := setHeader(x, headerPrefiller); set || !removed {
			t.Errorf("exchange %d: %s set %v (%q), removed %v; want removed", x.ID, headerPrefiller, set, v, removed)
		}
	}
	time.Sleep(200 * time.Millisecond) // a prefill sent to the trap would have landed by now
	trap.waitCounts(t, simCounts{})
	for _, s := range f.sidecars {
		if st := s.stages(t); len(st) != 0 {
			t.Errorf("sidecar %s ran the P/D protocol: %+v", s.addr, st)
		}
	}
	k.waitReleased(t)
}
