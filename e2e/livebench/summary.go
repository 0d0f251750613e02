package livebench

import (
	"math"
	"slices"
	"time"
)

// Summary condenses a run, as vLLM's benchmark_serving reports it:
// latencies are over the successful requests (ITL pooled over all their
// gaps), percentiles interpolate linearly between order statistics
// (numpy's default). Times are in milliseconds.
type Summary struct {
	Requests  int `json:"requests"`
	Succeeded int `json:"succeeded"`
	Failed    int `json:"failed"`
	// Failures counts the failed requests by reason.
	Failures map[Reason]int `json:"failures,omitempty"`
	// DurationS is the run's duration in seconds; RequestsPerS the
	// successful requests per second of it.
	DurationS    float64 `json:"duration_s"`
	RequestsPerS float64 `json:"requests_per_s"`
	TTFTP50Ms    float64 `json:"ttft_p50_ms"`
	TTFTP90Ms    float64 `json:"ttft_p90_ms"`
	TTFTP99Ms    float64 `json:"ttft_p99_ms"`
	ITLP90Ms     float64 `json:"itl_p90_ms"`
	E2EP90Ms     float64 `json:"e2e_p90_ms"`
	// OutputTokens sums the successful requests' usage counts.
	OutputTokens int `json:"output_tokens"`
	// SendLagP99Ms is the 99th percentile of how late requests were sent
	// (Sent - Scheduled): a large value means the client, not the
	// server, was the bottleneck.
	SendLagP99Ms float64 `json:"send_lag_p99_ms"`
}

// Summarize condenses run.
func Summarize(run Run) Summary {
	s := Summary{Requests: len(run.Results), DurationS: run.Elapsed.Seconds()}
	var ttft, itl, e2e, lag []float64
	for i := range run.Results {
		r := &run.Results[i]
		if r.Reason != "" {
			s.Failed++
			if s.Failures == nil {
				s.Failures = map[Reason]int{}
			}
			s.Failures[r.Reason]++
			continue
		}
		s.Succeeded++
		s.OutputTokens += r.OutputTokens
		ttft = append(ttft, ms(r.TTFT))
		e2e = append(e2e, ms(r.E2E))
		lag = append(lag, ms(r.Sent-r.Scheduled))
		for _, g := range r.ITL {
			itl = append(itl, ms(g))
		}
	}
	if s.DurationS > 0 {
		s.RequestsPerS = float64(s.Succeeded) / s.DurationS
	}
	s.TTFTP50Ms = Percentile(ttft, 50)
	s.TTFTP90Ms = Percentile(ttft, 90)
	s.TTFTP99Ms = Percentile(ttft, 99)
	s.ITLP90Ms = Percentile(itl, 90)
	s.E2EP90Ms = Percentile(e2e, 90)
	s.SendLagP99Ms = Percentile(lag, 99)
	return s
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Percentile is the p-th percentile (0..100) of xs with linear
// interpolation between order statistics, as numpy.percentile; 0 for no
// values. xs is not modified.
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	pos := min(max(p, 0), 100) / 100 * float64(len(s)-1)
	lo := int(math.Floor(pos))
	hi := min(lo+1, len(s)-1)
	return s[lo] + (s[hi]-s[lo])*(pos-float64(lo))
}
