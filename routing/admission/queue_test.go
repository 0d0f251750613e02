package admission_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing/admission"
	"github.com/kvbandit/kvbandit/routing/clock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var t0 = time.Unix(1_700_000_000, 0)

// budget is a Saturation that reports "saturated" until it is given room
// for n more requests; each admission (OnAdmit) uses one unit, like the
// engine booking a request's prefill tokens.
type budget struct {
	mu    sync.Mutex
	room  int
	order []string
}

func (b *budget) Saturated() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.room <= 0
}

func (b *budget) give(n int) {
	b.mu.Lock()
	b.room += n
	b.mu.Unlock()
}

func (b *budget) admitted() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.order...)
}

// item returns an Item named name whose OnAdmit records the name and uses
// one unit of room.
func (b *budget) item(name string, it admission.Item) admission.Item {
	it.OnAdmit = func() {
		b.mu.Lock()
		b.room--
		b.order = append(b.order, name)
		b.mu.Unlock()
	}
	return it
}

func newQueue(t *testing.T, cfg admission.Config, clk clock.Clock, sat admission.Saturation) *admission.Queue {
	t.Helper()
	if cfg.Threshold == 0 {
		cfg.Threshold = 1
	}
	q, err := admission.New(cfg, clk, sat)
	if err != nil {
		t.Fatal(err)
	}
	return q
}

// waitDepth waits until n requests are queued.
func waitDepth(t *testing.T, q *admission.Queue, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for q.Stats().Depth != n {
		if time.Now().After(deadline) {
			t.Fatalf("queue depth = %d, want %d", q.Stats().Depth, n)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// admitAsync runs Admit in a goroutine and returns a channel with its result.
func admitAsync(ctx context.Context, q *admission.Queue, it admission.Item) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- q.Admit(ctx, it) }()
	return ch
}

func result(t *testing.T, ch <-chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(5 * time.Second):
		t.Fatal("Admit did not return")
		return nil
	}
}

func pending(t *testing.T, ch <-chan error) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("Admit returned %v, want it still waiting", err)
	case <-time.After(5 * time.Millisecond):
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name  string
		cfg   admission.Config
		field []string // substrings every error must contain; nil means valid
	}{
		{name: "zero is off and valid", cfg: admission.Config{}},
		{name: "full", cfg: admission.Config{Threshold: 4, Policy: admission.PolicyWSPT, MaxWait: time.Second, MaxQueued: 8}},
		{name: "negative threshold", cfg: admission.Config{Threshold: -1}, field: []string{"Threshold"}},
		{name: "NaN threshold", cfg: admission.Config{Threshold: math.NaN()}, field: []string{"Threshold"}},
		{name: "infinite threshold", cfg: admission.Config{Threshold: math.Inf(1)}, field: []string{"Threshold"}},
		{name: "unknown policy", cfg: admission.Config{Threshold: 1, Policy: "lcfs"}, field: []string{"Policy", `"lcfs"`}},
		{name: "negative max wait", cfg: admission.Config{MaxWait: -time.Second}, field: []string{"MaxWait"}},
		{name: "negative max queued", cfg: admission.Config{MaxQueued: -1}, field: []string{"MaxQueued"}},
		{name: "every bad field reported", cfg: admission.Config{Threshold: -1, Policy: "x", MaxWait: -1, MaxQueued: -1},
			field: []string{"Threshold", "Policy", "MaxWait", "MaxQueued"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := tt.cfg.Validate()
			if tt.field == nil {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatal("Validate() = nil, want an error")
			}
			for _, f := range tt.field {
				if !strings.Contains(err.Error(), f) {
					t.Errorf("error %q does not name %s", err, f)
				}
			}
			if _, nerr := admission.New(tt.cfg, nil, admission.SaturationFunc(func() bool { return false })); nerr == nil {
				t.Error("New accepted an invalid config")
			}
		})
	}
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	got := admission.Config{Threshold: 2}.WithDefaults()
	if got.Policy != admission.PolicyFCFS || got.MaxWait != admission.DefaultMaxWait || got.MaxQueued != admission.DefaultMaxQueued {
		t.Fatalf("WithDefaults() = %+v", got)
	}
	if (admission.Config{}).Enabled() || !got.Enabled() {
		t.Fatal("Enabled() should follow Threshold > 0")
	}
	if _, err := admission.New(admission.Config{Threshold: 1}, nil, nil); err == nil {
		t.Fatal("New without a Saturation should fail when enabled")
	}
}

func TestErrorsWrapRejected(t *testing.T) {
	t.Parallel()
	for _, err := range []error{admission.ErrShed, admission.ErrQueueFull, admission.ErrWaitExceeded} {
		if !errors.Is(fmt.Errorf("engine: %w", err), admission.ErrRejected) {
			t.Errorf("%v does not wrap ErrRejected", err)
		}
	}
}

func TestAdmitWithoutSaturation(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		cfg      admission.Config
		priority int
	}{
		{name: "disabled", cfg: admission.Config{}, priority: 0},
		{name: "disabled sheddable", cfg: admission.Config{}, priority: -1},
		{name: "enabled", cfg: admission.Config{Threshold: 1}, priority: 0},
		{name: "enabled urgent", cfg: admission.Config{Threshold: 1}, priority: 5},
		{name: "enabled sheddable is not shed when not saturated", cfg: admission.Config{Threshold: 1}, priority: -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var sat admission.Saturation
			if tt.cfg.Enabled() {
				sat = admission.SaturationFunc(func() bool { return false })
			}
			q, err := admission.New(tt.cfg, clock.NewVirtual(t0), sat)
			if err != nil {
				t.Fatal(err)
			}
			var calls int
			if err := q.Admit(t.Context(), admission.Item{Priority: tt.priority, OnAdmit: func() { calls++ }}); err != nil {
				t.Fatalf("Admit() = %v", err)
			}
			if calls != 1 {
				t.Fatalf("OnAdmit ran %d times, want 1", calls)
			}
			if s := q.Stats(); s.AdmittedImmediately != 1 || s.Depth != 0 {
				t.Fatalf("Stats() = %+v", s)
			}
		})
	}
}

func TestShedWhenSaturated(t *testing.T) {
	t.Parallel()
	b := &budget{}
	q := newQueue(t, admission.Config{}, clock.NewVirtual(t0), b)
	err := q.Admit(t.Context(), b.item("shed", admission.Item{Priority: -1}))
	if !errors.Is(err, admission.ErrShed) || !errors.Is(err, admission.ErrRejected) {
		t.Fatalf("Admit() = %v, want ErrShed", err)
	}
	if got := b.admitted(); len(got) != 0 {
		t.Fatalf("OnAdmit ran for a shed request: %v", got)
	}
	if s := q.Stats(); s.Shed != 1 || s.Depth != 0 {
		t.Fatalf("Stats() = %+v", s)
	}
}

func TestOrder(t *testing.T) {
	t.Parallel()
	type entry struct {
		name    string
		arrival time.Duration // after t0
		head    time.Duration
		cost    float64
		slo     time.Duration // deadline = arrival + slo; 0: none
	}
	tests := []struct {
		name    string
		policy  admission.Policy
		entries []entry // enqueued in this order
		want    []string
	}{
		{
			name:    "fcfs by arrival",
			policy:  admission.PolicyFCFS,
			entries: []entry{{name: "b", arrival: time.Second}, {name: "c", arrival: 2 * time.Second}, {name: "a"}},
			want:    []string{"a", "b", "c"},
		},
		{
			name:   "fcfs head start moves arrival earlier",
			policy: admission.PolicyFCFS,
			entries: []entry{
				{name: "a"}, {name: "b", arrival: time.Second},
				{name: "c", arrival: 3 * time.Second, head: 5 * time.Second}, // effective −2 s
			},
			want: []string{"c", "a", "b"},
		},
		{
			name:    "fcfs fractional latency sensitivity",
			policy:  admission.PolicyFCFS,
			entries: []entry{{name: "a"}, {name: "b", arrival: time.Second, head: 1500 * time.Millisecond}},
			want:    []string{"b", "a"},
		},
		{
			name:    "fcfs negative head start counts as zero",
			policy:  admission.PolicyFCFS,
			entries: []entry{{name: "a", head: -5 * time.Second}, {name: "b", arrival: time.Second}},
			want:    []string{"a", "b"},
		},
		{
			name:    "fcfs ties keep enqueue order",
			policy:  admission.PolicyFCFS,
			entries: []entry{{name: "x", arrival: time.Second}, {name: "y", arrival: time.Second}, {name: "z", head: 0, arrival: time.Second}},
			want:    []string{"x", "y", "z"},
		},
		{
			name:   "fcfs ties broken by objective deadline, none last",
			policy: admission.PolicyFCFS,
			entries: []entry{
				{name: "none", arrival: time.Second}, {name: "late", arrival: time.Second, slo: time.Second},
				{name: "soon", arrival: time.Second, slo: 100 * time.Millisecond}, {name: "early", slo: 10 * time.Second},
			},
			want: []string{"early", "soon", "late", "none"},
		},
		{
			name:   "fcfs deadline never beats a head start",
			policy: admission.PolicyFCFS,
			entries: []entry{
				{name: "slo", slo: time.Millisecond}, {name: "prio", arrival: time.Second, head: 2 * time.Second},
			},
			want: []string{"prio", "slo"},
		},
		{
			name:    "fcfs ignores cost",
			policy:  admission.PolicyFCFS,
			entries: []entry{{name: "long", cost: 10000}, {name: "short", arrival: time.Second, cost: 1}},
			want:    []string{"long", "short"},
		},
		{
			name:    "wspt shortest first",
			policy:  admission.PolicyWSPT,
			entries: []entry{{name: "a", cost: 1000}, {name: "b", cost: 100}, {name: "c", cost: 500}},
			want:    []string{"b", "c", "a"},
		},
		{
			name:   "wspt weight is one plus head start seconds",
			policy: admission.PolicyWSPT,
			entries: []entry{
				{name: "a", cost: 100},                        // 1/100 = 0.010
				{name: "b", cost: 300, head: 5 * time.Second}, // 6/300 = 0.020
				{name: "c", cost: 150},                        // 1/150 ≈ 0.0067
			},
			want: []string{"b", "a", "c"},
		},
		{
			name:   "wspt cost below one counts as one, ties by effective arrival",
			policy: admission.PolicyWSPT,
			entries: []entry{
				{name: "a", arrival: 2 * time.Second, cost: 0},
				{name: "b", arrival: time.Second, cost: 0.5},
				{name: "c", cost: math.NaN()},
				{name: "d", cost: 2},
			},
			want: []string{"c", "b", "a", "d"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := &budget{}
			q := newQueue(t, admission.Config{Policy: tt.policy}, clock.NewVirtual(t0), b)
			var results []<-chan error
			for i, e := range tt.entries {
				it := admission.Item{Arrival: t0.Add(e.arrival), HeadStart: e.head, Cost: e.cost}
				if e.slo > 0 {
					it.Deadline = it.Arrival.Add(e.slo)
				}
				results = append(results, admitAsync(t.Context(), q, b.item(e.name, it)))
				waitDepth(t, q, i+1) // enqueue order is deterministic
			}
			b.give(len(tt.entries))
			q.Wake()
			for _, ch := range results {
				if err := result(t, ch); err != nil {
					t.Fatalf("Admit() = %v", err)
				}
			}
			if got := b.admitted(); strings.Join(got, ",") != strings.Join(tt.want, ",") {
				t.Fatalf("admitted %v, want %v", got, tt.want)
			}
			if s := q.Stats(); s.AdmittedAfterWait != uint64(len(tt.entries)) || s.Depth != 0 {
				t.Fatalf("Stats() = %+v", s)
			}
		})
	}
}

func TestWakeAdmitsWhileNotSaturated(t *testing.T) {
	t.Parallel()
	b := &budget{}
	var waits []time.Duration
	var mu sync.Mutex
	vc := clock.NewVirtual(t0)
	q := newQueue(t, admission.Config{OnWait: func(d time.Duration) {
		mu.Lock()
		waits = append(waits, d)
		mu.Unlock()
	}}, vc, b)
	a := admitAsync(t.Context(), q, b.item("a", admission.Item{}))
	waitDepth(t, q, 1)
	bb := admitAsync(t.Context(), q, b.item("b", admission.Item{}))
	waitDepth(t, q, 2)
	c := admitAsync(t.Context(), q, b.item("c", admission.Item{}))
	waitDepth(t, q, 3)

	q.Wake() // still saturated: nothing happens
	pending(t, a)

	vc.Step(2 * time.Second)
	b.give(2)
	q.Wake()
	if err := result(t, a); err != nil {
		t.Fatal(err)
	}
	if err := result(t, bb); err != nil {
		t.Fatal(err)
	}
	pending(t, c)
	if s := q.Stats(); s.Depth != 1 || s.AdmittedAfterWait != 2 {
		t.Fatalf("Stats() = %+v", s)
	}

	vc.Step(time.Second)
	b.give(1)
	q.Wake()
	if err := result(t, c); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(b.admitted(), ","); got != "a,b,c" {
		t.Fatalf("admitted %s", got)
	}
	// The max-wait timers of admitted requests are stopped.
	if at, ok := vc.NextAt(); ok {
		t.Fatalf("timer still pending at %v", at)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(waits) != 3 || waits[0] != 2*time.Second || waits[1] != 2*time.Second || waits[2] != 3*time.Second {
		t.Fatalf("OnWait got %v, want [2s 2s 3s]", waits)
	}
}

// Fairness: a newcomer that finds room but a non-empty queue (Wake not yet
// called) lets the queued requests go first.
func TestNewcomerDoesNotOvertake(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name      string
		room      int // room given before the newcomer arrives
		priority  int
		wantErr   error
		wantOrder string
		wantDepth int
	}{
		{name: "room for the queued one only: newcomer queues", room: 1, wantOrder: "queued", wantDepth: 1},
		{name: "room for both: queued first, newcomer immediate", room: 2, wantOrder: "queued,new", wantDepth: 0},
		{name: "sheddable newcomer shed after the drain", room: 1, priority: -1, wantErr: admission.ErrShed, wantOrder: "queued"},
		{name: "urgent newcomer still behind the queued one", room: 1, priority: 9, wantOrder: "queued", wantDepth: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := &budget{}
			q := newQueue(t, admission.Config{}, clock.NewVirtual(t0), b)
			queued := admitAsync(t.Context(), q, b.item("queued", admission.Item{}))
			waitDepth(t, q, 1)
			b.give(tt.room) // capacity freed, but nobody called Wake

			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			newcomer := admitAsync(ctx, q, b.item("new", admission.Item{Priority: tt.priority, HeadStart: time.Duration(max(tt.priority, 0)) * time.Second}))
			if err := result(t, queued); err != nil {
				t.Fatal(err)
			}
			if tt.wantDepth == 1 {
				waitDepth(t, q, 1)
				pending(t, newcomer)
				cancel()
				if err := result(t, newcomer); !errors.Is(err, context.Canceled) {
					t.Fatalf("newcomer = %v, want context.Canceled", err)
				}
			} else if err := result(t, newcomer); !errors.Is(err, tt.wantErr) {
				t.Fatalf("newcomer = %v, want %v", err, tt.wantErr)
			}
			if got := strings.Join(b.admitted(), ","); got != tt.wantOrder {
				t.Fatalf("admitted %s, want %s", got, tt.wantOrder)
			}
		})
	}
}

func TestQueueFull(t *testing.T) {
	t.Parallel()
	b := &budget{}
	q := newQueue(t, admission.Config{MaxQueued: 2}, clock.NewVirtual(t0), b)
	ctx, cancel := context.WithCancel(t.Context())
	r1 := admitAsync(ctx, q, admission.Item{})
	r2 := admitAsync(ctx, q, admission.Item{})
	waitDepth(t, q, 2)
	err := q.Admit(t.Context(), admission.Item{Priority: 3})
	if !errors.Is(err, admission.ErrQueueFull) || !errors.Is(err, admission.ErrRejected) {
		t.Fatalf("Admit() = %v, want ErrQueueFull", err)
	}
	cancel()
	for _, r := range []<-chan error{r1, r2} {
		if err := result(t, r); !errors.Is(err, context.Canceled) {
			t.Fatalf("waiter = %v", err)
		}
	}
	if s := q.Stats(); s.Full != 1 || s.Cancelled != 2 || s.Depth != 0 {
		t.Fatalf("Stats() = %+v", s)
	}
}

func TestMaxWaitOnVirtualClock(t *testing.T) {
	t.Parallel()
	vc := clock.NewVirtual(t0)
	b := &budget{}
	waits := make(chan time.Duration, 4)
	q := newQueue(t, admission.Config{MaxWait: 10 * time.Second, OnWait: func(d time.Duration) { waits <- d }}, vc, b)

	a := admitAsync(t.Context(), q, b.item("a", admission.Item{}))
	waitDepth(t, q, 1)
	vc.Step(9 * time.Second)
	pending(t, a)
	later := admitAsync(t.Context(), q, b.item("later", admission.Item{}))
	waitDepth(t, q, 2)

	vc.Step(time.Second) // a's 10 s are up, later's are not
	if err := result(t, a); !errors.Is(err, admission.ErrWaitExceeded) || !errors.Is(err, admission.ErrRejected) {
		t.Fatalf("a = %v, want ErrWaitExceeded", err)
	}
	if d := <-waits; d != 10*time.Second {
		t.Fatalf("a waited %v", d)
	}
	pending(t, later)
	vc.Step(9 * time.Second)
	if err := result(t, later); !errors.Is(err, admission.ErrWaitExceeded) {
		t.Fatalf("later = %v, want ErrWaitExceeded", err)
	}
	if d := <-waits; d != 10*time.Second {
		t.Fatalf("later waited %v", d)
	}
	if s := q.Stats(); s.TimedOut != 2 || s.Depth != 0 {
		t.Fatalf("Stats() = %+v", s)
	}
	if got := b.admitted(); len(got) != 0 {
		t.Fatalf("OnAdmit ran for timed-out requests: %v", got)
	}
}

func TestCancelRemovesWaiter(t *testing.T) {
	t.Parallel()
	vc := clock.NewVirtual(t0)
	b := &budget{}
	var waited atomic.Int64
	q := newQueue(t, admission.Config{OnWait: func(d time.Duration) { waited.Store(int64(d)) }}, vc, b)
	ctx, cancel := context.WithCancel(t.Context())
	r := admitAsync(ctx, q, b.item("gone", admission.Item{}))
	waitDepth(t, q, 1)
	vc.Step(time.Second)
	cancel()
	if err := result(t, r); !errors.Is(err, context.Canceled) {
		t.Fatalf("Admit() = %v, want context.Canceled", err)
	}
	if s := q.Stats(); s.Depth != 0 || s.Cancelled != 1 {
		t.Fatalf("Stats() = %+v", s)
	}
	if _, ok := vc.NextAt(); ok {
		t.Fatal("the cancelled waiter's timer is still pending")
	}
	if time.Duration(waited.Load()) != time.Second {
		t.Fatalf("OnWait = %v, want 1s", time.Duration(waited.Load()))
	}
	b.give(1)
	q.Wake()
	if got := b.admitted(); len(got) != 0 {
		t.Fatalf("a cancelled waiter was admitted: %v", got)
	}

	// A context that is already done is not queued.
	done, cancelDone := context.WithCancel(t.Context())
	cancelDone()
	b2 := &budget{}
	q2 := newQueue(t, admission.Config{}, vc, b2)
	if err := q2.Admit(done, admission.Item{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Admit(done ctx) = %v", err)
	}
	if s := q2.Stats(); s.Depth != 0 || s.Cancelled != 1 {
		t.Fatalf("Stats() = %+v", s)
	}
}

func TestDeadlineOnRealClock(t *testing.T) {
	t.Parallel()
	q := newQueue(t, admission.Config{MaxWait: time.Hour}, nil, admission.SaturationFunc(func() bool { return true }))
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Millisecond)
	defer cancel()
	if err := q.Admit(ctx, admission.Item{}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Admit() = %v, want DeadlineExceeded", err)
	}
	if s := q.Stats(); s.Depth != 0 || s.Cancelled != 1 {
		t.Fatalf("Stats() = %+v", s)
	}
}

// Many goroutines admit while another toggles saturation and wakes the
// queue; every Admit ends in exactly one counter and nothing is left queued.
func TestConcurrentAdmitWake(t *testing.T) {
	t.Parallel()
	for _, policy := range []admission.Policy{admission.PolicyFCFS, admission.PolicyWSPT} {
		t.Run(string(policy), func(t *testing.T) {
			t.Parallel()
			var saturated atomic.Bool
			var onAdmit, onWait atomic.Int64
			q := newQueue(t, admission.Config{
				Policy: policy, MaxWait: 5 * time.Millisecond, MaxQueued: 16,
				OnWait: func(time.Duration) { onWait.Add(1) },
			}, nil, admission.SaturationFunc(saturated.Load))

			stop := make(chan struct{})
			toggled := make(chan struct{})
			go func() {
				defer close(toggled)
				rng := rand.New(rand.NewPCG(1, 2))
				for {
					select {
					case <-stop:
						return
					default:
					}
					saturated.Store(rng.IntN(3) > 0)
					q.Wake()
					time.Sleep(time.Duration(rng.IntN(50)) * time.Microsecond)
				}
			}()

			const workers, perWorker = 32, 40
			var ok, shed, full, waited, cancelled atomic.Int64
			var wg sync.WaitGroup
			for w := range workers {
				wg.Go(func() {
					rng := rand.New(rand.NewPCG(uint64(w), 7))
					for range perWorker {
						ctx, cancel := context.WithTimeout(t.Context(), time.Duration(rng.IntN(6000))*time.Microsecond)
						prio := rng.IntN(5) - 1
						err := q.Admit(ctx, admission.Item{
							Priority:  prio,
							HeadStart: time.Duration(max(prio, 0)) * time.Second,
							Cost:      float64(1 + rng.IntN(4096)),
							OnAdmit:   func() { onAdmit.Add(1) },
						})
						cancel()
						switch {
						case err == nil:
							ok.Add(1)
						case errors.Is(err, admission.ErrShed):
							shed.Add(1)
						case errors.Is(err, admission.ErrQueueFull):
							full.Add(1)
						case errors.Is(err, admission.ErrWaitExceeded):
							waited.Add(1)
						case errors.Is(err, context.DeadlineExceeded):
							cancelled.Add(1)
						default:
							t.Errorf("Admit() = %v", err)
						}
					}
				})
			}
			wg.Wait()
			close(stop)
			<-toggled

			s := q.Stats()
			total := int64(workers * perWorker)
			if got := ok.Load() + shed.Load() + full.Load() + waited.Load() + cancelled.Load(); got != total {
				t.Fatalf("%d results, want %d", got, total)
			}
			if int64(s.AdmittedImmediately+s.AdmittedAfterWait) != ok.Load() || onAdmit.Load() != ok.Load() ||
				int64(s.Shed) != shed.Load() || int64(s.Full) != full.Load() ||
				int64(s.TimedOut) != waited.Load() || int64(s.Cancelled) != cancelled.Load() || s.Depth != 0 {
				t.Fatalf("Stats() = %+v; ok=%d onAdmit=%d shed=%d full=%d waited=%d cancelled=%d",
					s, ok.Load(), onAdmit.Load(), shed.Load(), full.Load(), waited.Load(), cancelled.Load())
			}
			if onWait.Load() > int64(s.AdmittedAfterWait+s.TimedOut+s.Cancelled) {
				t.Fatalf("OnWait ran %d times for %d queued requests", onWait.Load(), s.AdmittedAfterWait+s.TimedOut+s.Cancelled)
			}
			t.Logf("%+v", s)
		})
	}
}

// BenchmarkAdmit measures the caller's cost of Admit when nobody waits.
//
//	go test -run '^$' -bench Admit -benchmem ./routing/admission/
func BenchmarkAdmit(b *testing.B) {
	notSaturated := admission.SaturationFunc(func() bool { return false })
	saturated := admission.SaturationFunc(func() bool { return true })
	cases := []struct {
		name string
		cfg  admission.Config
		sat  admission.Saturation
		item admission.Item
		want error
	}{
		{name: "disabled", cfg: admission.Config{}},
		{name: "not_saturated", cfg: admission.Config{Threshold: 1}, sat: notSaturated},
		{name: "shed", cfg: admission.Config{Threshold: 1}, sat: saturated, item: admission.Item{Priority: -1}, want: admission.ErrShed},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			q, err := admission.New(c.cfg, clock.NewVirtual(t0), c.sat)
			if err != nil {
				b.Fatal(err)
			}
			ctx := b.Context()
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := q.Admit(ctx, c.item); err != c.want {
						b.Errorf("Admit() = %v", err)
						return
					}
				}
			})
		})
	}
}
