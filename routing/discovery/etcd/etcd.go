// Package etcd discovers workers through etcd: a [Source] that lists and
// watches endpoint records under one key prefix, and a [Registrar] that
// keeps one worker's record alive under a lease (`kvbandit register`).
//
// # Key schema
//
// Each worker is one key, <prefix>/<pool>/endpoints/<id>, whose value is a
// JSON record with the fields of [routing.Endpoint] (address, models,
// adapters, engine, block_size, ...), decoded by [discovery.DecodeRecord].
// Records are written under a lease, so a worker that dies disappears when
// its lease expires. The default prefix is "/kvbandit/v1" and the default
// pool "default".
//
// # Behaviour
//
// The source lists the prefix, publishes the whole set (sorted by id), then
// watches from the list's revision and publishes one new set per watch
// response. Records that do not decode are skipped and counted; two records
// for one address keep the one with the lowest key. A compacted watch
// re-lists. When etcd cannot be reached (watch broken, leader lost, a
// periodic linearizable probe failing) the source reports itself degraded,
// keeps its last set, and retries with backoff; the first successful
// re-list clears the degraded state and publishes.
package etcd

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

// SourceName is the source's name in endpoint sets, metrics and logs.
const SourceName = "etcd"

// Defaults.
const (
	DefaultPrefix          = "/kvbandit/v1"
	DefaultPool            = "default"
	DefaultDialTimeoutSecs = 5.0
	// DefaultMaxListBytes bounds one response from etcd (the pool's list,
	// a watch batch): 16,384 endpoints (routing.MaxEndpoints) of 4 KiB
	// records. etcd's client would accept up to 2 GiB.
	DefaultMaxListBytes = 64 << 20
)

// Backoff between reconnection attempts, and the probe that notices a dead
// server while a watch is quiet.
const (
	backoffMin    = 100 * time.Millisecond
	backoffMax    = 2 * time.Second
	probeInterval = time.Second
	probeTimeout  = 2 * time.Second
	// gRPC keepalive: etcd refuses pings more frequent than 5s
	// (--grpc-keepalive-min-time).
	keepAliveTime    = 5 * time.Second
	keepAliveTimeout = 2 * time.Second
)

// TLSConfig are the client's TLS settings. Any field set turns TLS on.
type TLSConfig struct {
	// CA is a PEM file of the CAs that sign the server certificates
	// (empty: the system pool).
	CA string `json:"ca"`
	// Cert and Key are the client certificate and key (PEM files), set
	// together.
	Cert string `json:"cert"`
	Key  string `json:"key"`
	// ServerName overrides the name checked in the server certificate.
	ServerName string `json:"server_name"`
	// InsecureSkipVerify disables server certificate checks (tests only).
	InsecureSkipVerify bool `json:"insecure_skip_verify"`
}

func (t TLSConfig) enabled() bool {
	return t.CA != "" || t.Cert != "" || t.Key != "" || t.ServerName != "" || t.InsecureSkipVerify
}

// Config says where the records are.
type Config struct {
	// Endpoints are the etcd servers, host:port or URLs.
	Endpoints []string `json:"endpoints"`
	// Prefix is the root of kvbandit's keys (default "/kvbandit/v1").
	Prefix string `json:"prefix"`
	// Pool names the worker pool under the prefix (default "default").
	Pool string `json:"pool"`
	// DialTimeoutSecs bounds connection setup and each list (default 5).
	DialTimeoutSecs float64 `json:"dial_timeout_secs"`
	// Username and Password authenticate to etcd, when set.
	Username string `json:"username"`
	Password string `json:"password"`
	// TLS configures client TLS.
	TLS TLSConfig `json:"tls"`
	// MaxListBytes bounds one response from etcd (default 64 MiB); a
	// larger list fails (the source stays degraded on its last good set)
	// instead of being received whole.
	MaxListBytes int `json:"max_list_bytes"`
}

// Defaults fills unset fields.
func (c *Config) Defaults() {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	c.Prefix = strings.TrimRight(c.Prefix, "/")
	if c.Prefix == "" {
		c.Prefix = "/"
	}
	if c.Pool == "" {
		c.Pool = DefaultPool
	}
	if c.DialTimeoutSecs == 0 {
		c.DialTimeoutSecs = DefaultDialTimeoutSecs
	}
	if c.MaxListBytes == 0 {
		c.MaxListBytes = DefaultMaxListBytes
	}
}

// Validate checks a defaulted config; errors name the bad field.
func (c Config) Validate() error {
	switch {
	case len(c.Endpoints) == 0:
		return errors.New("etcd: endpoints: at least one etcd endpoint is required")
	case slices.Contains(c.Endpoints, ""):
		return errors.New("etcd: endpoints: empty endpoint")
	case !strings.HasPrefix(c.Prefix, "/"):
		return fmt.Errorf("etcd: prefix %q must start with /", c.Prefix)
	case c.Pool == "" || strings.Contains(c.Pool, "/"):
		return fmt.Errorf("etcd: pool %q must be a non-empty name without /", c.Pool)
	case c.DialTimeoutSecs <= 0 || math.IsNaN(c.DialTimeoutSecs) || math.IsInf(c.DialTimeoutSecs, 0):
		return fmt.Errorf("etcd: dial_timeout_secs %v must be positive", c.DialTimeoutSecs)
	case c.MaxListBytes <= 0:
		return fmt.Errorf("etcd: max_list_bytes %d must be positive", c.MaxListBytes)
	case c.Password != "" && c.Username == "":
		return errors.New("etcd: password set without username")
	case (c.TLS.Cert == "") != (c.TLS.Key == ""):
		return errors.New("etcd: tls: cert and key must be set together")
	}
	return nil
}

// EndpointsPrefix is the key prefix of the pool's records,
// "<prefix>/<pool>/endpoints/".
func (c Config) EndpointsPrefix() string {
	return strings.TrimRight(c.Prefix, "/") + "/" + c.Pool + "/endpoints/"
}

func (c Config) dialTimeout() time.Duration {
	return time.Duration(c.DialTimeoutSecs * float64(time.Second))
}

// newClient makes a client; it does not connect (clientv3.New is
// non-blocking), so only bad TLS files fail here.
func newClient(cfg Config) (*clientv3.Client, error) {
	cc := clientv3.Config{
		Endpoints:            cfg.Endpoints,
		DialTimeout:          cfg.dialTimeout(),
		DialKeepAliveTime:    keepAliveTime,
		DialKeepAliveTimeout: keepAliveTimeout,
		PermitWithoutStream:  true,
		MaxCallRecvMsgSize:   cfg.MaxListBytes,
		Username:             cfg.Username,
		Password:             cfg.Password,
		Logger:               zap.NewNop(),
	}
	if cfg.TLS.enabled() {
		tc, err := tlsConfig(cfg.TLS)
		if err != nil {
			return nil, err
		}
		cc.TLS = tc
	}
	c, err := clientv3.New(cc)
	if err != nil {
		return nil, fmt.Errorf("etcd: client: %w", err)
	}
	return c, nil
}

func tlsConfig(t TLSConfig) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName, InsecureSkipVerify: t.InsecureSkipVerify} //nolint:gosec // opt-in
	if t.CA != "" {
		pem, err := os.ReadFile(t.CA)
		if err != nil {
			return nil, fmt.Errorf("etcd: tls ca: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("etcd: tls ca %s: no PEM certificates", t.CA)
		}
		tc.RootCAs = pool
	}
	if t.Cert != "" {
		cert, err := tls.LoadX509KeyPair(t.Cert, t.Key)
		if err != nil {
			return nil, fmt.Errorf("etcd: tls client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// Deps are the source's and registrar's collaborators.
type Deps struct {
	Logger *slog.Logger // nil: discard
	Clock  clock.Clock  // nil: real time; used for the retry backoff
}

func (d Deps) defaults() Deps {
	if d.Logger == nil {
		d.Logger = slog.New(slog.DiscardHandler)
	}
	d.Clock = clock.Or(d.Clock)
	return d
}

// Source lists and watches the pool's records. Make it with [New].
type Source struct {
	cfg  Config
	deps Deps
	log  *slog.Logger

	// afterList, when set (tests), runs after every successful list with
	// the list's revision, before the watch starts.
	afterList func(rev int64)
}

var _ discovery.Source = (*Source)(nil)

// New makes a source. cfg is defaulted, then validated.
func New(cfg Config, deps Deps) (*Source, error) {
	cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	deps = deps.defaults()
	return &Source{cfg: cfg, deps: deps, log: deps.Logger.With("source", SourceName)}, nil
}

// Name implements [discovery.Source].
func (s *Source) Name() string { return SourceName }

// errCompacted ends a watch whose start revision was compacted away.
var errCompacted = errors.New("etcd: watch revision compacted")

// Run implements [discovery.Source]. It returns an error only when the
// client cannot be made (unreadable TLS files); every etcd failure is
// reported with [discovery.Sink.SetDegraded] and retried.
func (s *Source) Run(ctx context.Context, sink discovery.Sink) error {
	cli, err := newClient(s.cfg)
	if err != nil {
		return err
	}
	defer cli.Close()
	st := &state{sink: sink, log: s.log, prefix: s.cfg.EndpointsPrefix(), badSeen: map[string]int64{}, dupSeen: map[string]bool{}}
	bo := backoff{min: backoffMin, max: backoffMax}
	degraded := false
	for {
		err := s.session(ctx, cli, st, &degraded, &bo)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, errCompacted) {
			s.log.Info("etcd watch compacted: listing again", "err", err)
			continue
		}
		s.log.Warn("etcd discovery failed: keeping the last endpoint set", "err", err)
		sink.SetDegraded(SourceName, err)
		degraded = true
		if !sleep(ctx, s.deps.Clock, bo.next()) {
			return nil
		}
	}
}

// session lists, publishes and watches until the watch fails or ctx ends.
func (s *Source) session(ctx context.Context, cli *clientv3.Client, st *state, degraded *bool, bo *backoff) error {
	rev, err := s.list(ctx, cli, st)
	if err != nil {
		return err
	}
	bo.reset()
	if *degraded {
		st.sink.SetDegraded(SourceName, nil)
		*degraded = false
	}
	st.publish()
	if s.afterList != nil {
		s.afterList(rev)
	}

	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	probeErr := make(chan error, 1)
	// A failed probe also cancels the watch's context: cli.Watch blocks
	// until its stream is open, retrying for as long as its context
	// lives, so a server killed between the list and the watch would
	// otherwise hold this session (and the source's degraded state) for
	// ever.
	wg.Go(func() {
		if s.probe(wctx, cli, probeErr) {
			cancel()
		}
	})

	wch := cli.Watch(wctx, st.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-probeErr:
			return fmt.Errorf("etcd unreachable: %w", err)
		case wresp, ok := <-wch:
			if !ok {
				if err := ctx.Err(); err != nil {
					return err
				}
				select {
				case err := <-probeErr:
					return fmt.Errorf("etcd unreachable: %w", err)
				default:
				}
				return errors.New("etcd: watch channel closed")
			}
			if wresp.CompactRevision != 0 || errors.Is(wresp.Err(), rpctypes.ErrCompacted) {
				return fmt.Errorf("%w: watch from %d, compacted at %d", errCompacted, rev+1, wresp.CompactRevision)
			}
			if err := wresp.Err(); err != nil {
				return fmt.Errorf("etcd: watch: %w", err)
			}
			if wresp.IsProgressNotify() || len(wresp.Events) == 0 {
				continue
			}
			for _, ev := range wresp.Events {
				switch ev.Type {
				case mvccpb.PUT:
					st.put(ev.Kv)
				case mvccpb.DELETE:
					st.remove(string(ev.Kv.Key))
				}
			}
			st.publish()
		}
	}
}

// list reads the whole prefix into st and returns the revision it saw.
func (s *Source) list(ctx context.Context, cli *clientv3.Client, st *state) (int64, error) {
	lctx, cancel := context.WithTimeout(ctx, s.cfg.dialTimeout())
	defer cancel()
	resp, err := cli.Get(lctx, st.prefix, clientv3.WithPrefix())
	if err != nil {
		return 0, fmt.Errorf("etcd: list %s: %w", st.prefix, err)
	}
	st.reset()
	for _, kv := range resp.Kvs {
		st.put(kv)
	}
	s.log.Debug("etcd listed", "records", len(resp.Kvs), "revision", resp.Header.Revision)
	return resp.Header.Revision, nil
}

// probe reads one key linearizably every probeInterval (it needs a leader)
// and reports the first failure on out (and true): a killed server leaves
// a watch stream silently reconnecting, so the watch alone would not
// notice. It returns false when ctx ends.
func (s *Source) probe(ctx context.Context, cli *clientv3.Client, out chan<- error) bool {
	key := strings.TrimSuffix(s.cfg.EndpointsPrefix(), "endpoints/") + "probe"
	t := time.NewTicker(probeInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		_, err := cli.Get(pctx, key, clientv3.WithCountOnly())
		cancel()
		if err != nil && ctx.Err() == nil {
			out <- err
			return true
		}
	}
}

// state is the source's view of the records, owned by Run's goroutine.
type state struct {
	sink   discovery.Sink
	log    *slog.Logger
	prefix string
	eps    map[string]routing.Endpoint // etcd key → endpoint
	// badSeen remembers the mod revision of each bad record already
	// counted, so a re-list does not count it again; dupSeen the keys
	// counted as duplicates in the last set.
	badSeen map[string]int64
	dupSeen map[string]bool
}

func (st *state) reset() { st.eps = map[string]routing.Endpoint{} }

func (st *state) put(kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	delete(st.eps, key)
	ep, err := st.decode(key, kv.Value)
	if err != nil {
		if st.badSeen[key] != kv.ModRevision {
			st.badSeen[key] = kv.ModRevision
			st.sink.Skipped(SourceName, discovery.SkipReason(err))
			st.log.Warn("etcd record skipped", "key", key, "reason", discovery.SkipReason(err), "err", err)
		}
		return
	}
	delete(st.badSeen, key)
	st.eps[key] = ep
}

func (st *state) decode(key string, value []byte) (routing.Endpoint, error) {
	if strings.TrimPrefix(key, st.prefix) == "" {
		return routing.Endpoint{}, &discovery.RecordError{Reason: discovery.ReasonMalformed, Err: errors.New("empty id")}
	}
	return discovery.DecodeRecord(value)
}

func (st *state) remove(key string) {
	delete(st.eps, key)
	delete(st.badSeen, key)
}

// publish offers the current set, sorted by key; of two records with one
// address, the lower key wins.
func (st *state) publish() {
	keys := make([]string, 0, len(st.eps))
	for k := range st.eps {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, cmp.Compare[string])
	set := routing.EndpointSet{Source: SourceName, Endpoints: make([]routing.Endpoint, 0, len(keys))}
	byAddr := make(map[routing.EndpointKey]string, len(keys))
	dups := map[string]bool{}
	for _, k := range keys {
		ep := st.eps[k]
		if first, dup := byAddr[ep.Key]; dup {
			dups[k] = true
			if !st.dupSeen[k] {
				st.sink.Skipped(SourceName, discovery.ReasonDuplicate)
				st.log.Warn("etcd record skipped: address already registered", "key", k, "address", ep.Key, "kept", first)
			}
			continue
		}
		byAddr[ep.Key] = k
		set.Endpoints = append(set.Endpoints, ep)
	}
	st.dupSeen = dups
	if err := st.sink.Publish(set); err != nil {
		st.log.Warn("etcd endpoint set refused", "err", err)
	}
}

// backoff doubles from min to max.
type backoff struct {
	min, max, cur time.Duration
}

func (b *backoff) next() time.Duration {
	if b.cur == 0 {
		b.cur = b.min
	} else {
		b.cur = min(2*b.cur, b.max)
	}
	return b.cur
}

func (b *backoff) reset() { b.cur = 0 }

// sleep waits d on clk; it reports false when ctx ended first.
func sleep(ctx context.Context, clk clock.Clock, d time.Duration) bool {
	done := make(chan struct{})
	t := clk.AfterFunc(d, func() { close(done) })
	select {
	case <-done:
		return true
	case <-ctx.Done():
		t.Stop()
		return false
	}
}
