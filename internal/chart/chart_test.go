package chart

import (
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
)

func tickLabels(ticks []plot.Tick) (labels []string, values []float64) {
	for _, t := range ticks {
		if t.Label != "" {
			labels = append(labels, t.Label)
			values = append(values, t.Value)
		}
	}
	return labels, values
}

func TestDurationTicks(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		lo, hi float64
		want   []string
	}{
		{0.01, 3, []string{"10ms", "20ms", "50ms", "100ms", "200ms", "500ms", "1s", "2s"}},
		{0.0125, 0.35, []string{"20ms", "50ms", "100ms", "200ms"}},
		{1e-4, 2e-3, []string{"100µs", "200µs", "500µs", "1ms", "2ms"}},
		{2.5, 40, []string{"5s", "10s", "20s"}},
		// Too narrow for two 1-2-5 labels: every digit is labelled.
		{0.031, 0.069, []string{"40ms", "50ms", "60ms"}},
		// Too narrow for two digits: the ends.
		{0.0412, 0.0475, []string{"41.2ms", "47.5ms"}},
	} {
		ticks := DurationTicks{}.Ticks(c.lo, c.hi)
		got, values := tickLabels(ticks)
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("[%v, %v]: labels %q, want %q", c.lo, c.hi, got, c.want)
		}
		for _, v := range values {
			if v < c.lo*(1-1e-9) || v > c.hi*(1+1e-9) {
				t.Errorf("[%v, %v]: tick %v outside the range", c.lo, c.hi, v)
			}
		}
	}
	if ticks := (DurationTicks{}).Ticks(0, 1); ticks != nil {
		t.Errorf("log ticks from 0: %v", ticks)
	}
}

func TestCountTicks(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		lo, hi float64
		want   []string
	}{
		{0, 1, []string{"0", "1"}},
		{0, 3, []string{"0", "1", "2", "3"}},
		{0, 7.5, []string{"0", "1", "2", "3", "4", "5", "6", "7"}},
		{0, 37, []string{"0", "5", "10", "15", "20", "25", "30", "35"}},
		{0, 90, []string{"0", "20", "40", "60", "80"}},
		{0.4, 2600, []string{"500", "1000", "1500", "2000", "2500"}},
	} {
		got, values := tickLabels(CountTicks{}.Ticks(c.lo, c.hi))
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("[%v, %v]: labels %q, want %q", c.lo, c.hi, got, c.want)
		}
		for _, v := range values {
			if v != math.Trunc(v) {
				t.Errorf("[%v, %v]: tick %v is not an integer", c.lo, c.hi, v)
			}
		}
	}
	if ticks := (CountTicks{}).Ticks(math.NaN(), 1); ticks != nil {
		t.Errorf("NaN range: %v", ticks)
	}
}

func TestSaveColumn(t *testing.T) {
	t.Parallel()
	if err := SaveColumn(nil, vg.Inch, vg.Inch, filepath.Join(t.TempDir(), "none.svg")); err == nil {
		t.Error("no panel: no error")
	}
	var panels []Panel
	for _, name := range []string{"top panel", "bottom panel"} {
		p := plot.New()
		p.Title.Text = name
		panels = append(panels, Panel{Plot: p, Lines: []Line{
			{Name: "first line", XY: plotter.XYs{{X: 0, Y: 0}, {X: 1, Y: 1}}},
			{Name: "second line", XY: plotter.XYs{{X: 0, Y: 1}, {X: 1, Y: 0}}},
		}})
	}
	path := filepath.Join(t.TempDir(), "column.svg")
	if err := SaveColumn(panels, 6*vg.Inch, 4*vg.Inch, path); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	// Both titles, and one legend for the two panels.
	for _, want := range []string{"top panel", "bottom panel", "first line", "second line"} {
		if n := strings.Count(string(b), want); n != 1 {
			t.Errorf("%q %d times, want once", want, n)
		}
	}
}
