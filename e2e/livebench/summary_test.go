package livebench

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestPercentile: numpy.percentile's default (linear) interpolation.
func TestPercentile(t *testing.T) {
	xs := []float64{4, 1, 3, 2}
	for _, tc := range []struct{ p, want float64 }{{0, 1}, {50, 2.5}, {90, 3.7}, {99, 3.97}, {100, 4}} {
		if got := Percentile(xs, tc.p); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("p%v = %v, want %v", tc.p, got, tc.want)
		}
	}
	if xs[0] != 4 {
		t.Error("Percentile sorted its input")
	}
	if Percentile(nil, 50) != 0 || Percentile([]float64{7}, 99) != 7 {
		t.Error("empty or single-value percentiles")
	}
}

func TestSummarize(t *testing.T) {
	ok := func(ttft, e2e time.Duration, itl ...time.Duration) Result {
		return Result{TTFT: ttft, E2E: e2e, ITL: itl, Chunks: len(itl) + 1, OutputTokens: len(itl) + 1}
	}
	run := Run{Elapsed: 2 * time.Second, Results: []Result{
		ok(10*time.Millisecond, 100*time.Millisecond, 5*time.Millisecond, 7*time.Millisecond),
		ok(20*time.Millisecond, 200*time.Millisecond, 9*time.Millisecond),
		ok(30*time.Millisecond, 300*time.Millisecond),
		{Reason: ReasonTimeout, TTFT: time.Hour},
		{Reason: ReasonInFlight},
	}}
	run.Results[1].Sent, run.Results[1].Scheduled = 1010*time.Millisecond, time.Second
	s := Summarize(run)
	want := Summary{
		Requests: 5, Succeeded: 3, Failed: 2,
		Failures:  map[Reason]int{ReasonTimeout: 1, ReasonInFlight: 1},
		DurationS: 2, RequestsPerS: 1.5,
		TTFTP50Ms: 20, TTFTP90Ms: 28, TTFTP99Ms: 29.8,
		ITLP90Ms: 8.6, E2EP90Ms: 280, OutputTokens: 6, SendLagP99Ms: 9.8,
	}
	got, _ := json.Marshal(s)
	exp, _ := json.Marshal(want)
	if !bytes.Equal(roundJSON(t, got), roundJSON(t, exp)) {
		t.Errorf("summary\n got %s\nwant %s", got, exp)
	}
}

// roundJSON rounds the numbers of a flat JSON object to 1e-9.
func roundJSON(t *testing.T, b []byte) []byte {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	for k, v := range m {
		if f, ok := v.(float64); ok {
			m[k] = math.Round(f*1e9) / 1e9
		}
	}
	out, _ := json.Marshal(m)
	return out
}

func TestWriteTTFTCDF(t *testing.T) {
	dir := t.TempDir()
	series := []Series{
		{Name: "kvbandit", TTFT: []time.Duration{50 * time.Millisecond, 80 * time.Millisecond, 2 * time.Second}},
		{Name: "round-robin", TTFT: []time.Duration{90 * time.Millisecond, time.Second, 4 * time.Second}},
		{Name: "empty"},
	}
	for _, tc := range []struct{ file, magic string }{{"ttft.svg", "<?xml"}, {"ttft.png", "\x89PNG"}} {
		path := filepath.Join(dir, tc.file)
		if err := WriteTTFTCDF(path, series); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(b, []byte(tc.magic)) || len(b) < 1000 {
			t.Errorf("%s: %d bytes starting %q", tc.file, len(b), b[:min(len(b), 8)])
		}
		if tc.file == "ttft.svg" && (!bytes.Contains(b, []byte("round-robin")) || !bytes.Contains(b, []byte("100ms"))) {
			t.Error("svg: no legend entry round-robin or tick label 100ms")
		}
	}
	if err := WriteTTFTCDF(filepath.Join(dir, "none.svg"), []Series{{Name: "empty"}}); err == nil {
		t.Error("a plot without data was written")
	}
	if got := len(TTFTs(Run{Results: []Result{{TTFT: 1}, {Reason: ReasonTimeout}}})); got != 1 {
		t.Errorf("TTFTs kept %d values, want the 1 success", got)
	}
}
