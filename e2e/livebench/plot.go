package livebench

import (
	"errors"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
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
// axis, in the style of `kvbandit bench --plot` (internal/benchcmd):
// tab10 colours, the legend right of the data area, ticks in ms or s.
// The format follows path's extension (png, svg, pdf). Series without
// values are left out; with none at all it is an error.
func WriteTTFTCDF(path string, series []Series) error {
	p := plot.New()
	p.Title.Text = "TTFT CDF"
	p.X.Label.Text = "TTFT (log scale)"
	p.Y.Label.Text = "fraction of requests"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = durationTicks{}
	p.Y.Min, p.Y.Max = 0, 1
	leg := plot.NewLegend()
	leg.Top, leg.Left = true, true
	n := 0
	for _, s := range series {
		xy := cdf(s.TTFT)
		if xy == nil {
			continue
		}
		l, err := plotter.NewLine(xy)
		if err != nil {
			return fmt.Errorf("%s: %w", s.Name, err)
		}
		l.Color = palette[n%len(palette)]
		l.Width = vg.Points(1.5)
		if n >= len(palette) {
			l.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		}
		p.Add(l)
		leg.Add(s.Name, l)
		n++
	}
	if n == 0 {
		return errors.New("livebench: no TTFT to plot")
	}
	return save(p, leg, 9*vg.Inch, 5*vg.Inch, path)
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

// save draws p with the legend right of its data area and writes it.
func save(p *plot.Plot, leg plot.Legend, w, h vg.Length, path string) error {
	format := strings.TrimPrefix(strings.ToLower(filepath.Ext(path)), ".")
	c, err := draw.NewFormattedCanvas(w, h, format)
	if err != nil {
		return err
	}
	dc := draw.New(c)
	r := leg.Rectangle(dc)
	area := dc
	area.Max.X -= r.Max.X - r.Min.X + vg.Points(16)
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

// palette is matplotlib's tab10, as internal/benchcmd uses.
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x94, 0x67, 0xbd, 0xff},
	{0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff}, {0x7f, 0x7f, 0x7f, 0xff}, {0xbc, 0xbd, 0x22, 0xff}, {0x17, 0xbe, 0xcf, 0xff},
}

// durationTicks marks a log-scale seconds axis: a tick at every digit
// step, labels at 1, 2 and 5 of each decade ("20ms", "1s"), or at every
// tick (and the ends) when that gives fewer than two labels.
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
				t.Label = secondsLabel(v)
				labelled++
			}
			ticks = append(ticks, t)
		}
	}
	if labelled < 2 {
		for i := range ticks {
			ticks[i].Label = secondsLabel(ticks[i].Value)
		}
		if len(ticks) < 2 {
			ticks = append(ticks, plot.Tick{Value: lo, Label: secondsLabel(lo)}, plot.Tick{Value: hi, Label: secondsLabel(hi)})
		}
	}
	return ticks
}

// secondsLabel writes seconds in the unit that keeps the number short.
func secondsLabel(v float64) string {
	switch {
	case v >= 1:
		return strconv.FormatFloat(v, 'g', 3, 64) + "s"
	case v >= 1e-3:
		return strconv.FormatFloat(v*1e3, 'g', 3, 64) + "ms"
	}
	return strconv.FormatFloat(v*1e6, 'g', 3, 64) + "µs"
}
