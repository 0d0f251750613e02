package app

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	coordclient "k8s.io/client-go/kubernetes/typed/coordination/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvbandit/kvbandit/internal/leader"
)

// LeaderOptions are the --leader-elect* flags: active-passive replicas on
// a Kubernetes Lease, readiness = leader (see internal/leader).
type LeaderOptions struct {
	Enabled   bool
	LeaseName string
	Namespace string // empty: $POD_NAMESPACE, else "default"
	Identity  string // empty: hostname_pid
	// Timings; zero means the defaults (15s, 10s, 2s). Not flags: tests
	// shorten them.
	LeaseDuration, RenewDeadline, RetryPeriod time.Duration
	// Now is the election's clock; nil: time.Now.
	Now func() time.Time
}

// AddFlags registers the options on fs.
func (o *LeaderOptions) AddFlags(fs *flag.FlagSet) {
	fs.BoolVar(&o.Enabled, "leader-elect", false, "active-passive replicas: only the holder of a coordination.k8s.io/v1 Lease is ready (readiness = synced and leading); losing the API server never demotes the leader")
	fs.StringVar(&o.LeaseName, "leader-elect-lease-name", "kvbandit", "--leader-elect: the Lease's name")
	fs.StringVar(&o.Namespace, "leader-elect-namespace", "", "--leader-elect: the Lease's namespace (default $POD_NAMESPACE, else \"default\")")
	fs.StringVar(&o.Identity, "leader-elect-identity", "", "--leader-elect: this replica's identity in the Lease (default hostname_pid)")
}

// Validate checks the options.
func (o LeaderOptions) Validate() error {
	if o.Enabled && o.LeaseName == "" {
		return errors.New("--leader-elect-lease-name must not be empty")
	}
	return nil
}

func (o LeaderOptions) config() leader.Config {
	c := leader.Config{Namespace: o.Namespace, Name: o.LeaseName, Identity: o.Identity,
		LeaseDuration: o.LeaseDuration, RenewDeadline: o.RenewDeadline, RetryPeriod: o.RetryPeriod}
	if c.Namespace == "" {
		c.Namespace = os.Getenv("POD_NAMESPACE")
	}
	if c.Namespace == "" {
		c.Namespace = "default"
	}
	if c.Identity == "" {
		h, _ := os.Hostname()
		c.Identity = h + "_" + strconv.Itoa(os.Getpid())
	}
	return c
}

// kubeRESTConfig is the API server client configuration: the --kubeconfig
// file when given, else the in-cluster service account, else $KUBECONFIG or
// ~/.kube/config.
func kubeRESTConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig != "" {
		return clientcmd.BuildConfigFromFlags("", kubeconfig)
	}
	if c, err := rest.InClusterConfig(); err == nil {
		return c, nil
	}
	return clientcmd.NewNonInteractiveDeferredLoadingClientConfig(clientcmd.NewDefaultClientConfigLoadingRules(), nil).ClientConfig()
}

// readyGate combines serve's readiness conditions: ready = discovery synced
// AND (no leader election OR leading), and never once shutdown started.
type readyGate struct {
	mu         sync.Mutex
	set        func(bool)
	stopping   *atomic.Bool
	needLeader bool
	synced     bool
	leading    bool
}

// bind attaches the health status setter; updates before it only record
// state.
func (g *readyGate) bind(set func(bool), stopping *atomic.Bool) {
	g.mu.Lock()
	g.set, g.stopping = set, stopping
	g.mu.Unlock()
	g.update(func() {})
}

func (g *readyGate) setSynced()        { g.update(func() { g.synced = true }) }
func (g *readyGate) setLeading(v bool) { g.update(func() { g.leading = v }) }
func (g *readyGate) update(change func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	change()
	if g.set == nil || g.stopping.Load() {
		return
	}
	g.set(g.synced && (!g.needLeader || g.leading))
}

// leaderRun is serve's Lease election; a nil *leaderRun is off.
type leaderRun struct {
	e    *leader.Elector
	hc   *http.Client // closed (idle connections) once the election ends
	stop func()
	done chan struct{}
	once sync.Once
}

// newLeaderElection builds the elector (nil when --leader-elect is off)
// and tells gate that readiness needs leadership. It does not contact the
// API server.
func newLeaderElection(o ServeOptions, log *slog.Logger, reg prometheus.Registerer, gate *readyGate) (*leaderRun, error) {
	if !o.LeaderElect.Enabled {
		return nil, nil
	}
	rc, err := kubeRESTConfig(o.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--leader-elect: API server config: %w", err)
	}
	hc, err := rest.HTTPClientFor(rc)
	if err != nil {
		return nil, fmt.Errorf("--leader-elect: %w", err)
	}
	cs, err := coordclient.NewForConfigAndClient(rest.CopyConfig(rc), hc)
	if err != nil {
		return nil, fmt.Errorf("--leader-elect: %w", err)
	}
	gate.needLeader = true
	e, err := leader.New(o.LeaderElect.config(), leader.Deps{Leases: cs, Logger: log, Registry: reg, Now: o.LeaderElect.Now, OnChange: gate.setLeading})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrUsage, err)
	}
	return &leaderRun{e: e, hc: hc}, nil
}

// start runs the election in the background and returns a function that
// stops it, releasing the Lease if held, and waits (it may be called more
// than once).
func (l *leaderRun) start() func() {
	if l == nil {
		return func() {}
	}
	ctx, cancel := context.WithCancel(context.Background())
	l.stop, l.done = cancel, make(chan struct{})
	go func() {
		defer close(l.done)
		_ = l.e.Run(ctx)
		l.hc.CloseIdleConnections()
	}()
	return func() { l.once.Do(func() { l.stop(); <-l.done }) }
}
