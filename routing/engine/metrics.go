package engine

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
)

// Collector exports the engine's per-endpoint counters and its index,
// queue and sweeper statistics. Per-endpoint series exist only for
// endpoints of the current snapshot, so label values are bounded by the
// endpoint set.
type Collector struct {
	e             *Engine
	inflight      *prometheus.Desc
	remote        *prometheus.Desc
	remoteExpired *prometheus.Desc
	decisions     *prometheus.Desc
	endpoints     *prometheus.Desc
	role          *prometheus.Desc
	pd            *prometheus.Desc
	prefill       *prometheus.Desc
	blocks        *prometheus.Desc
	indexEntries  *prometheus.Desc
	indexBlocks   *prometheus.Desc
	indexTiers    *prometheus.Desc
	indexEvents   *prometheus.Desc
	indexDropped  *prometheus.Desc
	expired       *prometheus.Desc
	servedUnknown *prometheus.Desc
	insertsDrop   *prometheus.Desc
	insertsLimit  *prometheus.Desc
	queueDepth    *prometheus.Desc
	queueOutcomes *prometheus.Desc
	ejections     *prometheus.Desc
	ejected       *prometheus.Desc
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a collector for e.
func NewCollector(e *Engine) *Collector {
	return &Collector{
		e:             e,
		inflight:      prometheus.NewDesc("kvbandit_endpoint_inflight", "Decisions on the endpoint whose outcome has not been reported yet.", []string{"endpoint"}, nil),
		remote:        prometheus.NewDesc("kvbandit_endpoint_remote_inflight", "Peer replicas' decisions on the endpoint applied here and not ended yet.", []string{"endpoint"}, nil),
		remoteExpired: prometheus.NewDesc("kvbandit_remote_decisions_expired_total", "Peer replicas' decisions released by the stale-decision timer because their end never came.", nil, nil),
		decisions:     prometheus.NewDesc("kvbandit_endpoint_decisions_total", "Decisions made for the endpoint.", []string{"endpoint"}, nil),
		endpoints:     prometheus.NewDesc("kvbandit_endpoints", "Endpoints in the current set.", nil, nil),
		role:          prometheus.NewDesc("kvbandit_endpoint_role", "1 for each endpoint of the current set, labelled with its prefill/decode role (prefill, decode, both).", []string{"endpoint", "role"}, nil),
		pd:            prometheus.NewDesc("kvbandit_pd_decisions_total", "Committed decisions in pools with prefill-role endpoints, by outcome: disaggregated, or why aggregated (no_body, below_threshold, no_eligible_prefill). Pools without prefill endpoints count no_prefill_endpoints.", []string{"outcome"}, nil),
		prefill:       prometheus.NewDesc("kvbandit_endpoint_active_prefill_tokens", "Prompt tokens of in-flight requests not prefilled yet.", []string{"endpoint"}, nil),
		blocks:        prometheus.NewDesc("kvbandit_endpoint_active_blocks", "Distinct KV blocks held by in-flight requests.", []string{"endpoint"}, nil),
		indexEntries:  prometheus.NewDesc("kvbandit_index_entries", "(block, worker) entries in the KV index, by mode.", []string{"mode"}, nil),
		indexBlocks:   prometheus.NewDesc("kvbandit_index_blocks", "Distinct blocks in the KV index.", nil, nil),
		indexTiers:    prometheus.NewDesc("kvbandit_index_tier_blocks", "Workers' lower-tier KV blocks in the index (from KV events with a CPU or disk medium), by medium.", []string{"medium"}, nil),
		indexEvents:   prometheus.NewDesc("kvbandit_index_event_rejections_total", "KV events rejected or partly applied, by reason.", []string{"reason"}, nil),
		indexDropped:  prometheus.NewDesc("kvbandit_index_approx_dropped_total", "Approximate entries dropped, by reason (ttl, pruned).", []string{"reason"}, nil),
		expired:       prometheus.NewDesc("kvbandit_decisions_expired_total", "Decisions released by the sweeper because their outcome never came.", nil, nil),
		servedUnknown: prometheus.NewDesc("kvbandit_served_unknown_total", "Outcomes whose served endpoint (data-plane metadata) was neither the chosen endpoint nor in the endpoint set; they teach nothing.", nil, nil),
		insertsDrop:   prometheus.NewDesc("kvbandit_index_inserts_dropped_total", "Approximate index inserts dropped because the index goroutine fell behind.", nil, nil),
		insertsLimit:  prometheus.NewDesc("kvbandit_index_insert_blocks_limited_total", "Blocks of prompts left out of the approximate index by the per-request and per-second insert bounds.", nil, nil),
		queueDepth:    prometheus.NewDesc("kvbandit_queue_depth", "Requests waiting in the admission queue.", nil, nil),
		queueOutcomes: prometheus.NewDesc("kvbandit_queue_requests_total", "Admission queue results.", []string{"result"}, nil),
		ejections:     prometheus.NewDesc("kvbandit_endpoint_ejections_total", "Endpoint ejections, by reason (errors: consecutive failed outcomes; scrape: consecutive failed metrics scrapes).", []string{"reason"}, nil),
		ejected:       prometheus.NewDesc("kvbandit_endpoints_ejected", "Endpoints of the current set that are ejected.", nil, nil),
	}
}

// Describe implements [prometheus.Collector].
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.inflight, c.remote, c.remoteExpired, c.decisions, c.endpoints, c.role, c.pd, c.prefill, c.blocks, c.indexEntries, c.indexBlocks, c.indexTiers, c.indexEvents, c.indexDropped, c.expired, c.servedUnknown, c.insertsDrop, c.insertsLimit, c.queueDepth, c.queueOutcomes, c.ejections, c.ejected} {
		ch <- d
	}
}

// Collect implements [prometheus.Collector].
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	states := c.e.snap.Load().eps
	ch <- prometheus.MustNewConstMetric(c.endpoints, prometheus.GaugeValue, float64(len(states)))
	now := c.e.clk.Now()
	ejected := 0
	for _, st := range states {
		k := string(st.Key)
		if st.ejected(now.UnixNano()) {
			ejected++
		}
		ch <- prometheus.MustNewConstMetric(c.role, prometheus.GaugeValue, 1, k, st.Role.String())
		ch <- prometheus.MustNewConstMetric(c.inflight, prometheus.GaugeValue, float64(st.InFlight.Load()), k)
		ch <- prometheus.MustNewConstMetric(c.remote, prometheus.GaugeValue, float64(st.RemoteInFlight.Load()), k)
		ch <- prometheus.MustNewConstMetric(c.decisions, prometheus.CounterValue, float64(st.Decisions.Load()), k)
		ch <- prometheus.MustNewConstMetric(c.prefill, prometheus.GaugeValue, float64(st.InFlightPrefill()), k)
		var blocks int64
		for _, b := range st.ActiveBlocks() {
			blocks += b
		}
		ch <- prometheus.MustNewConstMetric(c.blocks, prometheus.GaugeValue, float64(blocks), k)
	}
	for o, n := range c.e.pdCounts() {
		ch <- prometheus.MustNewConstMetric(c.pd, prometheus.CounterValue, float64(n), routing.PDOutcome(o).String())
	}
	is := c.e.index.Stats()
	ch <- prometheus.MustNewConstMetric(c.indexEntries, prometheus.GaugeValue, float64(is.ApproxEntries), "approximate")
	ch <- prometheus.MustNewConstMetric(c.indexEntries, prometheus.GaugeValue, float64(is.Entries-is.ApproxEntries), "event")
	ch <- prometheus.MustNewConstMetric(c.indexBlocks, prometheus.GaugeValue, float64(is.Blocks))
	ch <- prometheus.MustNewConstMetric(c.indexTiers, prometheus.GaugeValue, float64(is.CPUBlocks), "cpu")
	ch <- prometheus.MustNewConstMetric(c.indexTiers, prometheus.GaugeValue, float64(is.DiskBlocks), "disk")
	ch <- prometheus.MustNewConstMetric(c.indexEvents, prometheus.CounterValue, float64(is.UnknownParent), "unknown_parent")
	ch <- prometheus.MustNewConstMetric(c.indexEvents, prometheus.CounterValue, float64(is.UnknownRemoved), "unknown_removed")
	ch <- prometheus.MustNewConstMetric(c.indexEvents, prometheus.CounterValue, float64(is.Rejected), "rejected")
	ch <- prometheus.MustNewConstMetric(c.indexEvents, prometheus.CounterValue, float64(is.OverCapacity), "over_capacity")
	ch <- prometheus.MustNewConstMetric(c.indexEvents, prometheus.CounterValue, float64(is.TooManyBlockSizes), "too_many_block_sizes")
	ch <- prometheus.MustNewConstMetric(c.indexDropped, prometheus.CounterValue, float64(is.Expired), "ttl")
	ch <- prometheus.MustNewConstMetric(c.indexDropped, prometheus.CounterValue, float64(is.Pruned), "pruned")
	ch <- prometheus.MustNewConstMetric(c.expired, prometheus.CounterValue, float64(c.e.Expired()))
	ch <- prometheus.MustNewConstMetric(c.remoteExpired, prometheus.CounterValue, float64(c.e.RemoteExpired()))
	ch <- prometheus.MustNewConstMetric(c.servedUnknown, prometheus.CounterValue, float64(c.e.ServedUnknown()))
	ch <- prometheus.MustNewConstMetric(c.insertsDrop, prometheus.CounterValue, float64(c.e.DroppedInserts()))
	ch <- prometheus.MustNewConstMetric(c.insertsLimit, prometheus.CounterValue, float64(c.e.InsertBlocksLimited()))
	ch <- prometheus.MustNewConstMetric(c.ejected, prometheus.GaugeValue, float64(ejected))
	byErrors, byScrape := c.e.Ejections()
	ch <- prometheus.MustNewConstMetric(c.ejections, prometheus.CounterValue, float64(byErrors), EjectReasonErrors)
	ch <- prometheus.MustNewConstMetric(c.ejections, prometheus.CounterValue, float64(byScrape), EjectReasonScrape)
	if q := c.e.queue; q != nil {
		qs := q.Stats()
		ch <- prometheus.MustNewConstMetric(c.queueDepth, prometheus.GaugeValue, float64(qs.Depth))
		for name, v := range map[string]uint64{"admitted_immediately": qs.AdmittedImmediately, "admitted_after_wait": qs.AdmittedAfterWait, "shed": qs.Shed, "full": qs.Full, "timed_out": qs.TimedOut, "cancelled": qs.Cancelled} {
			ch <- prometheus.MustNewConstMetric(c.queueOutcomes, prometheus.CounterValue, float64(v), name)
		}
	}
}
