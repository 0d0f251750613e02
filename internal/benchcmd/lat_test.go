package benchcmd

import (
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim"
)

func TestParseSpeedSchedule(t *testing.T) {
	got, err := parseSpeedSchedule(" 1.5:0:0.5, 2m:1:0 ,2m:1:1", 2)
	if err != nil {
		t.Fatal(err)
	}
	want := []sim.Change{{Worker: 0, At: 1500 * time.Millisecond, Speed: 0.5}, {Worker: 1, At: 2 * time.Minute, Speed: 0}, {Worker: 1, At: 2 * time.Minute, Speed: 1}}
	if len(got) != len(want) {
		t.Fatalf("%+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("%d: %+v, want %+v", i, got[i], want[i])
		}
	}
	if c, err := parseSpeedSchedule("", 2); c != nil || err != nil {
		t.Fatal(c, err)
	}
}

func TestPredErr(t *testing.T) {
	ms := func(v int) time.Duration { return time.Duration(v) * time.Millisecond }
	r := &sim.Result{Requests: []sim.ReqResult{
		{TTFT: ms(100), Predicted: ms(110)}, // 10
		{TTFT: ms(200), Predicted: ms(150)}, // 50
		{TTFT: ms(300), Predicted: ms(330)}, // 30
		{TTFT: ms(50), Err: "route: no endpoint", Predicted: ms(1)},
	}}
	got, ok := predErr(r)
	// p50 |error| 30 ms over the actual p50 200 ms.
	if !ok || got < 0.149 || got > 0.151 {
		t.Fatalf("pred err %v %v, want 0.15", got, ok)
	}
	if _, ok := predErr(&sim.Result{Requests: []sim.ReqResult{{TTFT: ms(5)}}}); ok {
		t.Fatal("a policy without predictions has a pred err")
	}
}

func TestBenchPredErrAndSchedule(t *testing.T) {
	t.Parallel()
	path := writeMooncake(t, 80)
	jsonOut := filepath.Join(t.TempDir(), "out.json")
	out, errOut, err := run(t, "--trace", path, "--workers", "3", "--policy", "kv,kvbandit_blocks,kvbandit",
		"--rate-scale", "2", "--kv-blocks", "256", "--speed-schedule", "1s:1:0.5,3s:1:1", "--json", jsonOut)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	for _, want := range []string{"pred err", "speed schedule 1s:1:0.5,3s:1:1", "kvbandit_blocks"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	rep := readReport(t, jsonOut)
	for _, p := range rep.Policies {
		if predicts := p.Policy != "kv"; p.Predicts != predicts || (predicts && !(p.PredErr > 0 && p.PredErr < 10)) {
			t.Errorf("%s: predicts %v, pred err %v", p.Policy, p.Predicts, p.PredErr)
		}
	}
}
