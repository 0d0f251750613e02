package e2e

// The live benchmark's llmd picker: llm-d's EPP (llm-d-inference-scheduler
// v0.4.0 cmd/epp, built on GIE v1.2.0's runner) in its APPROXIMATE
// configuration. Its precise prefix-cache scorer cannot match these
// workers (other block hashes, the sims' dummy tokenizer) and cannot
// tokenize chat offline (docs/llmd-epp.md), so the row runs GIE's
// character-based prefix-cache-scorer, which the EPP fills from its own
// routing decisions, with llm-d's load and KV scorers. The binary comes
// from envLiveLLMD (bench_live_test.go builds it with tools/build.sh); no
// cgo is needed here.

import (
	"net"
	"os"
	"path/filepath"
	"testing"
)

// llmdApproxConfig is the EndpointPickerConfig of the llmd row. The
// weights of prefix-cache-scorer (3), kv-cache-utilization-scorer (2) and
// queue-scorer (2) are llm-d's default inference-scheduling profile (the
// llm-d guides' default-plugins.yaml); load-aware-scorer gets the weight
// 1 that llm-d-inference-scheduler v0.4.0's
// deploy/config/epp-estimate-prefix-cache-config.yaml gives it, with its
// default threshold (128 waiting requests). The prefix-cache-scorer's
// parameters are GIE v1.2.0's defaults, spelt out: 64-character blocks
// (about 16 tokens), 256 blocks matched at most, 31,250 blocks an
// endpoint. decode-filter, which llm-d's samples put in front, is left
// out: it keeps every pod without an llm-d.ai/role label, and these pods
// have none.
const llmdApproxConfig = `apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: single-profile-handler
- type: prefix-cache-scorer
  parameters:
    blockSize: 64
    maxPrefixBlocksToMatch: 256
    lruCapacityPerServer: 31250
- type: load-aware-scorer
- type: kv-cache-utilization-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-scorer
    weight: 3
  - pluginRef: load-aware-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: max-score-picker
`

// startLiveLLMD runs llm-d's EPP with llmdApproxConfig on an InferencePool
// of the fleet's addresses on a real kube-apiserver, as startLiveGIE runs
// GIE's. The sims export vllm:kv_cache_usage_perc, not GIE v1.2.0's
// default vllm:gpu_cache_usage_perc, hence the flag. Like GIE's EPP it
// speaks FULL_DUPLEX_STREAMED bodies both ways (its handlers answer body
// chunks with StreamedBodyResponse), envoysim's default: livePicker.mode
// stays zero.
func startLiveLLMD(t *testing.T, hosts []string) livePicker {
	t.Helper()
	bin := os.Getenv(envLiveLLMD)
	if bin == "" {
		t.Fatalf("%s is not set: run the llmd picker through make bench-live (it builds llm-d's EPP; make tools-llmd)", envLiveLLMD)
	}
	addr, health, metrics := freeAddr(t), freeAddr(t), freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	_, hp, _ := net.SplitHostPort(health)
	_, mp, _ := net.SplitHostPort(metrics)
	c, ns, pool := startLivePool(t, hosts, atoiLive(port))
	cfg := filepath.Join(t.TempDir(), "llmd-approx.yaml")
	if err := os.WriteFile(cfg, []byte(llmdApproxConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("llmd: llm-d's EPP v0.4.0 in its APPROXIMATE configuration (GIE's character prefix-cache-scorer ×3, load-aware ×1, kv-cache-utilization ×2, queue ×2; no precise KV-event scorer: docs/llmd-epp.md)")
	env := []string{"POD_NAME=llmd-epp-5d8f7c9b4-x2k9p", "NAMESPACE=" + ns, "KUBECONFIG=" + c.Kubeconfig(t, "admin")}
	return startLiveProc(t, "llmd", addr, env, bin, "--pool-name", pool, "--pool-namespace", ns,
		"--secure-serving=false", "--tracing=false", "--metrics-endpoint-auth=false", "--grpc-port", port,
		"--grpc-health-port", hp, "--metrics-port", mp,
		"--kv-cache-usage-percentage-metric", "vllm:kv_cache_usage_perc", "--config-file", cfg)
}
