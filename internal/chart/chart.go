// Package chart draws kvbandit's plots in one style (gonum/plot): lines
// in matplotlib's tab10 colours, dashed once the colours repeat, the
// legend right of the data area where it cannot hide a line, and axis
// ticks for log-scale seconds and for counts. kvbandit bench and the live
// benchmark use it.
package chart

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// Line is one named line of a plot.
type Line struct {
	Name string
	XY   plotter.XYs
}

// Save adds the lines in distinct colours and writes the plot with
// its legend to the right of the data area, where it cannot hide a line.
// The format follows path's extension (png, svg, pdf, ...).
func Save(p *plot.Plot, lines []Line, w, h vg.Length, path string) error {
	leg := plot.NewLegend()
	leg.Top, leg.Left = true, true
	if err := addLines(p, lines, &leg); err != nil {
		return err
	}
	c, dc, err := canvas(w, h, path)
	if err != nil {
		return err
	}
	area, legArea := splitLegend(dc, leg)
	p.Draw(area)
	legArea.Max.Y = p.DataCanvas(area).Max.Y
	leg.Draw(legArea)
	return write(c, path)
}

// Panel is one plot of a column of small multiples and its lines.
type Panel struct {
	Plot  *plot.Plot
	Lines []Line
}

// SaveColumn writes small multiples: the panels one above the other with
// their data areas aligned, the i-th line of every panel in the same
// colour, and one legend (the first panel's line names) right of the top
// panel. Each panel keeps its own title and axes; give them the same
// ranges to make them comparable.
func SaveColumn(panels []Panel, w, h vg.Length, path string) error {
	if len(panels) == 0 {
		return fmt.Errorf("chart: no panel to draw in %s", path)
	}
	leg := plot.NewLegend()
	leg.Top, leg.Left = true, true
	plots := make([][]*plot.Plot, len(panels))
	for i, pn := range panels {
		var l *plot.Legend
		if i == 0 {
			l = &leg
		}
		if err := addLines(pn.Plot, pn.Lines, l); err != nil {
			return err
		}
		plots[i] = []*plot.Plot{pn.Plot}
	}
	c, dc, err := canvas(w, h, path)
	if err != nil {
		return err
	}
	area, legArea := splitLegend(dc, leg)
	tiles := draw.Tiles{Rows: len(panels), Cols: 1, PadY: vg.Points(6), PadTop: vg.Points(2), PadBottom: vg.Points(2)}
	cells := plot.Align(plots, tiles, area)
	for i := range panels {
		panels[i].Plot.Draw(cells[i][0])
	}
	legArea.Max.Y = panels[0].Plot.DataCanvas(cells[0][0]).Max.Y
	leg.Draw(legArea)
	return write(c, path)
}

// addLines adds the lines to p in distinct colours, and to leg unless it
// is nil.
func addLines(p *plot.Plot, lines []Line, leg *plot.Legend) error {
	for i, l := range lines {
		pl, err := plotter.NewLine(l.XY)
		if err != nil {
			return fmt.Errorf("%s: %w", l.Name, err)
		}
		pl.Color = Color(i)
		pl.Width = vg.Points(1.5)
		if i >= len(Palette) {
			// Past the palette the colours repeat: dash them apart.
			pl.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		}
		p.Add(pl)
		if leg != nil {
			leg.Add(l.Name, pl)
		}
	}
	return nil
}

// canvas is a w×h canvas in the format of path's extension.
func canvas(w, h vg.Length, path string) (vg.CanvasWriterTo, draw.Canvas, error) {
	format := strings.TrimPrefix(strings.ToLower(filepath.Ext(path)), ".")
	c, err := draw.NewFormattedCanvas(w, h, format)
	if err != nil {
		return nil, draw.Canvas{}, err
	}
	return c, draw.New(c), nil
}

// splitLegend cuts the legend's width off the right of dc.
func splitLegend(dc draw.Canvas, leg plot.Legend) (area, legArea draw.Canvas) {
	r := leg.Rectangle(dc)
	legW := r.Max.X - r.Min.X + vg.Points(16)
	area = dc
	area.Max.X -= legW
	legArea = dc
	legArea.Min.X = area.Max.X + vg.Points(8)
	return area, legArea
}

// write writes the canvas to path.
func write(c vg.CanvasWriterTo, path string) error {
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

// Palette is matplotlib's tab10: ten colours told apart on white, also
// in print.
var Palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 0xff}, {0xff, 0x7f, 0x0e, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x94, 0x67, 0xbd, 0xff},
	{0x8c, 0x56, 0x4b, 0xff}, {0xe3, 0x77, 0xc2, 0xff}, {0x7f, 0x7f, 0x7f, 0xff}, {0xbc, 0xbd, 0x22, 0xff}, {0x17, 0xbe, 0xcf, 0xff},
}

// Color is the i-th line's colour.
func Color(i int) color.Color { return Palette[i%len(Palette)] }

// DurationTicks marks a log-scale seconds axis: every digit step gets a
// tick, 1, 2 and 5 of each decade a label in ms or s ("20ms", "1s"); a
// range too narrow for two such labels labels every digit, and one too
// narrow for that its ends.
type DurationTicks struct{}

// Ticks implements [plot.Ticker].
func (DurationTicks) Ticks(lo, hi float64) []plot.Tick {
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
				t.Label = SecondsLabel(v)
				labelled++
			}
			ticks = append(ticks, t)
		}
	}
	if labelled < 2 {
		for i := range ticks {
			ticks[i].Label = SecondsLabel(ticks[i].Value)
		}
		if len(ticks) < 2 {
			ticks = append(ticks, plot.Tick{Value: lo, Label: SecondsLabel(lo)}, plot.Tick{Value: hi, Label: SecondsLabel(hi)})
		}
	}
	return ticks
}

// SecondsLabel writes seconds in the unit that keeps the number short:
// 150µs, 20ms, 1.5s.
func SecondsLabel(v float64) string {
	switch {
	case v >= 1:
		return strconv.FormatFloat(v, 'g', 3, 64) + "s"
	case v >= 1e-3:
		return strconv.FormatFloat(v*1e3, 'g', 3, 64) + "ms"
	}
	return strconv.FormatFloat(v*1e6, 'g', 3, 64) + "µs"
}

// CountTicks marks an axis of counts (or whole seconds): integers only, at
// a step of 1, 2 or 5 times a power of ten that gives at most about eight
// labels.
type CountTicks struct{}

// Ticks implements [plot.Ticker].
func (CountTicks) Ticks(lo, hi float64) []plot.Tick {
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
