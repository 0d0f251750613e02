package benchcmd

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/internal/cmdline"
	"github.com/kvbandit/kvbandit/routing/sim"
)

func TestBenchObjectives(t *testing.T) {
	t.Parallel()
	path := writeMooncake(t, 60)
	jsonOut := filepath.Join(t.TempDir(), "out.json")
	for _, c := range []struct {
		ttft    string
		metLow  float64
		metHigh float64
	}{
		{"1ms", 0, 0},   // no simulated prefill is that fast
		{"10m", 1, 1},   // every served request meets it
		{"300ms", 0, 1}, // somewhere in between
	} {
		out, errOut, err := run(t, "--trace", path, "--workers", "3", "--policy", "round_robin,kv",
			"--kv-blocks", "256", "--rate-scale", "2", "--objective-ttft", c.ttft, "--objective-share", "0.5",
			"--objective-priority", "2", "--json", jsonOut)
		if err != nil {
			t.Fatalf("%v\n%s", err, errOut)
		}
		if !strings.Contains(out, "SLO met") || !strings.Contains(out, "others p90") {
			t.Fatalf("no objective columns:\n%s", out)
		}
		rep := readReport(t, jsonOut)
		for _, p := range rep.Policies {
			o := p.Objective
			if o == nil || o.Requests < 15 || o.Requests > 45 || o.Met < c.metLow || o.Met > c.metHigh || o.Shed != 0 || o.OthersP90 <= 0 {
				t.Errorf("%s %s: objective %+v", c.ttft, p.Policy, o)
			}
		}
	}
}

func TestObjectiveApplyIsSeeded(t *testing.T) {
	t.Parallel()
	mk := func() []sim.Request { return make([]sim.Request, 1000) }
	o := objectiveOptions{ttft: 300 * time.Millisecond, share: 0.25, priority: "-1"}
	a, b := mk(), mk()
	if err := o.apply(a, 7); err != nil {
		t.Fatal(err)
	}
	if err := o.apply(b, 7); err != nil {
		t.Fatal(err)
	}
	n := 0
	for i := range a {
		if a[i].Hints != b[i].Hints {
			t.Fatalf("request %d: %+v vs %+v", i, a[i].Hints, b[i].Hints)
		}
		if a[i].Hints.TTFTObjective != 0 {
			n++
			if !a[i].Hints.Sheddable() || a[i].Hints.TTFTObjective != 300*time.Millisecond {
				t.Fatalf("hints %+v", a[i].Hints)
			}
		}
	}
	if n < 200 || n > 300 {
		t.Fatalf("%d of 1000 requests have the objective, want about 250", n)
	}
}

func TestBenchObjectiveUsageErrors(t *testing.T) {
	t.Parallel()
	good := writeMooncake(t, 3)
	for _, c := range []struct{ args []string }{
		{[]string{"--objective-ttft", "500us"}},
		{[]string{"--objective-ttft", "11m"}},
		{[]string{"--objective-ttft", "1s", "--objective-share", "0"}},
		{[]string{"--objective-ttft", "1s", "--objective-share", "1.5"}},
		{[]string{"--objective-ttft", "1s", "--objective-priority", "high"}},
		{[]string{"--objective-ttft", "1s", "--objective-priority", "5000"}},
		{[]string{"--objective-headroom", "1.5"}},
	} {
		_, _, err := run(t, append([]string{"--policy", "round_robin", "--trace", good}, c.args...)...)
		if !errors.Is(err, cmdline.ErrUsage) || !strings.Contains(err.Error(), "--objective") {
			t.Errorf("%q: err %v, want a usage error naming the flag", c.args, err)
		}
	}
}
