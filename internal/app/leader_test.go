package app

import (
	"context"
	"io"
	"log/slog"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/kvbandit/kvbandit/internal/testenv/kubeenv"
)

// TestServeLeaderElect runs two in-process serve replicas with
// --leader-elect on a real kube-apiserver, as the chart's "kvbandit"
// ServiceAccount with only the chart's Lease permissions: exactly one
// reports readiness SERVING (both live); when it stops, it releases the
// Lease and the other becomes ready.
func TestServeLeaderElect(t *testing.T) {
	c := kubeenv.Start(t)
	const ns = "kvbandit-serve"
	c.CreateNamespace(t, ns)
	cs := c.Client(t)
	_, err := cs.RbacV1().Roles(ns).Create(t.Context(), &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: "leader-election"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"get", "create", "update"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = cs.RbacV1().RoleBindings(ns).Create(t.Context(), &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "leader-election"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: "leader-election"},
		Subjects:   []rbacv1.Subject{{Kind: "User", Name: "kvbandit"}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := c.Kubeconfig(t, "kvbandit")

	type replica struct {
		cancel context.CancelFunc
		done   chan error
		health healthpb.HealthClient
	}
	start := func(id string) *replica {
		listen := func() net.Listener {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			return l
		}
		ls := &Listeners{GRPC: listen(), Health: listen()}
		o := ServeOptions{Endpoints: "127.0.0.1:1", Policy: "kv", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second,
			StopGrace: 100 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text",
			Kubeconfig: kubeconfig,
			LeaderElect: LeaderOptions{Enabled: true, LeaseName: "kvbandit", Namespace: ns, Identity: id,
				LeaseDuration: 3 * time.Second, RetryPeriod: 300 * time.Millisecond}}
		ctx, cancel := context.WithCancel(context.Background())
		r := &replica{cancel: cancel, done: make(chan error, 1)}
		go func() { r.done <- Serve(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)), ls) }()
		cc, err := grpc.NewClient(ls.Health.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		r.health = healthpb.NewHealthClient(cc)
		var stopped atomic.Bool
		t.Cleanup(func() {
			cc.Close()
			if !stopped.Swap(true) {
				cancel()
				<-r.done
			}
		})
		return r
	}
	status := func(r *replica, service string) healthpb.HealthCheckResponse_ServingStatus {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		resp, err := r.health.Check(ctx, &healthpb.HealthCheckRequest{Service: service})
		if err != nil {
			return healthpb.HealthCheckResponse_UNKNOWN
		}
		return resp.GetStatus()
	}
	serving := func(r *replica) bool { return status(r, healthReadiness) == healthpb.HealthCheckResponse_SERVING }

	r1, r2 := start("replica-1"), start("replica-2")
	deadline := time.Now().Add(10 * time.Second)
	for serving(r1) == serving(r2) {
		if time.Now().After(deadline) {
			t.Fatalf("readiness: replica-1 %v, replica-2 %v; want exactly one SERVING", status(r1, healthReadiness), status(r2, healthReadiness))
		}
		time.Sleep(50 * time.Millisecond)
	}
	leader, standby := r1, r2
	if serving(r2) {
		leader, standby = r2, r1
	}
	for end := time.Now().Add(2 * time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if !serving(leader) || serving(standby) {
			t.Fatal("readiness changed with both replicas running")
		}
		if s := status(standby, healthExtProc); s != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Fatalf("standby's %s status %v, want NOT_SERVING", healthExtProc, s)
		}
		for _, r := range []*replica{leader, standby} {
			if s := status(r, healthLiveness); s != healthpb.HealthCheckResponse_SERVING {
				t.Fatalf("liveness %v, want SERVING", s)
			}
		}
	}

	// The leader shuts down: it releases the Lease, the standby takes over.
	leader.cancel()
	if err := <-leader.done; err != nil {
		t.Fatal(err)
	}
	leader.done <- nil // for the cleanup
	begin := time.Now()
	for !serving(standby) {
		if time.Since(begin) > 3*time.Second {
			t.Fatalf("the standby is not ready %v after the leader stopped", time.Since(begin))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("standby ready %v after the leader's shutdown", time.Since(begin).Round(time.Millisecond))
}
