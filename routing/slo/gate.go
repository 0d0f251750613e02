package slo

import (
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
)

// Config tunes the rule. The zero value takes the defaults below.
type Config struct {
	// Headroom is the share of the objective a prediction must stay under
	// to count as meeting it, in (0, 1]; 0 means DefaultHeadroom.
	// Predictions are means: a value below 1 buys attainment with cache.
	Headroom float64
	// NearTie keeps, among the candidates that meet the objective, those
	// whose overlap is at least (1 − NearTie) × the largest, in [0, 1);
	// 0 means DefaultNearTie, a negative value means exact ties only.
	NearTie float64
	// Off turns the rule off: objectives are only counted (met/missed),
	// never acted on. For comparisons.
	Off bool
}

// Defaults for [Config].
const (
	DefaultHeadroom = 0.8
	DefaultNearTie  = 0.1
)

// Validate reports a field out of range.
func (c Config) Validate() error {
	if math.IsNaN(c.Headroom) || c.Headroom < 0 || c.Headroom > 1 {
		return fmt.Errorf("slo: headroom %v outside [0, 1]", c.Headroom)
	}
	if math.IsNaN(c.NearTie) || c.NearTie >= 1 {
		return fmt.Errorf("slo: near_tie %v must be below 1", c.NearTie)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Headroom == 0 {
		c.Headroom = DefaultHeadroom
	}
	switch {
	case c.NearTie == 0:
		c.NearTie = DefaultNearTie
	case c.NearTie < 0:
		c.NearTie = 0
	}
	return c
}

// ErrUnmeetable is wrapped (with routing.ErrOverloaded) in the error
// returned for a sheddable request that no candidate is predicted to serve
// within its objective.
var ErrUnmeetable = errors.New("no endpoint is predicted to meet the TTFT objective")

// Gate applies objectives; it implements routing.Gate.
type Gate struct {
	cfg               Config
	met, missed, shed atomic.Uint64
	metricDesc        *prometheus.Desc
}

var _ prometheus.Collector = (*Gate)(nil)

// New returns a gate for cfg (defaults applied).
func New(cfg Config) (*Gate, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Gate{
		cfg:        cfg.withDefaults(),
		metricDesc: prometheus.NewDesc("kvbandit_objective_total", "Requests with a TTFT objective, by result: met (first token within the objective), missed (later, or a worker error first), shed (rejected at decision time: sheddable and no endpoint predicted to meet it).", []string{"result"}, nil),
	}, nil
}

// Filter is the engine's objectives stage: it returns the indexes of s.Candidates
// the policy may choose from, ascending, or nil for all of them, or an
// error wrapping routing.ErrOverloaded for a sheddable request that cannot
// meet its objective (counted as shed when commit is set).
func (g *Gate) Filter(s *routing.Scoring, p routing.Policy, commit bool) ([]int, error) {
	obj := s.Req.Hints.TTFTObjective
	if g.cfg.Off || obj <= 0 || len(s.Candidates) == 0 {
		return nil, nil
	}
	pr, ok := p.(routing.Predictor)
	if !ok {
		return nil, nil
	}
	preds := pr.Predict(s)
	if len(preds) != len(s.Candidates) {
		return nil, nil // a policy bug; route as if there were no objective
	}
	return g.choose(s, preds, obj, commit)
}

func (g *Gate) choose(s *routing.Scoring, preds []routing.Prediction, obj time.Duration, commit bool) ([]int, error) {
	limit := time.Duration(float64(obj) * g.cfg.Headroom)
	best, meet := -1, 0
	for i := range preds {
		if preds[i].TTFT <= limit {
			meet++
			best = max(best, s.Candidates[i].Overlap)
		}
	}
	if meet == 0 {
		if s.Req.Hints.Sheddable() {
			if commit {
				g.shed.Add(1)
			}
			return nil, fmt.Errorf("%w: %w (objective %v)", routing.ErrOverloaded, ErrUnmeetable, obj)
		}
		return nil, nil
	}
	floor := int(math.Ceil(float64(best) * (1 - g.cfg.NearTie)))
	keep := make([]int, 0, meet)
	for i := range preds {
		if preds[i].TTFT <= limit && s.Candidates[i].Overlap >= floor {
			keep = append(keep, i)
		}
	}
	if len(keep) == len(s.Candidates) {
		return nil, nil
	}
	return keep, nil
}

// Observe counts a committed decision's outcome against its objective
// (routing.Decision.Objective); decisions without one are ignored. Wire
// it into engine.Deps.OnDone.
func (g *Gate) Observe(d *routing.Decision, o routing.Outcome) {
	if d == nil || d.Objective <= 0 {
		return
	}
	switch {
	case o.TTFT > 0 && (o.Kind == routing.OutcomeSuccess || o.Kind == routing.OutcomeUpstreamError):
		if o.TTFT <= d.Objective {
			g.met.Add(1)
		} else {
			g.missed.Add(1)
		}
	case o.Kind == routing.OutcomeUpstreamError || o.Kind == routing.OutcomeExpired:
		g.missed.Add(1)
	}
}

// Counts returns the met, missed and shed counters.
func (g *Gate) Counts() (met, missed, shed uint64) {
	return g.met.Load(), g.missed.Load(), g.shed.Load()
}

// Describe implements [prometheus.Collector].
func (g *Gate) Describe(ch chan<- *prometheus.Desc) { ch <- g.metricDesc }

// Collect implements [prometheus.Collector].
func (g *Gate) Collect(ch chan<- prometheus.Metric) {
	met, missed, shed := g.Counts()
	ch <- prometheus.MustNewConstMetric(g.metricDesc, prometheus.CounterValue, float64(met), "met")
	ch <- prometheus.MustNewConstMetric(g.metricDesc, prometheus.CounterValue, float64(missed), "missed")
	ch <- prometheus.MustNewConstMetric(g.metricDesc, prometheus.CounterValue, float64(shed), "shed")
}
