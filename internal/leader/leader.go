// Package leader provides active-passive leader election on a Kubernetes
// coordination.k8s.io/v1 Lease, for running several `kvbandit serve`
// replicas of which only the leader is ready (as GIE's endpoint picker does
// with --ha-enable-leader-election).
//
// # The rule
//
// Failing to renew the Lease never demotes a replica: during an API-server
// outage the leader keeps leading (and stays ready) however long it lasts. A
// replica stops leading only when a successful read shows another identity
// holding a Lease that is still valid. This differs from
// k8s.io/client-go/tools/leaderelection, which stops leading when renewal
// fails for RenewDeadline; the loop here is a small Get/Create/Update on the
// Lease with optimistic concurrency (resourceVersion), so that rule is easy
// to see and to test.
//
// # Validity
//
// A Lease held by another identity is valid while renewTime+leaseDuration
// is in the future by the reader's clock, or while the reader saw the Lease
// record change less than leaseDuration ago (its own clock only, as
// client-go's observedTime does). The second clause keeps clock skew between
// replicas from making a live leader look expired, and means that after an
// API-server outage the holder, which retries every RetryPeriod, renews its
// own Lease before a standby that has not yet watched the Lease for a full
// leaseDuration can take it. A Lease with no holder (released) is free at
// once.
//
// # Lifecycle
//
// [Elector.Run] tries to acquire or renew every RetryPeriod until its
// context ends, then releases the Lease if it holds it (holder cleared) so a
// standby takes over within one RetryPeriod.
package leader

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coordclient "k8s.io/client-go/kubernetes/typed/coordination/v1"
)

// Defaults, as client-go's and GIE's.
const (
	DefaultLeaseDuration = 15 * time.Second
	DefaultRenewDeadline = 10 * time.Second
	DefaultRetryPeriod   = 2 * time.Second
)

// Config names the Lease and sets the timings.
type Config struct {
	Namespace string
	Name      string
	Identity  string
	// LeaseDuration is how long a Lease stays valid after its renewTime.
	LeaseDuration time.Duration
	// RenewDeadline: after failing to renew for this long the leader logs
	// a warning (once per outage). It keeps leading: see the package doc.
	RenewDeadline time.Duration
	// RetryPeriod is the interval between attempts, and each API call's
	// timeout.
	RetryPeriod time.Duration
}

func (c *Config) defaults() {
	if c.LeaseDuration <= 0 {
		c.LeaseDuration = DefaultLeaseDuration
	}
	if c.RenewDeadline <= 0 {
		c.RenewDeadline = DefaultRenewDeadline
	}
	if c.RetryPeriod <= 0 {
		c.RetryPeriod = DefaultRetryPeriod
	}
}

// Validate checks the configuration.
func (c Config) Validate() error {
	var errs []error
	if c.Namespace == "" {
		errs = append(errs, errors.New("leader election: namespace is empty"))
	}
	if c.Name == "" {
		errs = append(errs, errors.New("leader election: lease name is empty"))
	}
	if c.Identity == "" {
		errs = append(errs, errors.New("leader election: identity is empty"))
	}
	c.defaults()
	if c.LeaseDuration < time.Second {
		errs = append(errs, errors.New("leader election: lease duration must be >= 1s"))
	}
	if c.RetryPeriod >= c.LeaseDuration {
		errs = append(errs, errors.New("leader election: retry period must be shorter than the lease duration"))
	}
	return errors.Join(errs...)
}

// Deps are the injected dependencies; nil fields get defaults except
// Leases.
type Deps struct {
	// Leases is the typed coordination/v1 client (required).
	Leases coordclient.LeasesGetter
	Logger *slog.Logger // nil: slog.Default()
	// Registry receives kvbandit_leader and
	// kvbandit_lease_renew_failures_total; nil: not exported.
	Registry prometheus.Registerer
	Now      func() time.Time // nil: time.Now
	// After waits between attempts; nil: time.After. Tests with a fake
	// clock can make it advance the clock.
	After func(time.Duration) <-chan time.Time
	// OnChange is called (from Run's goroutine) each time leading changes.
	OnChange func(leading bool)
}

// Elector runs the election for one identity.
type Elector struct {
	cfg  Config
	d    Deps
	log  *slog.Logger
	now  func() time.Time
	wait func(time.Duration) <-chan time.Time

	leading  atomic.Bool
	leaderG  prometheus.Gauge
	failures prometheus.Counter

	mu sync.Mutex // guards the fields below (only Run's goroutine writes)
	// the last Lease read or written, and when its resourceVersion was
	// first seen by this replica's clock
	last       *coordinationv1.Lease
	observedAt time.Time
	// the time of the last successful renewal, and whether the current
	// outage was already logged
	renewedAt   time.Time
	warnedStale bool
}

// New checks cfg and builds an Elector; it does not contact the API server.
func New(cfg Config, d Deps) (*Elector, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.defaults()
	if d.Leases == nil {
		return nil, errors.New("leader election: no Lease client")
	}
	e := &Elector{cfg: cfg, d: d, log: d.Logger, now: d.Now, wait: d.After}
	if e.log == nil {
		e.log = slog.Default()
	}
	e.log = e.log.With("lease", cfg.Namespace+"/"+cfg.Name, "identity", cfg.Identity)
	if e.now == nil {
		e.now = time.Now
	}
	if e.wait == nil {
		e.wait = time.After
	}
	e.leaderG = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvbandit_leader", Help: "1 while this replica holds the leader Lease (and is ready), 0 otherwise."})
	e.failures = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvbandit_lease_renew_failures_total", Help: "Failed attempts to renew the leader Lease while leading (the replica keeps leading)."})
	if d.Registry != nil {
		if err := d.Registry.Register(e.leaderG); err != nil {
			return nil, fmt.Errorf("leader election metrics: %w", err)
		}
		if err := d.Registry.Register(e.failures); err != nil {
			return nil, fmt.Errorf("leader election metrics: %w", err)
		}
	}
	return e, nil
}

// Leading reports whether this replica currently leads.
func (e *Elector) Leading() bool { return e.leading.Load() }

// Identity returns the identity the elector runs as.
func (e *Elector) Identity() string { return e.cfg.Identity }

// Run tries to acquire, then keeps renewing, the Lease every RetryPeriod
// until ctx ends; then, if leading, it releases the Lease and stops
// leading. It returns nil when ctx ends.
func (e *Elector) Run(ctx context.Context) error {
	e.log.Info("leader election: starting", "lease_duration", e.cfg.LeaseDuration, "retry", e.cfg.RetryPeriod)
	for {
		e.tryAcquireOrRenew(ctx)
		select {
		case <-ctx.Done():
			e.release()
			return nil
		case <-e.wait(e.cfg.RetryPeriod):
		}
	}
}

// RunWithoutRelease is Run, except that it stops without releasing the
// Lease (a crashed leader; tests).
func (e *Elector) RunWithoutRelease(ctx context.Context) error {
	for {
		e.tryAcquireOrRenew(ctx)
		select {
		case <-ctx.Done():
			e.setLeading(false, "stopped without releasing")
			return nil
		case <-e.wait(e.cfg.RetryPeriod):
		}
	}
}

func (e *Elector) setLeading(v bool, why string) {
	if e.leading.Swap(v) == v {
		return
	}
	if v {
		e.leaderG.Set(1)
		e.log.Info("leader election: leading", "why", why)
	} else {
		e.leaderG.Set(0)
		e.log.Info("leader election: not leading", "why", why)
	}
	if e.d.OnChange != nil {
		e.d.OnChange(v)
	}
}

// observe records a Lease read or written, restarting the observation clock
// when its resourceVersion changed.
func (e *Elector) observe(l *coordinationv1.Lease, now time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.last == nil || e.last.ResourceVersion != l.ResourceVersion {
		e.observedAt = now
	}
	e.last = l
}

// validForeign reports whether l, held by another identity, is still valid
// (see the package doc).
func (e *Elector) validForeign(l *coordinationv1.Lease, now time.Time) bool {
	if holder(l) == "" {
		return false
	}
	d := e.cfg.LeaseDuration
	if l.Spec.LeaseDurationSeconds != nil {
		d = time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second
	}
	if l.Spec.RenewTime != nil && l.Spec.RenewTime.Add(d).After(now) {
		return true
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return now.Sub(e.observedAt) < d
}

func holder(l *coordinationv1.Lease) string {
	if l.Spec.HolderIdentity == nil {
		return ""
	}
	return *l.Spec.HolderIdentity
}

func (e *Elector) leases() coordclient.LeaseInterface {
	return e.d.Leases.Leases(e.cfg.Namespace)
}

// renewFailed counts a failed attempt while leading and keeps leading.
func (e *Elector) renewFailed(now time.Time, err error) {
	if !e.Leading() {
		e.log.Debug("leader election: cannot read the Lease; staying standby", "err", err)
		return
	}
	e.failures.Inc()
	e.mu.Lock()
	stale := now.Sub(e.renewedAt) >= e.cfg.RenewDeadline && !e.warnedStale
	if stale {
		e.warnedStale = true
	}
	since := e.renewedAt
	e.mu.Unlock()
	if stale {
		e.log.Warn("leader election: cannot renew the Lease; still leading until another replica is seen holding it", "since", since, "err", err)
	} else {
		e.log.Debug("leader election: renewal failed; still leading", "err", err)
	}
}

func (e *Elector) renewed(now time.Time) {
	e.mu.Lock()
	if e.warnedStale {
		e.log.Info("leader election: renewing the Lease again")
	}
	e.renewedAt, e.warnedStale = now, false
	e.mu.Unlock()
}

// tryAcquireOrRenew makes one attempt. Only a read showing another
// identity's valid Lease demotes; errors leave the state as it was.
func (e *Elector) tryAcquireOrRenew(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.RetryPeriod)
	defer cancel()
	now := e.now()
	l, err := e.leases().Get(ctx, e.cfg.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		l = e.newLease(now)
		created, err := e.leases().Create(ctx, l, metav1.CreateOptions{})
		if err != nil {
			e.renewFailed(now, fmt.Errorf("create: %w", err))
			return
		}
		e.observe(created, now)
		e.renewed(now)
		e.setLeading(true, "created the Lease")
		return
	case err != nil:
		// What happened meanwhile is unknown: the observation clock
		// restarts with the next successful read.
		e.mu.Lock()
		e.last = nil
		e.mu.Unlock()
		e.renewFailed(now, fmt.Errorf("get: %w", err))
		return
	}
	e.observe(l, now)
	h := holder(l)
	switch {
	case h == e.cfg.Identity:
		next := l.DeepCopy()
		t := metav1.NewMicroTime(now)
		next.Spec.RenewTime = &t
		next.Spec.LeaseDurationSeconds = ptr(int32(e.cfg.LeaseDuration / time.Second))
		if next.Spec.AcquireTime == nil {
			next.Spec.AcquireTime = &t
		}
		updated, err := e.leases().Update(ctx, next, metav1.UpdateOptions{})
		if err != nil {
			// A conflict means someone else wrote the Lease: the next read
			// tells whether they hold it.
			e.renewFailed(now, fmt.Errorf("renew: %w", err))
			return
		}
		e.observe(updated, now)
		e.renewed(now)
		e.setLeading(true, "holds the Lease")
	case e.validForeign(l, now):
		e.setLeading(false, "another replica holds a valid Lease: "+h)
	default:
		next := l.DeepCopy()
		nl := e.newLease(now)
		next.Spec = nl.Spec
		transitions := int32(1)
		if l.Spec.LeaseTransitions != nil {
			transitions = *l.Spec.LeaseTransitions + 1
		}
		next.Spec.LeaseTransitions = &transitions
		updated, err := e.leases().Update(ctx, next, metav1.UpdateOptions{})
		if err != nil {
			e.renewFailed(now, fmt.Errorf("acquire: %w", err))
			return
		}
		e.observe(updated, now)
		e.renewed(now)
		why := "acquired a released Lease"
		if h != "" {
			why = "acquired the expired Lease of " + h
		}
		e.setLeading(true, why)
	}
}

func (e *Elector) newLease(now time.Time) *coordinationv1.Lease {
	t := metav1.NewMicroTime(now)
	return &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: e.cfg.Name, Namespace: e.cfg.Namespace},
		Spec: coordinationv1.LeaseSpec{
			HolderIdentity:       ptr(e.cfg.Identity),
			LeaseDurationSeconds: ptr(int32(e.cfg.LeaseDuration / time.Second)),
			AcquireTime:          &t,
			RenewTime:            &t,
			LeaseTransitions:     ptr(int32(0)),
		},
	}
}

// release clears the holder if this replica holds the Lease, so that a
// standby takes over at its next attempt; it stops leading either way.
func (e *Elector) release() {
	if !e.Leading() {
		return
	}
	defer e.setLeading(false, "released the Lease")
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.RetryPeriod)
	defer cancel()
	for attempt := 0; attempt < 2; attempt++ {
		l, err := e.leases().Get(ctx, e.cfg.Name, metav1.GetOptions{})
		if err != nil {
			e.log.Warn("leader election: cannot release the Lease; a standby takes over when it expires", "err", err)
			return
		}
		if holder(l) != e.cfg.Identity {
			return
		}
		next := l.DeepCopy()
		now := metav1.NewMicroTime(e.now())
		next.Spec.HolderIdentity = nil
		next.Spec.RenewTime = &now
		next.Spec.LeaseDurationSeconds = ptr(int32(1))
		next.Spec.AcquireTime = nil
		if _, err = e.leases().Update(ctx, next, metav1.UpdateOptions{}); err == nil {
			return
		}
		if !apierrors.IsConflict(err) {
			e.log.Warn("leader election: cannot release the Lease; a standby takes over when it expires", "err", err)
			return
		}
	}
}

func ptr[T any](v T) *T { return &v }
