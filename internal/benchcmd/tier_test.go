package benchcmd

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/internal/cmdline"
)

// TestBenchCPUTier: --cpu-blocks gives every worker a CPU tier; the table
// gets a cpu hit column, the JSON the tier and the CPU hit rate, and a
// fleet whose GPU caches are too small to keep the trace's prefixes finds
// more of them cached with the tier than without.
func TestBenchCPUTier(t *testing.T) {
	t.Parallel()
	// Twelve conversations of 2 Mooncake blocks (1024 tokens) visited in
	// turn: 24 blocks of 512 tokens against GPU caches of 2 × 40 blocks of
	// 64 tokens (10 of them), so the GPUs evict what comes back later.
	var b strings.Builder
	for i := range 96 {
		c := i % 12
		fmt.Fprintf(&b, `{"timestamp": %d, "input_length": 1100, "output_length": 4, "hash_ids": [%d, %d, %d]}`+"\n", i*200, 10+c, 100+c, 1000+i)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "conversations.jsonl")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	bench := func(name string, extra ...string) (string, benchReport) {
		out := filepath.Join(dir, name+".json")
		args := append([]string{"--trace", path, "--workers", "2", "--policy", "kv,weighted", "--rate-scale", "2",
			"--kv-blocks", "40", "--json", out}, extra...)
		stdout, errOut, err := run(t, args...)
		if err != nil {
			t.Fatalf("%v\n%s", err, errOut)
		}
		rep := readReport(t, out)
		return stdout, rep
	}
	offOut, off := bench("off")
	onOut, on := bench("on", "--cpu-blocks", "400", "--cpu-reload-bandwidth", "100000")
	if strings.Contains(offOut, "cpu hit") || off.CPUBlocks != 0 {
		t.Errorf("a run without a tier shows one:\n%s", offOut)
	}
	for _, want := range []string{"cpu hit", "CPU KV tier: 400 blocks per worker, reload 100000 tokens/s"} {
		if !strings.Contains(onOut, want) {
			t.Errorf("output lacks %q:\n%s", want, onOut)
		}
	}
	if on.CPUBlocks != 400 || on.CPUReloadTokensSec != 100000 {
		t.Errorf("report tier %d blocks, %v tokens/s", on.CPUBlocks, on.CPUReloadTokensSec)
	}
	for i, p := range on.Policies {
		if p.CPUHitRate <= 0 || p.CPUHitRate > p.HitRate || p.HitRate <= off.Policies[i].HitRate || off.Policies[i].CPUHitRate != 0 {
			t.Errorf("%s: hit %.3f (cpu %.3f) with the tier, %.3f (cpu %.3f) without", p.Policy, p.HitRate, p.CPUHitRate, off.Policies[i].HitRate, off.Policies[i].CPUHitRate)
		}
	}
	for _, c := range []struct{ args []string }{
		{[]string{"--cpu-blocks", "-1"}},
		{[]string{"--cpu-blocks", "10", "--cpu-reload-bandwidth", "0"}},
		{[]string{"--cpu-reload-bandwidth", "-3"}},
	} {
		_, _, err := run(t, append([]string{"--trace", path, "--policy", "kv"}, c.args...)...)
		if err == nil || !errors.Is(err, cmdline.ErrUsage) || !strings.Contains(err.Error(), "--cpu-") {
			t.Errorf("%q: err %v, want a usage error naming the flag", c.args, err)
		}
	}
}
