package main

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

const mb = 1 << 20

// loadSeries makes load samples every 30 s whose RSS and goroutines follow f
// (i from 0), with a little seeded noise.
func loadSeries(n int, f func(i int) (rss, gor float64)) []sample {
	rng := rand.New(rand.NewPCG(1, 2))
	var out []sample
	for i := range n {
		r, g := f(i)
		out = append(out, sample{at: time.Duration(i+1) * 30 * time.Second, phase: "load",
			rss: int64(r * (1 + 0.02*(rng.Float64()-0.5))), goroutines: math.Round(g * (1 + 0.02*(rng.Float64()-0.5)))})
	}
	return out
}

func testLimits(n int) limits {
	o := options{Warmup: 0.1, Duration: time.Duration(n) * 30 * time.Second, RSSTolerance: 0.25, RSSSlackMiB: 16,
		GorTolerance: 0.10, GorSlack: 20, MinSuccess: 0.5}
	return defaultLimits(o)
}

func TestVerdictGrowth(t *testing.T) {
	for _, tc := range []struct {
		name           string
		f              func(i int) (float64, float64)
		rssGrew, gGrew bool
	}{
		{"flat", func(int) (float64, float64) { return 120 * mb, 150 }, false, false},
		{"linear RSS leak", func(i int) (float64, float64) { return (100 + 4*float64(i)) * mb, 150 }, true, false},
		{"goroutine leak", func(i int) (float64, float64) { return 120 * mb, 150 + 3*float64(i) }, false, true},
		// Burst at the end, then back: the medians of the thirds do not see it.
		{"late spike", func(i int) (float64, float64) {
			if i >= 57 {
				return 400 * mb, 400
			}
			return 120 * mb, 150
		}, false, false},
		// +40% but only 8 MiB: under the slack.
		{"small process", func(i int) (float64, float64) { return (20 + 0.15*float64(i)) * mb, 30 + 0.1*float64(i) }, false, false},
		// Warm-up growth only (first 10%), flat afterwards.
		{"warm-up", func(i int) (float64, float64) {
			if i < 5 {
				return (50 + 20*float64(i)) * mb, 60 + 20*float64(i)
			}
			return 150 * mb, 160
		}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ss := loadSeries(60, tc.f)
			v := judge(ss, testLimits(60))
			if v.rss.grew != tc.rssGrew || v.gor.grew != tc.gGrew {
				t.Errorf("RSS grew %v, goroutines grew %v; want %v, %v\n%s\n%s", v.rss.grew, v.gor.grew, tc.rssGrew, tc.gGrew, v.rss, v.gor)
			}
			if (len(v.failures) > 0) != (tc.rssGrew || tc.gGrew) {
				t.Errorf("failures %q", v.failures)
			}
		})
	}
}

func TestVerdictTooFewSamples(t *testing.T) {
	ss := loadSeries(7, func(i int) (float64, float64) { return (100 + 50*float64(i)) * mb, 100 })
	v := judge(ss, testLimits(7))
	if !v.rss.notJudged || len(v.failures) != 0 || len(v.notes) != 2 {
		t.Fatalf("7 samples (5 after the warm-up): notJudged %v, failures %q, notes %q", v.rss.notJudged, v.failures, v.notes)
	}
}

func TestJudgedSkipsWarmup(t *testing.T) {
	ss := loadSeries(40, func(int) (float64, float64) { return mb, 1 })
	ss = append([]sample{{phase: "idle"}}, ss...)
	ss = append(ss, sample{phase: "quiesce", at: 41 * 30 * time.Second})
	l := testLimits(40)
	js := judged(ss, l)
	// 10% of 20 min = 2 min: the samples at 30 s to 90 s are warm-up (3 > 2).
	if len(js) != 37 || js[0].at != 120*time.Second {
		t.Fatalf("judged %d samples from %v, want 37 from 2m0s", len(js), js[0].at)
	}
	l.warmup = 0
	if js := judged(ss, l); len(js) != 38 {
		t.Fatalf("no warm-up fraction: judged %d samples, want 38 (the first 2 are always left out)", len(js))
	}
}

func TestWarmupBounds(t *testing.T) {
	for _, tc := range []struct {
		duration, want time.Duration
	}{
		{30 * time.Minute, 3 * time.Minute}, // 10%
		{3 * time.Minute, 90 * time.Second}, // at least 2 min, at most half
		{10 * time.Minute, 2 * time.Minute}, // at least 2 min
	} {
		o := options{Warmup: 0.1, WarmupMin: 2 * time.Minute, Duration: tc.duration}
		if got := defaultLimits(o).warmup; got != tc.want {
			t.Errorf("%v run: warm-up %v, want %v", tc.duration, got, tc.want)
		}
	}
}

func TestVerdictRestartAndService(t *testing.T) {
	ss := loadSeries(30, func(int) (float64, float64) { return 100 * mb, 100 })
	for i := range ss {
		ss[i].startTime = 1000
		ss[i].normalOK = int64(100 * i)
		ss[i].normalNOK = int64(5 * i)
	}
	if v := judge(ss, testLimits(30)); len(v.failures) != 0 {
		t.Fatalf("healthy run failed: %q", v.failures)
	}
	ss[20].startTime = 2000
	v := judge(ss, testLimits(30))
	if len(v.failures) != 1 || !strings.Contains(v.failures[0], "restarted") {
		t.Fatalf("restart: failures %q", v.failures)
	}
	ss[20].startTime = 1000
	// From sample 20 on, nine failures per success.
	for i := 20; i < len(ss); i++ {
		ss[i].normalOK = ss[19].normalOK + int64(10*(i-19))
		ss[i].normalNOK = ss[19].normalNOK + int64(90*(i-19))
	}
	v = judge(ss, testLimits(30))
	if len(v.failures) != 1 || !strings.Contains(v.failures[0], "normal traffic") {
		t.Fatalf("service: failures %q", v.failures)
	}
}

func TestAfterLoad(t *testing.T) {
	ss := loadSeries(30, func(int) (float64, float64) { return 100 * mb, 200 })
	v := judge(ss, testLimits(30))
	afterLoad(&v, sample{goroutines: 150})
	if len(v.failures) != 0 {
		t.Fatalf("fewer goroutines after the load: %q", v.failures)
	}
	afterLoad(&v, sample{goroutines: 260})
	if len(v.failures) != 1 || !strings.Contains(v.failures[0], "leaked") {
		t.Fatalf("260 goroutines after a load at 200: %q", v.failures)
	}
}

func TestQuiet(t *testing.T) {
	if ok, why := quiet(sample{}); !ok {
		t.Fatalf("zero sample busy: %s", why)
	}
	ok, why := quiet(sample{streams: 2, epInflight: 1, epBusy: []string{"127.0.0.1:1=1"}})
	if ok || !strings.Contains(why, "streams 2") || !strings.Contains(why, "127.0.0.1:1=1") {
		t.Fatalf("busy sample: %v %q", ok, why)
	}
	if ok, _ := quiet(sample{scrapeErr: "refused"}); ok {
		t.Fatal("a failed scrape is not quiet")
	}
}

func TestLeastSquares(t *testing.T) {
	a, b := leastSquares([]float64{0, 1, 2, 3}, []float64{1, 3, 5, 7})
	if math.Abs(a-1) > 1e-9 || math.Abs(b-2) > 1e-9 {
		t.Fatalf("y = %g + %g t, want 1 + 2 t", a, b)
	}
}

func TestParseMetrics(t *testing.T) {
	p, err := parseMetrics(strings.NewReader(`# HELP go_goroutines Number of goroutines.
# TYPE go_goroutines gauge
go_goroutines 42
kvbandit_endpoint_inflight{endpoint="127.0.0.1:1"} 0
kvbandit_endpoint_inflight{endpoint="127.0.0.1:2"} 3
process_start_time_seconds 1.7e+09
`))
	if err != nil {
		t.Fatal(err)
	}
	if v, ok := p.sum("go_goroutines"); !ok || v != 42 {
		t.Errorf("go_goroutines = %v %v", v, ok)
	}
	if v, _ := p.sum("kvbandit_endpoint_inflight"); v != 3 {
		t.Errorf("inflight sum = %v", v)
	}
	if nz := p.nonZero("kvbandit_endpoint_inflight", "endpoint"); len(nz) != 1 || nz[0] != "127.0.0.1:2=3" {
		t.Errorf("nonZero = %q", nz)
	}
	if _, ok := p.sum("absent"); ok {
		t.Error("absent series found")
	}
}

func TestCrashExcerpt(t *testing.T) {
	log := strings.Join([]string{"time=1 level=INFO msg=serving", "fatal error: runtime: out of memory", "", "runtime stack:",
		"runtime.throw(...)", "", "goroutine 7 gp=0x1 m=3 [running]:", "runtime.makeslice(...)", "zmq4.(*Conn).read(...)", "",
		"goroutine 1 [select]:", "main.main()"}, "\n")
	got := crashExcerpt(log)
	want := "fatal error: runtime: out of memory\ngoroutine 7 gp=0x1 m=3 [running]:\nruntime.makeslice(...)\nzmq4.(*Conn).read(...)"
	if got != want {
		t.Fatalf("got\n%s\nwant\n%s", got, want)
	}
	if got := crashExcerpt("a\nb"); got != "a\nb" {
		t.Fatalf("no crash: %q", got)
	}
}

func TestTallyBoundsReasons(t *testing.T) {
	tl := newTally()
	for i := range 100 {
		tl.fail(strings.Repeat("x", i%20) + " reason")
	}
	tl.mu.Lock()
	n := len(tl.reasons)
	tl.mu.Unlock()
	if n > maxReasons+1 || tl.failedN.Load() != 100 {
		t.Fatalf("%d distinct reasons kept (max %d + other), %d failures", n, maxReasons, tl.failedN.Load())
	}
	if top := tl.topReasons(1); len(top) != 1 || !strings.Contains(top[0], "other") {
		t.Fatalf("top reason %q, want other", top)
	}
}

func TestOptions(t *testing.T) {
	var sb strings.Builder
	o, err := parseOptions([]string{"--duration", "3m", "--skip", "kv_flood,zmtp_stall"}, &sb)
	if err != nil {
		t.Fatal(err)
	}
	cs := classCatalog(o)
	var names []string
	for _, c := range cs {
		if o.selected(c) {
			names = append(names, c.name)
		}
	}
	if strings.Contains(strings.Join(names, " "), "kv_flood") || len(names) != len(cs)-2 {
		t.Fatalf("selected %v", names)
	}
	o, err = parseOptions([]string{"--only", "idle_stream"}, &sb)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range classCatalog(o) {
		if want := c.group == groupNormal || c.name == "idle_stream"; o.selected(c) != want {
			t.Errorf("--only idle_stream: %s selected %v", c.name, o.selected(c))
		}
	}
	if _, err := parseOptions([]string{"--skip", "no_such_class"}, &sb); err == nil {
		t.Fatal("unknown class accepted")
	}
	if _, err := parseOptions([]string{"--workers", "2"}, &sb); err == nil {
		t.Fatal("--workers 2 accepted")
	}
}
