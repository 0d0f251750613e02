package e2e

// kvbandit's P/D routing (issue 15) end to end with llm-d's pd-sidecar and
// llm-d-inference-sim workers. These tests need endpoint roles (the `role`
// field of endpoint records), the x-prefiller-host-port answer and
// --pd-threshold-tokens: they are behind the build tag pd until that lands,
// then the tag goes.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
)

// pdThreshold is --pd-threshold-tokens in these tests: a prompt with at
// least this many tokens left to prefill on the chosen decode worker is
// disaggregated.
const pdThreshold = 64

// startPDKvbandit runs kvbandit (kv policy) over the fleet, the roles given
// in a --config file's endpoints list (prefill sims: prefill, sidecars:
// decode), and an Envoy-faithful proxy whose cluster is the decode
// endpoints.
func startPDKvbandit(t *testing.T, f *pdFleet, extra ...string) (*kvb, *envoysim.Proxy) {
	t.Helper()
	var recs []map[string]any
	for _, s := range f.prefill {
		recs = append(recs, map[string]any{"address": s.addr, "role": "prefill", "models": []string{simModel}})
	}
	for _, s := range f.sidecars {
		recs = append(recs, map[string]any{"address": s.addr, "role": "decode", "models": []string{simModel}})
	}
	b, err := json.Marshal(map[string]any{"endpoints": recs}) // JSON is YAML
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"--config", path, "--policy", "kv", "--pd-threshold-tokens", fmt.Sprint(pdThreshold),
		"--scrape-interval", "200ms"}, extra...)
	k := startKvbandit(t, nil, args...)
	k.endpoints = f.sidecarAddrs() // the Envoy cluster: decode endpoints only
	k.waitScraped(t, append(f.sidecarAddrs(), f.prefillAddrs()...))
	return k, startProxy(t, k, envoysim.Config{})
}

// prefillAt returns the fleet's prefill sim at addr.
func (f *pdFleet) prefillAt(t *testing.T, addr string) *sim {
	t.Helper()
	for _, s := range f.prefill {
		if s.addr == addr {
			return s
		}
	}
	t.Fatalf("%s %q is not a prefill sim of the fleet (%v)", headerPrefiller, addr, f.prefillAddrs())
	return nil
}

// debugEndpoint is a row of /debug/endpoints.
type debugEndpoint struct {
	Address  string `json:"address"`
	Role     string `json:"role"`
	InFlight int64  `json:"inflight"`
	Health   struct {
		Ejected bool `json:"ejected"`
	} `json:"health"`
}

func (k *kvb) endpointRows(ctx context.Context) ([]debugEndpoint, error) {
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://"+k.metricsAddr+"/debug/endpoints", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var body struct {
		Endpoints []debugEndpoint `json:"endpoints"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return nil, err
	}
	return body.Endpoints, nil
}

// waitEjected waits until kvbandit has ejected addr.
func (k *kvb) waitEjected(t *testing.T, addr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		es, err := k.endpointRows(ctx)
		if err != nil {
			return false, err.Error()
		}
		for _, e := range es {
			if e.Address == addr {
				return e.Health.Ejected, fmt.Sprintf("%s not ejected: %+v", addr, e)
			}
		}
		return false, addr + " not in /debug/endpoints"
	}); err != nil {
		t.Fatal(err)
	}
}

// waitIdle waits until kvbandit_endpoint_inflight is 0 for every one of
// addrs (both roles), and fails if kvbandit does not report one of them.
func (k *kvb) waitIdle(t *testing.T, addrs []string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := poll(ctx, func() (bool, string) {
		ss, err := k.scrape(ctx)
		if err != nil {
			return false, err.Error()
		}
		var bad []string
		for _, a := range addrs {
			i := slices.IndexFunc(ss, func(s sample) bool {
				return s.name == "kvbandit_endpoint_inflight" && s.labels["endpoint"] == a
			})
			switch {
			case i < 0:
				bad = append(bad, a+" missing")
			case ss[i].value != 0:
				bad = append(bad, fmt.Sprintf("%s=%v", a, ss[i].value))
			}
		}
		return len(bad) == 0, "kvbandit_endpoint_inflight not 0: " + strings.Join(bad, ", ")
	}); err != nil {
		t.Fatal(err)
	}
}

// pdSend sends a streamed completion through the proxy, checks the stream
// and returns the exchange.
func pdSend(t *testing.T, c *http.Client, px *envoysim.Proxy, prompt []uint32, hdr map[string]string) envoysim.Exchange {
	t.Helper()
	n := len(px.Exchanges())
	checkStream(t, send(t, c, "POST", px.URL()+"/v1/completions", completion(prompt, 3), hdr))
	xs, err := px.WaitExchanges(t.Context(), n+1)
	if err != nil {
		t.Fatal(err)
	}
	x := xs[n]
	if x.Fallback || x.Upstream != x.Destination || x.LocalReply != 0 {
		t.Fatalf("exchange %d: destination %q upstream %q fallback %v local reply %d", x.ID, x.Destination, x.Upstream, x.Fallback, x.LocalReply)
	}
	return x
}

// totals sums the fleet's sims' counts: prefill sims, decode sims (a sim
// the test killed counts nothing).
func (f *pdFleet) totals(t *testing.T) (prefill, decode simCounts) {
	t.Helper()
	add := func(a *simCounts, s *sim) {
		select {
		case <-s.exited:
			return
		default:
		}
		c, err := s.counts(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		a.requests += c.requests
		a.remoteDecode += c.remoteDecode
		a.maxTokensSum += c.maxTokensSum
		a.ttft += c.ttft
		a.ttftFast += c.ttftFast
	}
	for _, s := range f.prefill {
		add(&prefill, s)
	}
	for _, s := range f.sidecars {
		add(&decode, s.decode)
	}
	return prefill, decode
}

// TestPDLongPromptDisaggregated: a long prompt is routed to a decode
// sidecar with x-prefiller-host-port naming a prefill sim; that sim gets
// one prefill-only request (max_tokens 1, remote_decode) and the decode sim
// behind the chosen sidecar decodes it after the simulated KV transfer.
// Roles show in /debug/endpoints, and in-flight returns to 0 on both roles.
func TestPDLongPromptDisaggregated(t *testing.T) {
	f := startPDFleet(t, 2, 2)
	k, px := startPDKvbandit(t, f)
	c := httpClient(t)

	es, err := k.endpointRows(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range es {
		want := "decode"
		if slices.Contains(f.prefillAddrs(), e.Address) {
			want = "prefill"
		}
		if e.Role != want {
			t.Errorf("/debug/endpoints: %s role %q, want %q", e.Address, e.Role, want)
		}
	}

	x := pdSend(t, c, px, ids(1, 4*pdThreshold), nil)
	pf, set, _ := setHeader(x, headerPrefiller)
	if !set {
		t.Fatalf("long prompt: kvbandit set no %s", headerPrefiller)
	}
	p := f.prefillAt(t, pf)
	sc := f.sidecarAt(t, x.Upstream)
	p.waitCounts(t, simCounts{requests: 1, remoteDecode: 1, maxTokensSum: 1, ttft: 1, ttftFast: 1})
	sc.decode.waitCounts(t, simCounts{requests: 1, maxTokensSum: 3, ttft: 1, ttftFast: 0})
	if st := sc.stages(t); len(st) != 2 || !st[0].Prefill || st[0].Body["max_tokens"] != 1.0 {
		t.Errorf("sidecar %s stages %+v, want the prefill (max_tokens 1) then the decode", sc.addr, st)
	}
	prefill, decode := f.totals(t)
	if prefill.requests != 1 || decode.requests != 1 {
		t.Errorf("fleet served prefill %v, decode %v: want one each", prefill, decode)
	}
	k.waitIdle(t, append(f.prefillAddrs(), f.sidecarAddrs()...))
}

// TestPDShortAndCachedPromptsStayAggregated: a short prompt, and a long
// prompt whose prefix the decode worker already holds (fewer than the
// threshold tokens left to prefill), are served aggregated by the decode
// sim: kvbandit sets no x-prefiller-host-port and no prefill sim is asked.
func TestPDShortAndCachedPromptsStayAggregated(t *testing.T) {
	f := startPDFleet(t, 2, 2)
	k, px := startPDKvbandit(t, f)
	c := httpClient(t)

	x := pdSend(t, c, px, ids(2, pdThreshold/2), nil)
	if v, set, _ := setHeader(x, headerPrefiller); set {
		t.Fatalf("short prompt: %s: %q", headerPrefiller, v)
	}
	f.sidecarAt(t, x.Upstream).decode.waitCounts(t, simCounts{requests: 1, maxTokensSum: 3, ttft: 1, ttftFast: 1})

	// A long prompt is disaggregated once; the same prefix plus a few
	// tokens then goes to the decode worker that holds it, aggregated.
	long := ids(3, 4*pdThreshold)
	first := pdSend(t, c, px, long, nil)
	if _, set, _ := setHeader(first, headerPrefiller); !set {
		t.Fatalf("long prompt: no %s", headerPrefiller)
	}
	next := pdSend(t, c, px, append(append([]uint32(nil), long...), ids(4, pdThreshold/4)...), nil)
	if v, set, _ := setHeader(next, headerPrefiller); set {
		t.Errorf("cached prompt (%d tokens left to prefill): %s: %q", pdThreshold/4, headerPrefiller, v)
	}
	if next.Upstream != first.Upstream {
		t.Errorf("cached prompt went to %s, its prefix is on %s", next.Upstream, first.Upstream)
	}
	time.Sleep(200 * time.Millisecond) // metrics settle
	prefill, decode := f.totals(t)
	if prefill.requests != 1 || prefill.remoteDecode != 1 || decode.requests != 3 || decode.disaggregated() != 1 {
		t.Errorf("fleet served prefill %v, decode %v: want 1 prefill, 3 decodes of which 1 after a transfer", prefill, decode)
	}
	k.waitIdle(t, append(f.prefillAddrs(), f.sidecarAddrs()...))
}

// TestPDSpoofedPrefillerHeaderWithRoles: with kvbandit's P/D routing, a
// client's x-prefiller-host-port never reaches a sidecar (see
// TestPDSpoofedPrefillerHeader for the trap): removed when the request
// stays aggregated (short prompt), replaced by kvbandit's own choice when
// it is disaggregated (long prompt).
func TestPDSpoofedPrefillerHeaderWithRoles(t *testing.T) {
	f := startPDFleet(t, 1, 2)
	trap := startPDSim(t)
	spoof := map[string]string{headerPrefiller: trap.addr}
	c := httpClient(t)
	k, px := startPDKvbandit(t, f)

	x := pdSend(t, c, px, ids(5, pdThreshold/2), spoof)
	if v, set, removed := setHeader(x, headerPrefiller); set || !removed {
		t.Errorf("short prompt with a spoofed header: set %v (%q), removed %v; want removed", set, v, removed)
	}
	x = pdSend(t, c, px, ids(6, 4*pdThreshold), spoof)
	if v, set, _ := setHeader(x, headerPrefiller); !set || v != f.prefill[0].addr {
		t.Errorf("long prompt with a spoofed header: %s %q (set %v), want kvbandit's %s", headerPrefiller, v, set, f.prefill[0].addr)
	}
	f.prefill[0].waitCounts(t, simCounts{requests: 1, remoteDecode: 1, maxTokensSum: 1, ttft: 1, ttftFast: 1})
	time.Sleep(200 * time.Millisecond) // a prefill sent to the trap would have landed by now
	trap.waitCounts(t, simCounts{})
	k.waitIdle(t, append(f.prefillAddrs(), f.sidecarAddrs()...))
}

// TestPDPrefillDeathFallsBack: when the only prefill sim dies, kvbandit
// ejects it (failed scrapes) and long prompts are then served aggregated
// (no x-prefiller-host-port, so the sidecar does not answer 502).
func TestPDPrefillDeathFallsBack(t *testing.T) {
	f := startPDFleet(t, 1, 2)
	k, px := startPDKvbandit(t, f)
	c := httpClient(t)

	x := pdSend(t, c, px, ids(8, 4*pdThreshold), nil)
	if _, set, _ := setHeader(x, headerPrefiller); !set {
		t.Fatalf("long prompt before the prefill sim died: no %s", headerPrefiller)
	}
	f.prefill[0].waitCounts(t, simCounts{requests: 1, remoteDecode: 1, maxTokensSum: 1, ttft: 1, ttftFast: 1})
	k.waitIdle(t, append(f.prefillAddrs(), f.sidecarAddrs()...))

	p := f.prefill[0]
	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-p.exited
	k.waitEjected(t, p.addr)

	for i := range 3 {
		x := pdSend(t, c, px, ids(uint32(9+i), 4*pdThreshold), nil)
		if v, set, _ := setHeader(x, headerPrefiller); set {
			t.Errorf("long prompt %d after the prefill sim died: %s %q", i, headerPrefiller, v)
		}
	}
	time.Sleep(200 * time.Millisecond)
	_, decode := f.totals(t)
	if decode.requests != 4 || decode.disaggregated() != 1 {
		t.Errorf("decode sims served %v, want 4 requests, 1 after a transfer", decode)
	}
	k.waitIdle(t, append(f.prefillAddrs(), f.sidecarAddrs()...))
}
