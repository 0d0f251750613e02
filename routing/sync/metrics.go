package sync

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

type metrics struct {
	// sent and received by wire.Kind; received[0] counts undecodable
	// messages (kind "malformed").
	sent, received [wire.KindKVEvents + 1]prometheus.Counter
	dropped        *prometheus.CounterVec
	rejected       *prometheus.CounterVec
	repaired       *prometheus.CounterVec
	expired        prometheus.Counter
	refuted        prometheus.Counter
	quarantined    prometheus.Counter
	vouched        prometheus.Counter
	connectErrors  prometheus.Counter
	batchItems     prometheus.Histogram
	degraded       prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer, s *Syncer) (*metrics, error) {
	msgs := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvbandit_sync_messages_total", Help: "Sync messages sent to and received from peer replicas, by kind.",
	}, []string{"direction", "kind"})
	m := &metrics{
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_sync_dropped_total", Help: "Sync items or messages dropped, by reason (queue_full, kv_queue, disconnected, publish_error, too_large, snapshot_trimmed: outgoing; malformed, other_pool, own_replica_id, too_many_peers, peer_evicted (a newcomer peer forgotten to admit a new id), epoch_conflict (another epoch of a peer heard within the epoch takeover time), slow_consumer, unsupported: incoming).",
		}, []string{"reason"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_sync_rejected_total", Help: "Peers' decisions, outcomes and republished KV events this replica refused, by reason (unknown_endpoint, invalid, limit, no_ttl, too_many_tokens, peer_inflight, peer_prefill_tokens, over_kv_capacity, quarantined; outcomes: outcome_unmatched, outcome_duplicate, outcome_mismatch, outcome_refuted, outcome_implausible, outcome_unvouched (no worker count covered it), outcome_pending_full (the queue waiting for the workers' counts was full), outcome_peer_gone (its peer left, was evicted or quarantined while it waited)).",
		}, []string{"reason"}),
		repaired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_sync_snapshot_repairs_total", Help: "Peers' decisions a snapshot started (missed Start) or ended (missed End).",
		}, []string{"action"}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_sync_expired_total", Help: "Peers' decisions ended because their peer went silent for the peer TTL or their own TTL passed.",
		}),
		refuted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_sync_refuted_total", Help: "Peers' decisions ended because the worker's own scraped request count (running + waiting) did not vouch for them.",
		}),
		vouched: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_sync_outcomes_vouched_total", Help: "Peers' outcomes learnt once a worker's own count of finished requests (vllm:request_success_total, sglang:num_requests_total) covered them.",
		}),
		quarantined: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_sync_quarantined_total", Help: "Peers quarantined because the workers refuted their decisions again and again (their Starts and outcomes refused for a while).",
		}),
		connectErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvbandit_sync_connect_errors_total", Help: "Failed NATS connect attempts and asynchronous NATS errors.",
		}),
		batchItems: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvbandit_sync_batch_items", Help: "Items per published batch.",
			Buckets: prometheus.ExponentialBuckets(1, 2, 14),
		}),
		degraded: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvbandit_sync_degraded", Help: "1 while the replica is not connected to NATS and routes on local state (and what it last heard from peers).",
		}),
	}
	for k := wire.KindBatch; k <= wire.KindKVEvents; k++ {
		m.sent[k] = msgs.WithLabelValues("sent", k.String())
		m.received[k] = msgs.WithLabelValues("received", k.String())
	}
	m.received[0] = msgs.WithLabelValues("received", "malformed")
	peers := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvbandit_sync_peers", Help: "Peer replicas heard from within the peer TTL.",
	}, s.peerCount)
	age := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvbandit_sync_peer_update_age_seconds", Help: "Age of the newest message from any peer replica (0 without peers).",
	}, s.newestUpdateAge)
	quarantinedNow := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvbandit_sync_peers_quarantined", Help: "Peer replica ids quarantined now.",
	}, s.quarantinedPeers)
	pending := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "kvbandit_sync_outcomes_pending", Help: "Peers' outcomes waiting for the next scrape of a worker's count of finished requests.",
	}, s.pendingOutcomes)
	for _, c := range []prometheus.Collector{msgs, m.dropped, m.rejected, m.repaired, m.expired, m.refuted, m.quarantined, m.vouched, m.connectErrors, m.batchItems, m.degraded, peers, age, quarantinedNow, pending} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}
