package benchcmd

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

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

// queueBins is the number of time bins of the queue plot: enough to show
// a burst, few enough that a panel an inch high draws a line, not a
// comb of spikes.
const queueBins = 200

// plotQueue writes the waiting requests over time as small multiples,
// one panel per run (policy) on the same axes: per time bin, the mean
// over the workers and the busiest worker's peak. ps are the runs'
// summaries (for the panel titles), best the run named as the best.
func plotQueue(path string, results []*sim.Result, ps []policySummary, best int) error {
	var span time.Duration
	for _, r := range results {
		if n := len(r.Queue); n > 0 {
			span = max(span, r.Queue[n-1].At)
		}
	}
	if span <= 0 {
		span = time.Second
	}
	panels := make([]chart.Panel, len(results))
	yMax := 1.0
	for i, r := range results {
		mean, busiest := queueSummary(r, span, queueBins)
		for _, xy := range busiest {
			yMax = max(yMax, xy.Y)
		}
		p := plot.New()
		p.Title.Text = r.Policy
		if i < len(ps) {
			p.Title.Text = fmt.Sprintf("%s: TTFT p90 %s", r.Policy, fmtSec(ps[i].TTFTP90))
		}
		if i == best {
			p.Title.Text += " (best TTFT p90)"
		}
		p.Y.Label.Text = "waiting"
		p.X.Tick.Marker = chart.CountTicks{} // whole seconds
		p.Y.Tick.Marker = chart.CountTicks{}
		p.X.Min, p.X.Max = 0, span.Seconds()
		if i == len(results)-1 {
			p.X.Label.Text = fmt.Sprintf("virtual time (s); %d bins of %s", queueBins, fmtSec((span / queueBins).Seconds()))
		}
		panels[i] = chart.Panel{Plot: p, Lines: []chart.Line{
			{Name: "mean per worker", XY: mean},
			{Name: "busiest worker", XY: busiest},
		}}
	}
	for _, pn := range panels {
		pn.Plot.Y.Min, pn.Plot.Y.Max = 0, yMax
	}
	h := vg.Length(len(panels))*1.4*vg.Inch + 0.6*vg.Inch
	return chart.SaveColumn(panels, 11*vg.Inch, h, path)
}

// queueSummary bins r's waiting requests over [0, span) into bins bins.
// A sample holds from its time to the next sample's (the last to span).
// Per bin: mean is the time-weighted mean of the waiting requests over
// the workers; busiest is the most any one worker had waiting while the
// bin lasted. Points sit at the bins' centres, in seconds.
func queueSummary(r *sim.Result, span time.Duration, bins int) (mean, busiest plotter.XYs) {
	width := float64(span) / float64(bins)
	area := make([]float64, bins) // waiting requests × time, summed over the workers
	peak := make([]float64, bins)
	workers := max(1, len(r.Workers))
	for i, q := range r.Queue {
		from, to := float64(q.At), float64(span)
		if i+1 < len(r.Queue) {
			to = float64(r.Queue[i+1].At)
		}
		to = min(to, float64(span))
		total, top := 0, 0
		for _, w := range q.Waiting {
			total += w
			top = max(top, w)
		}
		first := int(from / width)
		if first >= bins {
			continue
		}
		// A sample of zero length still shows in its bin's peak.
		peak[first] = max(peak[first], float64(top))
		for b := first; b < bins && float64(b)*width < to; b++ {
			lo, hi := max(from, float64(b)*width), min(to, float64(b+1)*width)
			if hi > lo {
				area[b] += float64(total) * (hi - lo)
				peak[b] = max(peak[b], float64(top))
			}
		}
	}
	for b := range bins {
		x := (float64(b) + 0.5) * width / float64(time.Second)
		mean = append(mean, plotter.XY{X: x, Y: area[b] / width / float64(workers)})
		busiest = append(busiest, plotter.XY{X: x, Y: peak[b]})
	}
	return mean, busiest
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
