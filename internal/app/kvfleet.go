package app

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvevents"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// kvFleet keeps one KV-event subscriber per endpoint that configures
// kv_events, following the endpoint sets discovery publishes: endpoints
// that join are subscribed, endpoints that leave (or change their events
// address) are closed.
type kvFleet struct {
	ctx    context.Context
	engine *engine.Engine
	log    *slog.Logger
	// publish, when set (active-active replicas), republishes the
	// messages a worker sends to a bound socket (kv_events_bind), which
	// only this replica receives. Set before the first Follow.
	publish func(endpoint string, seq uint64, payload []byte)
	// hold makes new subscribers hold their streams for the warm start
	// (warm.go) until it resumes or releases them; onResumeGap is their
	// OnResumeGap; cacheBlocks the configured GPU cache size of a worker
	// that does not report num_gpu_blocks (router.kv_cache_blocks). Set
	// before the first Follow; hold is cleared under mu.
	hold        bool
	onResumeGap func(endpoint string)
	cacheBlocks int

	mu      sync.Mutex
	subs    map[routing.EndpointKey]*kvSub
	retired map[string]uint64 // counters of closed subscribers by kind, kept for the totals
	failed  atomic.Uint64
}

type kvSub struct {
	ep  routing.Endpoint
	sub *kvevents.Sub
}

func newKVFleet(ctx context.Context, engine *engine.Engine, log *slog.Logger) *kvFleet {
	return &kvFleet{ctx: ctx, engine: engine, log: log, subs: map[routing.EndpointKey]*kvSub{}, retired: map[string]uint64{}}
}

func sameEvents(a, b *routing.Endpoint) bool {
	return a.KVEvents == b.KVEvents && a.KVEventsBind == b.KVEventsBind && a.KVEventsReplay == b.KVEventsReplay && a.KVEventsFirstSeq == b.KVEventsFirstSeq &&
		a.DataParallelSize == b.DataParallelSize
}

// Follow reconciles the subscribers with set; it returns the subscription
// errors (a bad address, a port already bound), which are also logged and
// counted.
func (f *kvFleet) Follow(set routing.EndpointSet) []error {
	f.mu.Lock()
	defer f.mu.Unlock()
	want := make(map[routing.EndpointKey]*routing.Endpoint, len(set.Endpoints))
	for i := range set.Endpoints {
		if ep := &set.Endpoints[i]; ep.KVEvents != "" {
			want[ep.Key] = ep
		}
	}
	for k, s := range f.subs {
		if ep, ok := want[k]; !ok || !sameEvents(ep, &s.ep) {
			f.closeLocked(k, s)
		}
	}
	var errs []error
	for k, ep := range want {
		if _, ok := f.subs[k]; ok {
			continue
		}
		var tap func(string, uint64, []byte)
		if ep.KVEventsBind {
			tap = f.publish
		}
		sub, err := kvevents.Subscribe(f.ctx, kvevents.Config{Endpoint: string(k), Address: ep.KVEvents, Bind: ep.KVEventsBind, ReplayAddress: ep.KVEventsReplay, FirstSeq: ep.KVEventsFirstSeq,
			Hold: f.hold, CacheBlocks: f.cacheBlocks, Ranks: ep.DataParallelSize}, kvevents.Deps{
			Logger:      f.log,
			OnMessage:   tap,
			OnResumeGap: f.onResumeGap,
			Apply: func(_ string, rank int, ev kvindex.Event) error {
				return f.engine.ApplyKVEvent(k, rank, ev)
			},
			OnTrust: func(_ string, trusted bool) {
				f.engine.TrustKVEvents(k, trusted)
				f.log.Info("KV events", "endpoint", k, "trusted", trusted)
			},
		})
		if err != nil {
			f.failed.Add(1)
			f.log.Error("KV events: cannot subscribe; the endpoint stays on the approximate index", "endpoint", k, "address", ep.KVEvents, "err", err)
			errs = append(errs, err)
			continue
		}
		f.subs[k] = &kvSub{ep: *ep, sub: sub}
	}
	return errs
}

func (f *kvFleet) closeLocked(k routing.EndpointKey, s *kvSub) {
	s.sub.Close()
	for _, c := range counters(s.sub.Stats()) {
		f.retired[c.kind] += c.n
	}
	delete(f.subs, k)
}

// Push feeds a KV-event message a peer replica republished to the
// endpoint's subscriber (kvevents.Sub.Push: never blocks). An endpoint
// without a subscriber here is routing.ErrUnknownEndpoint.
func (f *kvFleet) Push(k routing.EndpointKey, seq uint64, payload []byte) error {
	f.mu.Lock()
	s, ok := f.subs[k]
	f.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %s: no KV-event subscriber", routing.ErrUnknownEndpoint, k)
	}
	s.sub.Push(seq, payload)
	return nil
}

// Addr returns the bound address of an endpoint's subscriber (bind mode),
// or nil.
func (f *kvFleet) Addr(k routing.EndpointKey) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if s, ok := f.subs[k]; ok && s.sub.Addr() != nil {
		return s.sub.Addr().String()
	}
	return ""
}

// Close stops every subscriber.
func (f *kvFleet) Close() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for k, s := range f.subs {
		f.closeLocked(k, s)
	}
}

var (
	kvEventsDesc     = prometheus.NewDesc("kvbandit_kv_events_total", "KV event messages and outcomes per endpoint (endpoint=\"\" holds the totals of subscribers closed since start).", []string{"endpoint", "kind"}, nil)
	kvTrustedDesc    = prometheus.NewDesc("kvbandit_kv_events_trusted", "1 while the endpoint's KV events describe its whole cache; 0 while it is indexed approximately.", []string{"endpoint"}, nil)
	kvSubscribeDesc  = prometheus.NewDesc("kvbandit_kv_events_subscribe_errors_total", "KV-event subscriptions that failed (bad address, port in use).", nil, nil)
	kvSubscribedDesc = prometheus.NewDesc("kvbandit_kv_events_subscribers", "Endpoints with a KV-event subscriber.", nil, nil)
	kvConnsDesc      = prometheus.NewDesc("kvbandit_kv_events_connections", "ZMTP connections open now for the endpoint's KV events (handshaking ones included).", []string{"endpoint"}, nil)
)

type counter struct {
	kind string
	n    uint64
}

// counters lists a subscriber's counters under their kind label of
// kvbandit_kv_events_total.
func counters(st kvevents.Stats) []counter {
	return []counter{
		{"messages", st.Messages}, {"blocks", st.Blocks}, {"malformed", st.Malformed}, {"dropped", st.Dropped},
		{"gaps", st.Gaps}, {"restarts", st.Restarts}, {"resyncs", st.Resyncs}, {"replays", st.Replays},
		{"unknown_parent", st.UnknownParent},
		// Events the index refused as over its limits (a worker's cap of
		// event-fed blocks, the block sizes); each makes the view
		// approximate.
		{"index_limit", st.IndexLimit},
		// The ZMTP socket's own refusals: connections over MaxConns, the
		// connections silent longest closed to make room for new ones, and
		// connections ended by a failed handshake, a protocol error, a
		// limit or a silent peer.
		{"connections_rejected", st.ConnectionsRejected}, {"connections_evicted", st.ConnectionsEvicted},
		{"connection_errors", st.ConnectionErrors},
	}
}

// Describe implements prometheus.Collector.
func (f *kvFleet) Describe(ch chan<- *prometheus.Desc) {
	ch <- kvEventsDesc
	ch <- kvTrustedDesc
	ch <- kvSubscribeDesc
	ch <- kvSubscribedDesc
	ch <- kvConnsDesc
}

// Collect implements prometheus.Collector.
func (f *kvFleet) Collect(ch chan<- prometheus.Metric) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for kind, n := range f.retired {
		ch <- prometheus.MustNewConstMetric(kvEventsDesc, prometheus.CounterValue, float64(n), "", kind)
	}
	for k, s := range f.subs {
		st := s.sub.Stats()
		for _, c := range counters(st) {
			ch <- prometheus.MustNewConstMetric(kvEventsDesc, prometheus.CounterValue, float64(c.n), string(k), c.kind)
		}
		trusted := 0.0
		if st.Trusted {
			trusted = 1
		}
		ch <- prometheus.MustNewConstMetric(kvTrustedDesc, prometheus.GaugeValue, trusted, string(k))
		ch <- prometheus.MustNewConstMetric(kvConnsDesc, prometheus.GaugeValue, float64(st.Connections), string(k))
	}
	ch <- prometheus.MustNewConstMetric(kvSubscribeDesc, prometheus.CounterValue, float64(f.failed.Load()))
	ch <- prometheus.MustNewConstMetric(kvSubscribedDesc, prometheus.GaugeValue, float64(len(f.subs)))
}
