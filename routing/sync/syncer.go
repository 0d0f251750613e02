package sync

import (
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	stdsync "sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// Defaults of Config's zero fields.
const (
	DefaultBatchInterval     = 2 * time.Millisecond
	DefaultSnapshotInterval  = time.Second
	DefaultHeartbeatInterval = 500 * time.Millisecond
	DefaultPeerTTL           = 3 * time.Second
	DefaultMaxPendingBytes   = 64 << 20
	// DefaultMaxPendingMsgs bounds the messages NATS holds beside their
	// bytes: a flood of tiny messages (26-byte heartbeats) costs NATS a
	// few hundred bytes each in bookkeeping that the byte limit does not
	// count. 65,536 is more than a minute of a busy peer's batches.
	DefaultMaxPendingMsgs = 65536
	DefaultMaxQueueItems  = 16384
	DefaultMaxPeers       = 256
	DefaultReconnectWait  = 250 * time.Millisecond
	// DefaultDecisionTTL is the TTL sent with every Start: how long peers
	// keep a decision without an End (the engine's stale bound).
	DefaultDecisionTTL = engine.DefaultStaleAfter
	// DefaultMaxPeerInFlight bounds one peer's open decisions: what one
	// replica at the default --max-inflight (1024) could hold, with as
	// many proxy requests.
	DefaultMaxPeerInFlight = 2048
	// DefaultOutcomeSlack is how much longer than a decision was open
	// here its outcome may say it took (sync delay, batching).
	DefaultOutcomeSlack = 500 * time.Millisecond
)

// ErrConfig is wrapped by New for an invalid Config.
var ErrConfig = errors.New("sync: invalid config")

// ErrNoCredentials is wrapped (with ErrConfig) by New for a Config with
// no credentials and without AllowAnonymous: on a NATS server that lets
// anyone in, every client would be a trusted peer.
var ErrNoCredentials = errors.New("sync: no NATS credentials (user/password, token, nkey seed file, creds file or an mTLS client certificate)")

// Config configures a Syncer. Zero durations and limits take the defaults
// above.
type Config struct {
	// Servers are the NATS URLs (nats://, tls://), at least one.
	Servers []string
	// Pool is the pool name; messages of another pool are dropped.
	Pool string
	// Replica is this replica's id, unique in the pool.
	Replica string
	// SubjectPrefix is the subject prefix; default "kvbandit.<pool>".
	SubjectPrefix string

	// Authentication: a credentials file (JWT and nkey seed), or user and
	// password, or a token, or an nkey seed file (at most one of them),
	// and/or a TLS client certificate (TLS.Cert, mTLS). One of them is
	// required unless AllowAnonymous is set.
	CredsFile      string
	User, Password string
	Token          string
	NkeyFile       string
	// AllowAnonymous lets the syncer connect without credentials (a
	// warning is logged at Start): then any client the NATS server lets
	// in can act as a peer.
	AllowAnonymous bool
	// TLS configures TLS and mutual TLS.
	TLS TLSConfig

	BatchInterval     time.Duration
	SnapshotInterval  time.Duration
	HeartbeatInterval time.Duration
	PeerTTL           time.Duration
	// DecisionTTL is sent with every Start (how long peers keep it
	// without an End).
	DecisionTTL time.Duration
	// MaxRemoteTTL caps a peer's Start's TTL (a longer one is cut to it);
	// a Start without a TTL is refused (reason "no_ttl"): a decision a
	// peer never ends would hold its load for ever. Default
	// DefaultDecisionTTL.
	MaxRemoteTTL time.Duration
	// MaxRemoteTokens bounds the prompt tokens one peer decision may
	// claim; a Start over it is refused (reason "too_many_tokens").
	// serve sets it to --max-body-bytes: a token takes at least a byte
	// of the body a replica accepts. Default routing.MaxRemoteTokens.
	MaxRemoteTokens int
	// MaxPeerInFlight bounds the open decisions one peer may claim, and
	// MaxPeerPrefillTokens the prompt tokens of those not prefilled yet;
	// a Start past either is refused (reasons "peer_inflight",
	// "peer_prefill_tokens"). Defaults DefaultMaxPeerInFlight and
	// MaxPeerInFlight × MaxRemoteTokens: what one replica could hold.
	MaxPeerInFlight      int
	MaxPeerPrefillTokens int64
	// OutcomeSlack bounds how much a peer's outcome's TTFT and latency
	// may exceed the time its decision was open here (and the latency
	// fall short of it); default DefaultOutcomeSlack.
	OutcomeSlack time.Duration
	// Claims configures the check of peers' decisions against the
	// workers' own request counts (ClaimCheck).
	Claims ClaimCheck
	// ReconnectWait is the pause between reconnect attempts (plus up to
	// half of it at random).
	ReconnectWait time.Duration
	// MaxPendingBytes and MaxPendingMsgs bound the incoming messages NATS
	// holds for this replica before it drops them (counted as
	// slow_consumer), by their bytes and by their count.
	MaxPendingBytes int
	MaxPendingMsgs  int
	// MaxQueueItems bounds the local items waiting to be published; past
	// it items are dropped (the next snapshot repairs peers).
	MaxQueueItems int
	// MaxPeers bounds the peers tracked.
	MaxPeers int
	// MaxKVQueueBytes bounds the KV-event payloads waiting to be
	// republished (PublishKVEvents); past it messages are dropped.
	MaxKVQueueBytes int
	// Warm configures the warm start's exchange (warm.go).
	Warm WarmConfig
}

// TLSConfig is the client side of TLS: a CA to trust (else the system
// pool), a client certificate and key for mTLS, the server name to check.
type TLSConfig struct {
	CA, Cert, Key      string
	ServerName         string
	InsecureSkipVerify bool
}

func (t TLSConfig) enabled() bool {
	return t.CA != "" || t.Cert != "" || t.Key != "" || t.ServerName != "" || t.InsecureSkipVerify
}

// Engine is what a Syncer needs of the routing engine; *engine.Engine
// implements it.
type Engine interface {
	StartRemote(routing.RemoteStart) (*engine.RemoteDecision, error)
	LearnRemote(routing.RemoteOutcome) error
}

var _ Engine = (*engine.Engine)(nil)

// Deps are a Syncer's injected dependencies; nil fields get defaults.
type Deps struct {
	Logger   *slog.Logger          // nil: slog.Default()
	Registry prometheus.Registerer // nil: a private registry
	// Clock measures peers' ages and decisions' TTLs; the periodic work
	// (batching, heartbeats, snapshots, sweeps) runs on real tickers. It
	// must be the engine's clock: the claim checks compare it with the
	// times the engine's scraped loads were reported.
	Clock clock.Clock
	// Rand picks the epoch; nil: crypto/rand.
	Rand func() uint64
	// OnKVEvents receives a worker's KV-event message republished by a
	// peer (see PublishKVEvents): the endpoint's key, the worker's
	// sequence number and the msgpack payload (a copy: it may be
	// retained). It is called on NATS's delivery goroutine and must not
	// block (kvevents.Sub.Push does not). An error (wrap
	// routing.ErrUnknownEndpoint for an endpoint without a subscriber
	// here) is counted in kvbandit_sync_rejected_total. Nil: republished
	// KV events are dropped (reason unsupported).
	OnKVEvents func(endpoint string, seq uint64, payload []byte) error
	// State exports this replica's state for a peer that starts (the
	// warm start, warm.go); nil: peers' requests are refused.
	State StateSource
}

func (c *Config) defaults() error {
	if len(c.Servers) == 0 {
		return fmt.Errorf("%w: no NATS server", ErrConfig)
	}
	if c.Pool == "" || len(c.Pool) > wire.MaxIDLen {
		return fmt.Errorf("%w: pool must have 1 to %d bytes", ErrConfig, wire.MaxIDLen)
	}
	if c.Replica == "" || len(c.Replica) > wire.MaxIDLen {
		return fmt.Errorf("%w: replica id must have 1 to %d bytes", ErrConfig, wire.MaxIDLen)
	}
	if c.SubjectPrefix == "" {
		c.SubjectPrefix = "kvbandit." + subjectToken(c.Pool)
	}
	if strings.ContainsAny(c.SubjectPrefix, " \t\r\n*>") || strings.HasPrefix(c.SubjectPrefix, ".") || strings.HasSuffix(c.SubjectPrefix, ".") || strings.Contains(c.SubjectPrefix, "..") {
		return fmt.Errorf("%w: subject prefix %q", ErrConfig, c.SubjectPrefix)
	}
	if err := c.checkCredentials(); err != nil {
		return err
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.BatchInterval, DefaultBatchInterval)
	def(&c.SnapshotInterval, DefaultSnapshotInterval)
	def(&c.HeartbeatInterval, DefaultHeartbeatInterval)
	def(&c.PeerTTL, DefaultPeerTTL)
	def(&c.DecisionTTL, DefaultDecisionTTL)
	def(&c.MaxRemoteTTL, DefaultDecisionTTL)
	if c.MaxRemoteTokens <= 0 || c.MaxRemoteTokens > routing.MaxRemoteTokens {
		c.MaxRemoteTokens = routing.MaxRemoteTokens
	}
	if c.MaxPeerInFlight <= 0 {
		c.MaxPeerInFlight = DefaultMaxPeerInFlight
	}
	if c.MaxPeerPrefillTokens <= 0 {
		c.MaxPeerPrefillTokens = int64(c.MaxPeerInFlight) * int64(c.MaxRemoteTokens)
	}
	def(&c.OutcomeSlack, DefaultOutcomeSlack)
	c.Claims.defaults()
	def(&c.ReconnectWait, DefaultReconnectWait)
	if c.PeerTTL <= c.HeartbeatInterval {
		return fmt.Errorf("%w: peer TTL %v must exceed the heartbeat interval %v", ErrConfig, c.PeerTTL, c.HeartbeatInterval)
	}
	if c.MaxPendingBytes <= 0 {
		c.MaxPendingBytes = DefaultMaxPendingBytes
	}
	if c.MaxPendingMsgs <= 0 {
		c.MaxPendingMsgs = DefaultMaxPendingMsgs
	}
	if c.MaxQueueItems <= 0 {
		c.MaxQueueItems = DefaultMaxQueueItems
	}
	if c.MaxPeers <= 0 {
		c.MaxPeers = DefaultMaxPeers
	}
	if c.MaxKVQueueBytes <= 0 {
		c.MaxKVQueueBytes = DefaultMaxKVQueueBytes
	}
	return c.Warm.defaults(c.HeartbeatInterval)
}

// checkCredentials: at most one of creds file, user/password, token and
// nkey seed file; a TLS cert with its key; and some credential unless
// AllowAnonymous.
func (c *Config) checkCredentials() error {
	n := 0
	for _, set := range []bool{c.CredsFile != "", c.User != "" || c.Password != "", c.Token != "", c.NkeyFile != ""} {
		if set {
			n++
		}
	}
	if n > 1 {
		return fmt.Errorf("%w: credentials file, user/password, token and nkey seed file are exclusive", ErrConfig)
	}
	if (c.TLS.Cert == "") != (c.TLS.Key == "") {
		return fmt.Errorf("%w: tls cert and key go together", ErrConfig)
	}
	if n == 0 && c.TLS.Cert == "" && !c.AllowAnonymous {
		return fmt.Errorf("%w: %w", ErrConfig, ErrNoCredentials)
	}
	return nil
}

// Anonymous reports whether the configuration connects without
// credentials (AllowAnonymous and none given).
func (c *Config) Anonymous() bool {
	return c.CredsFile == "" && c.User == "" && c.Password == "" && c.Token == "" && c.NkeyFile == "" && c.TLS.Cert == ""
}

// subjectToken makes a pool name usable as one subject token.
func subjectToken(s string) string {
	return strings.Map(func(r rune) rune {
		if r <= ' ' || r == '.' || r == '*' || r == '>' || r == 0x7f {
			return '_'
		}
		return r
	}, s)
}

// Syncer shares this replica's decisions with its peers and applies
// theirs. Make one with New, connect the hooks to engine.Deps, then
// Start it with the engine.
type Syncer struct {
	cfg   Config
	log   *slog.Logger
	clk   clock.Clock
	epoch uint64
	m     *metrics

	subjects [wire.KindKVEvents + 1]string

	// Local side (hooks and flusher).
	lmu      stdsync.Mutex
	queue    []wire.Item
	spare    []wire.Item
	qbytes   int
	inflight map[uint64]*wire.Start
	kick     chan struct{} // the queue went from empty to not empty
	urgent   chan struct{} // the queue nears a message's size
	resnap   chan struct{} // send a snapshot now (reconnected, a peer came back)
	kvQueue  []wire.KVEvents
	kvBytes  int
	kvKick   chan struct{} // the KV-event queue went from empty to not empty
	seq      uint64        // flusher only
	buf      []byte        // flusher only
	// inflightAt is when each in-flight decision was made (s.clk), for
	// the claim checks (vouch.go).
	inflightAt map[uint64]time.Time
	// own is when this replica's own successful outcomes ended, per
	// endpoint (unix ns, s.clk), until a check counts them
	// (completions.go).
	own map[routing.EndpointKey][]int64

	// Remote side.
	rmu    stdsync.Mutex
	eng    Engine
	dec    wire.Decoder
	peers  map[string]*peer
	seen   seenIDs // ids without a slot, by how often they were heard
	closed bool
	onKV   func(endpoint string, seq uint64, payload []byte) error
	// suspects are ids whose claims were refuted, or quarantined
	// (trust.go); at most MaxPeers.
	suspects map[string]*suspect

	nc        *nats.Conn
	sub       *nats.Subscription
	connected atomic.Bool
	authLog   logLimiter
	peerLines lineBudget
	warm      *warm // the warm start's exchange (warm.go)
	stop      chan struct{}
	wg        stdsync.WaitGroup
	started   bool
	closeOnce stdsync.Once

	// refuteLines and claimLines bound refutation and quarantine lines;
	// claims is the flusher's state of the claim check (sweep).
	refuteLines, claimLines lineBudget
	claims                  claimCheckState
	// done holds peers' outcomes waiting for a worker's count of
	// finished requests (completions.go; s.rmu).
	done completions
}

// New checks cfg and makes a Syncer. It does not connect: its hooks may
// be used at once (they queue), Start connects.
func New(cfg Config, deps Deps) (*Syncer, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if deps.Logger == nil {
		deps.Logger = slog.Default()
	}
	if deps.Registry == nil {
		deps.Registry = prometheus.NewRegistry()
	}
	if deps.Clock == nil {
		deps.Clock = clock.Real{}
	}
	s := &Syncer{
		cfg: cfg, log: deps.Logger.With("component", "sync", "replica", cfg.Replica, "pool", cfg.Pool), clk: deps.Clock,
		inflight: make(map[uint64]*wire.Start), inflightAt: make(map[uint64]time.Time), suspects: make(map[string]*suspect),
		kick: make(chan struct{}, 1), urgent: make(chan struct{}, 1), resnap: make(chan struct{}, 1), kvKick: make(chan struct{}, 1),
		peers: make(map[string]*peer), stop: make(chan struct{}), onKV: deps.OnKVEvents,
	}
	if deps.Rand != nil {
		s.epoch = deps.Rand()
	} else {
		var b [8]byte
		_, _ = rand.Read(b[:])
		s.epoch = binary.LittleEndian.Uint64(b[:])
	}
	for k := wire.KindBatch; k <= wire.KindKVEvents; k++ {
		s.subjects[k] = cfg.SubjectPrefix + "." + k.String()
	}
	s.authLog.every = 30 * time.Second
	s.peerLines.burst, s.peerLines.window = peerLinesBurst, peerLinesWindow
	s.refuteLines.burst, s.refuteLines.window = quarantineLinesBurst/2, peerLinesWindow
	s.claimLines.burst, s.claimLines.window = quarantineLinesBurst/2, peerLinesWindow
	s.seen.max = 4 * cfg.MaxPeers
	m, err := newMetrics(deps.Registry, s)
	if err != nil {
		return nil, err
	}
	s.warm = &warm{cfg: cfg.Warm, source: deps.State}
	if err := s.warm.register(deps.Registry); err != nil {
		return nil, err
	}
	s.m = m
	s.m.degraded.Set(1)
	return s, nil
}

// Epoch is this incarnation's random epoch.
func (s *Syncer) Epoch() uint64 { return s.epoch }

// Subject is the subject prefix in use.
func (s *Syncer) Subject() string { return s.cfg.SubjectPrefix }

// Degraded reports whether the syncer is not connected to NATS.
func (s *Syncer) Degraded() bool { return !s.connected.Load() }

// Start connects to NATS in the background (it never waits for a server:
// an unreachable one is retried for ever, the replica routing on local
// state meanwhile), subscribes and starts the flusher. e receives peers'
// decisions and outcomes. A bad TLS file or option is an error; a server
// that is down is not.
func (s *Syncer) Start(e Engine) error {
	if e == nil {
		return fmt.Errorf("%w: nil engine", ErrConfig)
	}
	opts, err := s.natsOptions()
	if err != nil {
		return err
	}
	if s.cfg.Anonymous() {
		s.log.Warn("NATS without credentials (--sync-allow-anonymous): any client the NATS server lets in can act as a peer replica; give the replicas credentials (docs/security.md)")
	}
	s.rmu.Lock()
	s.eng = e
	s.rmu.Unlock()
	nc, err := nats.Connect(strings.Join(s.cfg.Servers, ","), opts...)
	if err != nil {
		return fmt.Errorf("sync: nats: %w", err)
	}
	sub, err := nc.Subscribe(s.cfg.SubjectPrefix+".*", s.receive)
	if err == nil {
		err = sub.SetPendingLimits(s.cfg.MaxPendingMsgs, s.cfg.MaxPendingBytes)
	}
	if err != nil {
		nc.Close()
		return fmt.Errorf("sync: subscribe %s.*: %w", s.cfg.SubjectPrefix, err)
	}
	s.nc, s.sub = nc, sub
	if err := s.startWarm(nc); err != nil {
		nc.Close()
		return err
	}
	// A round trip to the server (PING/PONG after the SUB) makes
	// "connected" mean "hearing peers": before it, the server may not have
	// registered the subscription, and what peers publish meanwhile is
	// lost (seen in TestHostileMessages). Bounded: a slow server only
	// delays Start by subscribeFlushTimeout, and the periodic snapshots
	// repair anything missed.
	if nc.IsConnected() {
		if ferr := nc.FlushTimeout(subscribeFlushTimeout); ferr != nil {
			s.log.Warn("NATS did not confirm the subscription in time", "err", ferr)
		}
	}
	if nc.IsConnected() {
		s.setConnected(nc, true, "")
	} else {
		s.log.Warn("NATS unreachable: routing on local state until it connects", "servers", s.cfg.Servers)
	}
	s.started = true
	s.wg.Add(1)
	go s.run()
	return nil
}

// subscribeFlushTimeout bounds Start's wait for the server to confirm the
// subscription.
const subscribeFlushTimeout = 2 * time.Second

func (s *Syncer) natsOptions() ([]nats.Option, error) {
	c := &s.cfg
	opts := []nats.Option{
		nats.Name("kvbandit " + c.Replica),
		nats.MaxReconnects(-1),
		nats.RetryOnFailedConnect(true),
		nats.ReconnectWait(c.ReconnectWait),
		nats.ReconnectJitter(c.ReconnectWait/2, c.ReconnectWait/2),
		nats.IgnoreAuthErrorAbort(),
		// While disconnected, publishing fails at once (counted): the
		// snapshot after the reconnect carries the state, not a replay.
		nats.ReconnectBufSize(-1),
		nats.Timeout(2 * time.Second),
		nats.PingInterval(time.Second),
		nats.MaxPingsOutstanding(2),
		nats.DrainTimeout(2 * time.Second),
		nats.ConnectHandler(func(nc *nats.Conn) { s.setConnected(nc, true, "connected") }),
		nats.ReconnectHandler(func(nc *nats.Conn) { s.setConnected(nc, true, "reconnected") }),
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			if s.connected.Load() {
				s.setConnected(nc, false, "")
				s.log.Warn("NATS connection lost: routing on local state until it reconnects", "err", err)
			}
		}),
		nats.ReconnectErrHandler(func(_ *nats.Conn, err error) { s.connectFailed(err) }),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			if errors.Is(err, nats.ErrSlowConsumer) {
				s.m.dropped.WithLabelValues("slow_consumer").Inc()
				return
			}
			s.connectFailed(err)
		}),
	}
	switch {
	case c.CredsFile != "":
		opts = append(opts, nats.UserCredentials(c.CredsFile))
	case c.User != "" || c.Password != "":
		opts = append(opts, nats.UserInfo(c.User, c.Password))
	case c.Token != "":
		opts = append(opts, nats.Token(c.Token))
	case c.NkeyFile != "":
		opt, err := nats.NkeyOptionFromSeed(c.NkeyFile)
		if err != nil {
			return nil, fmt.Errorf("%w: nkey seed file: %w", ErrConfig, err)
		}
		opts = append(opts, opt)
	}
	if c.TLS.enabled() {
		tc, err := c.TLS.config()
		if err != nil {
			return nil, err
		}
		opts = append(opts, nats.Secure(tc))
	}
	return opts, nil
}

func (t TLSConfig) config() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName, InsecureSkipVerify: t.InsecureSkipVerify} //nolint:gosec // opt-in
	if t.CA != "" {
		pem, err := os.ReadFile(t.CA)
		if err != nil {
			return nil, fmt.Errorf("%w: tls ca: %w", ErrConfig, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%w: tls ca %s: no certificate", ErrConfig, t.CA)
		}
		tc.RootCAs = pool
	}
	if t.Cert != "" {
		cert, err := tls.LoadX509KeyPair(t.Cert, t.Key)
		if err != nil {
			return nil, fmt.Errorf("%w: tls cert: %w", ErrConfig, err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

func (s *Syncer) setConnected(nc *nats.Conn, up bool, what string) {
	s.connected.Store(up)
	if up {
		s.m.degraded.Set(0)
		if what != "" {
			s.log.Info("NATS "+what+": sharing state with peers", "url", nc.ConnectedUrlRedacted())
		}
		s.signal(s.resnap)
		return
	}
	s.m.degraded.Set(1)
}

// connectFailed logs a failed (re)connect attempt: at most one line per
// distinct error every 30 s, so a wrong password is one clear line per
// period, not a flood.
func (s *Syncer) connectFailed(err error) {
	s.m.connectErrors.Inc()
	if s.authLog.allow(err.Error(), time.Now()) {
		msg := "NATS connect failed: routing on local state, retrying"
		if errors.Is(err, nats.ErrAuthorization) || strings.Contains(strings.ToLower(err.Error()), "authorization") {
			msg = "NATS rejected the credentials (check sync.nats user/password, token, nkey_file or creds_file): routing on local state, retrying"
		}
		s.log.Error(msg, "err", err, "servers", s.cfg.Servers)
	}
}

// logLimiter lets one message per key through every period.
type logLimiter struct {
	mu    stdsync.Mutex
	every time.Duration
	last  map[string]time.Time
}

func (l *logLimiter) allow(key string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.last == nil || len(l.last) > 64 {
		l.last = make(map[string]time.Time)
	}
	if t, ok := l.last[key]; ok && now.Sub(t) < l.every {
		return false
	}
	l.last[key] = now
	return true
}

func (s *Syncer) signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// Close flushes what is queued, drains the connection (at most a couple
// of seconds), ends every peer decision applied to the engine and stops
// the goroutines. Call it before the engine's Close. It is idempotent.
func (s *Syncer) Close() error {
	s.closeOnce.Do(func() {
		if !s.started {
			s.rmu.Lock()
			s.closed = true
			s.rmu.Unlock()
			return
		}
		close(s.stop)
		s.wg.Wait() // the flusher publishes the last batch before it returns
		s.stopWarm()
		closed := make(chan struct{})
		s.nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
		if err := s.nc.Drain(); err != nil {
			s.nc.Close()
		}
		select {
		case <-closed:
		case <-time.After(5 * time.Second):
			s.nc.Close()
		}
		s.connected.Store(false)
		s.rmu.Lock()
		s.closed = true
		for id, p := range s.peers {
			p.endAll()
			delete(s.peers, id)
		}
		s.suspects = nil
		s.done = completions{}
		s.rmu.Unlock()
	})
	return nil
}
