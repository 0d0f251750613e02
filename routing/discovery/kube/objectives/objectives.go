package objectives

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/kvbandit/kvbandit/routing/clock"
)

// GVR is the InferenceObjective resource at the version the project pins
// (GIE v1.5.0).
var GVR = schema.GroupVersionResource{Group: "inference.networking.x-k8s.io", Version: "v1alpha2", Resource: "inferenceobjectives"}

// The pool reference an objective must carry (the CRD's defaults).
const (
	PoolGroup = "inference.networking.k8s.io"
	PoolKind  = "InferencePool"
)

// Bounds and timing.
const (
	// MaxObjectives is the default bound on objectives kept.
	MaxObjectives = 4096
	// MaxNameLen is the longest objective name kept (a DNS subdomain's
	// bound); the request side never looks up a longer one.
	MaxNameLen = validation.DNS1123SubdomainMaxLength
	// RetryInterval is how often the watcher retries while the CRD is not
	// served or not readable.
	RetryInterval = 30 * time.Second
	// listTimeout bounds one availability check.
	listTimeout = 10 * time.Second
)

// Skip reasons (the reason label of the skipped counter).
const (
	ReasonMalformed = "malformed"
	ReasonOverLimit = "over_limit"
)

// Config says which objectives to follow.
type Config struct {
	// Namespace is the pool's namespace (required).
	Namespace string
	// Pool is the InferencePool's name (required).
	Pool string
	// MaxObjectives bounds the objectives kept (0: [MaxObjectives]).
	MaxObjectives int
	// Resync is the informer's resync period (0: none).
	Resync time.Duration
}

// Deps are the watcher's collaborators.
type Deps struct {
	// Config reaches the API server; ignored when Dynamic is set.
	Config *rest.Config
	// Dynamic is the API client (tests); made from Config when nil.
	Dynamic dynamic.Interface
	Logger  *slog.Logger
	Clock   clock.Clock
}

// Stats is the watcher's state, for metrics.
type Stats struct {
	// Known is the number of objectives in the snapshot.
	Known int
	// Available is true once the objectives could be listed (the CRD is
	// served and readable) and the informer has synced.
	Available bool
	// Skipped counts skipped object versions by reason.
	Skipped map[string]uint64
}

// Watcher follows one pool's InferenceObjectives. Priority is safe for
// concurrent use; Run is called once.
type Watcher struct {
	cfg Config
	dyn dynamic.Interface
	log *slog.Logger
	clk clock.Clock

	snap      atomic.Pointer[map[string]int]
	available atomic.Bool

	mu      sync.Mutex
	skipped map[string]uint64
	// counted: object UID -> resourceVersion already counted as skipped.
	counted map[string]string
}

// New checks cfg and makes the API client; it does not contact the API
// server (Run does).
func New(cfg Config, deps Deps) (*Watcher, error) {
	if errs := validation.IsDNS1123Label(cfg.Namespace); len(errs) > 0 {
		return nil, fmt.Errorf("inference objectives: namespace %q: %s", cfg.Namespace, strings.Join(errs, "; "))
	}
	if errs := validation.IsDNS1123Subdomain(cfg.Pool); len(errs) > 0 {
		return nil, fmt.Errorf("inference objectives: pool name %q: %s", cfg.Pool, strings.Join(errs, "; "))
	}
	if cfg.MaxObjectives < 0 || cfg.Resync < 0 {
		return nil, errors.New("inference objectives: negative bound or resync period")
	}
	if cfg.MaxObjectives == 0 {
		cfg.MaxObjectives = MaxObjectives
	}
	dyn := deps.Dynamic
	if dyn == nil {
		if deps.Config == nil {
			return nil, errors.New("inference objectives: no API server configuration")
		}
		rc := rest.CopyConfig(deps.Config)
		rc.Timeout = 0 // a client timeout would cut the watch
		if rc.UserAgent == "" {
			rc.UserAgent = "kvbandit"
		}
		var err error
		if dyn, err = dynamic.NewForConfig(rc); err != nil {
			return nil, fmt.Errorf("inference objectives: %w", err)
		}
	}
	log := deps.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	w := &Watcher{cfg: cfg, dyn: dyn, log: log.With("component", "inference_objectives", "pool", cfg.Pool),
		clk: clock.Or(deps.Clock), skipped: map[string]uint64{}, counted: map[string]string{}}
	empty := map[string]int{}
	w.snap.Store(&empty)
	return w, nil
}

// Priority returns the priority of the pool's objective name; ok is false
// when no such objective is known. It never blocks.
func (w *Watcher) Priority(name string) (priority int, ok bool) {
	if len(name) > MaxNameLen {
		return 0, false
	}
	priority, ok = (*w.snap.Load())[name]
	return priority, ok
}

// Stats returns the current state.
func (w *Watcher) Stats() Stats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return Stats{Known: len(*w.snap.Load()), Available: w.available.Load(), Skipped: maps.Clone(w.skipped)}
}

// Run follows the objectives until ctx ends; it returns nil then. A CRD
// that is not served, or RBAC that forbids reading it, is logged and
// retried, never returned.
func (w *Watcher) Run(ctx context.Context) error {
	var lastErr string
	for {
		err := w.check(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err == nil {
			break
		}
		if msg := explain(err, w.cfg.Namespace); msg != lastErr {
			lastErr = msg
			w.log.Warn("inference objectives unavailable: requests get the default priority; retrying", "every", RetryInterval, "err", msg)
		}
		wake := make(chan struct{})
		t := w.clk.AfterFunc(RetryInterval, func() { close(wake) })
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-wake:
		}
	}
	if lastErr != "" {
		w.log.Info("inference objectives available")
	}
	return w.follow(ctx)
}

// check lists one objective, so that a missing CRD or missing permission
// is told once instead of being retried silently by a reflector.
func (w *Watcher) check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, listTimeout)
	defer cancel()
	_, err := w.dyn.Resource(GVR).Namespace(w.cfg.Namespace).List(ctx, metav1.ListOptions{Limit: 1})
	return err
}

func explain(err error, ns string) string {
	switch {
	case apierrors.IsNotFound(err):
		return fmt.Sprintf("the API server does not serve %s (install the Gateway API Inference Extension CRDs): %v", GVR, err)
	case apierrors.IsForbidden(err):
		return fmt.Sprintf("forbidden: the service account needs get/list/watch on inferenceobjectives (%s) in namespace %s: %v", GVR.Group, ns, err)
	}
	return err.Error()
}

// follow runs the informer and rebuilds the snapshot after changes.
func (w *Watcher) follow(ctx context.Context) error {
	inf := dynamicinformer.NewFilteredDynamicInformer(w.dyn, GVR, w.cfg.Namespace, w.cfg.Resync, cache.Indexers{}, nil).Informer()
	_ = inf.SetTransform(func(obj any) (any, error) {
		if m, ok := obj.(metav1.Object); ok {
			m.SetManagedFields(nil)
		}
		return obj, nil
	})
	kick := make(chan struct{}, 1)
	signal := func(any) {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: signal, DeleteFunc: signal, UpdateFunc: func(_, n any) { signal(n) },
	})
	if err != nil {
		return fmt.Errorf("inference objectives: %w", err)
	}
	ictx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		inf.RunWithContext(ictx)
	}()
	defer func() {
		cancel()
		wg.Wait()
	}()
	if !cache.WaitForCacheSync(ctx.Done(), reg.HasSynced) {
		return nil
	}
	w.available.Store(true)
	signal(nil)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
			w.rebuild(inf.GetStore().List())
		}
	}
}

// parsed is one objective of the pool.
type parsed struct {
	name     string
	uid, rv  string
	priority int
}

// rebuild makes and publishes the snapshot from the informer's objects.
func (w *Watcher) rebuild(objs []any) {
	var mine []parsed
	live := make(map[string]bool, len(objs))
	w.mu.Lock()
	defer w.mu.Unlock()
	skip := func(uid, rv, name, reason string, err error) {
		live[uid] = true
		if w.counted[uid] == rv {
			return
		}
		w.counted[uid] = rv
		w.skipped[reason]++
		w.log.Warn("inference objective skipped", "objective", name, "reason", reason, "err", err)
	}
	for _, o := range objs {
		u, ok := o.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		prio, ours, err := Parse(u.Object, w.cfg.Pool)
		uid, rv, name := string(u.GetUID()), u.GetResourceVersion(), u.GetName()
		switch {
		case err != nil:
			skip(uid, rv, name, ReasonMalformed, err)
		case ours && u.GetDeletionTimestamp() == nil:
			mine = append(mine, parsed{name: name, uid: uid, rv: rv, priority: prio})
		}
	}
	slices.SortFunc(mine, func(a, b parsed) int { return strings.Compare(a.name, b.name) })
	if len(mine) > w.cfg.MaxObjectives {
		for _, p := range mine[w.cfg.MaxObjectives:] {
			skip(p.uid, p.rv, p.name, ReasonOverLimit, fmt.Errorf("more than %d objectives in the pool", w.cfg.MaxObjectives))
		}
		mine = mine[:w.cfg.MaxObjectives]
	}
	for uid := range w.counted {
		if !live[uid] {
			delete(w.counted, uid)
		}
	}
	snap := make(map[string]int, len(mine))
	for _, p := range mine {
		snap[p.name] = p.priority
	}
	if !maps.Equal(snap, *w.snap.Load()) {
		w.snap.Store(&snap)
		w.log.Debug("inference objectives updated", "known", len(snap))
	}
}

// Parse reads an InferenceObjective object (as decoded JSON): whether it
// belongs to pool and its priority (0 when unset). err is non-nil for a
// malformed object: a name longer than [MaxNameLen] or empty, a spec or
// poolRef that is not an object, a poolRef field that is not a string, or
// a priority that is not an integer.
func Parse(obj map[string]any, pool string) (priority int, ours bool, err error) {
	md, _ := obj["metadata"].(map[string]any)
	name, _ := md["name"].(string)
	if name == "" || len(name) > MaxNameLen {
		return 0, false, fmt.Errorf("metadata.name: empty or longer than %d bytes", MaxNameLen)
	}
	spec, ok := obj["spec"].(map[string]any)
	if !ok {
		return 0, false, errors.New("spec is not an object")
	}
	ref, ok := spec["poolRef"].(map[string]any)
	if !ok {
		return 0, false, errors.New("spec.poolRef is not an object")
	}
	var f [3]string
	for i, k := range [...]string{"name", "group", "kind"} {
		v, present := ref[k]
		if !present || v == nil {
			continue
		}
		if f[i], ok = v.(string); !ok {
			return 0, false, fmt.Errorf("spec.poolRef.%s is not a string", k)
		}
	}
	if f[1] == "" {
		f[1] = PoolGroup
	}
	if f[2] == "" {
		f[2] = PoolKind
	}
	if p, present := spec["priority"]; present && p != nil {
		switch n := p.(type) {
		case int:
			priority = int(max(min(int64(n), math.MaxInt32), math.MinInt32))
		case int64:
			priority = int(max(min(n, math.MaxInt32), math.MinInt32))
		case float64: // JSON decoded without the API machinery
			if n != math.Trunc(n) || math.IsInf(n, 0) {
				return 0, false, errors.New("spec.priority is not an integer")
			}
			priority = int(max(min(n, math.MaxInt32), math.MinInt32))
		default:
			return 0, false, errors.New("spec.priority is not an integer")
		}
	}
	return priority, f[0] == pool && f[1] == PoolGroup && f[2] == PoolKind, nil
}
