package benchcmd

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/internal/cmdline"
)

func TestBenchPDUsageErrors(t *testing.T) {
	t.Parallel()
	good := writeMooncake(t, 3)
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--workers", "4", "--prefill-workers", "-1"}, "--prefill-workers -1: want 0 to 3"},
		{[]string{"--workers", "4", "--prefill-workers", "4"}, "--prefill-workers 4: want 0 to 3"},
		{[]string{"--workers", "1", "--prefill-workers", "1"}, "--prefill-workers 1: want 0 to 0"},
		{[]string{"--prefill-workers", "x"}, "invalid value"},
		{[]string{"--prefill-workers", "1", "--pd-threshold-tokens", "-5"}, "--pd-threshold-tokens -5"},
		{[]string{"--prefill-workers", "1", "--kv-transfer-gbps", "0"}, "--kv-transfer-gbps"},
		{[]string{"--prefill-workers", "1", "--kv-transfer-gbps", "NaN"}, "--kv-transfer-gbps"},
		{[]string{"--prefill-workers", "1", "--kv-transfer-latency", "-1ms"}, "--kv-transfer-latency"},
		{[]string{"--prefill-workers", "1", "--kv-bytes-per-token", "0"}, "--kv-bytes-per-token"},
	} {
		_, errOut, err := run(t, append([]string{"--policy", "round_robin", "--trace", good}, c.args...)...)
		if err == nil || !errors.Is(err, cmdline.ErrUsage) || !strings.Contains(err.Error()+errOut, c.want) {
			t.Errorf("%q: err %v (usage %v), want %q\n%s", c.args, err, errors.Is(err, cmdline.ErrUsage), c.want, errOut)
		}
	}
}

// With --prefill-workers every policy gives three rows at the same
// workers: aggregated (nothing disaggregated), always (every request) and
// conditional (in between here: the trace's prompts straddle the
// threshold), with ITL percentiles.
func TestBenchPDRows(t *testing.T) {
	t.Parallel()
	path := writeMooncake(t, 60)
	jsonOut := filepath.Join(t.TempDir(), "out.json")
	out, errOut, err := run(t, "--trace", path, "--workers", "4", "--prefill-workers", "1", "--policy", "kvbandit",
		"--pd-threshold-tokens", "1300", "--kv-blocks", "256", "--json", jsonOut, "--quiet")
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	for _, want := range []string{"kvbandit aggregated", "kvbandit pd-always", "kvbandit pd-conditional", "ITL p50", "disagg", "P/D: workers 0-0 prefill, 1-3 decode"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	rep := readReport(t, jsonOut)
	if len(rep.Policies) != 3 || rep.PrefillWorkers != 1 || rep.PDThresholdTokens != 1300 {
		t.Fatalf("report %+v", rep)
	}
	agg, always, cond := rep.Policies[0], rep.Policies[1], rep.Policies[2]
	if agg.Disaggregated != 0 || always.Disaggregated != 1 || cond.Disaggregated <= 0 || cond.Disaggregated >= 1 {
		t.Fatalf("disaggregated shares: aggregated %v, always %v, conditional %v", agg.Disaggregated, always.Disaggregated, cond.Disaggregated)
	}
	for _, p := range rep.Policies {
		if p.Served != 60 || p.ITLP50 <= 0 || p.ITLP90 < p.ITLP50 || p.TTFTP90 <= 0 {
			t.Errorf("%s: %+v", p.Policy, p)
		}
	}
	// The prefill worker never decodes: in the pd rows it is busy only
	// with prefill legs, and every request is served by a decode worker.
	if n := always.RequestsPerWorker[0]; n != 60 {
		t.Errorf("always: prefill worker ran %d prefill legs, want 60", n)
	}
}
