// Package prefixstate keeps the per-prefix routing state that hint-aware
// policies share: for every (tenant, prefix id) the request counter that
// yields the reuse budget, the endpoint the prefix was last routed to (its
// soft pin) with the costs recorded then, and, per endpoint, the outstanding
// work of the prefixes pinned to it.
//
// The reference Thompson router (NeMo Agent Toolkit) keeps the same state in
// two unbounded dictionaries without expiry, so a workflow that sends fewer
// requests than it announced leaks its entry forever. A [Store] bounds the
// number of entries (least recently used first out) and expires entries a
// TTL after their last use, both on the injected clock.
//
// Keys come from clients (the tenant header, the prefix id hint), so the
// store also bounds each entry's bytes: every key that enters it goes
// through [NewKey], which keeps an id of at most [MaxIDLen] bytes as is and
// replaces any other by its SHA-256 ([BoundID]). Distinct tenants and
// prefix ids never share an entry (nothing is truncated), and an entry
// holds at most 2·MaxIDLen bytes of ids whatever the client sent.
//
// # Concurrency
//
// A Store is safe for concurrent use. Entries live in shards, each guarded
// by its own mutex held only for a map lookup and a few field updates; no
// lock is shared by all requests. The per-endpoint outstanding work is a
// copy-on-write map of atomic counters, so [Store.OutstandingWork] takes no
// lock at all. Work is kept in fixed point (milli-units), so pinning and
// unpinning are exact and a drained endpoint returns to exactly zero.
package prefixstate

import (
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
)

// Defaults for [Config].
const (
	DefaultTTL        = 10 * time.Minute
	DefaultMaxEntries = 100_000
	DefaultShards     = 64
	// MaxTotalRequests caps a client's announced total_requests, so that a
	// hostile hint cannot make the outstanding work overflow.
	MaxTotalRequests = 1 << 20
	// MaxOpenReuse caps the reuse budget assumed for a session that
	// announced no total (see [Store.Arrive]): its affinity weight
	// R/(R+1) stays at most 8/9, and a policy that charges the budget as
	// outstanding work charges at most 8 requests' worth for it.
	MaxOpenReuse = 8
	// maxContribution caps one prefix's outstanding work (in work units).
	maxContribution = 1e9
	// milli is the fixed-point scale of the outstanding work counters.
	milli = 1000
	// sweepBatch bounds the entries removed per shard lock hold.
	sweepBatch = 256
)

// Pin is where a prefix was last routed and the costs its requests carried
// then; the costs are opaque to the store except through
// [Store.OutstandingWork].
type Pin struct {
	Endpoint    routing.EndpointKey
	DPRank      int
	DecodeCost  float64
	PrefillCost float64
	IATFactor   float64
	// At is when the caller pinned (set by the caller; the store keeps it
	// as given), so a policy can tell how long ago the prefix was last
	// routed.
	At time.Time
}

// Config bounds a [Store].
type Config struct {
	// TTL is how long an entry lives after its last use (Arrive with commit,
	// or Pin). 0 means DefaultTTL.
	TTL time.Duration `json:"ttl"`
	// NoExpiry keeps entries until their budget is spent or the LRU bound
	// evicts them, as the reference router does.
	NoExpiry bool `json:"no_expiry"`
	// MaxEntries bounds the number of entries. The bound is split evenly
	// over the shards and kept per shard: inserting into a full shard
	// evicts that shard's least recently used entry, so eviction starts
	// slightly before the whole store is full. 0 means DefaultMaxEntries.
	MaxEntries int `json:"max_entries"`
	// SweepInterval is how often expired entries are removed in the
	// background (expired entries are also ignored when touched). 0 means
	// TTL/10, at least one second and at most one minute.
	SweepInterval time.Duration `json:"sweep_interval"`
	// Shards is the number of lock shards, rounded up to a power of two
	// (and lowered so that every shard holds at least one entry). 0 means
	// DefaultShards.
	Shards int `json:"shards"`
}

// ErrInvalidConfig is wrapped by every [Config.Validate] error.
var ErrInvalidConfig = errors.New("invalid prefix state config")

// Validate rejects negative values.
func (c Config) Validate() error {
	switch {
	case c.TTL < 0:
		return fmt.Errorf("%w: prefix_state.ttl: must not be negative", ErrInvalidConfig)
	case c.MaxEntries < 0:
		return fmt.Errorf("%w: prefix_state.max_entries: must not be negative", ErrInvalidConfig)
	case c.SweepInterval < 0:
		return fmt.Errorf("%w: prefix_state.sweep_interval: must not be negative", ErrInvalidConfig)
	case c.Shards < 0 || c.Shards > 1<<16:
		return fmt.Errorf("%w: prefix_state.shards: must be in [0, 65536]", ErrInvalidConfig)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
	if c.MaxEntries == 0 {
		c.MaxEntries = DefaultMaxEntries
	}
	if c.Shards == 0 {
		c.Shards = DefaultShards
	}
	n := 1
	for n < c.Shards {
		n <<= 1
	}
	for n > 1 && n > c.MaxEntries {
		n >>= 1
	}
	c.Shards = n
	if c.SweepInterval == 0 {
		c.SweepInterval = min(max(c.TTL/10, time.Second), time.Minute)
	}
	return c
}

// Stats are the store's counters.
type Stats struct {
	// Entries is the number of live entries.
	Entries int
	// Expired counts entries removed because their TTL passed.
	Expired uint64
	// Evicted counts entries removed by the LRU bound.
	Evicted uint64
}

// Store holds prefix state. The zero value is not usable; call [New].
type Store struct {
	cfg    Config
	clk    clock.Clock
	seed   maphash.Seed
	shards []shard
	mask   uint64
	work   workTable

	entries atomic.Int64
	expired atomic.Uint64
	evicted atomic.Uint64

	timerMu sync.Mutex
	timer   clock.Timer
	closed  bool
}

type shard struct {
	mu sync.Mutex
	m  map[Key]*entry
	// lru is the sentinel of a circular list, most recent first. Because
	// every touch moves an entry to the front, the back is also the entry
	// that expires first, so the sweep stops at the first live one.
	lru entry
	cap int
	_   [64]byte // keep shards on separate cache lines
}

type entry struct {
	key        Key
	prev, next *entry
	lastUse    int64 // clock nanoseconds
	total      int32
	processed  int32
	pinned     bool
	pin        Pin
	contrib    int64         // milli work units charged to work
	work       *atomic.Int64 // the endpoint counter contrib is charged to
}

// New returns an empty store on clk (nil: the real clock). Unless
// cfg.NoExpiry is set, a sweep runs every cfg.SweepInterval on clk until
// [Store.Close].
func New(cfg Config, clk clock.Clock) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	s := &Store{cfg: cfg, clk: clock.Or(clk), seed: maphash.MakeSeed(), shards: make([]shard, cfg.Shards), mask: uint64(cfg.Shards - 1)}
	per, rem := cfg.MaxEntries/cfg.Shards, cfg.MaxEntries%cfg.Shards
	for i := range s.shards {
		sh := &s.shards[i]
		sh.m = make(map[Key]*entry)
		sh.lru.next, sh.lru.prev = &sh.lru, &sh.lru
		sh.cap = per
		if i < rem {
			sh.cap++
		}
	}
	s.work.init()
	if !cfg.NoExpiry {
		s.timer = s.clk.AfterFunc(cfg.SweepInterval, s.sweepTick)
	}
	return s, nil
}

// Config returns the effective configuration (defaults filled in).
func (s *Store) Config() Config { return s.cfg }

// Close stops the background sweep. The store stays usable; expired entries
// are then only dropped when touched.
func (s *Store) Close() {
	s.timerMu.Lock()
	defer s.timerMu.Unlock()
	s.closed = true
	if s.timer != nil {
		s.timer.Stop()
		s.timer = nil
	}
}

// Arrive counts a request of prefix k that announced totalRequests requests
// in its group and returns the reuse budget remaining after it, together
// with the prefix's current pin. ok is false when the prefix is pinned
// nowhere.
//
// With an announced total (totalRequests >= 1) the budget is
// R = max(total − processed, 0), total = max(total, totalRequests): the
// session's affinity ends when its announced total is reached.
// totalRequests < 1 announces nothing (a session id alone, as
// x-prefix-id without x-prefix-total-requests): such an open session is
// assumed to continue, and its budget is the number of its requests seen
// so far, capped at [MaxOpenReuse], R = min(processed, MaxOpenReuse): a
// session expected to last as long again as it has lasted (Gott's
// Copernican estimate, the median of the remaining length when nothing
// else is known), so the affinity weight R/(R+1) grows from 1/2 to at most
// MaxOpenReuse/(MaxOpenReuse+1) as the session proves itself. An open
// session ends by expiry (TTL) or eviction; a total announced later
// refines it (and ends it once reached).
//
// With commit false the call is a read-only peek (a Score): it returns what
// a committed call would return and changes nothing, not even the entry's
// recency. An empty prefix id, or a new prefix that announces a total of
// one, costs nothing: no entry is made.
//
// When an announced budget reaches zero the counter is reset, so a later
// request of the same id starts a new group (the reference deletes its
// counter), and the pin stays until [Store.Pin] with reuse 0 removes the
// entry.
func (s *Store) Arrive(k Key, totalRequests int, commit bool) (reuse int, last Pin, ok bool) {
	if k.PrefixID == "" {
		return 0, Pin{}, false
	}
	k = k.bound()
	total := int32(min(max(totalRequests, 0), MaxTotalRequests)) // 0: none announced
	now := s.now()
	sh := s.shard(k)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[k]
	if e != nil && s.expiredAt(e, now) {
		if commit {
			s.remove(sh, e)
			s.expired.Add(1)
		}
		e = nil
	}
	if !commit {
		var t, p int32
		if e != nil {
			t, p = e.total, e.processed
			last, ok = e.pin, e.pinned
		}
		return budget(max(t, total), min(p+1, MaxTotalRequests)), last, ok
	}
	if e == nil {
		if total == 1 {
			return 0, Pin{}, false
		}
		e = s.insert(sh, k)
	} else {
		sh.moveToFront(e)
	}
	e.total = max(e.total, total)
	e.processed = min(e.processed+1, MaxTotalRequests)
	reuse = budget(e.total, e.processed)
	e.lastUse = now
	last, ok = e.pin, e.pinned
	if reuse == 0 {
		if !e.pinned {
			s.remove(sh, e)
		} else {
			e.total, e.processed = 0, 0
		}
	}
	return reuse, last, ok
}

// budget is the reuse budget of a group with announced total (0: none)
// after processed requests: what the announcement leaves, or for an open
// group min(processed, MaxOpenReuse) (see [Store.Arrive]).
func budget(total, processed int32) int {
	if total > 0 {
		return int(max(total-processed, 0))
	}
	return int(min(processed, MaxOpenReuse))
}

// Pin records that prefix k was routed to p with reuse requests expected
// after this one, and charges reuse·(DecodeCost+PrefillCost)·IATFactor to
// p.Endpoint's outstanding work (moving the charge from the previous pin).
// reuse <= 0 removes the entry. Pinning a prefix the store does not hold
// (evicted or expired since Arrive) recreates it with a budget of reuse.
func (s *Store) Pin(k Key, p Pin, reuse int) {
	if k.PrefixID == "" {
		return
	}
	k = k.bound()
	now := s.now()
	sh := s.shard(k)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[k]
	if e != nil && s.expiredAt(e, now) {
		s.remove(sh, e)
		s.expired.Add(1)
		e = nil
	}
	if reuse <= 0 {
		if e != nil {
			s.remove(sh, e)
		}
		return
	}
	reuse = min(reuse, MaxTotalRequests)
	if e == nil {
		e = s.insert(sh, k)
		e.total, e.processed = int32(reuse), 0
	} else {
		sh.moveToFront(e)
	}
	s.uncharge(e)
	e.pin, e.pinned, e.lastUse = p, true, now
	if c := contribution(reuse, p); c > 0 {
		e.contrib = c
		e.work = s.work.add(p.Endpoint, c)
	}
}

// OutstandingWork returns Σ reuse(p)·(decode(p)+prefill(p))·iat(p) over the
// prefixes p pinned to endpoint, as of their last pin. It takes no lock.
func (s *Store) OutstandingWork(endpoint routing.EndpointKey) float64 {
	return float64(s.work.load(endpoint)) / milli
}

// Len returns the number of entries.
func (s *Store) Len() int { return int(s.entries.Load()) }

// Stats returns the store's counters.
func (s *Store) Stats() Stats {
	return Stats{Entries: s.Len(), Expired: s.expired.Load(), Evicted: s.evicted.Load()}
}

// Sweep removes every expired entry now. The background sweep calls it;
// tests and callers without a sweep may too.
func (s *Store) Sweep() {
	if s.cfg.NoExpiry {
		return
	}
	now := s.now()
	for i := range s.shards {
		sh := &s.shards[i]
		for more := true; more; {
			sh.mu.Lock()
			more = false
			for n := 0; ; n++ {
				e := sh.lru.prev
				if e == &sh.lru || !s.expiredAt(e, now) {
					break
				}
				if n == sweepBatch {
					more = true
					break
				}
				s.remove(sh, e)
				s.expired.Add(1)
			}
			sh.mu.Unlock()
		}
	}
	s.work.prune()
}

func (s *Store) sweepTick() {
	s.Sweep()
	s.timerMu.Lock()
	defer s.timerMu.Unlock()
	if !s.closed {
		s.timer = s.clk.AfterFunc(s.cfg.SweepInterval, s.sweepTick)
	}
}

func (s *Store) now() int64 { return s.clk.Now().UnixNano() }

func (s *Store) expiredAt(e *entry, now int64) bool {
	return !s.cfg.NoExpiry && now-e.lastUse >= int64(s.cfg.TTL)
}

func (s *Store) shard(k Key) *shard {
	return &s.shards[maphash.Comparable(s.seed, k)&s.mask]
}

// insert adds a new entry for k (bounded) at the front, evicting the least
// recently used entry of a full shard. The key's strings are cloned so that
// an entry never pins a request body or header the id was sliced from.
func (s *Store) insert(sh *shard, k Key) *entry {
	for len(sh.m) >= sh.cap && sh.lru.prev != &sh.lru {
		s.remove(sh, sh.lru.prev)
		s.evicted.Add(1)
	}
	k.Tenant, k.PrefixID = strings.Clone(k.Tenant), strings.Clone(k.PrefixID)
	e := &entry{key: k}
	sh.m[k] = e
	sh.pushFront(e)
	s.entries.Add(1)
	return e
}

func (s *Store) remove(sh *shard, e *entry) {
	s.uncharge(e)
	delete(sh.m, e.key)
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
	s.entries.Add(-1)
}

func (s *Store) uncharge(e *entry) {
	if e.work != nil {
		e.work.Add(-e.contrib)
		e.work, e.contrib = nil, 0
	}
}

func (sh *shard) pushFront(e *entry) {
	e.prev, e.next = &sh.lru, sh.lru.next
	sh.lru.next.prev = e
	sh.lru.next = e
}

func (sh *shard) moveToFront(e *entry) {
	if sh.lru.next == e {
		return
	}
	e.prev.next, e.next.prev = e.next, e.prev
	sh.pushFront(e)
}

// contribution is a pin's outstanding work in milli-units; negative or
// non-finite costs count as zero.
func contribution(reuse int, p Pin) int64 {
	nonneg := func(v float64) float64 {
		if v > 0 && !math.IsInf(v, 1) {
			return v
		}
		return 0
	}
	w := float64(reuse) * (nonneg(p.DecodeCost) + nonneg(p.PrefillCost)) * nonneg(p.IATFactor)
	return int64(math.Round(min(w, maxContribution) * milli))
}
