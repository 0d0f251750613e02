package engine

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/burst"
)

// This file holds the engine's side of routing/burst: decisions made in
// a burst across the pool's replicas wait for this replica's turn, so that
// the pool decides the burst in turn instead of blind to itself.

// Turn records req's arrival and returns when its decision should be
// made: the zero time for at once (not in a burst, a lone replica, or
// this replica's turn is first), else req.Arrival plus its turn's offset
// (routing/burst). Pick calls it unless Options.ExternalTurns is set;
// then the caller must call it once per request and call Pick at the time
// it returns.
func (e *Engine) Turn(req *routing.Request) time.Time {
	return e.burst.Turn(req.Arrival, e.clk.Now())
}

// SetReplicas says this replica's rank among the pool's live replicas
// (0-based, the same order on every replica) and their number, itself
// included; the sync layer calls it when peers come and go. Without
// Options.Burst it does nothing.
func (e *Engine) SetReplicas(rank, replicas int) { e.burst.SetReplicas(rank, replicas) }

// BurstStats returns routing/burst's figures (zeros without
// Options.Burst).
func (e *Engine) BurstStats() burst.Stats { return e.burst.Stats(e.clk.Now()) }

// waitTurn waits for req's turn (Turn) unless the caller does
// (Options.ExternalTurns); ctx's cause ends the wait.
func (e *Engine) waitTurn(ctx context.Context, req *routing.Request) error {
	if e.burst == nil || e.opts.ExternalTurns {
		return nil
	}
	at := e.Turn(req)
	if at.IsZero() {
		return nil
	}
	d := at.Sub(e.clk.Now())
	if d <= 0 {
		return nil
	}
	done := make(chan struct{})
	t := e.clk.AfterFunc(d, func() { close(done) })
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		t.Stop()
		return context.Cause(ctx)
	}
}

// BurstCollector exports routing/burst's figures: how bursty the traffic
// looks, how many decisions waited for their turn and for how long, and
// the peer decisions still made blind to ours.
type BurstCollector struct {
	e                                  *Engine
	simultaneous, blind, turns, waited *prometheus.Desc
	rank, replicas                     *prometheus.Desc
}

var _ prometheus.Collector = (*BurstCollector)(nil)

// NewBurstCollector returns the collector for e.
func NewBurstCollector(e *Engine) *BurstCollector {
	return &BurstCollector{
		e:            e,
		simultaneous: prometheus.NewDesc("kvbandit_burst_simultaneous", "Peer decisions estimated to be made blind to each of this replica's beyond chance (how bursty arrivals are); decisions take turns at 1 or more.", nil, nil),
		blind:        prometheus.NewDesc("kvbandit_burst_blind_decisions", "Mean number of peer decisions that were blind to one of this replica's (made within the sync delay of it) over the last 10 s.", nil, nil),
		turns:        prometheus.NewDesc("kvbandit_burst_turns_total", "Decisions that waited for this replica's turn in a burst.", nil, nil),
		waited:       prometheus.NewDesc("kvbandit_burst_turn_wait_seconds_total", "Time decisions waited for their turn in a burst.", nil, nil),
		rank:         prometheus.NewDesc("kvbandit_burst_rank", "This replica's rank among the pool's live replicas (its turn in a burst).", nil, nil),
		replicas:     prometheus.NewDesc("kvbandit_burst_replicas", "Live replicas of the pool, this one included, as the turns count them.", nil, nil),
	}
}

// Describe implements [prometheus.Collector].
func (c *BurstCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.simultaneous, c.blind, c.turns, c.waited, c.rank, c.replicas} {
		ch <- d
	}
}

// Collect implements [prometheus.Collector].
func (c *BurstCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.e.BurstStats()
	ch <- prometheus.MustNewConstMetric(c.simultaneous, prometheus.GaugeValue, s.Simultaneous)
	ch <- prometheus.MustNewConstMetric(c.blind, prometheus.GaugeValue, s.Blind)
	ch <- prometheus.MustNewConstMetric(c.turns, prometheus.CounterValue, float64(s.Held))
	ch <- prometheus.MustNewConstMetric(c.waited, prometheus.CounterValue, s.HeldSeconds)
	ch <- prometheus.MustNewConstMetric(c.rank, prometheus.GaugeValue, float64(s.Rank))
	ch <- prometheus.MustNewConstMetric(c.replicas, prometheus.GaugeValue, float64(s.Replicas))
}
