package leader

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	coordclient "k8s.io/client-go/kubernetes/typed/coordination/v1"
)

// fakeAPI is an in-memory Lease store with resourceVersion checks and an
// outage switch. Only Get, Create and Update are implemented.
type fakeAPI struct {
	mu    sync.Mutex
	lease *coordinationv1.Lease
	rv    int
	down  bool
}

var errDown = errors.New("connection refused")

var leaseGR = schema.GroupResource{Group: "coordination.k8s.io", Resource: "leases"}

func (f *fakeAPI) Leases(string) coordclient.LeaseInterface { return fakeLeases{f: f} }

func (f *fakeAPI) setDown(v bool) { f.mu.Lock(); f.down = v; f.mu.Unlock() }

// put replaces the stored Lease (another replica's write).
func (f *fakeAPI) put(l *coordinationv1.Lease) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.rv++
	l = l.DeepCopy()
	l.ResourceVersion = strconv.Itoa(f.rv)
	f.lease = l
}

func (f *fakeAPI) get() *coordinationv1.Lease {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.lease == nil {
		return nil
	}
	return f.lease.DeepCopy()
}

type fakeLeases struct {
	coordclient.LeaseInterface // nil: other methods panic
	f                          *fakeAPI
}

func (c fakeLeases) Get(_ context.Context, name string, _ metav1.GetOptions) (*coordinationv1.Lease, error) {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	if c.f.down {
		return nil, errDown
	}
	if c.f.lease == nil {
		return nil, apierrors.NewNotFound(leaseGR, name)
	}
	return c.f.lease.DeepCopy(), nil
}

func (c fakeLeases) Create(_ context.Context, l *coordinationv1.Lease, _ metav1.CreateOptions) (*coordinationv1.Lease, error) {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	if c.f.down {
		return nil, errDown
	}
	if c.f.lease != nil {
		return nil, apierrors.NewAlreadyExists(leaseGR, l.Name)
	}
	c.f.rv++
	l = l.DeepCopy()
	l.ResourceVersion = strconv.Itoa(c.f.rv)
	c.f.lease = l
	return l.DeepCopy(), nil
}

func (c fakeLeases) Update(_ context.Context, l *coordinationv1.Lease, _ metav1.UpdateOptions) (*coordinationv1.Lease, error) {
	c.f.mu.Lock()
	defer c.f.mu.Unlock()
	if c.f.down {
		return nil, errDown
	}
	if c.f.lease == nil {
		return nil, apierrors.NewNotFound(leaseGR, l.Name)
	}
	if l.ResourceVersion != c.f.lease.ResourceVersion {
		return nil, apierrors.NewConflict(leaseGR, l.Name, errors.New("resourceVersion mismatch"))
	}
	c.f.rv++
	l = l.DeepCopy()
	l.ResourceVersion = strconv.Itoa(c.f.rv)
	c.f.lease = l
	return l.DeepCopy(), nil
}

// fakeClock is a settable clock.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) Now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *fakeClock) Add(d time.Duration) { c.mu.Lock(); c.t = c.t.Add(d); c.mu.Unlock() }

func newFakeElector(t *testing.T, api *fakeAPI, clk *fakeClock, id string) *Elector {
	t.Helper()
	e, err := New(Config{Namespace: "ns", Name: "kvbandit", Identity: id}, Deps{Leases: api, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func foreign(id string, renew time.Time) *coordinationv1.Lease {
	t := metav1.NewMicroTime(renew)
	return &coordinationv1.Lease{
		ObjectMeta: metav1.ObjectMeta{Name: "kvbandit", Namespace: "ns"},
		Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr(id), LeaseDurationSeconds: ptr(int32(15)), RenewTime: &t, AcquireTime: &t},
	}
}

// The attempts below are driven step by step (tryAcquireOrRenew) with a
// fake clock: the rule without waiting for real time.

func TestFakeOneLeader(t *testing.T) {
	api, clk := &fakeAPI{}, &fakeClock{t: time.Unix(1e6, 0)}
	a, b := newFakeElector(t, api, clk, "a"), newFakeElector(t, api, clk, "b")
	for range 5 {
		a.tryAcquireOrRenew(t.Context())
		b.tryAcquireOrRenew(t.Context())
		clk.Add(DefaultRetryPeriod)
	}
	if !a.Leading() || b.Leading() {
		t.Fatalf("a leading %v, b leading %v; want a only", a.Leading(), b.Leading())
	}
}

func TestFakeOutageNeverDemotes(t *testing.T) {
	api, clk := &fakeAPI{}, &fakeClock{t: time.Unix(1e6, 0)}
	a, b := newFakeElector(t, api, clk, "a"), newFakeElector(t, api, clk, "b")
	a.tryAcquireOrRenew(t.Context())
	b.tryAcquireOrRenew(t.Context())
	api.setDown(true)
	for range 30 { // 60 s, four lease durations
		clk.Add(DefaultRetryPeriod)
		a.tryAcquireOrRenew(t.Context())
		b.tryAcquireOrRenew(t.Context())
		if !a.Leading() || b.Leading() {
			t.Fatalf("during the outage: a leading %v, b leading %v", a.Leading(), b.Leading())
		}
	}
	api.setDown(false)
	// The standby reads first after the outage: the Lease looks expired by
	// renewTime, but b has not watched it for a lease duration yet.
	clk.Add(DefaultRetryPeriod)
	b.tryAcquireOrRenew(t.Context())
	a.tryAcquireOrRenew(t.Context())
	for range 10 {
		clk.Add(DefaultRetryPeriod)
		b.tryAcquireOrRenew(t.Context())
		a.tryAcquireOrRenew(t.Context())
		if !a.Leading() || b.Leading() {
			t.Fatalf("after the outage: a leading %v, b leading %v", a.Leading(), b.Leading())
		}
	}
}

func TestFakeForeignValidLeaseDemotes(t *testing.T) {
	api, clk := &fakeAPI{}, &fakeClock{t: time.Unix(1e6, 0)}
	a := newFakeElector(t, api, clk, "a")
	a.tryAcquireOrRenew(t.Context())
	if !a.Leading() {
		t.Fatal("a does not lead an empty Lease")
	}
	// b took the Lease over (a partition a could not see through).
	api.put(foreign("b", clk.Now()))
	clk.Add(DefaultRetryPeriod)
	a.tryAcquireOrRenew(t.Context())
	if a.Leading() {
		t.Fatal("a still leads after seeing b's valid Lease")
	}
}

func TestFakeExpiredForeignTakenOver(t *testing.T) {
	api, clk := &fakeAPI{}, &fakeClock{t: time.Unix(1e6, 0)}
	api.put(foreign("b", clk.Now()))
	a := newFakeElector(t, api, clk, "a")
	for clk.Now().Before(time.Unix(1e6, 0).Add(DefaultLeaseDuration)) {
		a.tryAcquireOrRenew(t.Context())
		if a.Leading() {
			t.Fatalf("a took a valid Lease at %v", clk.Now())
		}
		clk.Add(DefaultRetryPeriod)
	}
	a.tryAcquireOrRenew(t.Context())
	clk.Add(DefaultRetryPeriod)
	a.tryAcquireOrRenew(t.Context())
	if !a.Leading() {
		t.Fatal("a did not take over the expired Lease")
	}
	if l := api.get(); holder(l) != "a" || *l.Spec.LeaseTransitions != 1 {
		t.Fatalf("Lease holder %q transitions %d", holder(l), *l.Spec.LeaseTransitions)
	}
}

func TestFakeSkewedClockStillValid(t *testing.T) {
	// b's clock is 1 min behind: its renewTime looks expired to a, but a
	// sees the record change every renewal, so it stays standby.
	api, clk := &fakeAPI{}, &fakeClock{t: time.Unix(1e6, 0)}
	a := newFakeElector(t, api, clk, "a")
	for range 20 {
		api.put(foreign("b", clk.Now().Add(-time.Minute)))
		a.tryAcquireOrRenew(t.Context())
		if a.Leading() {
			t.Fatal("a took a Lease that b keeps renewing")
		}
		clk.Add(DefaultRetryPeriod)
	}
}

func TestFakeReleaseLetsStandbyLead(t *testing.T) {
	api, clk := &fakeAPI{}, &fakeClock{t: time.Unix(1e6, 0)}
	a, b := newFakeElector(t, api, clk, "a"), newFakeElector(t, api, clk, "b")
	a.tryAcquireOrRenew(t.Context())
	b.tryAcquireOrRenew(t.Context())
	a.release()
	if a.Leading() {
		t.Fatal("a leads after releasing")
	}
	b.tryAcquireOrRenew(t.Context())
	if !b.Leading() {
		t.Fatalf("b does not take a released Lease: %+v", api.get().Spec)
	}
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{Namespace: "n", Name: "l", Identity: "i"}).Validate(); err != nil {
		t.Fatal(err)
	}
	if err := (Config{}).Validate(); err == nil {
		t.Fatal("empty config accepted")
	}
	if err := (Config{Namespace: "n", Name: "l", Identity: "i", LeaseDuration: 2 * time.Second, RetryPeriod: 2 * time.Second}).Validate(); err == nil {
		t.Fatal("retry >= lease duration accepted")
	}
}
