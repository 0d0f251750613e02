package benchcmd

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"gonum.org/v1/plot/plotter"

	"github.com/kvbandit/kvbandit/routing/sim"
)

func TestBestPolicy(t *testing.T) {
	t.Parallel()
	ps := []policySummary{{Policy: "a", Served: 10, TTFTP90: 2}, {Policy: "none", TTFTP90: 0}, {Policy: "b", Served: 10, TTFTP90: 1}, {Policy: "c", Served: 10, TTFTP90: 1}}
	if got := bestPolicy(ps); got != 2 {
		t.Fatalf("best %d, want 2 (the first with the lowest p90 among those that served)", got)
	}
	if got := bestPolicy([]policySummary{{Policy: "none"}}); got != 0 {
		t.Fatalf("best %d with nothing served", got)
	}
}

func TestQueueSummary(t *testing.T) {
	t.Parallel()
	// Two workers over 4 s in 2 bins of 2 s: worker 0 has 4 waiting for
	// [0, 1 s), then nobody until worker 1 has 2 waiting for [3 s, 4 s);
	// a zero-length sample of 9 at 2 s still shows as the peak of bin 1.
	r := &sim.Result{Workers: make([]sim.WorkerResult, 2), Queue: []sim.QueueSample{
		{At: 0, Waiting: []int{4, 0}},
		{At: time.Second, Waiting: []int{0, 0}},
		{At: 2 * time.Second, Waiting: []int{9, 0}},
		{At: 2 * time.Second, Waiting: []int{0, 0}},
		{At: 3 * time.Second, Waiting: []int{0, 2}},
	}}
	mean, busiest := queueSummary(r, 4*time.Second, 2)
	if len(mean) != 2 || len(busiest) != 2 {
		t.Fatalf("%d and %d points, want 2 bins", len(mean), len(busiest))
	}
	// Bin 0: 4 × 1 s over 2 s and 2 workers = 1; bin 1: 2 × 1 s = 0.5.
	for i, want := range []plotter.XY{{X: 1, Y: 1}, {X: 3, Y: 0.5}} {
		if mean[i] != want {
			t.Errorf("mean bin %d %v, want %v", i, mean[i], want)
		}
	}
	if busiest[0].Y != 4 || busiest[1].Y != 9 {
		t.Errorf("busiest %v, want 4 and 9", busiest)
	}
}

// TestPlotQueuePanels: the queue plot has one panel per policy, each
// titled with its TTFT p90, the best one named, on one time axis.
func TestPlotQueuePanels(t *testing.T) {
	t.Parallel()
	var results []*sim.Result
	var ps []policySummary
	for i, name := range []string{"round_robin", "kv", "kvbandit"} {
		r := &sim.Result{Policy: name, Workers: make([]sim.WorkerResult, 8)}
		for s := range 50 {
			w := make([]int, 8)
			w[(s+i)%8] = s % 5
			r.Queue = append(r.Queue, sim.QueueSample{At: time.Duration(s) * 100 * time.Millisecond, Waiting: w})
		}
		results = append(results, r)
		ps = append(ps, policySummary{Policy: name, Served: 1, TTFTP90: 2.05 / float64(i+1)})
	}
	path := filepath.Join(t.TempDir(), "bench-queue.svg")
	if err := plotQueue(path, results, ps, 2); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	svg := string(b)
	for _, want := range []string{"round_robin: TTFT p90 2.05s", "kv: TTFT p90 1.02s", "kvbandit: TTFT p90 683ms (best TTFT p90)", "mean per worker", "busiest worker"} {
		if strings.Count(svg, want) != 1 {
			t.Errorf("%q appears %d times in the plot, want once", want, strings.Count(svg, want))
		}
	}
	if strings.Contains(svg, "worker 7") {
		t.Error("a line per worker: the plot is one summary per policy")
	}
}
