package livebench

import (
	"errors"
	"slices"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/kvbandit/kvbandit/internal/chart"
)

// Series is one line of a CDF plot.
type Series struct {
	Name string
	TTFT []time.Duration
}

// TTFTs returns the TTFT of the successful requests of run.
func TTFTs(run Run) []time.Duration {
	var out []time.Duration
	for i := range run.Results {
		if run.Results[i].OK() {
			out = append(out, run.Results[i].TTFT)
		}
	}
	return out
}

// WriteTTFTCDF draws the TTFT CDF of every series on a log-scale time
// axis, in the style of `kvbandit bench --plot` (internal/chart):
// tab10 colours, the legend right of the data area, ticks in ms or s.
// The format follows path's extension (png, svg, pdf). Series without
// values are left out; with none at all it is an error.
func WriteTTFTCDF(path string, series []Series) error {
	p := plot.New()
	p.Title.Text = "TTFT CDF"
	p.X.Label.Text = "TTFT (log scale)"
	p.Y.Label.Text = "fraction of requests"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = chart.DurationTicks{}
	p.Y.Min, p.Y.Max = 0, 1
	var lines []chart.Line
	for _, s := range series {
		if xy := cdf(s.TTFT); xy != nil {
			lines = append(lines, chart.Line{Name: s.Name, XY: xy})
		}
	}
	if len(lines) == 0 {
		return errors.New("livebench: no TTFT to plot")
	}
	return chart.Save(p, lines, 9*vg.Inch, 5*vg.Inch, path)
}

// cdf is the empirical CDF of ds in seconds (at most about 2,000
// points; values floored at 100µs for the log axis).
func cdf(ds []time.Duration) plotter.XYs {
	if len(ds) == 0 {
		return nil
	}
	v := make([]float64, len(ds))
	for i, d := range ds {
		v[i] = max(d.Seconds(), 1e-4)
	}
	slices.Sort(v)
	step := max(1, len(v)/2000)
	var xy plotter.XYs
	for i := 0; i < len(v); i += step {
		xy = append(xy, plotter.XY{X: v[i], Y: float64(i+1) / float64(len(v))})
	}
	return append(xy, plotter.XY{X: v[len(v)-1], Y: 1})
}
