package benchcmd

import (
	"flag"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/sim"
)

// benchPD is bench's prefill/decode comparison: with --prefill-workers P
// every policy runs three times at the same --workers N: aggregated (all N
// both), always disaggregated (workers 0..P−1 prefill, the rest decode,
// threshold 0) and conditional (the same roles, --pd-threshold-tokens).
type benchPD struct {
	prefill   int
	threshold int
	latency   time.Duration
	gbps      float64 // GB/s
	perToken  int
}

// benchRun is one row of the table: a policy under a P/D mode.
type benchRun struct {
	label, policy string
	roles         []routing.Role
	pd            *pd.Config
}

func (p *benchPD) addFlags(fs *flag.FlagSet) {
	fs.IntVar(&p.prefill, "prefill-workers", 0, "P/D: make P of --workers prefill-only (the rest decode) and compare, per policy, aggregated (all both), always disaggregated and conditional rows (0: no P/D)")
	fs.IntVar(&p.threshold, "pd-threshold-tokens", pd.DefaultThresholdTokens, "--prefill-workers: the conditional rows' pd.threshold_tokens")
	fs.DurationVar(&p.latency, "kv-transfer-latency", sim.DefaultTransferLatency, "--prefill-workers: fixed time of one prefill-to-decode KV transfer (an assumption, see docs/bench.md)")
	fs.Float64Var(&p.gbps, "kv-transfer-gbps", sim.DefaultTransferBytesPerSec/1e9, "--prefill-workers: KV transfer bandwidth in GB/s (default: half a 400 Gb/s RDMA link)")
	fs.IntVar(&p.perToken, "kv-bytes-per-token", sim.DefaultKVBytesPerToken, "--prefill-workers: KV bytes per token (default: Llama-3.1-8B in fp16)")
}

func (p *benchPD) validate(workers int) error {
	switch {
	case p.prefill < 0 || p.prefill >= workers:
		return fmt.Errorf("--prefill-workers %d: want 0 to %d (at least one decode worker of --workers %d)", p.prefill, workers-1, workers)
	case p.threshold < 0 || p.threshold > pd.MaxThresholdTokens:
		return fmt.Errorf("--pd-threshold-tokens %d: want 0 to %d", p.threshold, pd.MaxThresholdTokens)
	case p.latency < 0 || p.latency > time.Minute:
		return fmt.Errorf("--kv-transfer-latency %v: want 0 to 1m", p.latency)
	case !(p.gbps > 0) || math.IsInf(p.gbps, 0) || p.gbps > 1e6:
		return fmt.Errorf("--kv-transfer-gbps %v: want a number of GB/s > 0", p.gbps)
	case p.perToken <= 0 || p.perToken > 1<<30:
		return fmt.Errorf("--kv-bytes-per-token %d: want 1 to 2^30", p.perToken)
	}
	return nil
}

// transfer is the simulator's transfer model. A zero latency is kept as
// zero (the simulator's zero would take its default).
func (p *benchPD) transfer() sim.Transfer {
	lat := p.latency
	if lat == 0 {
		lat = time.Nanosecond
	}
	return sim.Transfer{Latency: lat, BytesPerSec: p.gbps * 1e9, BytesPerToken: p.perToken}
}

// runs expands the policies into the table's rows: one per policy without
// P/D, three with it.
func (p *benchPD) runs(names []string, workers int) []benchRun {
	if p.prefill == 0 {
		out := make([]benchRun, len(names))
		for i, n := range names {
			out[i] = benchRun{label: n, policy: n}
		}
		return out
	}
	roles := make([]routing.Role, workers)
	for i := range roles {
		roles[i] = routing.RoleDecode
		if i < p.prefill {
			roles[i] = routing.RolePrefill
		}
	}
	out := make([]benchRun, 0, 3*len(names))
	for _, n := range names {
		out = append(out,
			benchRun{label: n + " aggregated", policy: n},
			benchRun{label: n + " pd-always", policy: n, roles: roles, pd: &pd.Config{ThresholdTokens: 0}},
			benchRun{label: n + " pd-conditional", policy: n, roles: roles, pd: &pd.Config{ThresholdTokens: p.threshold}})
	}
	return out
}

// report fills the run's P/D fields (none without P/D).
func (p *benchPD) report(rep *benchReport) {
	if p.prefill > 0 {
		rep.PrefillWorkers, rep.PDThresholdTokens = p.prefill, p.threshold
		rep.TransferLatencySec, rep.TransferGBps, rep.KVBytesPerToken = p.latency.Seconds(), p.gbps, p.perToken
	}
}

// pdLine is the header line of a P/D run ("" without).
func (rep *benchReport) pdLine() string {
	if rep.PrefillWorkers == 0 {
		return ""
	}
	return fmt.Sprintf("P/D: workers 0-%d prefill, %d-%d decode in the pd rows (aggregated: all both); conditional threshold %d tokens; KV transfer %v + %d bytes/token at %g GB/s\n",
		rep.PrefillWorkers-1, rep.PrefillWorkers, rep.Workers-1, rep.PDThresholdTokens,
		time.Duration(rep.TransferLatencySec*float64(time.Second)), rep.KVBytesPerToken, rep.TransferGBps)
}

// summarizePD fills a row's ITL percentiles and disaggregated share.
func summarizePD(s *policySummary, r *sim.Result) {
	var itl []time.Duration
	served, disagg := 0, 0
	for _, q := range r.Requests {
		if q.Err != "" {
			continue
		}
		served++
		if q.PrefillWorker >= 0 {
			disagg++
		}
		if q.OutputTokens > 1 {
			itl = append(itl, q.ITL)
		}
	}
	slices.Sort(itl)
	s.ITLP50, s.ITLP90 = pct(itl, 50), pct(itl, 90)
	if served > 0 {
		s.Disaggregated = float64(disagg) / float64(served)
	}
}
