package burst

import (
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"
)

// Defaults of Config's zero fields.
const (
	// DefaultHorizon is how far back the Meter looks: several bursts of a
	// trace stamped on a 3 s grid, short enough to follow a change of
	// traffic within seconds.
	DefaultHorizon = 10 * time.Second
	// DefaultMaxTurns bounds the turns, hence the longest wait, to 7
	// steps; replicas past it share turns (rank modulo MaxTurns).
	DefaultMaxTurns = 8
	// DefaultThreshold is the Simultaneous value at which turns start:
	// on average one peer decision blind to each of ours, beyond chance.
	DefaultThreshold = 1
	// DefaultMinArrivals is how many own arrivals the horizon must hold
	// before the Meter judges the traffic bursty.
	DefaultMinArrivals = 8
	// ringSize is how many of its own arrivals and decisions the Meter
	// remembers. Beyond it within one window the counts saturate (they
	// err towards "not bursty").
	ringSize = 128
	// buckets splits the horizon.
	buckets = 10
)

// ErrConfig is wrapped by NewMeter for an invalid Config.
var ErrConfig = errors.New("burst: invalid config")

// Config configures a Meter.
type Config struct {
	// Delay is the sync delay d: how long after a decision the pool's
	// other replicas have applied it. 0 (a lone replica, or decisions
	// applied at once): no Meter.
	Delay time.Duration
	// Step is the wait between two turns (default Delay + Delay/8: a
	// turn must start after the previous one's decisions arrived).
	Step time.Duration
	// MaxTurns bounds the turns (default DefaultMaxTurns); 1 never waits.
	MaxTurns int
	// Threshold is the Simultaneous value at which turns start (default
	// DefaultThreshold); negative: never (the Meter only measures).
	Threshold float64
	// Horizon is how far back the Meter looks (default DefaultHorizon).
	Horizon time.Duration
	// MinArrivals is the own arrivals the horizon must hold before turns
	// can start (default DefaultMinArrivals).
	MinArrivals int
}

func (c *Config) defaults() error {
	if c.Step < 0 || c.MaxTurns < 0 || c.Horizon < 0 || c.MinArrivals < 0 || math.IsNaN(c.Threshold) {
		return fmt.Errorf("%w: negative step, turns, horizon or arrivals, or NaN threshold", ErrConfig)
	}
	if c.Step == 0 {
		c.Step = c.Delay + c.Delay/8
	}
	if c.MaxTurns == 0 {
		c.MaxTurns = DefaultMaxTurns
	}
	if c.Threshold == 0 {
		c.Threshold = DefaultThreshold
	}
	if c.Horizon == 0 {
		c.Horizon = DefaultHorizon
	}
	if c.MinArrivals == 0 {
		c.MinArrivals = DefaultMinArrivals
	}
	return nil
}

// Meter measures how bursty a replica's traffic is and gives its
// decisions their turns (see the package doc). Make one with NewMeter; a
// nil *Meter measures nothing, never waits and reports zeros.
type Meter struct {
	cfg    Config
	window int64 // 2·Delay, ns
	width  int64 // one bucket's span, ns
	start  atomic.Int64
	// arrivals and decisions are the times (Unix ns) of the last ringSize
	// own arrivals and decisions; the next* counters index them.
	arrivals  [ringSize]atomic.Int64
	decisions [ringSize]atomic.Int64
	nextArr   atomic.Uint64
	nextDec   atomic.Uint64
	counts    [buckets]bucket
	// place is this replica's rank (low 32 bits) and the pool's live
	// replicas (high 32 bits).
	place     atomic.Uint64
	held      atomic.Int64
	heldNanos atomic.Int64
}

// bucket counts one span of time.
type bucket struct {
	epoch atomic.Int64 // the span's number: time / width
	arr   atomic.Int64 // own arrivals
	clust atomic.Int64 // own arrivals within the window before each
	own   atomic.Int64 // own decisions
	peer  atomic.Int64 // peers' decisions received
	pairs atomic.Int64 // own decisions within the window before each
}

// NewMeter returns a Meter for cfg, or nil (no error) when cfg.Delay is 0
// or less.
func NewMeter(cfg Config) (*Meter, error) {
	if cfg.Delay <= 0 {
		return nil, nil
	}
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	m := &Meter{cfg: cfg, window: 2 * int64(cfg.Delay), width: max(int64(cfg.Horizon)/buckets, 1)}
	for i := range m.counts {
		m.counts[i].epoch.Store(math.MinInt64)
	}
	m.start.Store(math.MinInt64)
	m.place.Store(1 << 32) // rank 0 of 1
	return m, nil
}

// SetReplicas says this replica's rank among the pool's live replicas
// (0-based, ordered the same way on every replica) and their number,
// itself included. The sync layer calls it when peers come and go.
func (m *Meter) SetReplicas(rank, replicas int) {
	if m == nil {
		return
	}
	replicas = max(replicas, 1)
	rank = min(max(rank, 0), replicas-1)
	m.place.Store(uint64(uint32(rank)) | uint64(uint32(replicas))<<32)
}

// Replicas returns what SetReplicas last said.
func (m *Meter) Replicas() (rank, replicas int) {
	if m == nil {
		return 0, 1
	}
	p := m.place.Load()
	return int(uint32(p)), int(p >> 32)
}

// Turn records a request that arrived at arrival and returns when its
// decision should be made: arrival plus this replica's turn times Step
// while the traffic is bursty (see the package doc), or the zero time to
// decide at once (not bursty, a lone replica, turn 0, or a turn already
// past at now). A zero arrival means now.
func (m *Meter) Turn(arrival, now time.Time) time.Time {
	if m == nil {
		return time.Time{}
	}
	if arrival.IsZero() || arrival.After(now) {
		arrival = now
	}
	t := arrival.UnixNano()
	m.start.CompareAndSwap(math.MinInt64, t)
	c := recent(&m.arrivals, t, m.window)
	m.arrivals[(m.nextArr.Add(1)-1)%ringSize].Store(t)
	b := m.bucket(t)
	b.arr.Add(1)
	b.clust.Add(c)
	rank, n := m.Replicas()
	turn := rank % m.cfg.MaxTurns
	if n < 2 || turn == 0 || m.cfg.Threshold < 0 || m.Simultaneous(now) < m.cfg.Threshold {
		return time.Time{}
	}
	at := arrival.Add(time.Duration(turn) * m.cfg.Step)
	if !at.After(now) {
		return time.Time{}
	}
	m.held.Add(1)
	m.heldNanos.Add(int64(at.Sub(now)))
	return at
}

// Local records one of this replica's own decisions, made at now.
func (m *Meter) Local(now time.Time) {
	if m == nil {
		return
	}
	t := now.UnixNano()
	m.decisions[(m.nextDec.Add(1)-1)%ringSize].Store(t)
	m.bucket(t).own.Add(1)
}

// Remote records the arrival of a peer's decision at now: this replica's
// decisions of the last 2·Delay were blind to it, and it to them.
func (m *Meter) Remote(now time.Time) {
	if m == nil {
		return
	}
	t := now.UnixNano()
	b := m.bucket(t)
	b.peer.Add(1)
	if n := recent(&m.decisions, t, m.window); n > 0 {
		b.pairs.Add(n)
	}
}

// recent counts the times of ring within (t−window, t].
func recent(ring *[ringSize]atomic.Int64, t, window int64) int64 {
	n := int64(0)
	for i := range ring {
		if at := ring[i].Load(); at != 0 && at <= t && t-at < window {
			n++
		}
	}
	return n
}

// Stats are a Meter's figures at one moment.
type Stats struct {
	// Simultaneous estimates the peers' decisions made blind to each of
	// this replica's beyond what their rates alone give: how bursty the
	// traffic is. Turns start at Config.Threshold.
	Simultaneous float64
	// Blind is the mean number of peer decisions that were blind to one
	// of this replica's (and it to them) over the horizon: what turns
	// leave of the problem.
	Blind float64
	// Held counts decisions that waited for their turn, HeldSeconds their
	// waits.
	Held        int64
	HeldSeconds float64
	// Rank and Replicas are what SetReplicas said.
	Rank, Replicas int
}

// Stats returns the Meter's figures at now.
func (m *Meter) Stats(now time.Time) Stats {
	if m == nil {
		return Stats{Replicas: 1}
	}
	s := Stats{Simultaneous: m.Simultaneous(now), Held: m.held.Load(), HeldSeconds: float64(m.heldNanos.Load()) / 1e9}
	s.Rank, s.Replicas = m.Replicas()
	if t := m.sum(now.UnixNano()); t.own > 0 {
		s.Blind = float64(t.pairs) / float64(t.own)
	}
	return s
}

// Simultaneous returns Stats.Simultaneous at now.
func (m *Meter) Simultaneous(now time.Time) float64 {
	if m == nil {
		return 0
	}
	t := now.UnixNano()
	s := m.sum(t)
	if s.arr < int64(m.cfg.MinArrivals) || s.peer == 0 {
		return 0
	}
	span := min(t-m.start.Load(), int64(m.cfg.Horizon))
	if span <= 0 {
		return 0
	}
	// Own arrivals in the window before each, less what arrivals at the
	// same rate spread at random would give.
	excess := float64(s.clust)/float64(s.arr) - float64(s.arr)*float64(m.window)/float64(span)
	if excess <= 0 {
		return 0
	}
	// The count looks back only, so a pair of own arrivals is counted
	// once: twice the excess is the own arrivals around each. The peers'
	// cluster as ours, in the proportion of their decisions to ours.
	return 2 * excess * float64(s.peer) / float64(s.arr)
}

type sums struct{ arr, clust, own, peer, pairs int64 }

// sum adds up the buckets of the horizon before t (Unix ns).
func (m *Meter) sum(t int64) sums {
	e := t / m.width
	var s sums
	for i := range m.counts {
		b := &m.counts[i]
		if be := b.epoch.Load(); be <= e && be > e-buckets {
			s.arr += b.arr.Load()
			s.clust += b.clust.Load()
			s.own += b.own.Load()
			s.peer += b.peer.Load()
			s.pairs += b.pairs.Load()
		}
	}
	return s
}

// bucket returns the bucket of time t (Unix ns), cleared first when it
// last held an older span. Two writers that cross a span's start at once
// may lose a count between them: the Meter is a statistic.
func (m *Meter) bucket(t int64) *bucket {
	e := t / m.width
	b := &m.counts[((e%buckets)+buckets)%buckets]
	for {
		old := b.epoch.Load()
		if old >= e {
			return b
		}
		if b.epoch.CompareAndSwap(old, e) {
			b.arr.Store(0)
			b.clust.Store(0)
			b.own.Store(0)
			b.peer.Store(0)
			b.pairs.Store(0)
			return b
		}
	}
}
