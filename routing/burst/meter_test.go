package burst

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

var t0 = time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)

const delay = 2 * time.Millisecond

func newMeter(t *testing.T, cfg Config) *Meter {
	t.Helper()
	if cfg.Delay == 0 {
		cfg.Delay = delay
	}
	m, err := NewMeter(cfg)
	if err != nil || m == nil {
		t.Fatalf("NewMeter: %v, %v", m, err)
	}
	return m
}

func TestOffAndConfig(t *testing.T) {
	m, err := NewMeter(Config{})
	if m != nil || err != nil {
		t.Fatalf("Delay 0: %v, %v; want nil, nil", m, err)
	}
	// A nil Meter is usable and inert.
	m.SetReplicas(3, 4)
	m.Local(t0)
	m.Remote(t0)
	if at := m.Turn(t0, t0); !at.IsZero() {
		t.Errorf("nil Meter gave a turn at %v", at)
	}
	if s := m.Stats(t0); s != (Stats{Replicas: 1}) {
		t.Errorf("nil Meter stats %+v", s)
	}
	for _, c := range []Config{{Delay: delay, Step: -1}, {Delay: delay, MaxTurns: -1}, {Delay: delay, Horizon: -1}, {Delay: delay, MinArrivals: -1}} {
		if _, err := NewMeter(c); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: err %v, want ErrConfig", c, err)
		}
	}
	m = newMeter(t, Config{})
	if m.cfg.Step != delay+delay/8 || m.cfg.MaxTurns != DefaultMaxTurns || m.cfg.Threshold != DefaultThreshold {
		t.Errorf("defaults %+v", m.cfg)
	}
	if r, n := m.Replicas(); r != 0 || n != 1 {
		t.Errorf("a new Meter is rank %d of %d, want 0 of 1", r, n)
	}
	m.SetReplicas(7, 3)
	if r, n := m.Replicas(); r != 2 || n != 3 {
		t.Errorf("rank 7 of 3 clamped to %d of %d, want 2 of 3", r, n)
	}
}

// bursts drives m as replica rank of replicas sees a trace stamped on a
// grid: every 500 ms a burst of own arrivals (decided at once or at
// their turn) and the peers' share of it, whose decisions arrive a sync
// delay later. It returns the turns Turn gave in the last burst.
func bursts(m *Meter, rank, replicas, n, own, peers int) []time.Time {
	m.SetReplicas(rank, replicas)
	var last []time.Time
	for b := range n {
		at := t0.Add(time.Duration(b) * 500 * time.Millisecond)
		last = last[:0]
		for range own {
			turn := m.Turn(at, at)
			last = append(last, turn)
			m.Local(at)
		}
		for range peers {
			m.Remote(at.Add(delay))
		}
	}
	return last
}

// TestTurnsInBursts: bursts make the traffic bursty; a replica of rank 2
// then decides two steps after the arrival, rank 0 at once, and a replica
// alone never waits.
func TestTurnsInBursts(t *testing.T) {
	m := newMeter(t, Config{})
	turns := bursts(m, 2, 4, 30, 3, 9)
	s := m.Stats(t0.Add(15 * time.Second))
	if s.Simultaneous < DefaultThreshold {
		t.Fatalf("Simultaneous %.2f in bursts of 12, want >= %v", s.Simultaneous, DefaultThreshold)
	}
	last := t0.Add(29 * 500 * time.Millisecond)
	for i, at := range turns {
		if want := last.Add(2 * m.cfg.Step); !at.Equal(want) {
			t.Errorf("arrival %d of the last burst: turn %v, want %v (rank 2)", i, at, want)
		}
	}
	if s.Held == 0 || s.HeldSeconds <= 0 {
		t.Errorf("held %d for %.4f s, want some", s.Held, s.HeldSeconds)
	}
	// Decisions made at once are blind to the peers' of the same burst.
	if s.Blind < 8 || s.Blind > 10 {
		t.Errorf("Blind %.2f, want about 9 (every peer decision of a burst)", s.Blind)
	}

	first := newMeter(t, Config{})
	for _, at := range bursts(first, 0, 4, 30, 3, 9) {
		if !at.IsZero() {
			t.Errorf("rank 0 waited until %v", at)
		}
	}
	alone := newMeter(t, Config{})
	for _, at := range bursts(alone, 0, 1, 30, 12, 0) {
		if !at.IsZero() {
			t.Errorf("a lone replica waited until %v", at)
		}
	}
	if s := alone.Stats(last); s.Simultaneous != 0 || s.Blind != 0 {
		t.Errorf("a lone replica: %+v", s)
	}
	never := newMeter(t, Config{Threshold: -1})
	for _, at := range bursts(never, 3, 4, 30, 3, 9) {
		if !at.IsZero() {
			t.Errorf("Threshold < 0 waited until %v", at)
		}
	}
	capped := newMeter(t, Config{MaxTurns: 2})
	for _, at := range bursts(capped, 5, 8, 30, 3, 21) {
		if want := last.Add(capped.cfg.Step); !at.Equal(want) {
			t.Errorf("rank 5 with 2 turns: %v, want %v (turn 5 mod 2 = 1)", at, want)
		}
	}
}

// TestNoTurnsWhenSmooth: arrivals spread at random, however many, are
// not a burst: nobody waits (turns would only delay them).
func TestNoTurnsWhenSmooth(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, rate := range []float64{20, 500, 5000} { // own arrivals per second
		m := newMeter(t, Config{})
		m.SetReplicas(3, 4)
		at := t0
		waited := 0
		var peers []time.Time
		for range int(rate * 5) {
			at = at.Add(time.Duration(rng.ExpFloat64() / rate * float64(time.Second)))
			for len(peers) > 0 && !peers[0].After(at) {
				m.Remote(peers[0])
				peers = peers[1:]
			}
			if !m.Turn(at, at).IsZero() {
				waited++
			}
			m.Local(at)
			// Three peers at the same rate, each decision arriving a sync
			// delay after it was made at a random moment near ours.
			for range 3 {
				peers = append(peers, at.Add(delay+time.Duration(rng.ExpFloat64()/rate*float64(time.Second))))
			}
			sortTimes(peers)
		}
		s := m.Stats(at)
		if waited > 0 || s.Simultaneous > 0.5 {
			t.Errorf("%v arrivals/s spread at random: %d waited, Simultaneous %.2f (Blind %.2f)", rate, waited, s.Simultaneous, s.Blind)
		}
	}
}

func sortTimes(ts []time.Time) {
	for i := 1; i < len(ts); i++ {
		for j := i; j > 0 && ts[j].Before(ts[j-1]); j-- {
			ts[j], ts[j-1] = ts[j-1], ts[j]
		}
	}
}

// TestTooFewArrivals: a handful of arrivals cannot tell a burst.
func TestTooFewArrivals(t *testing.T) {
	m := newMeter(t, Config{})
	for _, at := range bursts(m, 1, 2, 2, 3, 3) {
		if !at.IsZero() {
			t.Errorf("waited after 6 arrivals (MinArrivals %d)", DefaultMinArrivals)
		}
	}
}

// TestHorizon: once bursts stop for longer than the horizon, spread
// arrivals decide at once again.
func TestHorizon(t *testing.T) {
	m := newMeter(t, Config{})
	bursts(m, 1, 2, 30, 6, 6)
	later := t0.Add(15*time.Second + DefaultHorizon)
	for i := range 40 {
		at := later.Add(time.Duration(i) * 100 * time.Millisecond)
		if turn := m.Turn(at, at); !turn.IsZero() {
			t.Fatalf("arrival %d, %v after the last burst: turn %v", i, at.Sub(t0), turn)
		}
		m.Local(at)
		m.Remote(at.Add(50 * time.Millisecond))
	}
}

// TestTurnPast: a turn already past when the decision comes (a slow
// tokenizer, a late Pick) is not waited for.
func TestTurnPast(t *testing.T) {
	m := newMeter(t, Config{})
	bursts(m, 3, 4, 30, 3, 9)
	at := t0.Add(time.Minute / 4)
	if turn := m.Turn(at, at.Add(time.Second)); !turn.IsZero() {
		t.Errorf("turn %v for a decision a second late", turn)
	}
	if turn := m.Turn(time.Time{}, at); !turn.Equal(at.Add(3 * m.cfg.Step)) {
		t.Errorf("zero arrival: turn %v, want now + 3 steps", turn)
	}
}

func TestMeterConcurrent(t *testing.T) {
	m := newMeter(t, Config{})
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 2000 {
				at := t0.Add(time.Duration(i) * time.Millisecond)
				switch g {
				case 0:
					m.Turn(at, at)
					m.Local(at)
				case 1:
					m.Remote(at)
				case 2:
					m.SetReplicas(i%4, 4)
				default:
					m.Stats(at)
				}
			}
		}()
	}
	wg.Wait()
}

func BenchmarkTurn(b *testing.B) {
	m, _ := NewMeter(Config{Delay: delay})
	bursts(m, 2, 4, 30, 3, 9)
	at := t0.Add(time.Minute)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		now := at.Add(time.Duration(i) * time.Microsecond)
		m.Turn(now, now)
		m.Local(now)
	}
}
