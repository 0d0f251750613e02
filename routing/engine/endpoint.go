package engine

import (
	"github.com/kvbandit/kvbandit/routing"

	"fmt"
	"strconv"
	"sync/atomic"

	"github.com/kvbandit/kvbandit/routing/slots"
)

// snapshot is the published endpoint set: immutable once stored, except
// for the Live and runtime state its endpoints share by pointer with the
// snapshots before and after it.
type snapshot struct {
	set routing.EndpointSet
	eps []*endpoint
	// states are eps' vocabulary views, for Endpoints.
	states []*routing.EndpointState
	byKey  map[routing.EndpointKey]*endpoint
	models map[routing.ModelName]struct{}
	// anyModel is set when some endpoint declares no models.
	anyModel bool
	// prefillRole is set when some endpoint has the prefill role.
	prefillRole bool
}

// endpoint is one endpoint of a snapshot: its vocabulary state (the
// endpoint and its shared Live counters) and the engine's own state of it,
// which is shared across snapshots in the same way.
type endpoint struct {
	routing.EndpointState
	*runtime
}

// runtime is the engine's state of an endpoint that outlives snapshots.
type runtime struct {
	// ranks holds each data-parallel rank's index worker and insert
	// state, aligned with Live.Ranks; immutable once published.
	ranks []*rankState
	// scraped is the endpoint's last scraped load; nil until a scrape.
	scraped atomic.Pointer[routing.Load]
	// scrapedAt is when scraped was reported (engine clock, Unix ns),
	// stored after it.
	scrapedAt atomic.Int64
	// blockSize is the block size the worker reports (vllm:cache_config_info);
	// 0 until known. Discovery's block size, when given, wins.
	blockSize atomic.Int64
	// rankLoads is each rank's scraped load (one per rank); nil unless the
	// endpoint has several ranks and the worker reports them.
	rankLoads atomic.Pointer[[]routing.Load]
	// health is the endpoint's ejection state.
	health health
	// adapters are the LoRA adapters the worker reported.
	adapters adapterSet
}

// newLive makes the shared state of a new endpoint: one slot, policy memo
// and index worker per data-parallel rank.
func (e *Engine) newLive(ep routing.Endpoint) (*routing.Live, *runtime) {
	n := max(ep.DataParallelSize, 1)
	l := &routing.Live{Ranks: make([]*routing.Rank, n)}
	rt := &runtime{ranks: make([]*rankState, n)}
	for r := range n {
		rank := r
		if n == 1 {
			rank = -1
		}
		l.Ranks[r] = &routing.Rank{Slot: &slots.Slot{}}
		rt.ranks[r] = &rankState{slot: l.Ranks[r].Slot, worker: e.index.Worker(string(ep.Key), rank), budget: bucket{rate: float64(e.opts.InsertTokensPerRank)}}
	}
	return l, rt
}

// load returns the endpoint's last scraped load (zero when none).
func (rt *runtime) load() routing.Load {
	if p := rt.scraped.Load(); p != nil {
		return *p
	}
	return routing.Load{}
}

// Update validates set and publishes it. On a validation error the current
// snapshot stays and the error is returned. Live counters of endpoints that
// stay are carried over.
func (e *Engine) Update(set routing.EndpointSet) error {
	set.Endpoints = append([]routing.Endpoint(nil), set.Endpoints...)
	if err := set.Validate(); err != nil {
		e.log.Warn("endpoint set rejected", "source", set.Source, "err", err)
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	old := e.snap.Load()
	next := &snapshot{set: set, byKey: make(map[routing.EndpointKey]*endpoint, len(set.Endpoints)), models: map[routing.ModelName]struct{}{}}
	for _, ep := range set.Endpoints {
		st := &endpoint{EndpointState: routing.EndpointState{Endpoint: ep}}
		prev, had := old.byKey[ep.Key]
		switch {
		case had && len(prev.ranks) == max(ep.DataParallelSize, 1):
			st.Live, st.runtime = prev.Live, prev.runtime
		case had:
			// Its ranks changed: start its cache state afresh. In-flight
			// decisions keep their own slot pointers.
			e.index.RemoveEndpoint(string(ep.Key))
			st.Live, st.runtime = e.newLive(ep)
		default:
			st.Live, st.runtime = e.newLive(ep)
		}
		next.eps = append(next.eps, st)
		next.states = append(next.states, &st.EndpointState)
		next.byKey[ep.Key] = st
		if len(ep.Models) == 0 {
			next.anyModel = true
		}
		next.prefillRole = next.prefillRole || ep.Role == routing.RolePrefill
		for _, m := range ep.Models {
			next.models[m] = struct{}{}
		}
		for _, m := range ep.Adapters {
			next.models[m] = struct{}{}
		}
	}
	e.snap.Store(next)
	for k := range old.byKey {
		if _, ok := next.byKey[k]; !ok {
			e.index.RemoveEndpoint(string(k)) // purge a removed endpoint
		}
	}
	e.log.Info("endpoint set published", "source", set.Source, "endpoints", len(set.Endpoints))
	return nil
}

// candidates filters the snapshot by model and subset hint, then drops
// ejected endpoints (at now, unix nanos) unless health is false or every
// eligible endpoint is ejected.
func (s *snapshot) candidates(req *routing.Request, passThrough, health bool, now int64) ([]*endpoint, error) {
	if len(s.states) == 0 {
		return nil, routing.ErrNoEndpoints
	}
	filterModel := req.Model != ""
	if filterModel && !s.anyModel {
		if _, ok := s.models[req.Model]; !ok && !s.scrapedAdapter(req.Model) {
			if !passThrough {
				return nil, fmt.Errorf("%w: %s", routing.ErrModelNotFound, quoteModel(req.Model))
			}
			filterModel = false
		}
	}
	if !filterModel && req.Subset == nil {
		if health {
			return filterHealthy(s.eps, now, false), nil
		}
		return s.eps, nil
	}
	out := make([]*endpoint, 0, len(s.eps))
	for _, st := range s.eps {
		if filterModel && !st.serves(req.Model) {
			continue
		}
		if req.Subset != nil && !req.Subset.Contains(st.Addr()) {
			continue
		}
		out = append(out, st)
	}
	if len(out) == 0 {
		if req.Subset != nil {
			return nil, routing.ErrSubsetEmpty
		}
		return nil, routing.ErrNoEndpoints
	}
	if health {
		out = filterHealthy(out, now, true)
	}
	return out, nil
}

// maxQuotedModel bounds the bytes of a model name quoted in an error: the
// name comes from the client's body, and the error goes back to it (and to
// logs).
const maxQuotedModel = 256

// quoteModel quotes m for an error message, cut to maxQuotedModel bytes.
func quoteModel(m routing.ModelName) string {
	if len(m) <= maxQuotedModel {
		return strconv.Quote(string(m))
	}
	return strconv.Quote(string(m[:maxQuotedModel])) + "... (" + strconv.Itoa(len(m)) + " bytes)"
}

// scrapedAdapter reports whether some endpoint's worker reported model as
// a LoRA adapter (the slow path for models discovery does not declare).
func (s *snapshot) scrapedAdapter(model routing.ModelName) bool {
	for _, st := range s.eps {
		if st.adapters.has(model) {
			return true
		}
	}
	return false
}

// blockSize is the endpoint's KV block size: from discovery, else as the
// worker reports it, else the router default.
func (e *Engine) blockSize(st *endpoint) int {
	if st.BlockSize > 0 {
		return st.BlockSize
	}
	if bs := st.runtime.blockSize.Load(); bs > 0 {
		return int(bs)
	}
	return e.opts.BlockSize
}

// ReportLoad publishes an endpoint's scraped load and, when the worker
// reports it, its KV block size (0: unknown). It is called by the load
// scraper, off the request path; an unknown endpoint is ignored. It wakes
// the admission queue, since load data may have freed capacity. Known,
// fresh load (a good scrape) ends an ejection for failed scrapes.
func (e *Engine) ReportLoad(ep routing.EndpointKey, ld routing.Load, blockSize int) bool {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return false
	}
	st.scraped.Store(&ld)
	st.scrapedAt.Store(e.clk.Now().UnixNano()) // after the load: see ScrapedLoad
	if ld.Known && !ld.Stale {
		e.scrapeOK(st)
	}
	if blockSize > 0 {
		st.runtime.blockSize.Store(int64(blockSize))
	}
	if e.queue != nil {
		e.queue.Wake()
	}
	return true
}

// saturated reports whether every endpoint is saturated: its active prefill
// tokens exceed Threshold × its prefill capacity, or its load data is stale.
// When every endpoint's data is stale, load is unknown, not overloaded, and
// only the prefill rule applies.
func (e *Engine) saturated() bool {
	states := e.snap.Load().eps
	if len(states) == 0 {
		return false
	}
	allStale := true
	for _, st := range states {
		if !st.load().Stale {
			allStale = false
			break
		}
	}
	for _, st := range states {
		if st.load().Stale && !allStale {
			continue
		}
		capacity := st.MaxBatchedTokens
		if capacity <= 0 {
			capacity = e.opts.DefaultMaxBatchedTokens
		}
		if float64(st.InFlightPrefill()) <= e.opts.Admission.Threshold*float64(capacity) {
			return false
		}
	}
	return true
}
