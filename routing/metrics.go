package routing

import "github.com/prometheus/client_golang/prometheus"

// Collector exports the engine's per-endpoint counters. Series exist only
// for endpoints of the current snapshot, so label values are bounded by
// the endpoint set.
type Collector struct {
	e         *Engine
	inflight  *prometheus.Desc
	decisions *prometheus.Desc
	endpoints *prometheus.Desc
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a collector for e.
func NewCollector(e *Engine) *Collector {
	return &Collector{
		e:         e,
		inflight:  prometheus.NewDesc("kvbandit_endpoint_inflight", "Decisions on the endpoint whose outcome has not been reported yet.", []string{"endpoint"}, nil),
		decisions: prometheus.NewDesc("kvbandit_endpoint_decisions_total", "Decisions made for the endpoint.", []string{"endpoint"}, nil),
		endpoints: prometheus.NewDesc("kvbandit_endpoints", "Endpoints in the current set.", nil, nil),
	}
}

// Describe implements [prometheus.Collector].
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.inflight
	ch <- c.decisions
	ch <- c.endpoints
}

// Collect implements [prometheus.Collector].
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	states := c.e.Endpoints()
	ch <- prometheus.MustNewConstMetric(c.endpoints, prometheus.GaugeValue, float64(len(states)))
	for _, st := range states {
		k := string(st.Key)
		ch <- prometheus.MustNewConstMetric(c.inflight, prometheus.GaugeValue, float64(st.InFlight.Load()), k)
		ch <- prometheus.MustNewConstMetric(c.decisions, prometheus.CounterValue, float64(st.Decisions.Load()), k)
	}
}

// OutcomeAware is implemented by policies that need outcomes (in-flight
// counts, rewards) to work well; kvbandit warns when response processing
// is off for such a policy.
type OutcomeAware interface {
	NeedsOutcomes() bool
}
