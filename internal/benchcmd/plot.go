package benchcmd

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/kvbandit/kvbandit/internal/chart"
	"github.com/kvbandit/kvbandit/routing/sim"
)

// plotTTFT writes the TTFT CDF of every policy (log-scale seconds).
func plotTTFT(path string, results []*sim.Result) error {
	p := plot.New()
	p.Title.Text = "TTFT CDF per policy"
	p.X.Label.Text = "TTFT (log scale)"
	p.Y.Label.Text = "fraction of requests"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = chart.DurationTicks{}
	p.Y.Min, p.Y.Max = 0, 1
	var lines []chart.Line
	for _, r := range results {
		var ttft []float64
		for _, q := range r.Requests {
			if q.Err == "" {
				ttft = append(ttft, max(q.TTFT.Seconds(), 1e-4))
			}
		}
		if len(ttft) == 0 {
			continue
		}
		slices.Sort(ttft)
		step := max(1, len(ttft)/2000)
		var xy plotter.XYs
		for i := 0; i < len(ttft); i += step {
			xy = append(xy, plotter.XY{X: ttft[i], Y: float64(i+1) / float64(len(ttft))})
		}
		xy = append(xy, plotter.XY{X: ttft[len(ttft)-1], Y: 1})
		lines = append(lines, chart.Line{Name: r.Policy, XY: xy})
	}
	return chart.Save(p, lines, 9*vg.Inch, 5*vg.Inch, path)
}

// plotQueue writes the waiting requests of every worker over time under
// one policy; why says why that one.
func plotQueue(path string, r *sim.Result, why string) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("waiting requests per worker: %s (%s)", r.Policy, why)
	p.X.Label.Text = "virtual time (s)"
	p.Y.Label.Text = "waiting requests"
	p.X.Tick.Marker = chart.CountTicks{} // whole seconds
	p.Y.Tick.Marker = chart.CountTicks{}
	p.Y.Min, p.Y.Max = 0, 1
	var lines []chart.Line
	for w := range r.Workers {
		var xy plotter.XYs
		for _, q := range r.Queue {
			if w < len(q.Waiting) {
				xy = append(xy, plotter.XY{X: q.At.Seconds(), Y: float64(q.Waiting[w])})
				p.Y.Max = max(p.Y.Max, float64(q.Waiting[w]))
			}
		}
		if len(xy) > 0 {
			lines = append(lines, chart.Line{Name: fmt.Sprintf("worker %d", w), XY: xy})
		}
	}
	return chart.Save(p, lines, 11*vg.Inch, 5*vg.Inch, path)
}

// bestPolicy is the index of the policy with the lowest TTFT p90 among
// those that served requests (the first on a tie; 0 when none did).
func bestPolicy(ps []policySummary) int {
	best := -1
	for i, p := range ps {
		if p.Served > 0 && (best < 0 || p.TTFTP90 < ps[best].TTFTP90) {
			best = i
		}
	}
	return max(best, 0)
}

// queuePlotPath is OUT-queue.png for --plot OUT.png.
func queuePlotPath(out string) string {
	ext := filepath.Ext(out)
	return strings.TrimSuffix(out, ext) + "-queue" + ext
}
