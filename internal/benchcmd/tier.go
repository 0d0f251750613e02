package benchcmd

import (
	"flag"
	"fmt"
	"math"

	"github.com/kvbandit/kvbandit/routing/sim"
)

// benchTier is bench's optional CPU (host-memory) KV tier per worker.
type benchTier struct {
	cpuBlocks int
	// reload is the CPU tier's reload bandwidth in prompt tokens per second.
	reload float64
}

func (t *benchTier) addFlags(fs *flag.FlagSet) {
	fs.IntVar(&t.cpuBlocks, "cpu-blocks", 0, "host-memory (CPU) KV tier per worker, in blocks of --block-size (0: none): GPU evictions move there and load back instead of being recomputed, with vLLM offloading's KV events")
	fs.Float64Var(&t.reload, "cpu-reload-bandwidth", sim.DefaultCPUReloadTokensPerSec,
		"--cpu-blocks: reload bandwidth from the CPU tier, in prompt tokens per second (default: PCIe 4.0 x16, ~25 GB/s, at 128 KiB of KV per token)")
}

func (t *benchTier) validate() error {
	if t.cpuBlocks < 0 {
		return fmt.Errorf("--cpu-blocks %d: must be >= 0", t.cpuBlocks)
	}
	if !(t.reload > 0) || math.IsInf(t.reload, 0) {
		return fmt.Errorf("--cpu-reload-bandwidth %v: must be a number of tokens per second > 0", t.reload)
	}
	return nil
}

// apply gives a worker the tier.
func (t *benchTier) apply(w *sim.WorkerConfig) {
	w.CPUBlocks, w.CPUReloadTokensPerSec = t.cpuBlocks, t.reload
}

// report fills the run's tier fields (none without a tier).
func (t *benchTier) report(rep *benchReport) {
	if t.cpuBlocks > 0 {
		rep.CPUBlocks, rep.CPUReloadTokensSec = t.cpuBlocks, t.reload
	}
}

// tierLine is the header line of a run with a CPU tier ("" without).
func (rep *benchReport) tierLine() string {
	if rep.CPUBlocks == 0 {
		return ""
	}
	return fmt.Sprintf("CPU KV tier: %d blocks per worker, reload %.0f tokens/s (KV hit includes the CPU hits)\n", rep.CPUBlocks, rep.CPUReloadTokensSec)
}
