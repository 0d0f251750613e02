package main

import (
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"time"
)

// sample is one measurement of the kvbandit process.
type sample struct {
	at    time.Duration // since the load started
	phase string        // "idle" (before the load), "load", "quiesce"

	rss          int64 // bytes
	heapInuse    float64
	goroutines   float64
	threads, fds int

	streams       float64 // kvbandit_extproc_streams_inflight
	proxyInflight float64 // kvbandit_proxy_requests_inflight
	epInflight    float64 // sum of kvbandit_endpoint_inflight
	epBusy        []string
	epInflights   []float64 // per fleet worker, in fleet order (-1: not in the set)
	buffered      float64   // kvbandit_buffered_body_bytes
	metricsBytes  int
	kvSubs        float64
	startTime     float64 // process_start_time_seconds

	ok, failed, skipped int64
	perClass            []classCount
	normalOK, normalNOK int64

	scrapeErr string
}

type classCount struct{ ok, failed, skipped int64 }

// limits are the verdict's tolerances.
type limits struct {
	warmup             time.Duration
	rssTol, rssSlack   float64 // fraction, bytes
	gorTol, gorSlack   float64 // fraction, count
	minSuccess         float64
	minJudgedSamples   int
	minWarmupSamples   int
	minSuccessRequests int64
}

func defaultLimits(o options) limits {
	warmup := min(max(time.Duration(o.Warmup*float64(o.Duration)), o.WarmupMin), o.Duration/2)
	return limits{warmup: warmup, rssTol: o.RSSTolerance, rssSlack: o.RSSSlackMiB * (1 << 20),
		gorTol: o.GorTolerance, gorSlack: o.GorSlack, minSuccess: o.MinSuccess,
		minJudgedSamples: 6, minWarmupSamples: 2, minSuccessRequests: 20}
}

// growth is the analysis of one series after the warm-up.
type growth struct {
	name              string
	n                 int
	first, last       float64 // medians of the first and last thirds
	thirds            float64 // (last - first) / first
	slope             float64 // least-squares units per second
	slopeGrowth       float64 // the fitted line's rise over the window, relative to its start
	absRise           float64 // last - first
	tol, slack        float64
	grew, notJudged   bool
	why               string
	unit              func(float64) string
	windowStart, span time.Duration
}

func (g growth) String() string {
	if g.notJudged {
		return fmt.Sprintf("%s: not judged (%s)", g.name, g.why)
	}
	return fmt.Sprintf("%s: first third median %s, last third %s (%+.1f%%); least-squares slope %s/min (%+.1f%% over %v); tolerance %.0f%% and %s",
		g.name, g.unit(g.first), g.unit(g.last), 100*g.thirds, g.unit(g.slope*60), 100*g.slopeGrowth, g.span.Round(time.Second),
		100*g.tol, g.unit(g.slack))
}

// judged returns the load samples after the warm-up: those taken after
// the warm-up time, and never the first minWarmupSamples ones.
func judged(samples []sample, l limits) []sample {
	var load []sample
	for _, s := range samples {
		if s.phase == "load" && s.scrapeErr == "" {
			load = append(load, s)
		}
	}
	skip := l.minWarmupSamples
	cut := l.warmup
	for skip < len(load) && load[skip].at < cut {
		skip++
	}
	if skip > len(load) {
		return nil
	}
	return load[skip:]
}

// analyse judges one series: it grew when the last third's median exceeds
// the first third's by more than tol, the least-squares line rises by more
// than tol over the window, and the rise is above slack. Requiring both
// keeps one late spike (slope only) or one early step that then stays flat
// in a long run (thirds only, small slope) from failing the run alone.
func analyse(name string, ss []sample, value func(sample) float64, tol, slack float64, minN int, unit func(float64) string) growth {
	g := growth{name: name, n: len(ss), tol: tol, slack: slack, unit: unit}
	if len(ss) < minN {
		g.notJudged = true
		g.why = fmt.Sprintf("%d samples after the warm-up, need %d: run longer or sample more often", len(ss), minN)
		return g
	}
	ys := make([]float64, len(ss))
	ts := make([]float64, len(ss))
	for i, s := range ss {
		ys[i], ts[i] = value(s), s.at.Seconds()
	}
	k := len(ss) / 3
	g.first, g.last = median(ys[:k]), median(ys[len(ys)-k:])
	g.absRise = g.last - g.first
	if g.first > 0 {
		g.thirds = g.absRise / g.first
	}
	a, b := leastSquares(ts, ys)
	g.slope = b
	g.windowStart = ss[0].at
	g.span = ss[len(ss)-1].at - ss[0].at
	if start := a + b*ts[0]; start > 0 {
		g.slopeGrowth = b * (ts[len(ts)-1] - ts[0]) / start
	}
	g.grew = g.thirds > tol && g.slopeGrowth > tol && g.absRise > slack
	return g
}

// leastSquares fits y = a + b·t.
func leastSquares(ts, ys []float64) (a, b float64) {
	n := float64(len(ts))
	var st, sy, stt, sty float64
	for i := range ts {
		st += ts[i]
		sy += ys[i]
		stt += ts[i] * ts[i]
		sty += ts[i] * ys[i]
	}
	d := n*stt - st*st
	if d == 0 {
		return sy / n, 0
	}
	b = (n*sty - st*sy) / d
	return (sy - b*st) / n, b
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func mib(v float64) string { return fmt.Sprintf("%.1f MiB", v/(1<<20)) }
func num(v float64) string { return fmt.Sprintf("%.0f", v) }

// verdict is the end of a run.
type verdict struct {
	failures []string
	notes    []string
	rss, gor growth
}

// judge applies the growth, restart and service rules to the samples.
func judge(samples []sample, l limits) verdict {
	var v verdict
	js := judged(samples, l)
	v.rss = analyse("RSS", js, func(s sample) float64 { return float64(s.rss) }, l.rssTol, l.rssSlack, l.minJudgedSamples, mib)
	v.gor = analyse("goroutines", js, func(s sample) float64 { return s.goroutines }, l.gorTol, l.gorSlack, l.minJudgedSamples, num)
	for _, g := range []growth{v.rss, v.gor} {
		switch {
		case g.notJudged:
			v.notes = append(v.notes, g.String())
		case g.grew:
			v.failures = append(v.failures, "grew: "+g.String())
		}
	}
	// The process must be the one started at the beginning.
	var start float64
	for _, s := range samples {
		if s.startTime == 0 {
			continue
		}
		if start == 0 {
			start = s.startTime
		} else if s.startTime != start {
			v.failures = append(v.failures, fmt.Sprintf("kvbandit restarted: process_start_time_seconds went from %.0f to %.0f at %v", start, s.startTime, s.at.Round(time.Second)))
			break
		}
	}
	// Normal traffic must mostly succeed in the last third of the load.
	if l.minSuccess > 0 {
		var load []sample
		for _, s := range samples {
			if s.phase == "load" {
				load = append(load, s)
			}
		}
		if len(load) >= 3 {
			from, to := load[len(load)-1-len(load)/3], load[len(load)-1]
			okN, nok := to.normalOK-from.normalOK, to.normalNOK-from.normalNOK
			if okN+nok >= l.minSuccessRequests {
				if rate := float64(okN) / float64(okN+nok); rate < l.minSuccess {
					v.failures = append(v.failures, fmt.Sprintf("normal traffic: %.0f%% of %d requests succeeded in the last third of the load (minimum %.0f%%)",
						100*rate, okN+nok, 100*l.minSuccess))
				}
			}
		}
	}
	return v
}

// afterLoad checks the quiesced process against the early load: goroutines
// must be back at or below the first third's level.
func afterLoad(v *verdict, final sample) {
	if v.gor.notJudged {
		return
	}
	limit := v.gor.first*(1+v.gor.tol) + v.gor.slack
	if final.goroutines > limit {
		v.failures = append(v.failures, fmt.Sprintf("goroutines after the load and quiescence: %.0f, above the early load level (%.0f, limit %.0f): goroutines leaked",
			final.goroutines, v.gor.first, limit))
	}
}

// quiet reports whether nothing is in flight, and what is if something is.
func quiet(s sample) (bool, string) {
	var busy []string
	if s.scrapeErr != "" {
		return false, "scrape failed: " + s.scrapeErr
	}
	if s.streams != 0 {
		busy = append(busy, fmt.Sprintf("ext_proc streams %g", s.streams))
	}
	if s.proxyInflight != 0 {
		busy = append(busy, fmt.Sprintf("proxy requests %g", s.proxyInflight))
	}
	if s.epInflight != 0 {
		busy = append(busy, fmt.Sprintf("endpoint in-flight %g (%s)", s.epInflight, strings.Join(s.epBusy, ", ")))
	}
	if s.buffered != 0 {
		busy = append(busy, fmt.Sprintf("buffered body bytes %g", s.buffered))
	}
	return len(busy) == 0, strings.Join(busy, "; ")
}

// ---- output ---------------------------------------------------------------------------

const tableHeader = "  elapsed  phase    RSS_MiB heap_MiB   gor  thr   fds streams px_infl ep_infl buf_KiB met_KiB kvsub       ok  failed skipped"

func (s sample) row() string {
	if s.scrapeErr != "" && s.rss == 0 {
		return fmt.Sprintf("%9s  %-7s  (no sample: %s)", fmtElapsed(s.at), s.phase, s.scrapeErr)
	}
	r := fmt.Sprintf("%9s  %-7s %8.1f %8.1f %5.0f %4d %5d %7.0f %7.0f %7.0f %7.0f %7.0f %5.0f %8d %7d %7d",
		fmtElapsed(s.at), s.phase, float64(s.rss)/(1<<20), s.heapInuse/(1<<20), s.goroutines, s.threads, s.fds,
		s.streams, s.proxyInflight, s.epInflight, s.buffered/1024, float64(s.metricsBytes)/1024, s.kvSubs, s.ok, s.failed, s.skipped)
	if s.scrapeErr != "" {
		r += "  (/metrics: " + s.scrapeErr + ")"
	}
	return r
}

func fmtElapsed(d time.Duration) string {
	neg := d < 0
	if neg {
		d = -d
	}
	d = d.Round(time.Second)
	s := fmt.Sprintf("%d:%02d:%02d", int(d.Hours()), int(d.Minutes())%60, int(d.Seconds())%60)
	if neg {
		s = "-" + s
	}
	return s
}

func csvHeader(classes []*class, endpoints []string) string {
	cols := []string{"elapsed_s", "phase", "rss_bytes", "heap_inuse_bytes", "goroutines", "threads", "fds", "extproc_streams",
		"proxy_inflight", "endpoint_inflight", "buffered_body_bytes", "metrics_bytes", "kv_subscribers", "ok", "failed", "skipped"}
	for _, ep := range endpoints {
		cols = append(cols, "inflight_"+ep)
	}
	for _, c := range classes {
		cols = append(cols, c.name+"_ok", c.name+"_failed", c.name+"_skipped")
	}
	return strings.Join(cols, ",")
}

func (s sample) csv() string {
	cols := []string{fmt.Sprintf("%.1f", s.at.Seconds()), s.phase, fmt.Sprint(s.rss), fmt.Sprintf("%.0f", s.heapInuse),
		fmt.Sprintf("%.0f", s.goroutines), fmt.Sprint(s.threads), fmt.Sprint(s.fds), fmt.Sprintf("%.0f", s.streams),
		fmt.Sprintf("%.0f", s.proxyInflight), fmt.Sprintf("%.0f", s.epInflight), fmt.Sprintf("%.0f", s.buffered),
		fmt.Sprint(s.metricsBytes), fmt.Sprintf("%.0f", s.kvSubs), fmt.Sprint(s.ok), fmt.Sprint(s.failed), fmt.Sprint(s.skipped)}
	for _, v := range s.epInflights {
		cols = append(cols, fmt.Sprintf("%.0f", v))
	}
	for _, c := range s.perClass {
		cols = append(cols, fmt.Sprint(c.ok), fmt.Sprint(c.failed), fmt.Sprint(c.skipped))
	}
	return strings.Join(cols, ",")
}

// minMedMax summarises one series over the load samples.
func minMedMax(samples []sample, value func(sample) float64, unit func(float64) string) string {
	var ys []float64
	for _, s := range samples {
		if s.phase == "load" && s.scrapeErr == "" {
			ys = append(ys, value(s))
		}
	}
	if len(ys) == 0 {
		return "no samples"
	}
	return fmt.Sprintf("min %s, median %s, max %s", unit(slices.Min(ys)), unit(median(ys)), unit(slices.Max(ys)))
}
