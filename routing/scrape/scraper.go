package scrape

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/clock"
)

// Config tunes a Scraper. Zero fields take the documented defaults.
type Config struct {
	// Interval is the time between rounds (default 1s).
	Interval time.Duration
	// Timeout bounds one scrape, body included (default 1s).
	Timeout time.Duration
	// MaxInFlight bounds concurrent scrapes (default 16).
	MaxInFlight int
	// StaleAfter is how long after its last success a target is marked
	// stale (default 3 × Interval).
	StaleAfter time.Duration
	// MaxBody bounds a metrics body (default DefaultMaxBody).
	MaxBody int64
}

func (c *Config) defaults() {
	if c.Interval <= 0 {
		c.Interval = time.Second
	}
	if c.Timeout <= 0 {
		c.Timeout = time.Second
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = 16
	}
	if c.StaleAfter <= 0 {
		c.StaleAfter = 3 * c.Interval
	}
	if c.MaxBody <= 0 {
		c.MaxBody = DefaultMaxBody
	}
}

// Target is one endpoint to scrape.
type Target struct {
	// Key is the endpoint's ip:port.
	Key string
	// URL is the metrics URL; empty means http://<Key>/metrics.
	URL string
}

func (t Target) url() string {
	if t.URL != "" {
		return t.URL
	}
	return "http://" + t.Key + "/metrics"
}

// Deps are a Scraper's collaborators. Nil fields get defaults.
type Deps struct {
	// Client makes the requests (nil: a private client whose idle
	// connections are closed when Run returns).
	Client *http.Client
	// Clock drives rounds and staleness (nil: the real clock).
	Clock clock.Clock
	// Logger (nil: slog.Default()).
	Logger *slog.Logger
	// Targets returns the current targets; it is called once per round, so
	// targets may join and leave at any time (nil: no targets).
	Targets func() []Target
	// Publish receives every good sample and every stale mark. It is called
	// from scrape goroutines, concurrently for different targets, never
	// concurrently for one target; it must not modify the sample's slices,
	// which stale marks share (nil: discard).
	Publish func(Target, Sample)
	// OnError receives every failed scrape, with the same concurrency as
	// Publish (nil: logged at debug level).
	OnError func(Target, error)
}

// StatusError is a non-200 answer.
type StatusError struct{ Code int }

func (e *StatusError) Error() string { return fmt.Sprintf("scrape: HTTP status %d", e.Code) }

// Stats counts scrape outcomes by reason. Scrapes cut short by Run's
// context ending are not counted.
type Stats struct {
	OK         uint64 // published a sample
	Timeout    uint64 // Config.Timeout passed (connect, headers or body)
	HTTPStatus uint64 // a status other than 200
	Parse      uint64 // ErrMalformed or ErrNoLoadMetrics
	TooLarge   uint64 // ErrTooLarge
	Other      uint64 // anything else (connection refused, DNS, reset)
}

// ByReason returns the counts keyed by metric label value: ok, timeout,
// http_status, parse, too_large and other.
func (s Stats) ByReason() map[string]uint64 {
	return map[string]uint64{
		"ok": s.OK, "timeout": s.Timeout, "http_status": s.HTTPStatus,
		"parse": s.Parse, "too_large": s.TooLarge, "other": s.Other,
	}
}

// Scraper scrapes every target's /metrics each interval and publishes the
// load. Its methods are safe for concurrent use.
type Scraper struct {
	cfg     Config
	client  *http.Client
	ownsCli bool
	clk     clock.Clock
	log     *slog.Logger
	targets func() []Target
	publish func(Target, Sample)
	onError func(Target, error)

	sem chan struct{}
	wg  sync.WaitGroup

	mu     sync.Mutex
	states map[string]*targetState

	ok, timeout, httpStatus, parse, tooLarge, other atomic.Uint64
}

// targetState is what the scraper remembers of one target. It is replaced
// when a target leaves, so a late result for a departed target is dropped.
type targetState struct {
	target Target
	busy   bool      // a scrape is in flight
	since  time.Time // first seen, or the last success
	last   Sample    // last good sample
}

// New returns a Scraper; call Run to start it.
func New(cfg Config, deps Deps) *Scraper {
	cfg.defaults()
	s := &Scraper{
		cfg:     cfg,
		client:  deps.Client,
		clk:     clock.Or(deps.Clock),
		log:     deps.Logger,
		targets: deps.Targets,
		publish: deps.Publish,
		onError: deps.OnError,
		sem:     make(chan struct{}, cfg.MaxInFlight),
		states:  make(map[string]*targetState),
	}
	if s.client == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConnsPerHost = 1
		s.client = &http.Client{Transport: tr}
		s.ownsCli = true
	}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.targets == nil {
		s.targets = func() []Target { return nil }
	}
	if s.publish == nil {
		s.publish = func(Target, Sample) {}
	}
	if s.onError == nil {
		s.onError = func(t Target, err error) {
			s.log.Debug("metrics scrape failed", "endpoint", t.Key, "err", err)
		}
	}
	return s
}

// Stats returns the outcome counts so far.
func (s *Scraper) Stats() Stats {
	return Stats{
		OK: s.ok.Load(), Timeout: s.timeout.Load(), HTTPStatus: s.httpStatus.Load(),
		Parse: s.parse.Load(), TooLarge: s.tooLarge.Load(), Other: s.other.Load(),
	}
}

// Run scrapes a round at once and then every Interval, by the clock, until
// ctx is done; it returns nil after every scrape has finished. A round
// never waits for the previous one: a target whose scrape is still in
// flight is skipped.
func (s *Scraper) Run(ctx context.Context) error {
	tick := make(chan struct{}, 1)
	var (
		mu      sync.Mutex
		stopped bool
		timer   clock.Timer
	)
	var fire func()
	fire = func() {
		select {
		case tick <- struct{}{}:
		default: // a round is pending already
		}
		mu.Lock()
		defer mu.Unlock()
		if !stopped {
			timer = s.clk.AfterFunc(s.cfg.Interval, fire)
		}
	}
	mu.Lock()
	timer = s.clk.AfterFunc(s.cfg.Interval, fire)
	mu.Unlock()
	defer func() {
		mu.Lock()
		stopped = true
		timer.Stop()
		mu.Unlock()
		s.wg.Wait()
		if s.ownsCli {
			s.client.CloseIdleConnections()
		}
	}()

	s.startRound(ctx)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick:
			s.startRound(ctx)
		}
	}
}

// ScrapeOnce runs one round and waits for it (for tools and tests; do not
// mix with a concurrent Run). With the default client, it closes idle
// connections before returning.
func (s *Scraper) ScrapeOnce(ctx context.Context) {
	s.startRound(ctx)
	s.wg.Wait()
	if s.ownsCli {
		s.client.CloseIdleConnections()
	}
}

// startRound refreshes the target set and starts a scrape for every idle
// target.
func (s *Scraper) startRound(ctx context.Context) {
	if ctx.Err() != nil {
		return
	}
	now := s.clk.Now()
	targets := s.targets()

	s.mu.Lock()
	seen := make(map[string]bool, len(targets))
	var start []*targetState
	for _, t := range targets {
		if t.Key == "" || seen[t.Key] {
			continue
		}
		seen[t.Key] = true
		st := s.states[t.Key]
		if st == nil || st.target != t {
			st = &targetState{target: t, since: now}
			s.states[t.Key] = st
		}
		if st.busy {
			// Still in flight: its own timeout ends it, and a failure
			// checks staleness then.
			continue
		}
		st.busy = true
		start = append(start, st)
	}
	for k := range s.states {
		if !seen[k] {
			delete(s.states, k)
		}
	}
	s.mu.Unlock()

	for _, st := range start {
		s.wg.Add(1)
		go s.scrapeTarget(ctx, st)
	}
}

func (s *Scraper) scrapeTarget(ctx context.Context, st *targetState) {
	defer s.wg.Done()
	select {
	case s.sem <- struct{}{}:
	case <-ctx.Done():
		s.done(st)
		return
	}
	sample, err := s.fetch(ctx, st.target)
	<-s.sem
	if ctx.Err() != nil { // shutting down: not the target's fault
		s.done(st)
		return
	}
	now := s.clk.Now()
	if err != nil {
		s.count(err)
		if s.current(st) {
			s.onError(st.target, err)
		}
		s.done(st)
		s.checkStale(st, now)
		return
	}
	s.ok.Add(1)
	sample.At = now
	s.mu.Lock()
	st.since, st.last = now, sample
	cur := s.states[st.target.Key] == st
	s.mu.Unlock()
	if cur {
		s.publish(st.target, sample)
	}
	s.done(st)
}

func (s *Scraper) current(st *targetState) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.states[st.target.Key] == st
}

func (s *Scraper) done(st *targetState) {
	s.mu.Lock()
	st.busy = false
	s.mu.Unlock()
}

// checkStale publishes a stale mark, after each failed scrape, while the target's
// last success (or, before any, its first sighting) is StaleAfter old or
// more. The mark keeps the last good load and Known; a target that never
// answered is published with Known false.
func (s *Scraper) checkStale(st *targetState, now time.Time) {
	s.mu.Lock()
	if s.states[st.target.Key] != st || now.Sub(st.since) < s.cfg.StaleAfter {
		s.mu.Unlock()
		return
	}
	mark := st.last
	mark.Stale = true
	mark.At = now
	s.mu.Unlock()
	s.publish(st.target, mark)
}

func (s *Scraper) fetch(ctx context.Context, t Target) (Sample, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, t.url(), nil)
	if err != nil {
		return Sample{}, err
	}
	req.Header.Set("Accept", "text/plain;version=0.0.4;q=1,*/*;q=0.1")
	resp, err := s.client.Do(req)
	if err != nil {
		return Sample{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return Sample{}, &StatusError{Code: resp.StatusCode}
	}
	if resp.ContentLength > s.cfg.MaxBody {
		return Sample{}, fmt.Errorf("%w (Content-Length %d, limit %d)", ErrTooLarge, resp.ContentLength, s.cfg.MaxBody)
	}
	return Parse(resp.Body, s.cfg.MaxBody)
}

func (s *Scraper) count(err error) {
	var se *StatusError
	var ne net.Error
	switch {
	case errors.Is(err, ErrTooLarge):
		s.tooLarge.Add(1)
	case errors.As(err, &se):
		s.httpStatus.Add(1)
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		s.timeout.Add(1)
	case errors.Is(err, ErrMalformed), errors.Is(err, ErrNoLoadMetrics):
		s.parse.Add(1)
	default:
		s.other.Add(1)
	}
}
