package benchcmd

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim"
)

// predErr is how well a policy predicted TTFT: the p50 of |predicted −
// actual| over the served requests, as a share of the actual TTFT p50.
// ok is false when the policy made no prediction.
func predErr(r *sim.Result) (float64, bool) {
	var errs, actual []time.Duration
	for _, q := range r.Requests {
		if q.Err != "" || q.Predicted <= 0 {
			continue
		}
		errs = append(errs, (q.Predicted - q.TTFT).Abs())
		actual = append(actual, q.TTFT)
	}
	if len(errs) == 0 {
		return 0, false
	}
	slices.Sort(errs)
	slices.Sort(actual)
	p50 := pct(actual, 50)
	if p50 <= 0 {
		return 0, false
	}
	return pct(errs, 50) / p50, true
}

// parseSpeedSchedule parses --speed-schedule "T:W:S,...": at virtual time
// T (a Go duration, or seconds) since the first arrival, worker W (0-based)
// runs at speed S (0 stops it, 1 is nominal).
func parseSpeedSchedule(s string, workers int) ([]sim.Change, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []sim.Change
	for i, item := range strings.Split(s, ",") {
		f := strings.Split(strings.TrimSpace(item), ":")
		if len(f) != 3 {
			return nil, fmt.Errorf("--speed-schedule: entry %d (%q): want T:W:S", i+1, item)
		}
		at, err := time.ParseDuration(f[0])
		if err != nil {
			sec, perr := strconv.ParseFloat(f[0], 64)
			if perr != nil || math.IsNaN(sec) || math.IsInf(sec, 0) || sec > 1e9 {
				return nil, fmt.Errorf("--speed-schedule: entry %d: time %q is not a duration", i+1, f[0])
			}
			at = time.Duration(sec * float64(time.Second))
		}
		w, err := strconv.Atoi(f[1])
		if err != nil || w < 0 || w >= workers {
			return nil, fmt.Errorf("--speed-schedule: entry %d: worker %q: want 0 to %d", i+1, f[1], workers-1)
		}
		sp, err := strconv.ParseFloat(f[2], 64)
		if err != nil || !(sp >= 0) || math.IsInf(sp, 0) {
			return nil, fmt.Errorf("--speed-schedule: entry %d: speed %q must be a number >= 0", i+1, f[2])
		}
		if at < 0 || (len(out) > 0 && at < out[len(out)-1].At) {
			return nil, fmt.Errorf("--speed-schedule: entry %d: times must be >= 0 and in order", i+1)
		}
		out = append(out, sim.Change{Worker: w, At: at, Speed: sp})
	}
	return out, nil
}

// fmtPredErr is a row's pred err cell ("-" for a policy that does not
// predict).
func fmtPredErr(p policySummary) string {
	if !p.Predicts {
		return "-\t"
	}
	return fmt.Sprintf("%.0f%%\t", 100*p.PredErr)
}
