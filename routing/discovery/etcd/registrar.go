package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

// DefaultTTL is a registration's lease TTL when none is given.
const DefaultTTL = 10 * time.Second

// cleanupTimeout bounds the delete and revoke when a registrar stops.
const cleanupTimeout = 5 * time.Second

// Registration is one worker's record.
type Registration struct {
	// ID is the last element of the key, <prefix>/<pool>/endpoints/<id>.
	ID string
	// Endpoint is the record; it must pass [discovery.CheckRecord].
	Endpoint routing.Endpoint
	// TTL is the lease TTL, rounded up to whole seconds (default 10s); the
	// record disappears that long after the registrar stops renewing it.
	TTL time.Duration
	// OnRegistered, when set, is called with the lease ID each time the
	// record has been written (again).
	OnRegistered func(lease int64)
}

// Registrar keeps one record in etcd under a lease until its context ends.
// Make it with [NewRegistrar].
type Registrar struct {
	cfg   Config
	reg   Registration
	deps  Deps
	log   *slog.Logger
	key   string
	value []byte

	lease atomic.Int64 // the lease the record is under now; 0 when not registered
}

// NewRegistrar checks cfg and the registration. The endpoint's address is
// canonicalised.
func NewRegistrar(cfg Config, reg Registration, deps Deps) (*Registrar, error) {
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if reg.ID == "" {
		return nil, errors.New("etcd: registration: empty id")
	}
	if err := discovery.CheckRecord(&reg.Endpoint); err != nil {
		return nil, fmt.Errorf("etcd: registration %s: %w", reg.ID, err)
	}
	if reg.TTL == 0 {
		reg.TTL = DefaultTTL
	}
	if reg.TTL < 0 {
		return nil, fmt.Errorf("etcd: registration %s: negative ttl %v", reg.ID, reg.TTL)
	}
	value, err := json.Marshal(reg.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("etcd: registration %s: %w", reg.ID, err)
	}
	deps = deps.defaults()
	key := cfg.EndpointsPrefix() + reg.ID
	return &Registrar{cfg: cfg, reg: reg, deps: deps, key: key, value: value,
		log: deps.Logger.With("key", key)}, nil
}

// Key is the record's key.
func (r *Registrar) Key() string { return r.key }

// Registered reports whether the record is written and its lease renewed.
func (r *Registrar) Registered() bool { return r.lease.Load() != 0 }

// Run grants a lease, writes the record under it and keeps the lease
// alive. When the keepalive stops (etcd unreachable for a whole TTL, lease
// lost) it grants a new lease and writes the record again, with backoff.
// When ctx ends it deletes the record and revokes the lease (within a few
// seconds of its own) and returns nil. It returns an error only when the
// client cannot be made.
func (r *Registrar) Run(ctx context.Context) error {
	cli, err := newClient(r.cfg)
	if err != nil {
		return err
	}
	defer cli.Close()
	bo := backoff{min: backoffMin, max: backoffMax}
	var lease clientv3.LeaseID // the last lease the record was put under
	for {
		err := r.register(ctx, cli, &lease, &bo)
		r.lease.Store(0)
		if ctx.Err() != nil {
			break
		}
		r.log.Warn("etcd registration lost: registering again", "err", err)
		if !sleep(ctx, r.deps.Clock, bo.next()) {
			break
		}
	}
	r.cleanup(ctx, cli, lease)
	return nil
}

// register writes the record under a new lease and keeps it alive until
// the keepalive channel closes.
func (r *Registrar) register(ctx context.Context, cli *clientv3.Client, lease *clientv3.LeaseID, bo *backoff) error {
	ttl := int64(math.Ceil(r.reg.TTL.Seconds()))
	gctx, cancel := context.WithTimeout(ctx, r.cfg.dialTimeout())
	defer cancel()
	g, err := cli.Grant(gctx, ttl)
	if err != nil {
		return fmt.Errorf("etcd: grant lease: %w", err)
	}
	if _, err := cli.Put(gctx, r.key, string(r.value), clientv3.WithLease(g.ID)); err != nil {
		r.revoke(ctx, cli, g.ID)
		return fmt.Errorf("etcd: put %s: %w", r.key, err)
	}
	if old := *lease; old != 0 && old != g.ID {
		// After a long outage the old lease may still exist (its server
		// kept the data dir); the record moved to the new lease, so
		// revoking the old one only drops the lease.
		r.revoke(ctx, cli, old)
	}
	*lease = g.ID
	kctx, kcancel := context.WithCancel(ctx)
	defer kcancel()
	ka, err := cli.KeepAlive(kctx, g.ID)
	if err != nil {
		return fmt.Errorf("etcd: keepalive: %w", err)
	}
	bo.reset()
	r.lease.Store(int64(g.ID))
	r.log.Info("registered in etcd", "lease", int64(g.ID), "ttl_secs", g.TTL)
	if r.reg.OnRegistered != nil {
		r.reg.OnRegistered(int64(g.ID))
	}
	for range ka {
		// Renewals arrive here until the keepalive stops: ctx ended, the
		// lease expired, or etcd was unreachable for a whole TTL.
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return fmt.Errorf("etcd: keepalive of lease %x stopped (etcd unreachable or lease expired)", int64(g.ID))
}

// revoke drops a lease, best effort.
func (r *Registrar) revoke(ctx context.Context, cli *clientv3.Client, id clientv3.LeaseID) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	if _, err := cli.Revoke(rctx, id); err != nil {
		r.log.Debug("etcd: revoke old lease", "lease", int64(id), "err", err)
	}
}

// cleanup deletes the record if it is still ours, then revokes the lease.
func (r *Registrar) cleanup(ctx context.Context, cli *clientv3.Client, lease clientv3.LeaseID) {
	if lease == 0 {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	// Delete only a record under our lease: another registrar with the
	// same id may have replaced it.
	_, err := cli.Txn(cctx).
		If(clientv3.Compare(clientv3.LeaseValue(r.key), "=", lease)).
		Then(clientv3.OpDelete(r.key)).
		Commit()
	if err != nil {
		r.log.Warn("etcd: delete record on shutdown", "err", err)
	}
	if _, err := cli.Revoke(cctx, lease); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		r.log.Debug("etcd: revoke lease on shutdown", "err", err)
	}
	r.log.Info("deregistered from etcd")
}
