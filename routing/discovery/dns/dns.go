package dns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

// SourceName is the name under which DNS trouble is reported degraded.
const SourceName = "dns"

// Defaults of [Config].
const (
	// DefaultRefresh equals Envoy's dns_refresh_rate default (5 s), so
	// kvbandit and a STRICT_DNS cluster of the same names follow DNS at
	// the same pace (override_host only routes to hosts Envoy has).
	DefaultRefresh  = 5 * time.Second
	DefaultTimeout  = 5 * time.Second
	DefaultMaxAddrs = 64
	DefaultMaxNames = 1024
	DefaultParallel = 16
)

// Results of one lookup (metric label values).
const (
	ResultSuccess  = "success"
	ResultNotFound = "not_found" // NXDOMAIN, or no usable address
	ResultTimeout  = "timeout"
	ResultError    = "error"
)

// ReasonTooManyNames is the skip reason of records past [Config.MaxNames].
const ReasonTooManyNames = "too_many_names"

// Resolver looks up the addresses of a host name; *net.Resolver is one.
// network is "ip" (both families). It must honour ctx's deadline.
type Resolver interface {
	LookupNetIP(ctx context.Context, network, host string) ([]netip.Addr, error)
}

var _ Resolver = (*net.Resolver)(nil)

// Config bounds and paces resolution. Zero fields take the defaults.
type Config struct {
	// Refresh is how often every name is resolved again.
	Refresh time.Duration
	// Timeout bounds one lookup.
	Timeout time.Duration
	// MaxAddrs is the most addresses kept per name (the lowest, sorted).
	MaxAddrs int
	// MaxNames is the most distinct names resolved per set.
	MaxNames int
	// Parallel is the most lookups in flight at once.
	Parallel int
}

func (c *Config) defaults() {
	if c.Refresh <= 0 {
		c.Refresh = DefaultRefresh
	}
	if c.Timeout <= 0 {
		c.Timeout = DefaultTimeout
	}
	if c.MaxAddrs <= 0 {
		c.MaxAddrs = DefaultMaxAddrs
	}
	if c.MaxNames <= 0 {
		c.MaxNames = DefaultMaxNames
	}
	if c.Parallel <= 0 {
		c.Parallel = DefaultParallel
	}
}

// Deps are the resolver's collaborators.
type Deps struct {
	// Resolver does the lookups; nil: net.DefaultResolver.
	Resolver Resolver
	// Logger; nil discards.
	Logger *slog.Logger
	// Registry receives kvbandit_dns_resolutions_total and
	// kvbandit_dns_failing_names; nil: a private registry.
	Registry prometheus.Registerer
	// Clock paces the refreshes; nil: the real clock.
	Clock clock.Clock
}

// Expander resolves names for the sources it wraps. Make one per process
// (its metrics are registered once) with [New].
type Expander struct {
	cfg     Config
	res     Resolver
	log     *slog.Logger
	clk     clock.Clock
	lookups *prometheus.CounterVec
	failing prometheus.Gauge
}

// New makes an Expander.
func New(cfg Config, deps Deps) (*Expander, error) {
	cfg.defaults()
	x := &Expander{cfg: cfg, res: deps.Resolver, log: deps.Logger, clk: clock.Or(deps.Clock)}
	if x.res == nil {
		x.res = net.DefaultResolver
	}
	if x.log == nil {
		x.log = slog.New(slog.DiscardHandler)
	}
	reg := deps.Registry
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	x.lookups = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvbandit_dns_resolutions_total",
		Help: "Host-name lookups of endpoint records, by result (success, not_found, timeout, error); a failed lookup keeps the name's last good addresses.",
	}, []string{"result"})
	x.failing = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "kvbandit_dns_failing_names",
		Help: "Endpoint host names whose last lookup failed (they keep their last good addresses).",
	})
	for _, r := range []string{ResultSuccess, ResultNotFound, ResultTimeout, ResultError} {
		x.lookups.WithLabelValues(r)
	}
	for _, c := range []prometheus.Collector{x.lookups, x.failing} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("dns: metrics: %w", err)
		}
	}
	return x, nil
}

// Wrap returns a source that publishes src's sets with every host name
// replaced by the endpoints it resolves to.
func (x *Expander) Wrap(src discovery.Source) *Source {
	return &Source{x: x, inner: src}
}

// Source is a [discovery.Source] wrapped by [Expander.Wrap].
type Source struct {
	x     *Expander
	inner discovery.Source
}

var _ discovery.Source = (*Source)(nil)

// Name implements [discovery.Source]: the wrapped source's name.
func (s *Source) Name() string { return s.inner.Name() }

// Run implements [discovery.Source]: it runs the wrapped source with a
// sink that resolves the names of every set it publishes, and re-resolves
// them every Refresh until ctx ends.
func (s *Source) Run(ctx context.Context, sink discovery.Sink) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st := &state{x: s.x, ctx: ctx, sink: sink, addrs: map[string][]netip.Addr{}, failing: map[string]error{}}
	defer func() {
		st.mu.Lock()
		s.x.failing.Sub(float64(len(st.failing)))
		st.mu.Unlock()
	}()
	tick := make(chan struct{}, 1)
	fire := func() {
		select {
		case tick <- struct{}{}:
		default:
		}
	}
	// The next refresh is armed before the work it paces starts, so
	// refreshes keep their period whatever the lookups take (a slow round
	// is followed at once by the next, never by two).
	timer := s.x.clk.AfterFunc(s.x.cfg.Refresh, fire)
	defer func() { timer.Stop() }()
	errc := make(chan error, 1)
	go func() { errc <- s.inner.Run(ctx, st) }()
	for {
		select {
		case err := <-errc:
			return err
		case <-tick:
			timer = s.x.clk.AfterFunc(s.x.cfg.Refresh, fire)
			st.refresh()
		}
	}
}

// state is one Run's view: the wrapped source's last set and each name's
// last good addresses. mu serialises the wrapped source's Publish and the
// refreshes, so sets reach the sink in order.
type state struct {
	x    *Expander
	ctx  context.Context
	sink discovery.Sink

	mu        sync.Mutex
	raw       *routing.EndpointSet
	names     []string // distinct names of raw, in record order, at most MaxNames
	addrs     map[string][]netip.Addr
	failing   map[string]error
	published []routing.Endpoint
	has       bool
}

// Publish implements [discovery.Sink]: names new to the set are resolved
// now, known ones keep their addresses until the next refresh.
func (st *state) Publish(set routing.EndpointSet) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	names, skipped := namesOf(set.Endpoints, st.x.cfg.MaxNames)
	if skipped > 0 {
		st.x.log.Warn("endpoint records skipped: too many host names in one set", "source", set.Source, "max_names", st.x.cfg.MaxNames, "skipped", skipped)
		for range skipped {
			st.sink.Skipped(set.Source, ReasonTooManyNames)
		}
	}
	st.raw, st.names = &set, names
	for n := range st.addrs {
		if !slices.Contains(names, n) {
			delete(st.addrs, n)
		}
	}
	for n := range st.failing {
		if !slices.Contains(names, n) {
			delete(st.failing, n)
			st.x.failing.Dec()
		}
	}
	var fresh []string
	for _, n := range names {
		if _, ok := st.addrs[n]; !ok {
			fresh = append(fresh, n)
		}
	}
	st.resolveLocked(fresh)
	err := st.publishLocked(true)
	st.reportLocked()
	return err
}

// SetDegraded implements [discovery.Sink].
func (st *state) SetDegraded(source string, err error) { st.sink.SetDegraded(source, err) }

// Skipped implements [discovery.Sink].
func (st *state) Skipped(source, reason string) { st.sink.Skipped(source, reason) }

// refresh resolves every name again and publishes the set if it changed.
func (st *state) refresh() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.raw == nil || len(st.names) == 0 {
		return
	}
	st.resolveLocked(st.names)
	if err := st.publishLocked(false); err != nil {
		st.x.log.Warn("resolved endpoint set refused", "source", st.raw.Source, "err", err)
	}
	st.reportLocked()
}

// resolveLocked looks names up, at most Parallel at once, and records the
// outcome of each: new addresses on success, the last good ones kept on
// failure.
func (st *state) resolveLocked(names []string) {
	if len(names) == 0 {
		return
	}
	type answer struct {
		addrs  []netip.Addr
		err    error
		result string
	}
	answers := make([]answer, len(names))
	sem := make(chan struct{}, st.x.cfg.Parallel)
	var wg sync.WaitGroup
	for i, n := range names {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			a, r, err := st.x.lookup(st.ctx, n)
			answers[i] = answer{a, err, r}
		})
	}
	wg.Wait()
	if st.ctx.Err() != nil {
		return // shutting down: not a DNS failure
	}
	for i, n := range names {
		a := answers[i]
		st.x.lookups.WithLabelValues(a.result).Inc()
		_, wasFailing := st.failing[n]
		if a.err == nil {
			if wasFailing {
				delete(st.failing, n)
				st.x.failing.Dec()
				st.x.log.Info("host name resolves again", "name", n, "addresses", len(a.addrs))
			}
			st.addrs[n] = a.addrs
			continue
		}
		if !wasFailing {
			st.x.failing.Inc()
			st.x.log.Warn("host name lookup failed: keeping its last good addresses", "name", n, "result", a.result, "kept", len(st.addrs[n]), "err", a.err)
		}
		st.failing[n] = a.err
	}
}

// reportLocked tells the sink whether any name is failing.
func (st *state) reportLocked() {
	if len(st.failing) == 0 {
		st.sink.SetDegraded(SourceName, nil)
		return
	}
	var errs []error
	for _, n := range st.names {
		if err := st.failing[n]; err != nil && len(errs) < 3 {
			errs = append(errs, err)
		}
	}
	if more := len(st.failing) - len(errs); more > 0 {
		errs = append(errs, fmt.Errorf("and %d more host names failing", more))
	}
	st.sink.SetDegraded(SourceName, errors.Join(errs...))
}

// publishLocked expands the raw set and publishes it. A set that is empty
// only because no name has resolved yet is not published (the sink keeps
// what it has); force publishes even an unchanged set (the wrapped
// source's own Publish, whose error it returns).
func (st *state) publishLocked(force bool) error {
	out := expand(st.raw.Endpoints, st.addrs)
	if len(out) == 0 && len(st.raw.Endpoints) > 0 {
		return nil
	}
	if !force && st.has && slices.EqualFunc(out, st.published, func(a, b routing.Endpoint) bool { return a.Equal(&b) }) {
		return nil
	}
	set := *st.raw
	set.Endpoints = out
	if err := st.sink.Publish(set); err != nil {
		return err
	}
	st.published, st.has = out, true
	return nil
}

// lookup resolves one name within the timeout and returns its usable
// addresses, sorted, deduplicated and capped at MaxAddrs.
func (x *Expander) lookup(ctx context.Context, name string) ([]netip.Addr, string, error) {
	ctx, cancel := context.WithTimeout(ctx, x.cfg.Timeout)
	defer cancel()
	raw, err := x.res.LookupNetIP(ctx, "ip", name)
	if err != nil {
		var de *net.DNSError
		switch {
		case errors.As(err, &de) && de.IsNotFound:
			return nil, ResultNotFound, err
		case errors.Is(err, context.DeadlineExceeded) || errors.As(err, &de) && de.IsTimeout:
			return nil, ResultTimeout, err
		}
		return nil, ResultError, err
	}
	addrs := make([]netip.Addr, 0, min(len(raw), x.cfg.MaxAddrs))
	for _, a := range raw {
		a = a.Unmap().WithZone("")
		if !a.IsValid() || a.IsUnspecified() || a.IsMulticast() {
			continue
		}
		addrs = append(addrs, a)
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	addrs = slices.Compact(addrs)
	if len(addrs) == 0 {
		return nil, ResultNotFound, fmt.Errorf("lookup %s: no usable address in %d answers", name, len(raw))
	}
	if len(addrs) > x.cfg.MaxAddrs {
		x.log.Warn("host name has more addresses than kept", "name", name, "addresses", len(addrs), "kept", x.cfg.MaxAddrs)
		addrs = addrs[:x.cfg.MaxAddrs]
	}
	return addrs, ResultSuccess, nil
}

// namesOf returns the distinct host names of eps in record order, at most
// max, and how many records name a host past that limit.
func namesOf(eps []routing.Endpoint, max int) (names []string, skipped int) {
	for _, ep := range eps {
		n, _, err := discovery.ParseName(string(ep.Key))
		if err != nil || n == "" || slices.Contains(names, n) {
			continue
		}
		if len(names) >= max {
			skipped++
			continue
		}
		names = append(names, n)
	}
	return names, skipped
}

// expand replaces each record naming a host by one endpoint per address
// of the name; literal records pass through. The first endpoint for an
// address wins. A record naming a host not in addrs yields nothing.
func expand(eps []routing.Endpoint, addrs map[string][]netip.Addr) []routing.Endpoint {
	out := make([]routing.Endpoint, 0, len(eps))
	seen := make(map[routing.EndpointKey]bool, len(eps))
	add := func(ep routing.Endpoint) {
		if !seen[ep.Key] {
			seen[ep.Key] = true
			out = append(out, ep)
		}
	}
	for _, ep := range eps {
		name, port, err := discovery.ParseName(string(ep.Key))
		if err != nil || name == "" {
			add(ep)
			continue
		}
		for _, a := range addrs[name] {
			add(resolved(ep, name, netip.AddrPortFrom(a, port)))
		}
	}
	return out
}

// resolved is ep at address ap; its URLs naming the same host are
// rewritten to the IP.
func resolved(ep routing.Endpoint, name string, ap netip.AddrPort) routing.Endpoint {
	ep.Key = routing.EndpointKey(ap.String())
	ep.KVEvents = rehost(ep.KVEvents, name, ap.Addr())
	ep.KVEventsReplay = rehost(ep.KVEventsReplay, name, ap.Addr())
	ep.MetricsURL = rehost(ep.MetricsURL, name, ap.Addr())
	return ep
}

// rehost replaces the host of URL u by ip when it is name (any case, with
// or without the trailing dot); other URLs are returned unchanged.
func rehost(u, name string, ip netip.Addr) string {
	if u == "" {
		return u
	}
	p, err := url.Parse(u)
	if err != nil || !strings.EqualFold(strings.TrimSuffix(p.Hostname(), "."), strings.TrimSuffix(name, ".")) {
		return u
	}
	host := ip.String()
	if port := p.Port(); port != "" {
		host = net.JoinHostPort(host, port)
	} else if ip.Is6() {
		host = "[" + host + "]"
	}
	p.Host = host
	return p.String()
}
