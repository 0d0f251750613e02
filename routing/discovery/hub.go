package discovery

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
)

// Source produces endpoint sets. Run publishes a first set as soon as it
// has one and a new set on every change, until ctx ends; it returns nil
// then, or an error when it cannot start at all (bad configuration).
// Transient backend failures are reported with [Sink.SetDegraded] and
// retried inside Run, never returned.
type Source interface {
	Name() string
	Run(ctx context.Context, sink Sink) error
}

// Sink receives what a source finds.
type Sink interface {
	// Publish offers a whole new set (Source is set by the caller). It
	// returns the validation error when the set is refused; the previous
	// set then stays.
	Publish(set routing.EndpointSet) error
	// SetDegraded reports the source's backend health: a non-nil err says
	// the source serves its last known set because its backend fails; nil
	// says it is healthy again.
	SetDegraded(source string, err error)
	// Skipped counts one record the source could not use (malformed,
	// unknown engine, ...); reason is a short metric label.
	Skipped(source, reason string)
}

// Gate holds endpoints back until the data plane can route to them (the EDS
// server: Envoy's override_host only reaches hosts in its cluster).
type Gate interface {
	// Offer tells the gate the desired set plus the endpoints that left but
	// still have decisions in flight (they stay in the data plane).
	Offer(desired []routing.Endpoint, lingering []routing.Endpoint)
	// Pickable reports whether the data plane can route to key now.
	Pickable(key routing.EndpointKey) bool
}

// Engine is the part of [engine.Engine] the hub drives.
type Engine interface {
	Update(set routing.EndpointSet) error
	Endpoints() []*routing.EndpointState
}

// HubDeps are the hub's collaborators.
type HubDeps struct {
	Engine Engine
	Logger *slog.Logger
	Clock  clock.Clock
	// Gate, when set, filters what the engine may pick (EDS).
	Gate Gate
	// AllowLinkLocal lets endpoints at link-local addresses (169.254.0.0/16,
	// fe80::/10: where clouds serve instance metadata and credentials)
	// through (--discovery-allow-link-local, config
	// discovery.allow_link_local). Without it the hub drops them from every
	// set, counting each as skipped with reason [ReasonLinkLocal].
	AllowLinkLocal bool
	// OnPublish, when set, is called after every set the engine took, with
	// the set and the time the source offered it (discovery latency).
	OnPublish func(set routing.EndpointSet, offered time.Time)
}

// Hub is the one place endpoint sets go through. It is safe for
// concurrent use; sets are applied in the order they arrive.
type Hub struct {
	deps HubDeps
	log  *slog.Logger
	clk  clock.Clock

	mu        sync.Mutex
	desired   routing.EndpointSet
	has       bool
	lingering map[routing.EndpointKey]*routing.EndpointState
	followers []func(routing.EndpointSet)
	published *routing.EndpointSet
	degraded  map[string]string
	stats     Stats
}

// Stats are the hub's counters.
type Stats struct {
	// Published counts sets the engine took; Rejected sets that failed
	// validation.
	Published, Rejected uint64
	// Skipped counts records skipped by sources, by source and reason.
	Skipped map[[2]string]uint64
	// Degraded maps each degraded source to its last error.
	Degraded map[string]string
	// Endpoints is the size of the desired set; Pickable of the set the
	// engine serves; Lingering of the endpoints kept for in-flight work.
	Endpoints, Pickable, Lingering int
	// Source names the source of the current set.
	Source string
}

// NewHub makes a hub. Call [Hub.Run] to release lingering endpoints.
func NewHub(deps HubDeps) *Hub {
	if deps.Engine == nil {
		panic("discovery: HubDeps.Engine is required")
	}
	if deps.Logger == nil {
		deps.Logger = slog.New(slog.DiscardHandler)
	}
	if deps.Clock == nil {
		deps.Clock = clock.Real{}
	}
	return &Hub{deps: deps, log: deps.Logger, clk: deps.Clock,
		lingering: map[routing.EndpointKey]*routing.EndpointState{}, degraded: map[string]string{},
		stats: Stats{Skipped: map[[2]string]uint64{}}}
}

// Follow registers f to be called with every set the engine takes (the
// pickable part of the desired set), and at once with the current one, if
// any. Calls are serialised; f must not call back into the hub.
func (h *Hub) Follow(f func(routing.EndpointSet)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.followers = append(h.followers, f)
	if h.published != nil {
		f(*h.published)
	}
}

// Publish implements [Sink]: it validates set, makes it the desired set,
// offers it to the gate and publishes the pickable part to the engine.
func (h *Hub) Publish(set routing.EndpointSet) error {
	offered := h.clk.Now()
	set.Endpoints = slices.Clone(set.Endpoints)
	if !h.deps.AllowLinkLocal {
		set.Endpoints = h.dropLinkLocal(set)
	}
	if err := set.Validate(); err != nil {
		h.mu.Lock()
		h.stats.Rejected++
		h.mu.Unlock()
		h.log.Warn("endpoint set rejected", "source", set.Source, "err", err)
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.has {
		h.log.Info("first endpoint set", "source", set.Source, "endpoints", len(set.Endpoints))
	}
	h.desired, h.has = set, true
	if err := h.applyLocked(); err != nil {
		return err
	}
	if h.deps.OnPublish != nil {
		h.deps.OnPublish(set, offered)
	}
	return nil
}

// dropLinkLocal returns set's endpoints without those at a link-local
// address, counting and logging each one dropped.
func (h *Hub) dropLinkLocal(set routing.EndpointSet) []routing.Endpoint {
	return slices.DeleteFunc(set.Endpoints, func(ep routing.Endpoint) bool {
		if !IsLinkLocal(ep.Key) {
			return false
		}
		h.Skipped(set.Source, ReasonLinkLocal)
		h.log.Warn("link-local endpoint dropped (allow it with --discovery-allow-link-local)", "source", set.Source, "address", ep.Key)
		return true
	})
}

// IsLinkLocal reports whether key is an "ip:port" whose IP is link-local
// unicast (169.254.0.0/16, fe80::/10).
func IsLinkLocal(key routing.EndpointKey) bool {
	ap, err := routing.ParseAddrPort(string(key))
	return err == nil && ap.Addr().IsLinkLocalUnicast()
}

// Refresh re-evaluates the gate (the EDS server calls it when a data plane
// acknowledges a version) and releases lingering endpoints whose decisions
// have ended.
func (h *Hub) Refresh() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.has {
		return
	}
	if err := h.applyLocked(); err != nil {
		h.log.Error("endpoint set refresh failed", "err", err)
	}
}

// applyLocked publishes the pickable part of the desired set to the
// engine, then offers the desired set plus the lingering endpoints to the
// gate. The order matters: an endpoint leaves the engine before the data
// plane is told to drop it, and the in-flight scan runs after the swap, so
// no pick can land on an endpoint the data plane no longer has.
func (h *Hub) applyLocked() error {
	prev := h.deps.Engine.Endpoints()
	pick := h.desired
	g := h.deps.Gate
	if g != nil {
		pick.Endpoints = make([]routing.Endpoint, 0, len(h.desired.Endpoints))
		for _, ep := range h.desired.Endpoints {
			if g.Pickable(ep.Key) {
				pick.Endpoints = append(pick.Endpoints, ep)
			}
		}
	}
	changed := !samePublished(prev, pick.Endpoints) || h.published == nil
	if changed {
		if err := h.deps.Engine.Update(pick); err != nil {
			h.stats.Rejected++
			return err
		}
		h.stats.Published++
		h.published = &pick
	}
	// Endpoints that left with decisions in flight linger in the data
	// plane until those decisions end.
	for _, st := range prev {
		if !containsKey(h.desired.Endpoints, st.Key) {
			h.lingering[st.Key] = st
		}
	}
	for k, st := range h.lingering {
		if st.InFlight.Load() <= 0 || containsKey(h.desired.Endpoints, k) {
			delete(h.lingering, k)
		}
	}
	if g != nil {
		linger := make([]routing.Endpoint, 0, len(h.lingering))
		for _, st := range h.lingering {
			linger = append(linger, st.Endpoint)
		}
		slices.SortFunc(linger, func(a, b routing.Endpoint) int { return compareKeys(a.Key, b.Key) })
		g.Offer(h.desired.Endpoints, linger)
	}
	h.updateGauges(pick)
	if changed {
		for _, f := range h.followers {
			f(pick)
		}
	}
	return nil
}

func (h *Hub) updateGauges(pick routing.EndpointSet) {
	h.stats.Endpoints = len(h.desired.Endpoints)
	h.stats.Pickable = len(pick.Endpoints)
	h.stats.Lingering = len(h.lingering)
	h.stats.Source = h.desired.Source
}

// SetDegraded implements [Sink].
func (h *Hub) SetDegraded(source string, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	_, was := h.degraded[source]
	switch {
	case err != nil:
		h.degraded[source] = err.Error()
		switch {
		case was:
		case h.has:
			h.log.Warn("discovery degraded: serving the last known endpoint set", "source", source, "err", err)
		default:
			h.log.Warn("discovery degraded: no endpoint set known yet, nothing to serve", "source", source, "err", err)
		}
	case was:
		delete(h.degraded, source)
		h.log.Info("discovery recovered", "source", source)
	}
}

// Skipped implements [Sink].
func (h *Hub) Skipped(source, reason string) {
	h.mu.Lock()
	h.stats.Skipped[[2]string{source, reason}]++
	h.mu.Unlock()
}

// Degraded reports whether any source is degraded.
func (h *Hub) Degraded() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.degraded) > 0
}

// Stats returns a copy of the hub's counters.
func (h *Hub) Stats() Stats {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := h.stats
	s.Skipped = make(map[[2]string]uint64, len(h.stats.Skipped))
	for k, v := range h.stats.Skipped {
		s.Skipped[k] = v
	}
	s.Degraded = make(map[string]string, len(h.degraded))
	for k, v := range h.degraded {
		s.Degraded[k] = v
	}
	return s
}

// Run releases lingering endpoints once their in-flight decisions end,
// checking every interval, until ctx ends.
func (h *Hub) Run(ctx context.Context, interval time.Duration) {
	if interval <= 0 {
		interval = 250 * time.Millisecond
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			h.mu.Lock()
			n := len(h.lingering)
			h.mu.Unlock()
			if n > 0 {
				h.Refresh()
			}
		}
	}
}

// RunSources runs every source until ctx ends or one fails to start; the
// first such error is returned after the others stop.
func RunSources(ctx context.Context, sink Sink, srcs ...Source) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make(chan error, len(srcs))
	for _, s := range srcs {
		go func() {
			err := s.Run(ctx, sink)
			if err != nil && ctx.Err() == nil {
				cancel()
				errs <- err
				return
			}
			errs <- nil
		}()
	}
	var all []error
	for range srcs {
		all = append(all, <-errs)
	}
	return errors.Join(all...)
}

func containsKey(eps []routing.Endpoint, k routing.EndpointKey) bool {
	return slices.ContainsFunc(eps, func(e routing.Endpoint) bool { return e.Key == k })
}

func compareKeys(a, b routing.EndpointKey) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// samePublished reports whether the engine already serves exactly eps
// (same order, same metadata): nothing to swap.
func samePublished(cur []*routing.EndpointState, eps []routing.Endpoint) bool {
	if len(cur) != len(eps) {
		return false
	}
	for i := range eps {
		if !cur[i].Endpoint.Equal(&eps[i]) {
			return false
		}
	}
	return true
}
