package leader

import (
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coordclient "k8s.io/client-go/kubernetes/typed/coordination/v1"

	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
)

// Short timings keep the real-API-server tests to seconds.
const (
	testLease = 3 * time.Second
	testRetry = 300 * time.Millisecond
	testNS    = "kvbandit-leader"
)

type running struct {
	e    *Elector
	reg  *prometheus.Registry
	stop context.CancelFunc
	done chan struct{}
}

// elect starts an elector for id on lease; release=false stops it like a
// crashed process (the Lease is left held).
func elect(t *testing.T, leases coordclient.LeasesGetter, lease, id string, release bool) *running {
	t.Helper()
	reg := prometheus.NewRegistry()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	e, err := New(Config{Namespace: testNS, Name: lease, Identity: id, LeaseDuration: testLease, RenewDeadline: time.Second, RetryPeriod: testRetry},
		Deps{Leases: leases, Logger: log, Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{e: e, reg: reg, stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		if release {
			_ = e.Run(ctx)
		} else {
			_ = e.RunWithoutRelease(ctx)
		}
	}()
	t.Cleanup(func() { cancel(); <-r.done })
	return r
}

func (r *running) halt() { r.stop(); <-r.done }

// eventually polls cond every 50 ms until it holds or d passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("after %v: %s", d, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return time.Since(start)
}

// steady checks cond every 50 ms for d.
func steady(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if !cond() {
			t.Fatalf("not %s", what)
		}
	}
}

func exactlyOne(rs ...*running) bool {
	n := 0
	for _, r := range rs {
		if r.e.Leading() {
			n++
		}
	}
	return n == 1
}

func getLease(t *testing.T, leases coordclient.LeasesGetter, name string) *coordinationv1.Lease {
	t.Helper()
	l, err := leases.Leases(testNS).Get(t.Context(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestKubeLease runs the election against a real kube-apiserver and etcd.
// The outage subtest kills the API server, so it runs last.
func TestKubeLease(t *testing.T) {
	c := kubeenv.Start(t)
	c.CreateNamespace(t, testNS)
	leases := c.Client(t).CoordinationV1()

	t.Run("TwoElectorsOneLeader", func(t *testing.T) {
		a, b := elect(t, leases, "one", "a", true), elect(t, leases, "one", "b", true)
		eventually(t, 5*time.Second, "no leader", func() bool { return exactlyOne(a, b) })
		steady(t, 2*testLease, "exactly one leader", func() bool { return exactlyOne(a, b) })
		want := "a"
		if b.e.Leading() {
			want = "b"
		}
		if h := holder(getLease(t, leases, "one")); h != want {
			t.Fatalf("Lease holder %q, leader %q", h, want)
		}
	})

	t.Run("ReleaseHandsOver", func(t *testing.T) {
		a := elect(t, leases, "release", "a", true)
		eventually(t, 5*time.Second, "a does not lead", a.e.Leading)
		b := elect(t, leases, "release", "b", true)
		steady(t, 3*testRetry, "b standby", func() bool { return !b.e.Leading() })
		a.halt()
		if a.e.Leading() {
			t.Fatal("a leads after its context ended")
		}
		if h := holder(getLease(t, leases, "release")); h == "a" {
			t.Fatal("a did not release the Lease")
		}
		took := eventually(t, 2*time.Second, "b did not take the released Lease", b.e.Leading)
		t.Logf("b leads %v after a released (lease duration %v)", took, testLease)
	})

	t.Run("ValidForeignLeaseStaysStandby", func(t *testing.T) {
		now := metav1.NewMicroTime(time.Now())
		_, err := leases.Leases(testNS).Create(t.Context(), &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: "foreign", Namespace: testNS},
			Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr("someone-else"), LeaseDurationSeconds: ptr(int32(3600)), RenewTime: &now, AcquireTime: &now},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		a := elect(t, leases, "foreign", "a", true)
		steady(t, 2*testLease, "a standby under a valid foreign Lease", func() bool { return !a.e.Leading() })
		if got := value(a.e.leaderG); got != 0 {
			t.Fatalf("kvbandit_leader %v, want 0", got)
		}
	})

	t.Run("ExpiredLeaseTakenOver", func(t *testing.T) {
		a := elect(t, leases, "expired", "a", false)
		eventually(t, 5*time.Second, "a does not lead", a.e.Leading)
		b := elect(t, leases, "expired", "b", true)
		steady(t, 2*testRetry, "b standby", func() bool { return !b.e.Leading() })
		a.halt() // crashed: the Lease still names a
		l := getLease(t, leases, "expired")
		if holder(l) != "a" {
			t.Fatalf("holder %q after a crashed, want a", holder(l))
		}
		expiry := l.Spec.RenewTime.Add(testLease)
		eventually(t, 2*testLease, "b did not take over the expired Lease", b.e.Leading)
		if now := time.Now(); now.Before(expiry) {
			t.Fatalf("b took the Lease %v before it expired", expiry.Sub(now))
		}
		t.Logf("b leads %v after the Lease expired", time.Since(expiry))
		if l := getLease(t, leases, "expired"); holder(l) != "b" || *l.Spec.LeaseTransitions != 1 {
			t.Fatalf("holder %q transitions %d, want b 1", holder(l), *l.Spec.LeaseTransitions)
		}
	})

	t.Run("APIServerOutageNeverDemotes", func(t *testing.T) {
		a := elect(t, leases, "outage", "a", true)
		eventually(t, 5*time.Second, "a does not lead", a.e.Leading)
		b := elect(t, leases, "outage", "b", true)
		steady(t, 2*testRetry, "b standby", func() bool { return !b.e.Leading() })

		c.Kill()
		// Well past the lease duration: a keeps leading, b stays standby.
		steady(t, 3*testLease, "a leading and b standby during the outage", func() bool { return a.e.Leading() && !b.e.Leading() })
		if n := value(a.e.failures); n < 3 {
			t.Fatalf("kvbandit_lease_renew_failures_total %v, want several", n)
		}
		if got := value(a.e.leaderG); got != 1 {
			t.Fatalf("kvbandit_leader %v during the outage, want 1", got)
		}

		c.Restart()
		before := value(a.e.failures)
		eventually(t, 5*time.Second, "a does not renew after the restart", func() bool {
			l, err := leases.Leases(testNS).Get(t.Context(), "outage", metav1.GetOptions{})
			return err == nil && holder(l) == "a" && time.Since(l.Spec.RenewTime.Time) < testRetry*3
		})
		steady(t, 2*testLease, "still exactly a after the restart", func() bool { return a.e.Leading() && !b.e.Leading() })
		if after := value(a.e.failures); after > before+1 {
			t.Errorf("renew failures still growing after the restart: %v -> %v", before, after)
		}
	})
}

// value reads a gauge's or counter's current value.
func value(c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	if g := m.GetGauge(); g != nil {
		return g.GetValue()
	}
	return m.GetCounter().GetValue()
}
