package sim

import (
	"testing"
	"time"
)

// TestCPUTierReload: blocks the GPU evicts move to the CPU tier; a request
// that needs them again loads them back at the reload bandwidth before its
// prefill instead of recomputing them, and the events describe both tiers.
func TestCPUTierReload(t *testing.T) {
	prefill := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	A, B, C, D := seq(12, 100), seq(12, 200), seq(12, 300), seq(12, 400)
	run := func(cpuBlocks int) (*rig, *active) {
		r := newRig(t, WorkerConfig{KVBlocks: 10, BlockSize: 4, Prefill: prefill, CPUBlocks: cpuBlocks, CPUReloadTokensPerSec: 4000})
		r.run(r.req(0, A, 2), r.req(time.Second, B, 2), r.req(2*time.Second, C, 2), r.req(3*time.Second, D, 2))
		a2 := r.req(4*time.Second, A, 2)
		r.run(a2)
		r.sameAsEvents()
		return r, a2
	}
	r, a2 := run(16)
	// A's 3 blocks went to the CPU; 2 of them (vLLM keeps the prompt's
	// last token to compute) load back: 8 tokens at 4,000/s is 2 ms, then
	// 4 tokens prefill in 4 ms.
	if a2.cached != 8 || a2.cpuCached != 8 {
		t.Fatalf("A again: cached %d, from cpu %d; want 8 and 8", a2.cached, a2.cpuCached)
	}
	if ttft := a2.firstAt - a2.req.Arrival; ttft != 6*time.Millisecond {
		t.Fatalf("TTFT %v, want 6ms (2ms reload + 4ms prefill)", ttft)
	}
	if got := r.w.stats.CPUCachedTokens; got != 8 {
		t.Fatalf("worker CPU cached tokens %d, want 8", got)
	}
	if len(r.cpu) != len(r.w.cpu.index) {
		t.Fatalf("events say %d cpu blocks, the tier has %d", len(r.cpu), len(r.w.cpu.index))
	}
	for h := range r.w.cpu.index {
		if !r.cpu[h] {
			t.Fatalf("cpu block %x never announced", h)
		}
	}
	// Without the tier A recomputes all 12 tokens.
	_, a2 = run(0)
	if a2.cached != 0 || a2.firstAt-a2.req.Arrival != 12*time.Millisecond {
		t.Fatalf("without a tier: cached %d, TTFT %v; want 0 and 12ms", a2.cached, a2.firstAt-a2.req.Arrival)
	}
	// A tier of 2 blocks keeps only the 2 most recently evicted.
	r, _ = run(2)
	if len(r.w.cpu.index) != 2 || len(r.cpu) != 2 {
		t.Fatalf("cpu tier of 2 holds %d (events %d)", len(r.w.cpu.index), len(r.cpu))
	}
}

// TestCPUTierThroughTheEngine: with KV events, the engine's index takes the
// tier's events without refusing any, and a fleet with a CPU tier finds
// more of its prompts cached than one without.
func TestCPUTierThroughTheEngine(t *testing.T) {
	reqs := synthetic(400, 12, 400, 40, 40, 5)
	run := func(cpu int) *Result {
		ws := make([]WorkerConfig, 2)
		for i := range ws {
			ws[i] = WorkerConfig{KVBlocks: 48, BlockSize: 16, CPUBlocks: cpu}
		}
		res, err := Run(t.Context(), Config{Workers: ws, Policy: "kv", KVEvents: true, Seed: 1}, reqs)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	off, on := run(0), run(400)
	if on.KVEventErrors != 0 || off.KVEventErrors != 0 {
		t.Fatalf("kv event errors: %d with the tier, %d without", on.KVEventErrors, off.KVEventErrors)
	}
	if off.CPUHitRate() != 0 || on.CPUHitRate() == 0 {
		t.Fatalf("cpu hit rate %v without the tier, %v with", off.CPUHitRate(), on.CPUHitRate())
	}
	if on.HitRate() <= off.HitRate() {
		t.Fatalf("hit rate %v with the tier, not above %v without", on.HitRate(), off.HitRate())
	}
	if _, err := (WorkerConfig{CPUBlocks: -1}).withDefaults(0); err == nil {
		t.Fatal("negative CPUBlocks accepted")
	}
	if _, err := (WorkerConfig{CPUReloadTokensPerSec: -5}).withDefaults(0); err == nil {
		t.Fatal("negative reload bandwidth accepted")
	}
}

// TestCPUTierEventsUnderChurn: a tier smaller than the GPU's eviction
// batches drops blocks it took in the same batch and takes back blocks it
// dropped; the events still describe both tiers exactly (as vLLM's
// offloading events would), and the engine's index refuses none.
func TestCPUTierEventsUnderChurn(t *testing.T) {
	reqs := synthetic(400, 30, 300, 60, 80, 9)
	for _, cpu := range []int{8, 24, 200} {
		r := newRig(t, WorkerConfig{KVBlocks: 48, BlockSize: 16, CPUBlocks: cpu})
		as := make([]*active, len(reqs))
		for i := range reqs {
			as[i] = &active{req: &reqs[i]}
		}
		r.check = func() {
			if len(r.cpu) != len(r.w.cpu.index) {
				t.Fatalf("cpu %d: events say %d blocks, the tier holds %d", cpu, len(r.cpu), len(r.w.cpu.index))
			}
			for h := range r.w.cpu.index {
				if !r.cpu[h] {
					t.Fatalf("cpu %d: block %x held, never announced", cpu, h)
				}
			}
		}
		r.run(as...)
		r.sameAsEvents()
		if r.w.stats.CPUCachedTokens == 0 {
			t.Errorf("cpu %d: no CPU hit", cpu)
		}
		ws := []WorkerConfig{{KVBlocks: 48, BlockSize: 16, CPUBlocks: cpu}, {KVBlocks: 48, BlockSize: 16, CPUBlocks: cpu}, {KVBlocks: 48, BlockSize: 16, CPUBlocks: cpu}}
		for _, p := range []string{"kv", "weighted"} {
			res, err := Run(t.Context(), Config{Workers: ws, Policy: p, KVEvents: true, Seed: 1}, reqs)
			if err != nil {
				t.Fatal(err)
			}
			if res.KVEventErrors != 0 {
				t.Errorf("cpu %d, %s: %d KV events refused", cpu, p, res.KVEventErrors)
			}
		}
	}
}
