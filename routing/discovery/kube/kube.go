package kube

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

// SourceName is the source's name in endpoint sets, metrics and logs.
const SourceName = "kube"

// PoolGVR is the InferencePool resource the source watches.
var PoolGVR = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// Timing.
const (
	// coalesce is the shortest interval between two publishes; a change
	// never waits longer than this.
	coalesce = 50 * time.Millisecond
	// preflightTimeout bounds the start-up List calls.
	preflightTimeout = 10 * time.Second
	// probeInterval is how often a degraded source checks the API server.
	probeInterval = time.Second
	probeTimeout  = 2 * time.Second
)

// Config says what to watch.
type Config struct {
	// Namespace is the pool's (and its Pods') namespace; default the
	// POD_NAMESPACE environment variable, else "default".
	Namespace string
	// Pool is the InferencePool's name; empty selects standalone mode.
	Pool string
	// Selector is the Pod label selector (standalone mode only).
	Selector map[string]string
	// TargetPorts are the worker ports of each Pod (standalone mode only;
	// in pool mode they come from the pool's spec.targetPorts).
	TargetPorts []int
	// Resync is the informers' resync period (0: none).
	Resync time.Duration
}

// Deps are the source's collaborators.
type Deps struct {
	// Config reaches the API server (required).
	Config *rest.Config
	Logger *slog.Logger
	Clock  clock.Clock
}

// Source follows an InferencePool (or a label selector) and its Pods.
type Source struct {
	cfg  Config
	log  *slog.Logger
	clk  clock.Clock
	kube kubernetes.Interface
	dyn  dynamic.Interface
	// netErr carries transport errors (API server unreachable).
	netErr chan error
}

var _ discovery.Source = (*Source)(nil)

// New checks cfg and makes the API clients; it does not contact the API
// server (Run does).
func New(cfg Config, deps Deps) (*Source, error) {
	if deps.Config == nil {
		return nil, errors.New("kube discovery: no API server configuration")
	}
	if cfg.Namespace == "" {
		cfg.Namespace = cmp.Or(os.Getenv("POD_NAMESPACE"), "default")
	}
	if errs := validation.IsDNS1123Label(cfg.Namespace); len(errs) > 0 {
		return nil, fmt.Errorf("kube discovery: namespace %q: %s", cfg.Namespace, strings.Join(errs, "; "))
	}
	if cfg.Resync < 0 {
		return nil, errors.New("kube discovery: negative resync period")
	}
	if cfg.Pool != "" {
		if errs := validation.IsDNS1123Subdomain(cfg.Pool); len(errs) > 0 {
			return nil, fmt.Errorf("kube discovery: pool name %q: %s", cfg.Pool, strings.Join(errs, "; "))
		}
		if len(cfg.Selector) > 0 || len(cfg.TargetPorts) > 0 {
			return nil, errors.New("kube discovery: a selector and target ports are for standalone mode; in pool mode the InferencePool supplies them")
		}
	} else {
		if len(cfg.Selector) == 0 {
			return nil, errors.New("kube discovery: standalone mode (no pool name) needs a pod label selector")
		}
		if _, err := labels.ValidatedSelectorFromSet(cfg.Selector); err != nil {
			return nil, fmt.Errorf("kube discovery: selector: %w", err)
		}
		if err := checkPorts(cfg.TargetPorts); err != nil {
			return nil, fmt.Errorf("kube discovery: target ports: %w", err)
		}
		cfg.Selector = maps.Clone(cfg.Selector)
		cfg.TargetPorts = slices.Clone(cfg.TargetPorts)
	}
	rc := rest.CopyConfig(deps.Config)
	// An HTTP client timeout would cut every watch; the start-up and probe
	// calls carry their own deadlines.
	rc.Timeout = 0
	// The reflectors retry a refused watch on their own without telling
	// anyone, so failures are seen where requests are sent.
	netErr := make(chan error, 1)
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper {
		return roundTripFunc(func(req *http.Request) (*http.Response, error) {
			resp, err := rt.RoundTrip(req)
			if err != nil && req.Context().Err() == nil {
				select {
				case netErr <- err:
				default:
				}
			}
			return resp, err
		})
	})
	if rc.UserAgent == "" {
		rc.UserAgent = "kvbandit"
	}
	kc, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kube discovery: %w", err)
	}
	dc, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kube discovery: %w", err)
	}
	log := deps.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Source{cfg: cfg, log: log.With("source", SourceName), clk: clock.Or(deps.Clock), kube: kc, dyn: dc, netErr: netErr}, nil
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func checkPorts(ports []int) error {
	if len(ports) == 0 {
		return errNoPorts
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if p < 1 || p > 65535 {
			return fmt.Errorf("port %d out of range 1..65535", p)
		}
		if seen[p] {
			return fmt.Errorf("port %d listed twice", p)
		}
		seen[p] = true
	}
	return nil
}

// Name implements [discovery.Source].
func (s *Source) Name() string { return SourceName }

// Run implements [discovery.Source]. It returns an error when the API
// server refuses the source's credentials or permissions, or (pool mode)
// does not serve InferencePools; an unreachable API server is not fatal.
func (s *Source) Run(ctx context.Context, sink discovery.Sink) error {
	r := &runner{Source: s, sink: sink,
		kick: make(chan struct{}, 1), flush: make(chan struct{}, 1), probe: make(chan struct{}, 1),
		probeRes: make(chan error, 1), watchErr: make(chan error, 1), skipped: map[string]string{}}
	if s.cfg.Pool == "" {
		r.ports = s.cfg.TargetPorts
	}
	if err := s.preflight(ctx); err != nil {
		if fatal(err) {
			return s.explain(err)
		}
		r.degrade(fmt.Errorf("kube discovery: %w", err))
	}
	return r.loop(ctx)
}

// preflight lists and watches the pods (and the pool) once, so that
// missing permissions (any of get/list/watch) fail fast rather than leave
// the informers retrying silently.
func (s *Source) preflight(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, preflightTimeout)
	defer cancel()
	pods := s.kube.CoreV1().Pods(s.cfg.Namespace)
	if _, err := pods.List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
		return err
	}
	one := int64(1)
	w, err := pods.Watch(ctx, metav1.ListOptions{TimeoutSeconds: &one})
	if err != nil {
		return err
	}
	w.Stop()
	if s.cfg.Pool == "" {
		return nil
	}
	sel := metav1.ListOptions{Limit: 1, FieldSelector: "metadata.name=" + s.cfg.Pool}
	if _, err := s.dyn.Resource(PoolGVR).Namespace(s.cfg.Namespace).List(ctx, sel); err != nil {
		return err
	}
	sel.Limit, sel.TimeoutSeconds = 0, &one
	pw, err := s.dyn.Resource(PoolGVR).Namespace(s.cfg.Namespace).Watch(ctx, sel)
	if err != nil {
		return err
	}
	pw.Stop()
	return nil
}

// fatal reports whether a preflight error is a configuration problem that
// retrying will not fix.
func fatal(err error) bool {
	return apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) || apierrors.IsNotFound(err)
}

func (s *Source) explain(err error) error {
	what := "pods"
	if s.cfg.Pool != "" {
		what = "pods and inferencepools (inference.networking.k8s.io)"
	}
	switch {
	case apierrors.IsForbidden(err):
		return fmt.Errorf("kube discovery: forbidden: the service account needs get/list/watch on %s in namespace %s: %w", what, s.cfg.Namespace, err)
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("kube discovery: unauthorized: the API server refused the credentials: %w", err)
	case apierrors.IsNotFound(err):
		return fmt.Errorf("kube discovery: the API server does not serve %s: install the Gateway API Inference Extension CRDs, or use standalone mode (a selector and target ports): %w", PoolGVR, err)
	}
	return err
}

// runner is one Run's state; its fields are owned by the loop goroutine
// unless noted.
type runner struct {
	*Source
	sink discovery.Sink

	// Channels (capacity 1, sent without blocking) wake the loop.
	kick, flush, probe chan struct{}
	probeRes           chan error
	watchErr           chan error

	wg sync.WaitGroup // informer, sync-wait and probe goroutines

	pool     *watch // nil in standalone mode
	pods     *watch // nil while the pool is absent
	podsSel  string
	ports    []int
	poolSeen bool // the pool existed at the last reconcile

	dirty        bool
	published    bool
	last         []routing.Endpoint
	lastAt       time.Time
	flushPending bool
	flushTimer   clock.Timer
	probeTimer   clock.Timer
	degraded     bool
	probing      bool
	skipped      map[string]string // pod UID -> resourceVersion already counted
}

// watch is one running informer.
type watch struct {
	inf    cache.SharedIndexInformer
	cancel context.CancelFunc
	synced chan struct{} // closed once the handler saw the first list
}

func (w *watch) isSynced() bool {
	select {
	case <-w.synced:
		return true
	default:
	}
	return false
}

func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// start runs inf until ctx ends or the watch is stopped.
func (r *runner) start(ctx context.Context, inf cache.SharedIndexInformer) *watch {
	ctx, cancel := context.WithCancel(ctx)
	w := &watch{inf: inf, cancel: cancel, synced: make(chan struct{})}
	kick := func(any) { signal(r.kick) }
	reg, _ := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: kick, DeleteFunc: kick, UpdateFunc: func(_, n any) { kick(n) },
	})
	_ = inf.SetWatchErrorHandler(func(_ *cache.Reflector, err error) {
		if ctx.Err() != nil || err == io.EOF || apierrors.IsResourceExpired(err) || apierrors.IsGone(err) {
			return // stopped, or a normal end of a watch
		}
		select {
		case r.watchErr <- err:
		default:
		}
	})
	_ = inf.SetTransform(stripManagedFields)
	r.wg.Add(2)
	go func() {
		defer r.wg.Done()
		inf.RunWithContext(ctx)
	}()
	go func() {
		defer r.wg.Done()
		if cache.WaitForCacheSync(ctx.Done(), reg.HasSynced) {
			close(w.synced)
			signal(r.kick)
		}
	}()
	return w
}

func stripManagedFields(obj any) (any, error) {
	if m, ok := obj.(metav1.Object); ok {
		m.SetManagedFields(nil)
	}
	return obj, nil
}

func (r *runner) stop(w *watch) {
	if w != nil {
		w.cancel()
	}
}

func (r *runner) startPool(ctx context.Context) {
	name := r.cfg.Pool
	inf := dynamicinformer.NewFilteredDynamicInformer(r.dyn, PoolGVR, r.cfg.Namespace, r.cfg.Resync, cache.Indexers{},
		func(o *metav1.ListOptions) { o.FieldSelector = "metadata.name=" + name }).Informer()
	r.pool = r.start(ctx, inf)
}

func (r *runner) startPods(ctx context.Context, sel string) {
	r.stop(r.pods)
	inf := coreinformers.NewFilteredPodInformer(r.kube, r.cfg.Namespace, r.cfg.Resync, cache.Indexers{},
		func(o *metav1.ListOptions) { o.LabelSelector = sel })
	r.pods, r.podsSel = r.start(ctx, inf), sel
}

// restart replaces every informer (after an outage: they re-list at once
// instead of waiting out their backoff). The last set keeps serving until
// the new informers have synced.
func (r *runner) restart(ctx context.Context) {
	r.stop(r.pool)
	r.stop(r.pods)
	r.pods, r.podsSel = nil, ""
	if r.cfg.Pool != "" {
		r.startPool(ctx)
	} else {
		r.startPods(ctx, labels.SelectorFromSet(r.cfg.Selector).String())
	}
	r.dirty = true
}

func (r *runner) loop(ctx context.Context) error {
	ictx, cancel := context.WithCancel(ctx)
	defer func() {
		cancel()
		for _, t := range []clock.Timer{r.flushTimer, r.probeTimer} {
			if t != nil {
				t.Stop()
			}
		}
		r.wg.Wait()
	}()
	r.restart(ictx)
	if r.degraded {
		r.scheduleProbe()
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-r.kick:
			r.dirty = true
			r.reconcile(ictx)
		case <-r.flush:
			r.flushPending = false
			r.reconcile(ictx)
		case err := <-r.netErr:
			if !r.degraded {
				r.degrade(fmt.Errorf("kube discovery: API server unreachable: %w", err))
				r.scheduleProbe()
			}
		case err := <-r.watchErr:
			if !r.degraded {
				r.degrade(fmt.Errorf("kube discovery: watch: %w", err))
				r.scheduleProbe()
			}
		case <-r.probe:
			r.runProbe(ictx)
		case err := <-r.probeRes:
			r.probing = false
			switch {
			case err == nil:
				r.degraded = false
				select { // an error from before the recovery
				case <-r.netErr:
				default:
				}
				r.sink.SetDegraded(SourceName, nil)
				r.log.Info("kube discovery: API server reachable again; re-listing")
				r.restart(ictx)
			case ctx.Err() == nil:
				r.scheduleProbe()
			}
		}
	}
}

func (r *runner) degrade(err error) {
	r.degraded = true
	r.sink.SetDegraded(SourceName, err)
	if r.published {
		r.log.Warn("kube discovery degraded: serving the last known endpoint set", "err", err)
	} else {
		r.log.Warn("kube discovery degraded: no endpoint set known yet, nothing to serve", "err", err)
	}
}

func (r *runner) scheduleProbe() {
	if r.probing {
		return
	}
	r.probing = true
	r.probeTimer = r.clk.AfterFunc(probeInterval, func() { signal(r.probe) })
}

// runProbe lists one pod in the background; the result comes back on
// probeRes.
func (r *runner) runProbe(ctx context.Context) {
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		defer cancel()
		_, err := r.kube.CoreV1().Pods(r.cfg.Namespace).List(pctx, metav1.ListOptions{Limit: 1})
		if err == nil && r.cfg.Pool != "" {
			_, err = r.dyn.Resource(PoolGVR).Namespace(r.cfg.Namespace).List(pctx,
				metav1.ListOptions{Limit: 1, FieldSelector: "metadata.name=" + r.cfg.Pool})
		}
		if err == nil && ctx.Err() != nil {
			err = ctx.Err()
		}
		r.probeRes <- err
	}()
}

// reconcile follows the pool (re-creating the Pod informer when its
// selector changes) and publishes when something changed and the
// informers have synced.
func (r *runner) reconcile(ctx context.Context) {
	if r.pool != nil {
		if !r.pool.isSynced() {
			return
		}
		r.followPool(ctx)
	}
	if !r.dirty || (r.pods != nil && !r.pods.isSynced()) {
		return
	}
	now := r.clk.Now()
	if r.published {
		if wait := r.lastAt.Add(coalesce).Sub(now); wait > 0 {
			if !r.flushPending {
				r.flushPending = true
				r.flushTimer = r.clk.AfterFunc(wait, func() { signal(r.flush) })
			}
			return
		}
	}
	r.dirty = false
	r.lastAt = now
	set := r.build()
	if r.published && slices.EqualFunc(set.Endpoints, r.last, func(a, b routing.Endpoint) bool { return a.Equal(&b) }) {
		return
	}
	if err := r.sink.Publish(set); err != nil {
		r.log.Warn("kube discovery: endpoint set refused", "err", err)
		return
	}
	r.published, r.last = true, set.Endpoints
}

// followPool reads the pool from its informer's store.
func (r *runner) followPool(ctx context.Context) {
	obj, exists, _ := r.pool.inf.GetStore().GetByKey(r.cfg.Namespace + "/" + r.cfg.Pool)
	u, _ := obj.(*unstructured.Unstructured)
	if !exists || u == nil {
		if r.pods != nil || r.poolSeen || !r.published {
			r.log.Warn("kube discovery: InferencePool not found; publishing an empty endpoint set",
				"namespace", r.cfg.Namespace, "pool", r.cfg.Pool)
		}
		r.stop(r.pods)
		r.pods, r.podsSel, r.ports, r.poolSeen = nil, "", nil, false
		return
	}
	sel, ports, err := poolSpec(u)
	if err != nil {
		if r.pods != nil || !r.published || r.poolSeen {
			r.log.Warn("kube discovery: InferencePool unusable; publishing an empty endpoint set", "pool", r.cfg.Pool, "err", err)
		}
		r.stop(r.pods)
		r.pods, r.podsSel, r.ports = nil, "", nil
		r.poolSeen = false
		return
	}
	if !r.poolSeen {
		r.log.Info("kube discovery: following InferencePool", "namespace", r.cfg.Namespace, "pool", r.cfg.Pool,
			"selector", sel, "target_ports", ports)
	}
	r.poolSeen = true
	if !slices.Equal(ports, r.ports) {
		r.ports = ports
		r.dirty = true
	}
	if r.pods == nil || sel != r.podsSel {
		if r.pods != nil {
			r.log.Info("kube discovery: pool selector changed", "selector", sel)
		}
		r.startPods(ctx, sel)
	}
}

// poolSpec reads spec.selector.matchLabels and spec.targetPorts.
func poolSpec(u *unstructured.Unstructured) (string, []int, error) {
	ml, _, err := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if err != nil {
		return "", nil, fmt.Errorf("spec.selector.matchLabels: %w", err)
	}
	if len(ml) == 0 {
		return "", nil, errors.New("spec.selector.matchLabels is empty")
	}
	sel, err := labels.ValidatedSelectorFromSet(ml)
	if err != nil {
		return "", nil, fmt.Errorf("spec.selector.matchLabels: %w", err)
	}
	tps, _, err := unstructured.NestedSlice(u.Object, "spec", "targetPorts")
	if err != nil {
		return "", nil, fmt.Errorf("spec.targetPorts: %w", err)
	}
	ports := make([]int, 0, len(tps))
	for _, tp := range tps {
		m, _ := tp.(map[string]any)
		n, ok, _ := unstructured.NestedInt64(m, "number")
		if !ok {
			return "", nil, errors.New("spec.targetPorts: an entry without a number")
		}
		ports = append(ports, int(n))
	}
	if err := checkPorts(ports); err != nil {
		return "", nil, fmt.Errorf("spec.targetPorts: %w", err)
	}
	return sel.String(), ports, nil
}

// build makes the endpoint set from the Pod informer's store.
func (r *runner) build() routing.EndpointSet {
	set := routing.EndpointSet{Source: SourceName, Endpoints: []routing.Endpoint{}}
	if r.pods == nil || len(r.ports) == 0 {
		return set
	}
	var pods []*corev1.Pod
	for _, o := range r.pods.inf.GetStore().List() {
		if p, ok := o.(*corev1.Pod); ok && p.Status.PodIP != "" && podReady(p) {
			pods = append(pods, p)
		}
	}
	slices.SortFunc(pods, func(a, b *corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	seen := make(map[routing.EndpointKey]bool, len(pods)*len(r.ports))
	live := make(map[string]bool, len(r.skipped))
	for _, p := range pods {
		eps, err := podEndpoints(p, r.ports)
		if err == nil {
			for _, ep := range eps {
				if seen[ep.Key] {
					err = &discovery.RecordError{Reason: discovery.ReasonDuplicate, Err: fmt.Errorf("address %s already taken by another pod", ep.Key)}
					break
				}
			}
		}
		if err != nil {
			uid := string(p.UID)
			live[uid] = true
			if r.skipped[uid] != p.ResourceVersion {
				r.skipped[uid] = p.ResourceVersion
				r.sink.Skipped(SourceName, discovery.SkipReason(err))
				r.log.Warn("kube discovery: pod skipped", "pod", p.Namespace+"/"+p.Name, "err", err)
			}
			continue
		}
		for _, ep := range eps {
			seen[ep.Key] = true
		}
		set.Endpoints = append(set.Endpoints, eps...)
	}
	for uid := range r.skipped {
		if !live[uid] {
			delete(r.skipped, uid)
		}
	}
	slices.SortFunc(set.Endpoints, func(a, b routing.Endpoint) int { return strings.Compare(string(a.Key), string(b.Key)) })
	return set
}
