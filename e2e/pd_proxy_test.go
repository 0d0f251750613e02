package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// startPDDirect runs nPrefill prefill sims, nDecode decode sims with no
// sidecar, and kvbandit's standalone proxy over them in --pd-proxy-mode
// direct (roles from a --config endpoints list, the kv policy); it returns
// the proxy's base URL.
func startPDDirect(t *testing.T, nPrefill, nDecode int) (k *kvb, base string, prefill, decode []*sim) {
	t.Helper()
	var recs []map[string]any
	var all []string
	for range nPrefill {
		s := startPDSim(t)
		prefill = append(prefill, s)
		recs = append(recs, map[string]any{"address": s.addr, "role": "prefill", "models": []string{simModel}})
		all = append(all, s.addr)
	}
	for range nDecode {
		s := startPDSim(t)
		decode = append(decode, s)
		recs = append(recs, map[string]any{"address": s.addr, "role": "decode", "models": []string{simModel}})
		all = append(all, s.addr)
	}
	b, err := json.Marshal(map[string]any{"endpoints": recs}) // JSON is YAML
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	k, base = startProxyKvbandit(t, nil, "--config", path, "--policy", "kv", "--pd-threshold-tokens", fmt.Sprint(pdThreshold),
		"--scrape-interval", "200ms", "--pd-proxy-mode", "direct", "--pd-prefill-timeout", "5s")
	k.waitScraped(t, all)
	return k, base, prefill, decode
}

// TestPDProxyDirect: the standalone proxy in direct mode runs both stages
// against real llm-d-inference-sim workers with no sidecar: a long prompt
// reaches the prefill sim as a prefill-only request (max_tokens 1,
// finish_reason remote_decode) and then the decode sim, which decodes it
// after the simulated KV transfer (its TTFT above the aggregated bucket);
// a short prompt is served aggregated; with the prefill sim killed, long
// prompts are still served, aggregated, by the decode sim (whether the
// prefill stage failed or the dead sim was already ejected). In-flight
// returns to 0 on both roles.
func TestPDProxyDirect(t *testing.T) {
	k, base, prefill, decode := startPDDirect(t, 1, 1)
	c := httpClient(t)
	p, d := prefill[0], decode[0]

	checkStream(t, send(t, c, "POST", base+"/v1/completions", completion(ids(21, 4*pdThreshold), 3), nil))
	p.waitCounts(t, simCounts{requests: 1, remoteDecode: 1, maxTokensSum: 1, ttft: 1, ttftFast: 1})
	d.waitCounts(t, simCounts{requests: 1, maxTokensSum: 3, ttft: 1, ttftFast: 0})

	checkStream(t, send(t, c, "POST", base+"/v1/completions", completion(ids(22, 8), 3), nil))
	d.waitCounts(t, simCounts{requests: 2, maxTokensSum: 6, ttft: 2, ttftFast: 1})
	k.waitIdle(t, []string{p.addr, d.addr})

	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-p.exited
	for i := range 3 {
		checkStream(t, send(t, c, "POST", base+"/v1/completions", completion(ids(uint32(23+i), 4*pdThreshold), 3), nil))
	}
	d.waitCounts(t, simCounts{requests: 5, maxTokensSum: 15, ttft: 5, ttftFast: 4})
	time.Sleep(100 * time.Millisecond)
	k.waitIdle(t, []string{p.addr, d.addr})
}
