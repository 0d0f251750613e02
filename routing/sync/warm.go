package sync

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	stdsync "sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing/sync/wire"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file holds the warm start's exchange (issue 22): a replica that
// starts asks a live peer for its state over NATS request/reply, and
// every replica answers its peers' requests, within bounds.
//
// Each replica subscribes to its own state subject, <prefix>.state.<id>
// (the id made a subject token). A requester picks the peer it heard last
// among those heard within the peer TTL (waiting up to Warm.PeerWait for
// one), sends a state request (wire.KindStateRequest) with a random
// transfer number, the most it takes (Warm.MaxBytes) and a reply inbox,
// and gets the chunks (wire.KindStateChunk) in order, Warm.Window at a
// time: it asks for the next window when one is in, so that neither side
// holds more than a window in flight (NATS's slow-consumer limits stay
// far away). Every chunk is decoded like any other peer message, and must
// name the request's transfer, the peer, the next index and the same
// total; the bytes in all are bounded by Warm.MaxBytes; a window not in
// within Warm.WindowTimeout, a refusal, or a chunk that breaks a rule
// ends the attempt, and the next peer is tried, until Warm.Timeout.
//
// A peer answers at most one transfer at a time, and starts at most
// Warm.Burst transfers, then one every Warm.ServeEvery: other requests get
// a refusal (counted by reason), so a hostile or looping requester costs
// it one export per interval. A transfer's chunks are encoded once, kept
// until the requester has asked for the last window or Warm.Timeout
// passes without a request, and a requester may ask for each window at
// most twice.

// Defaults of WarmConfig's zero fields.
const (
	DefaultWarmMaxBytes      = 64 << 20
	DefaultWarmTimeout       = 5 * time.Second
	DefaultWarmWindowTimeout = time.Second
	DefaultWarmWindow        = 8
	DefaultWarmServeEvery    = time.Second
	DefaultWarmBurst         = 2
)

// WarmConfig configures the warm start's exchange.
type WarmConfig struct {
	// Disabled: this replica neither asks its peers for their state nor
	// answers them.
	Disabled bool
	// MaxBytes bounds a transfer's bytes, asked for and answered
	// (default 64 MiB, at most wire.MaxStateBytes).
	MaxBytes int
	// Timeout bounds FetchState (every peer tried), and how long a served
	// transfer is kept without a request (default 5 s).
	Timeout time.Duration
	// WindowTimeout bounds the wait for one window of chunks (default
	// 1 s).
	WindowTimeout time.Duration
	// Window is the chunks sent per request (default 8, at most 64).
	Window int
	// PeerWait bounds FetchState's wait to hear a first peer (default
	// two heartbeat intervals).
	PeerWait time.Duration
	// ServeEvery and Burst rate-limit the transfers this replica starts
	// for its peers: Burst at once, then one per ServeEvery (defaults
	// 1 s and 2).
	ServeEvery time.Duration
	Burst      int
}

func (c *WarmConfig) defaults(heartbeat time.Duration) error {
	switch {
	case c.MaxBytes < 0 || c.MaxBytes > wire.MaxStateBytes:
		return fmt.Errorf("%w: warm start max bytes %d out of [0, %d]", ErrConfig, c.MaxBytes, uint64(wire.MaxStateBytes))
	case c.Window < 0 || c.Window > 64 || c.Burst < 0 || c.Timeout < 0 || c.WindowTimeout < 0 || c.PeerWait < 0 || c.ServeEvery < 0:
		return fmt.Errorf("%w: warm start window, burst and durations must be >= 0 (window <= 64)", ErrConfig)
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	if c.MaxBytes == 0 {
		c.MaxBytes = DefaultWarmMaxBytes
	}
	def(&c.Timeout, DefaultWarmTimeout)
	def(&c.WindowTimeout, DefaultWarmWindowTimeout)
	def(&c.PeerWait, 2*heartbeat)
	def(&c.ServeEvery, DefaultWarmServeEvery)
	if c.Window == 0 {
		c.Window = DefaultWarmWindow
	}
	if c.Burst == 0 {
		c.Burst = DefaultWarmBurst
	}
	return nil
}

// StateSource is what a Syncer needs to answer a peer's state request:
// this replica's state, of at most about maxBytes encoded (the Syncer
// trims what is over). It runs off NATS's delivery goroutine, one call at
// a time, and must stop when ctx ends.
type StateSource interface {
	ExportState(ctx context.Context, maxBytes int) (*warmstate.Snapshot, error)
}

// Errors of FetchState.
var (
	// ErrNoPeer: no peer was heard within Warm.PeerWait, or every peer
	// tried refused or failed.
	ErrNoPeer = errors.New("sync: no peer gave its state")
	// ErrWarmDisabled: the warm start is off (WarmConfig.Disabled, or the
	// Syncer is not started).
	ErrWarmDisabled = errors.New("sync: warm start disabled")
)

// FetchInfo describes a FetchState.
type FetchInfo struct {
	// Peer is the replica whose state was taken; Tried the peers asked,
	// in order, and why each that was left failed.
	Peer  string
	Tried []string
	// Chunks and Bytes are the transfer's.
	Chunks, Bytes int
	Took          time.Duration
}

// warm is a Syncer's warm-start exchange.
type warm struct {
	cfg    WarmConfig
	source StateSource
	m      warmMetrics
	sub    *nats.Subscription
	stop   chan struct{}
	wg     stdsync.WaitGroup

	mu     stdsync.Mutex
	cur    *transfer // the transfer being served, if any
	tokens float64   // transfers that may start now (≤ Burst)
	last   time.Time // when tokens were counted
}

type warmMetrics struct {
	fetches, served *prometheus.CounterVec
	bytes           *prometheus.CounterVec
}

func (w *warm) register(reg prometheus.Registerer) error {
	w.m = warmMetrics{
		fetches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_sync_warm_start_fetches_total", Help: "Warm-start state requests this replica made to its peers, by result (ok; refused: the peer would not answer; timeout; invalid: a chunk broke the exchange's rules or did not decode; too_large: over sync.warm_start.max_bytes; no_peer: none heard).",
		}, []string{"result"}),
		served: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_sync_warm_start_served_total", Help: "Peers' warm-start state requests this replica received, by result (started: a transfer began; window: a next window was sent; busy, rate_limited, no_state, disabled: refused; unknown_transfer, repeated: a continuation refused; malformed: not a valid request).",
		}, []string{"result"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvbandit_sync_warm_start_bytes_total", Help: "Warm-start state bytes sent to peers and received from them.",
		}, []string{"direction"}),
	}
	for _, c := range []prometheus.Collector{w.m.fetches, w.m.served, w.m.bytes} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// stateSubject is a replica's state subject.
func (s *Syncer) stateSubject(replica string) string {
	return s.cfg.SubjectPrefix + ".state." + subjectToken(replica)
}

// startWarm subscribes to this replica's state subject (Start calls it).
func (s *Syncer) startWarm(nc *nats.Conn) error {
	w := s.warm
	w.stop = make(chan struct{})
	w.tokens, w.last = float64(w.cfg.Burst), s.clk.Now()
	if w.cfg.Disabled {
		return nil
	}
	sub, err := nc.Subscribe(s.stateSubject(s.cfg.Replica), s.serveState)
	if err == nil {
		// Requests are small and few: a flood is bounded here, then
		// dropped by NATS (counted as slow_consumer).
		err = sub.SetPendingLimits(1024, 1<<20)
	}
	if err != nil {
		return fmt.Errorf("sync: subscribe %s: %w", s.stateSubject(s.cfg.Replica), err)
	}
	w.sub = sub
	return nil
}

// stopWarm ends the serving goroutines and drops the transfer being
// served (Close calls it before draining the connection).
func (s *Syncer) stopWarm() {
	w := s.warm
	if w.stop == nil {
		return
	}
	close(w.stop)
	w.wg.Wait()
	w.mu.Lock()
	if w.cur != nil {
		w.cur.expire.Stop()
		w.cur = nil
	}
	w.mu.Unlock()
}

// transfer is one transfer being served.
type transfer struct {
	requester string
	id        uint64
	reply     string
	chunks    [][]byte // encoded; nil until the export is done
	asked     []uint8  // requests per window
	expire    *time.Timer
}

// serveState is the state subject's handler (NATS's delivery goroutine for
// it, in order).
func (s *Syncer) serveState(msg *nats.Msg) {
	w := s.warm
	m, err := wire.Decode(msg.Data)
	if err != nil || m.Kind != wire.KindStateRequest || m.Pool != s.cfg.Pool || m.Replica == s.cfg.Replica ||
		m.StateRequest.Transfer == 0 || msg.Reply == "" || len(msg.Reply) > 256 {
		w.m.served.WithLabelValues("malformed").Inc()
		return
	}
	q := m.StateRequest
	if w.source == nil {
		s.refuse(msg.Reply, q.Transfer, "no_state")
		return
	}
	if q.From == 0 {
		s.startTransfer(m.Replica, msg.Reply, &q)
		return
	}
	w.mu.Lock()
	t := w.cur
	if t == nil || t.requester != m.Replica || t.id != q.Transfer || t.chunks == nil || int(q.From) >= len(t.chunks) ||
		int(q.From)%w.cfg.Window != 0 {
		w.mu.Unlock()
		s.refuse(msg.Reply, q.Transfer, "unknown_transfer")
		return
	}
	win := int(q.From) / w.cfg.Window
	if t.asked[win] >= 2 {
		w.mu.Unlock()
		s.refuse(msg.Reply, q.Transfer, "repeated")
		return
	}
	t.asked[win]++
	t.expire.Reset(w.cfg.Timeout)
	chunks := t.window(int(q.From), w.cfg.Window)
	if int(q.From)+len(chunks) >= len(t.chunks) {
		s.endTransfer(t) // the last window: nothing more to keep
	}
	w.mu.Unlock()
	w.m.served.WithLabelValues("window").Inc()
	s.sendChunks(msg.Reply, chunks)
}

// window returns chunks [from, from+n) (t's lock held).
func (t *transfer) window(from, n int) [][]byte {
	return t.chunks[from:min(from+n, len(t.chunks))]
}

// endTransfer forgets t if it is the one served (w.mu held).
func (s *Syncer) endTransfer(t *transfer) {
	w := s.warm
	if w.cur == t {
		t.expire.Stop()
		w.cur = nil
	}
}

// startTransfer begins serving a new transfer, unless one is being served
// to another requester or the rate limit says no.
func (s *Syncer) startTransfer(requester, reply string, q *wire.StateRequest) {
	w := s.warm
	now := s.clk.Now()
	w.mu.Lock()
	if w.cur != nil {
		w.mu.Unlock()
		s.refuse(reply, q.Transfer, "busy")
		return
	}
	w.tokens = min(float64(w.cfg.Burst), w.tokens+now.Sub(w.last).Seconds()/w.cfg.ServeEvery.Seconds())
	w.last = now
	if w.tokens < 1 {
		w.mu.Unlock()
		s.refuse(reply, q.Transfer, "rate_limited")
		return
	}
	w.tokens--
	t := &transfer{requester: requester, id: q.Transfer, reply: reply}
	t.expire = time.AfterFunc(w.cfg.Timeout, func() {
		w.mu.Lock()
		defer w.mu.Unlock()
		s.endTransfer(t)
	})
	w.cur = t
	w.mu.Unlock()
	w.m.served.WithLabelValues("started").Inc()
	limit := min(uint64(w.cfg.MaxBytes), max(q.MaxBytes, 1))
	w.wg.Add(1)
	go s.export(t, int(limit))
}

// export builds t's chunks and sends the first window (its own goroutine).
func (s *Syncer) export(t *transfer, limit int) {
	w := s.warm
	defer w.wg.Done()
	ctx, cancel := context.WithTimeout(context.Background(), w.cfg.Timeout)
	defer cancel()
	go func() { // Close ends the export

		select {
		case <-w.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	chunks, err := s.encodeState(ctx, t, limit)
	w.mu.Lock()
	if err != nil || w.cur != t {
		s.endTransfer(t)
		w.mu.Unlock()
		if err != nil {
			s.log.Warn("warm start: cannot export this replica's state for a peer", "peer", t.requester, "err", err)
			s.refuse(t.reply, t.id, "no_state")
		}
		return
	}
	t.chunks, t.asked = chunks, make([]uint8, (len(chunks)+w.cfg.Window-1)/w.cfg.Window)
	t.asked[0] = 1
	first := t.window(0, w.cfg.Window)
	if len(first) == len(chunks) {
		s.endTransfer(t)
	}
	w.mu.Unlock()
	s.sendChunks(t.reply, first)
}

// encodeState exports the state and encodes it in chunks of at most a
// message each and limit bytes in all, leaving out whole endpoints'
// streams and blocks (the largest first), then sessions, while it is
// over.
func (s *Syncer) encodeState(ctx context.Context, t *transfer, limit int) ([][]byte, error) {
	snap, err := s.warm.source.ExportState(ctx, limit)
	if err != nil {
		return nil, err
	}
	for {
		chunks, size, err := s.chunks(snap, t.id)
		if err != nil {
			return nil, err
		}
		if size <= limit {
			return chunks, nil
		}
		if !trimState(snap) {
			return nil, fmt.Errorf("%w: state of %d bytes, over the transfer's %d", wire.ErrTooLarge, size, limit)
		}
	}
}

func (s *Syncer) chunks(snap *warmstate.Snapshot, id uint64) ([][]byte, int, error) {
	pieces, err := wire.SplitState(snap, wire.ChunkBudget)
	if err != nil {
		return nil, 0, err
	}
	if len(pieces) > wire.MaxStateChunks {
		return nil, 0, fmt.Errorf("%w: %d chunks", wire.ErrTooLarge, len(pieces))
	}
	out := make([][]byte, len(pieces))
	size := 0
	for i := range pieces {
		m := wire.Message{Kind: wire.KindStateChunk, Pool: s.cfg.Pool, Replica: s.cfg.Replica, Epoch: s.epoch,
			StateChunk: wire.StateChunk{Transfer: id, Index: uint32(i), Total: uint32(len(pieces)), State: pieces[i]}}
		b, err := wire.Append(nil, &m)
		if err != nil {
			return nil, 0, err
		}
		out[i] = b
		size += len(b)
	}
	return out, size, nil
}

// trimState leaves out the endpoint with the most blocks (its stream and
// runs: the requester then starts it without a peer's state), or, with
// no block left, half the sessions. It reports false when nothing is left
// to trim.
func trimState(snap *warmstate.Snapshot) bool {
	counts := map[string]int{}
	for i := range snap.Blocks {
		counts[snap.Blocks[i].Endpoint] += len(snap.Blocks[i].Blocks)
	}
	if len(counts) > 0 {
		var worst string
		for ep, n := range counts {
			if worst == "" || n > counts[worst] || (n == counts[worst] && ep < worst) {
				worst = ep
			}
		}
		snap.Blocks = slices.DeleteFunc(snap.Blocks, func(b warmstate.Blocks) bool { return b.Endpoint == worst })
		snap.Streams = slices.DeleteFunc(snap.Streams, func(st warmstate.Stream) bool { return st.Endpoint == worst })
		return true
	}
	if len(snap.Sessions) > 0 {
		snap.Sessions = snap.Sessions[:len(snap.Sessions)/2]
		return true
	}
	return false
}

// refuse answers a request with a refusal and counts it by reason.
func (s *Syncer) refuse(reply string, id uint64, reason string) {
	s.warm.m.served.WithLabelValues(reason).Inc()
	m := wire.Message{Kind: wire.KindStateChunk, Pool: s.cfg.Pool, Replica: s.cfg.Replica, Epoch: s.epoch,
		StateChunk: wire.StateChunk{Transfer: id, Refused: true}}
	if b, err := wire.Append(nil, &m); err == nil && s.nc != nil {
		_ = s.nc.Publish(reply, b)
	}
}

func (s *Syncer) sendChunks(reply string, chunks [][]byte) {
	for _, b := range chunks {
		if err := s.nc.Publish(reply, b); err != nil {
			return
		}
		s.warm.m.bytes.WithLabelValues("sent").Add(float64(len(b)))
	}
}

// FetchState asks a live peer for its state and returns it whole (see the
// file comment): the peer heard last first, then the others, until one
// answers or Warm.Timeout (or ctx) ends. It waits up to Warm.PeerWait to
// hear a first peer. Errors: ErrNoPeer, ErrWarmDisabled, ctx's.
func (s *Syncer) FetchState(ctx context.Context) (*warmstate.Snapshot, FetchInfo, error) {
	w := s.warm
	start := time.Now()
	var info FetchInfo
	if w.cfg.Disabled || !s.started {
		return nil, info, ErrWarmDisabled
	}
	ctx, cancel := context.WithTimeout(ctx, w.cfg.Timeout)
	defer cancel()
	tried := map[string]bool{}
	for {
		peer, err := s.nextPeer(ctx, tried, start)
		if err != nil {
			if len(tried) == 0 {
				w.m.fetches.WithLabelValues("no_peer").Inc()
			}
			info.Took = time.Since(start)
			return nil, info, err
		}
		tried[peer] = true
		snap, chunks, n, err := s.fetchFrom(ctx, peer)
		if err == nil {
			w.m.fetches.WithLabelValues("ok").Inc()
			info.Peer, info.Chunks, info.Bytes, info.Took = peer, chunks, n, time.Since(start)
			info.Tried = append(info.Tried, peer)
			return snap, info, nil
		}
		w.m.fetches.WithLabelValues(fetchResult(err)).Inc()
		info.Tried = append(info.Tried, peer+": "+err.Error())
	}
}

// Errors of one attempt, for fetchResult.
var (
	errRefused    = errors.New("refused")
	errInvalid    = errors.New("invalid chunk")
	errTooLarge   = errors.New("transfer over sync.warm_start.max_bytes")
	errWindowTime = errors.New("no chunk within the window timeout")
)

func fetchResult(err error) string {
	switch {
	case errors.Is(err, errRefused):
		return "refused"
	case errors.Is(err, errTooLarge):
		return "too_large"
	case errors.Is(err, errInvalid):
		return "invalid"
	}
	return "timeout"
}

// nextPeer returns the live peer heard last that was not tried, waiting
// for one up to Warm.PeerWait after start (or ctx).
func (s *Syncer) nextPeer(ctx context.Context, tried map[string]bool, start time.Time) (string, error) {
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if p := s.livePeer(tried); p != "" {
			return p, nil
		}
		if len(tried) > 0 || time.Since(start) >= s.warm.cfg.PeerWait {
			return "", ErrNoPeer
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("%w: %w", ErrNoPeer, ctx.Err())
		case <-tick.C:
		}
	}
}

func (s *Syncer) livePeer(tried map[string]bool) string {
	now := s.clk.Now()
	s.rmu.Lock()
	defer s.rmu.Unlock()
	var best *peer
	for id, p := range s.peers {
		if tried[id] || now.Sub(p.lastHeard) > s.cfg.PeerTTL {
			continue
		}
		if best == nil || p.lastHeard.After(best.lastHeard) || (p.lastHeard.Equal(best.lastHeard) && id < best.replica) {
			best = p
		}
	}
	if best == nil {
		return ""
	}
	return best.replica
}

// fetchFrom runs one transfer from peer.
func (s *Syncer) fetchFrom(ctx context.Context, peer string) (*warmstate.Snapshot, int, int, error) {
	w := s.warm
	inbox := s.nc.NewInbox()
	ch := make(chan *nats.Msg, w.cfg.Window+4)
	sub, err := s.nc.ChanSubscribe(inbox, ch)
	if err != nil {
		return nil, 0, 0, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	_ = sub.SetPendingLimits(w.cfg.Window+4, (w.cfg.Window+4)*wire.MaxMessage)
	var idb [8]byte
	_, _ = rand.Read(idb[:])
	id := binary.LittleEndian.Uint64(idb[:]) | 1
	f := fetch{s: s, peer: peer, id: id, inbox: inbox, snap: &warmstate.Snapshot{}}
	if err := f.ask(0); err != nil {
		return nil, 0, 0, err
	}
	var dec wire.Decoder
	for {
		timer := time.NewTimer(w.cfg.WindowTimeout)
		var msg *nats.Msg
		select {
		case msg = <-ch:
		case <-timer.C:
		case <-ctx.Done():
		}
		timer.Stop()
		if msg == nil {
			if ctx.Err() != nil {
				return nil, 0, 0, ctx.Err()
			}
			return nil, 0, 0, errWindowTime
		}
		if len(msg.Data) == 0 && msg.Header.Get("Status") == "503" {
			// The server says nobody subscribes to the peer's state
			// subject (a replica with the warm start off).
			return nil, 0, 0, fmt.Errorf("%w: no responders", errRefused)
		}
		done, err := f.take(&dec, msg.Data)
		if err != nil {
			return nil, 0, 0, err
		}
		if done {
			return f.snap, int(f.total), f.bytes, nil
		}
	}
}

// fetch is one transfer's requester side.
type fetch struct {
	s     *Syncer
	peer  string
	id    uint64
	inbox string
	snap  *warmstate.Snapshot
	next  uint32 // the next chunk expected
	total uint32
	bytes int
}

func (f *fetch) ask(from uint32) error {
	s := f.s
	m := wire.Message{Kind: wire.KindStateRequest, Pool: s.cfg.Pool, Replica: s.cfg.Replica, Epoch: s.epoch,
		StateRequest: wire.StateRequest{Transfer: f.id, From: from, MaxBytes: uint64(s.warm.cfg.MaxBytes)}}
	b, err := wire.Append(nil, &m)
	if err != nil {
		return err
	}
	return s.nc.PublishRequest(s.stateSubject(f.peer), f.inbox, b)
}

// take checks and applies one chunk; done once the last is in.
func (f *fetch) take(dec *wire.Decoder, data []byte) (bool, error) {
	s := f.s
	f.bytes += len(data)
	s.warm.m.bytes.WithLabelValues("received").Add(float64(len(data)))
	if f.bytes > s.warm.cfg.MaxBytes {
		return false, fmt.Errorf("%w: %d bytes", errTooLarge, f.bytes)
	}
	m, err := dec.Decode(data)
	if err != nil {
		return false, fmt.Errorf("%w: %w", errInvalid, err)
	}
	c := &m.StateChunk
	switch {
	case m.Kind != wire.KindStateChunk || m.Pool != s.cfg.Pool || m.Replica != f.peer || c.Transfer != f.id:
		return false, fmt.Errorf("%w: kind %v from %q, transfer %d", errInvalid, m.Kind, m.Replica, c.Transfer)
	case c.Refused:
		return false, errRefused
	case c.Total == 0 || (f.total != 0 && c.Total != f.total) || c.Index != f.next:
		return false, fmt.Errorf("%w: chunk %d of %d, expected %d of %d", errInvalid, c.Index, c.Total, f.next, f.total)
	}
	f.total = c.Total
	f.snap.Append(&c.State)
	f.next++
	if f.next == f.total {
		return true, nil
	}
	if f.next%uint32(s.warm.cfg.Window) == 0 {
		return false, f.ask(f.next)
	}
	return false, nil
}
