package benchcmd

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/kvbandit/kvbandit/routing/sim"
)

// plotTTFT writes the TTFT CDF of every policy (log-scale seconds).
func plotTTFT(path string, results []*sim.Result) error {
	p := plot.New()
	p.Title.Text = "TTFT CDF per policy"
	p.X.Label.Text = "TTFT (log scale)"
	p.Y.Label.Text = "fraction of requests"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = durationTicks{}
	p.Y.Min, p.Y.Max = 0, 1
	var lines []namedLine
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
		lines = append(lines, namedLine{r.Policy, xy})
	}
	return savePlot(p, lines, 9*vg.Inch, 5*vg.Inch, path)
}

// plotQueue writes the waiting requests of every worker over time under
// one policy; why says why that one.
func plotQueue(path string, r *sim.Result, why string) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("waiting requests per worker: %s (%s)", r.Policy, why)
	p.X.Label.Text = "virtual time (s)"
	p.Y.Label.Text = "waiting requests"
	p.X.Tick.Marker = countTicks{} // whole seconds
	p.Y.Tick.Marker = countTicks{}
	p.Y.Min, p.Y.Max = 0, 1
	var lines []namedLine
	for w := range r.Workers {
		var xy plotter.XYs
		for _, q := range r.Queue {
			if w < len(q.Waiting) {
				xy = append(xy, plotter.XY{X: q.At.Seconds(), Y: float64(q.Waiting[w])})
				p.Y.Max = max(p.Y.Max, float64(q.Waiting[w]))
			}
		}
		if len(xy) > 0 {
			lines = append(lines, namedLine{fmt.Sprintf("worker %d", w), xy})
		}
	}
	return savePlot(p, lines, 11*vg.Inch, 5*vg.Inch, path)
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

type namedLine struct {
	name string
	xy   plotter.XYs
}

// savePlot adds the lines in distinct colours and writes the plot with
// its legend to the right of the data area, where it cannot hide a line.
// The format follows path's extension (png, svg, pdf, ...).
func savePlot(p *plot.Plot, lines []namedLine, w, h vg.Length, path string) error {
	leg := plot.NewLegend()
	leg.Top, leg.Left = true, true
	for i, l := range lines {
		pl, err := plotter.NewLine(l.xy)
		if err != nil {
			return fmt.Errorf("%s: %w", l.name, err)
		}
		pl.Color = plotColor(i)
		pl.Width = vg.Points(1.5)
		if i >= len(palette) {
			// Past the palette the colours repeat: dash them apart.
			pl.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		}
		p.Add(pl)
		leg.Add(l.name, pl)
	}
	format := strings.TrimPrefix(strings.ToLower(filepath.Ext(path)), ".")
	c, err := draw.NewFormattedCanvas(w, h, format)
	if err != nil {
		return err
	}
	dc := draw.New(c)
	r := leg.Rectangle(dc)
	legW := r.Max.X - r.Min.X + vg.Points(16)
	area := dc
	area.Max.X -= legW
	p.Draw(area)
	legArea := dc
	legArea.Min.X = area.Max.X + vg.Points(8)
	legArea.Max.Y = p.DataCanvas(area).Max.Y
	leg.Draw(legArea)
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := c.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// palette is matplotlib's tab10: ten colours told apart on white, also
// in print.
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x94, 0x67, 0xbd, 0xff},
	{0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff}, {0x7f, 0x7f, 0x7f, 0xff}, {0xbc, 0xbd, 0x22, 0xff}, {0x17, 0xbe, 0xcf, 0xff},
}

func plotColor(i int) color.Color { return palette[i%len(palette)] }

// durationTicks marks a log-scale seconds axis: every digit step gets a
// tick, 1, 2 and 5 of each decade a label in ms or s ("20ms", "1s"); a
// range too narrow for two such labels labels every digit, and one too
// narrow for that its ends.
type durationTicks struct{}

// Ticks implements [plot.Ticker].
func (durationTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(lo > 0) || !(hi >= lo) || math.IsInf(hi, 0) {
		return nil
	}
	var ticks []plot.Tick
	labelled := 0
	for e := int(math.Floor(math.Log10(lo))); e <= int(math.Ceil(math.Log10(hi))); e++ {
		for d := 1; d <= 9; d++ {
			v := float64(d) * math.Pow10(e)
			if v < lo*(1-1e-9) || v > hi*(1+1e-9) {
				continue
			}
			t := plot.Tick{Value: v}
			if d == 1 || d == 2 || d == 5 {
				t.Label = fmtTickSeconds(v)
				labelled++
			}
			ticks = append(ticks, t)
		}
	}
	if labelled < 2 {
		for i := range ticks {
			ticks[i].Label = fmtTickSeconds(ticks[i].Value)
		}
		if len(ticks) < 2 {
			ticks = append(ticks, plot.Tick{Value: lo, Label: fmtTickSeconds(lo)}, plot.Tick{Value: hi, Label: fmtTickSeconds(hi)})
		}
	}
	return ticks
}

// fmtTickSeconds writes seconds in the unit that keeps the number short:
// 150µs, 20ms, 1.5s.
func fmtTickSeconds(v float64) string {
	switch {
	case v >= 1:
		return strconv.FormatFloat(v, 'g', 3, 64) + "s"
	case v >= 1e-3:
		return strconv.FormatFloat(v*1e3, 'g', 3, 64) + "ms"
	}
	return strconv.FormatFloat(v*1e6, 'g', 3, 64) + "µs"
}

// countTicks marks an axis of counts (or whole seconds): integers only, at
// a step of 1, 2 or 5 times a power of ten that gives at most about eight
// labels.
type countTicks struct{}

// Ticks implements [plot.Ticker].
func (countTicks) Ticks(lo, hi float64) []plot.Tick {
	if math.IsNaN(lo) || math.IsNaN(hi) || math.IsInf(lo, 0) || math.IsInf(hi, 0) || hi < lo {
		return nil
	}
	step := 1.0
	for mag := 1.0; step*8 < hi-lo; mag *= 10 {
		for _, m := range []float64{1, 2, 5} {
			if step = m * mag; step*8 >= hi-lo {
				break
			}
		}
	}
	var ticks []plot.Tick
	for v := math.Ceil(lo/step) * step; v <= hi; v += step {
		ticks = append(ticks, plot.Tick{Value: v, Label: strconv.FormatFloat(v, 'f', 0, 64)})
	}
	return ticks
}

// queuePlotPath is OUT-queue.png for --plot OUT.png.
func queuePlotPath(out string) string {
	ext := filepath.Ext(out)
	return strings.TrimSuffix(out, ext) + "-queue" + ext
}
