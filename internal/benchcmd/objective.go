package benchcmd

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/sim"
	"github.com/kvbandit/kvbandit/routing/slo"
)

// This file holds the bench's latency objectives: --objective-ttft,
// --objective-share and --objective-priority give a seeded share of the
// requests a TTFT objective (routing.Hints.TTFTObjective, as x-slo-ttft-ms
// would), and the report adds the share of them that met it.

// objectiveOptions are the objective flags of `kvbandit bench`.
type objectiveOptions struct {
	ttft     time.Duration
	share    float64
	priority string // "" = none given
	headroom float64
	off      bool
}

func (o *objectiveOptions) addFlags(fs *flag.FlagSet) {
	fs.DurationVar(&o.ttft, "objective-ttft", 0, "give requests this TTFT objective (as x-slo-ttft-ms; 0: none)")
	fs.Float64Var(&o.share, "objective-share", 1, "with --objective-ttft: the share of requests (seeded choice) that carry it, in (0, 1]")
	fs.StringVar(&o.priority, "objective-priority", "", "with --objective-ttft: the priority of those requests (integer; below 0 is sheddable; empty: none)")
	fs.BoolVar(&o.off, "objective-rule-off", false, "count objectives without acting on them (the baseline for the rule)")
	fs.Float64Var(&o.headroom, "objective-headroom", 0, "the rule's headroom: a prediction must be under this share of the objective, in (0, 1] (0: routing/slo's default)")
}

// validate checks the flags and returns the priority (ok false: none).
func (o *objectiveOptions) validate() (prio int, ok bool, err error) {
	if err := (slo.Config{Headroom: o.headroom}).Validate(); err != nil {
		return 0, false, fmt.Errorf("--objective-headroom: %w", err)
	}
	if o.ttft == 0 {
		return 0, false, nil
	}
	if o.ttft < time.Millisecond || o.ttft > 10*time.Minute {
		return 0, false, fmt.Errorf("--objective-ttft %v: want 1ms to 10m", o.ttft)
	}
	if !(o.share > 0 && o.share <= 1) {
		return 0, false, fmt.Errorf("--objective-share %v: want (0, 1]", o.share)
	}
	if p := strings.TrimSpace(o.priority); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n < -1000 || n > 1000 {
			return 0, false, fmt.Errorf("--objective-priority %q: want an integer in [-1000, 1000]", o.priority)
		}
		return n, true, nil
	}
	return 0, false, nil
}

// apply gives the seeded share of reqs the objective (and priority), in
// place. The choice depends on the seed and the request order only, so
// every policy sees the same requests with objectives.
func (o *objectiveOptions) apply(reqs []sim.Request, seed int64) error {
	prio, hasPrio, err := o.validate()
	if err != nil || o.ttft == 0 {
		return err
	}
	rnd := rand.New(rand.NewPCG(uint64(seed), 0x5107))
	for i := range reqs {
		if rnd.Float64() >= o.share {
			continue
		}
		h := &reqs[i].Hints
		h.TTFTObjective = o.ttft
		if hasPrio {
			h.Priority, h.HasPriority = prio, true
		}
	}
	return nil
}

// objectiveSummary is a policy's objective attainment.
type objectiveSummary struct {
	// Requests is the number of requests with an objective.
	Requests int `json:"requests"`
	// Met is the share of them served with TTFT <= objective; shed and
	// failed ones count as not met.
	Met float64 `json:"met"`
	// Shed is the number rejected as overloaded at decision time.
	Shed int `json:"shed"`
	// OthersP90 is the TTFT p90 of the served requests without one.
	OthersP90 float64 `json:"others_ttft_p90_s"`
}

// summarizeObjectives returns nil when no request has an objective.
func summarizeObjectives(r *sim.Result, reqs []sim.Request) *objectiveSummary {
	var s objectiveSummary
	var met int
	var others []time.Duration
	for i, q := range r.Requests {
		if i >= len(reqs) {
			break
		}
		obj := reqs[i].Hints.TTFTObjective
		if obj <= 0 {
			if q.Err == "" {
				others = append(others, q.TTFT)
			}
			continue
		}
		s.Requests++
		switch {
		case q.Err == "" && q.TTFT <= obj:
			met++
		case q.Err != "" && strings.Contains(q.Err, routing.ErrOverloaded.Error()):
			s.Shed++
		}
	}
	if s.Requests == 0 {
		return nil
	}
	s.Met = float64(met) / float64(s.Requests)
	slices.Sort(others)
	s.OthersP90 = pct(others, 90)
	return &s
}

// objectiveColumns are the report's extra header cells.
const objectiveColumns = "SLO met\tshed\tothers p90\t"

func (s *objectiveSummary) cells() string {
	if s == nil {
		return "-\t-\t-\t"
	}
	return fmt.Sprintf("%.1f%%\t%d\t%s\t", 100*s.Met, s.Shed, fmtSec(s.OthersP90))
}
