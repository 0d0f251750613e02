package engine

import (
	"github.com/kvbandit/kvbandit/routing"

	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// EjectionOptions configure endpoint health: passive ejection after
// consecutive failed outcomes, and active ejection after consecutive
// failed metrics scrapes. An ejected endpoint is not a candidate unless no
// eligible endpoint is healthy; ejection alone never fails a request.
type EjectionOptions struct {
	// ConsecutiveErrors is the number of failed outcomes in a row that
	// eject an endpoint (default 5; negative: outcomes never eject). A
	// failure is an upstream 5xx, 408 or no status at all (connect
	// failure); see [Engine.ReportScrapeFailure] for scrapes.
	ConsecutiveErrors int
	// BaseEjection is the first ejection's length (default 10s); each
	// further ejection without a success in between lasts twice as long,
	// up to MaxEjection (default 5 minutes).
	BaseEjection time.Duration
	MaxEjection  time.Duration
	// ScrapeFailures is the number of failed scrapes in a row that eject an
	// endpoint until a scrape succeeds (default 3; negative: never).
	ScrapeFailures int
	// Disabled turns ejection off entirely.
	Disabled bool
}

// Defaults for [EjectionOptions] and [Options.AdapterRetention].
const (
	DefaultConsecutiveErrors = 5
	DefaultBaseEjection      = 10 * time.Second
	DefaultMaxEjection       = 5 * time.Minute
	DefaultScrapeFailures    = 3
	DefaultAdapterRetention  = 10 * time.Minute
)

func (o *EjectionOptions) defaults() {
	if o.ConsecutiveErrors == 0 {
		o.ConsecutiveErrors = DefaultConsecutiveErrors
	}
	if o.BaseEjection <= 0 {
		o.BaseEjection = DefaultBaseEjection
	}
	if o.MaxEjection <= 0 {
		o.MaxEjection = DefaultMaxEjection
	}
	o.MaxEjection = max(o.MaxEjection, o.BaseEjection)
	if o.ScrapeFailures == 0 {
		o.ScrapeFailures = DefaultScrapeFailures
	}
}

// Ejection reasons, as metric labels.
const (
	EjectReasonErrors = "errors"
	EjectReasonScrape = "scrape"
)

// health is an endpoint's ejection state, kept in its runtime so that it
// survives snapshot swaps. Pick only loads until and scrapeDown.
type health struct {
	// until is when a passive ejection ends, in unix nanoseconds of the
	// engine's clock (0: never ejected).
	until atomic.Int64
	// errs counts failed outcomes in a row since the last success or
	// ejection.
	errs atomic.Int64
	// streak counts ejections since the last success: the next one lasts
	// BaseEjection << streak, capped.
	streak atomic.Int64
	// scrapeFails counts failed scrapes in a row; scrapeDown is set once
	// they reach EjectionOptions.ScrapeFailures, until a good scrape.
	scrapeFails atomic.Int64
	scrapeDown  atomic.Bool
}

// adapterSet is the LoRA adapters an endpoint's worker reported, kept for
// Options.AdapterRetention after they were last seen.
type adapterSet struct {
	// names is sorted; read lock-free by the model filter.
	names atomic.Pointer[[]routing.ModelName]
	// mu guards seen (writers only: the scraper).
	mu   sync.Mutex
	seen map[routing.ModelName]time.Time
}

func (a *adapterSet) has(m routing.ModelName) bool {
	p := a.names.Load()
	if p == nil {
		return false
	}
	_, ok := slices.BinarySearch(*p, m)
	return ok
}

// ejected reports whether the endpoint is ejected at now (unix nanos).
func (rt *runtime) ejected(now int64) bool {
	return rt.health.scrapeDown.Load() || rt.health.until.Load() > now
}

// Ejected reports whether endpoint ep is ejected at now (by failed
// outcomes or failed scrapes); false for an endpoint not in the set. An
// ejected endpoint is still chosen when no healthy endpoint is eligible.
func (e *Engine) Ejected(ep routing.EndpointKey, now time.Time) bool {
	st, ok := e.snap.Load().byKey[ep]
	return ok && st.ejected(now.UnixNano())
}

// Health is a snapshot of an endpoint's health, for debugging pages.
type Health struct {
	// Ejected is set when the endpoint is ejected at the time asked.
	Ejected bool `json:"ejected"`
	// EjectedUntil is the end of the current or last passive ejection
	// (zero when never ejected for errors).
	EjectedUntil time.Time `json:"ejected_until,omitzero"`
	// ScrapeDown is set while the endpoint is ejected for failed scrapes.
	ScrapeDown bool `json:"scrape_down,omitempty"`
	// ConsecutiveErrors and ScrapeFailures are the current failure runs.
	ConsecutiveErrors int64 `json:"consecutive_errors"`
	ScrapeFailures    int64 `json:"scrape_failures"`
	// Ejections is the number of ejections since the last success.
	Ejections int64 `json:"ejections"`
	// Adapters are the LoRA adapters the worker reported recently.
	Adapters []routing.ModelName `json:"adapters,omitempty"`
}

// Health returns endpoint ep's health at now (the zero Health for an
// endpoint not in the set). Callers must not modify the returned Adapters.
func (e *Engine) Health(ep routing.EndpointKey, now time.Time) Health {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return Health{}
	}
	h := Health{
		Ejected:           st.ejected(now.UnixNano()),
		ScrapeDown:        st.health.scrapeDown.Load(),
		ConsecutiveErrors: st.health.errs.Load(),
		ScrapeFailures:    st.health.scrapeFails.Load(),
		Ejections:         st.health.streak.Load(),
	}
	if u := st.health.until.Load(); u != 0 {
		h.EjectedUntil = time.Unix(0, u)
	}
	if p := st.adapters.names.Load(); p != nil {
		h.Adapters = *p
	}
	return h
}

// ScrapedAdapters returns the LoRA adapters endpoint ep's worker reported
// within Options.AdapterRetention (sorted; callers must not modify it);
// nil for an endpoint not in the set.
func (e *Engine) ScrapedAdapters(ep routing.EndpointKey) []routing.ModelName {
	if st, ok := e.snap.Load().byKey[ep]; ok {
		if p := st.adapters.names.Load(); p != nil {
			return *p
		}
	}
	return nil
}

// serves reports whether the endpoint serves model: as discovery declares
// it ([routing.Endpoint.Serves]) or as a LoRA adapter its worker reported.
func (st *endpoint) serves(model routing.ModelName) bool {
	return st.Endpoint.Serves(model) || st.adapters.has(model)
}

// verdict is what an outcome says about an endpoint's health.
type verdict int8

const (
	neutral verdict = iota
	healthy
	failed
)

// classify judges an outcome. Only the upstream's answer counts: a 2xx or
// 3xx is a success; a 5xx, a 408 (the worker timed out) or no status at
// all (Envoy could not connect) is a failure; any other 4xx is the
// client's fault and counts for nothing. Cancelled, reset, abandoned,
// rejected and expired decisions count for nothing either: they end
// because the client left, Envoy reset the ext_proc stream (client
// disconnects, Envoy's own timeouts and restarts all do this, so it does
// not point at the worker), the router stopped, or the router lost track
// of the request. A worker that fails for real shows up as an upstream
// status, since Envoy answers 503 or 504 on its behalf.
func classify(o routing.Outcome) verdict {
	switch o.Kind {
	case routing.OutcomeSuccess:
		return healthy
	case routing.OutcomeUpstreamError:
		if o.Status == 0 || o.Status >= 500 || o.Status == 408 {
			return failed
		}
	}
	return neutral
}

// observe feeds one outcome into the endpoint's passive health. Outcomes
// that arrive while the endpoint is ejected are not counted (they mostly
// belong to requests sent before the ejection, or to requests sent
// because every endpoint was ejected).
func (e *Engine) observe(key routing.EndpointKey, rt *runtime, o routing.Outcome) {
	eo := &e.opts.Ejection
	if eo.Disabled || eo.ConsecutiveErrors < 0 {
		return
	}
	v := classify(o)
	if v == neutral {
		return
	}
	h := &rt.health
	now := e.clk.Now()
	nowNS := now.UnixNano()
	if h.until.Load() > nowNS {
		return
	}
	if v == healthy {
		if h.errs.Load() != 0 {
			h.errs.Store(0)
		}
		if h.streak.Load() != 0 {
			h.streak.Store(0)
		}
		return
	}
	n := h.errs.Add(1)
	if n < int64(eo.ConsecutiveErrors) || !h.errs.CompareAndSwap(n, 0) {
		// Below the threshold, or a concurrent failure (or success) moved
		// the count: whoever moved it last decides.
		return
	}
	k := h.streak.Add(1) - 1
	d := eo.BaseEjection
	for i := int64(0); i < k && d < eo.MaxEjection; i++ {
		d *= 2
	}
	d = min(d, eo.MaxEjection)
	h.until.Store(nowNS + int64(d))
	e.ejectErrors.Add(1)
	e.log.Warn("endpoint ejected", "endpoint", key, "reason", EjectReasonErrors,
		"consecutive_errors", n, "for", d, "ejections", k+1, "last_status", o.Status)
}

// ReportScrapeFailure records a failed metrics scrape of ep (called by the
// load scraper, off the request path). After EjectionOptions.ScrapeFailures
// failures in a row the endpoint is ejected until a scrape succeeds
// ([Engine.ReportLoad] with known, fresh load). It reports false for an
// unknown endpoint.
func (e *Engine) ReportScrapeFailure(ep routing.EndpointKey) bool {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return false
	}
	h := &st.health
	n := h.scrapeFails.Add(1)
	eo := &e.opts.Ejection
	if eo.Disabled || eo.ScrapeFailures < 0 || n < int64(eo.ScrapeFailures) {
		return true
	}
	if h.scrapeDown.CompareAndSwap(false, true) {
		e.ejectScrape.Add(1)
		e.log.Warn("endpoint ejected", "endpoint", ep, "reason", EjectReasonScrape, "scrape_failures", n)
	}
	return true
}

// scrapeOK clears an endpoint's scrape failures after a good scrape.
func (e *Engine) scrapeOK(st *endpoint) {
	h := &st.health
	if h.scrapeFails.Load() != 0 {
		h.scrapeFails.Store(0)
	}
	if h.scrapeDown.CompareAndSwap(true, false) {
		e.log.Info("endpoint restored", "endpoint", st.Key, "reason", EjectReasonScrape)
	}
}

// MaxRetainedAdapters bounds the adapters remembered per endpoint across
// reports (each report is bounded by the scraper too): the most recently
// reported are kept.
const MaxRetainedAdapters = 4096

// ReportAdapters publishes the LoRA adapters an endpoint's worker reports
// (vllm:lora_requests_info: adapters with running or waiting requests).
// Each adapter is remembered for Options.AdapterRetention after it was
// last reported, since vLLM lists only adapters in use. An endpoint serves
// a model that is one of its adapters even when discovery does not say
// so. It is called by the load scraper, off the request path; it reports
// false for an unknown endpoint.
func (e *Engine) ReportAdapters(ep routing.EndpointKey, adapters []routing.ModelName) bool {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return false
	}
	now := e.clk.Now()
	a := &st.adapters
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seen == nil {
		a.seen = make(map[routing.ModelName]time.Time, len(adapters))
	}
	for _, m := range adapters {
		if m != "" {
			a.seen[m] = now
		}
	}
	keep := make([]routing.ModelName, 0, len(a.seen))
	retain := max(e.opts.AdapterRetention, 0) // negative: only the latest report
	for m, at := range a.seen {
		if now.Sub(at) > retain {
			delete(a.seen, m)
			continue
		}
		keep = append(keep, m)
	}
	if len(keep) > MaxRetainedAdapters {
		// A worker reporting new names every scrape: keep the most
		// recently reported ones (the latest report first, then by name
		// for a stable choice), forget the rest.
		slices.SortFunc(keep, func(x, y routing.ModelName) int {
			if c := a.seen[y].Compare(a.seen[x]); c != 0 {
				return c
			}
			return strings.Compare(string(x), string(y))
		})
		for _, m := range keep[MaxRetainedAdapters:] {
			delete(a.seen, m)
		}
		keep = keep[:MaxRetainedAdapters]
	}
	slices.Sort(keep)
	if cur := a.names.Load(); cur != nil && slices.Equal(*cur, keep) {
		return true
	}
	if len(keep) == 0 {
		a.names.Store(nil)
	} else {
		a.names.Store(&keep)
	}
	return true
}

// ReportRankLoads publishes the scraped load of each data-parallel rank of
// ep, indexed by rank. Candidates for a rank then see its own waiting,
// running and KV usage; Known and Stale stay the endpoint's (ReportLoad).
// A list whose length is not the endpoint's rank count clears it. It
// reports false for an unknown endpoint.
func (e *Engine) ReportRankLoads(ep routing.EndpointKey, ranks []routing.Load) bool {
	st, ok := e.snap.Load().byKey[ep]
	if !ok {
		return false
	}
	if len(ranks) != len(st.ranks) || len(ranks) < 2 {
		st.rankLoads.Store(nil)
		return true
	}
	rl := slices.Clone(ranks)
	st.rankLoads.Store(&rl)
	return true
}

// Ejections returns how many ejections there have been, by reason.
func (e *Engine) Ejections() (errors, scrape int64) {
	return e.ejectErrors.Load(), e.ejectScrape.Load()
}

// filterHealthy drops ejected endpoints from eps unless every one of them
// is ejected. owned says eps is the caller's to modify in place.
func filterHealthy(eps []*endpoint, now int64, owned bool) []*endpoint {
	first := -1
	for i, st := range eps {
		if st.ejected(now) {
			first = i
			break
		}
	}
	if first < 0 {
		return eps
	}
	var out []*endpoint
	if owned {
		out = eps[:first]
	} else {
		out = make([]*endpoint, first, len(eps)-1)
		copy(out, eps[:first])
	}
	for _, st := range eps[first+1:] {
		if !st.ejected(now) {
			out = append(out, st)
		}
	}
	if len(out) == 0 {
		return eps // nothing was written: every endpoint is ejected
	}
	return out
}
