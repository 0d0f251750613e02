package kvevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvevents/zmtp"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// Config says where one endpoint's KV events come from.
type Config struct {
	// Endpoint names the worker in callbacks, e.g. "10.0.0.1:8000".
	Endpoint string
	// Address is the ZMQ address, e.g. "tcp://127.0.0.1:5557".
	Address string
	// Bind makes the SUB socket listen on Address (llm-d-inference-sim
	// dials the router); otherwise it connects to the worker's bound PUB
	// (vLLM with "endpoint":"tcp://*:5557"), retrying until Close.
	Bind bool
	// ReplayAddress is vLLM's replay_endpoint (a ROUTER socket), e.g.
	// "tcp://127.0.0.1:5558"; empty disables replay.
	ReplayAddress string
	// FirstSeq is the sequence number of the worker's first message: 0 for
	// vLLM (its publisher counts from itertools.count()), 1 for
	// llm-d-inference-sim. A first message with this number means the
	// subscriber saw the worker's cache from the start.
	FirstSeq uint64
	// QueueSize bounds the messages waiting between the socket and Apply;
	// 0 means 1024. A full queue drops messages (counted).
	QueueSize int
	// QueueBytes bounds the bytes of the messages waiting; 0 means 64 MiB.
	// A message that does not fit is dropped (counted).
	QueueBytes int
	// ReplayTimeout bounds one replay request; 0 means 2 s.
	ReplayTimeout time.Duration
	// HandshakeTimeout bounds a ZMTP handshake; 0 means 5 s.
	HandshakeTimeout time.Duration
	// MaxConns caps the publishers connected at once in bind mode
	// (handshaking ones included); 0 means 16. One worker needs one. When
	// all are taken, a new connection replaces the one that has gone
	// longest without a message, if that has been 2 s or more
	// (zmtp.Options.EvictAfter); otherwise it is refused.
	MaxConns int
	// MaxMessageBytes bounds one ZMQ message (and each of its frames);
	// 0 means 16 MiB, far above the largest batch Decode accepts.
	MaxMessageBytes int
	// Hold makes the Sub queue what arrives without applying it until
	// Resume (a peer replica's state at a known sequence number) or
	// Release (start as without Hold): the warm start (warm.go).
	Hold bool
	// CacheBlocks is the worker's GPU cache in blocks per rank
	// (vllm:cache_config_info's num_gpu_blocks, or configured), which
	// lets an untrusted view regain trust once the cache has turned over
	// (warm.go); 0: unknown until SetCacheBlocks, and trust is regained
	// only by a restart, a clear or a replay. Ranks is the worker's
	// data-parallel ranks (0 means 1); each must turn over.
	CacheBlocks int
	Ranks       int
}

// Deps are the subscriber's collaborators.
type Deps struct {
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// Apply applies one event of the endpoint's data-parallel rank. It is
	// called from one goroutine per Sub, in the worker's order. Required.
	Apply func(endpoint string, rank int, ev kvindex.Event) error
	// OnTrust reports whether the endpoint's indexed view is exact (true)
	// or may have missed events (false: treat it as approximate). It is
	// called on every change, the first time when the first message
	// arrives. Optional.
	OnTrust func(endpoint string, trusted bool)
	// OnResync is called each time the stream is found discontinuous: a
	// sequence gap (drops included), a worker restart, starting after the
	// worker, or a message that could not be decoded. Replay, when
	// configured, is attempted right after it. Optional.
	OnResync func(endpoint string)
	// OnMessage is a tap on the messages this Sub receives from the worker
	// itself (on its socket, or replayed): it is called from the apply
	// goroutine for each one that passed the sequence checks (duplicates
	// are not passed on) and decoded, before its events are applied, so
	// that a replica can republish them for its peers (issue 12). Messages
	// fed with Push are never passed to it (no republish loops). payload is
	// the message's third frame; it is not modified afterwards and may be
	// retained, but must not be modified. It must not block. Optional.
	OnMessage func(endpoint string, seq uint64, payload []byte)
	// OnResumeGap is called when the first message after a Resume
	// leaves a gap after the resumed sequence number (warm.go), after the
	// resync; the caller may Hold and Resume at a fresher state. It must
	// not block (it runs on the apply goroutine). Optional.
	OnResumeGap func(endpoint string)
}

// Stats are a Sub's counters since Subscribe.
type Stats struct {
	Messages  uint64 // messages decoded and applied, replayed ones included
	Events    uint64 // events passed to Apply
	Blocks    uint64 // stored blocks passed to Apply
	Ignored   uint64 // events of other KV groups or media
	Malformed uint64 // messages that failed to decode
	Dropped   uint64 // messages dropped because the queue was full (by count or bytes), pushed ones included
	Pushed    uint64 // messages fed with Push and queued
	// PushIgnored counts pushed messages ignored because this Sub's own
	// socket had a connection open (a publisher dialed its bound socket,
	// or it is connected to the worker's PUB): the worker then reaches
	// this replica directly, and a peer's copies, which may arrive late,
	// would read as a restart.
	PushIgnored    uint64
	Duplicates     uint64 // messages with the last sequence number again
	Gaps           uint64 // sequence gaps, drops included
	Restarts       uint64 // sequence went backwards (worker restart)
	Resyncs        uint64 // OnResync calls
	Replays        uint64 // replay requests sent
	ReplayFailures uint64 // replays that could not fill their gap
	UnknownParent  uint64 // Apply returned kvindex.ErrUnknownParent
	UnknownBlock   uint64 // Apply returned kvindex.ErrUnknownBlock
	// IndexLimit counts events the index refused, in whole or in part, as
	// over its limits (kvindex.ErrWorkerFull, kvindex.ErrTooManyBlockSizes):
	// each makes the view approximate until the worker clears or restarts.
	IndexLimit  uint64
	ApplyErrors uint64 // other Apply errors
	// Connections are the ZMTP connections open now (handshaking ones
	// included); ConnectionsRejected those refused because MaxConns were
	// open and none had been silent long enough to make room;
	// ConnectionsEvicted those closed to make room for a new one, having
	// gone longest without a message (see zmtp.Options.EvictAfter);
	// ConnectionErrors those ended by a failed handshake, a protocol error,
	// a limit or a silent peer.
	Connections         int64
	ConnectionsRejected uint64
	ConnectionsEvicted  uint64
	ConnectionErrors    uint64
	Trusted             bool
	// Warm start and turnover (warm.go): Covered counts queued messages a
	// resumed peer state already held (sequence at or below its own),
	// Turnovers the times trust came back because the worker's cache
	// turned over; Holding says the Sub waits for Resume or Release.
	Covered   uint64
	Turnovers uint64
	Holding   bool
}

// Sub is a running subscription to one endpoint's KV events.
type Sub struct {
	cfg  Config
	deps Deps
	log  *slog.Logger

	sock     *zmtp.Sub
	zopts    zmtp.Options
	addr     net.Addr // bound address in bind mode
	ctx      context.Context
	cancel   context.CancelFunc
	queue    chan message
	queued   atomic.Int64 // bytes in queue
	wg       sync.WaitGroup
	stopOnce sync.Once
	// qmu orders Push against closing the queue: Push holds it shared.
	qmu     sync.RWMutex
	qclosed bool
	stopCtx func() bool // unregisters the shutdown on ctx

	c struct {
		messages, events, blocks, ignored, malformed, dropped, duplicates,
		gaps, restarts, resyncs, replays, replayFailures, unknownParent,
		unknownBlock, indexLimit, applyErrors, pushed, pushIgnored,
		covered, turnovers atomic.Uint64
	}
	trusted atomic.Bool
	// ctrl carries the warm start's requests to the apply goroutine
	// (warm.go); holdingNow mirrors warm.holding for Stats.
	ctrl       chan control
	holdingNow atomic.Bool
	cache      atomic.Int64 // CacheBlocks, then SetCacheBlocks

	// Owned by the apply goroutine.
	started bool
	last    uint64
	trust   int8 // -1 unknown, 0 false, 1 true
	ranks   map[int]struct{}
	warm    warmState
}

// message is one queued ZMQ message: [topic, seq (8 bytes BE), payload].
type message struct {
	frames [][]byte
	pushed bool // fed with Push, not received from the worker
}

// Subscribe starts receiving one endpoint's KV events. In bind mode the
// listen error is returned; in connect mode dialing happens in the
// background, retried until Close. The Sub runs until Close or until ctx
// is done; Close must be called either way.
func Subscribe(ctx context.Context, cfg Config, deps Deps) (*Sub, error) {
	if deps.Apply == nil {
		return nil, errors.New("kvevents: Deps.Apply is required")
	}
	if cfg.Address == "" {
		return nil, errors.New("kvevents: Config.Address is required")
	}
	if cfg.QueueSize <= 0 {
		cfg.QueueSize = 1024
	}
	if cfg.QueueBytes <= 0 {
		cfg.QueueBytes = 64 << 20
	}
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = 2 * time.Second
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = 16
	}
	if cfg.MaxMessageBytes <= 0 {
		cfg.MaxMessageBytes = 16 << 20
	}
	s := &Sub{cfg: cfg, deps: deps, log: deps.Logger, trust: -1, ranks: map[int]struct{}{}, ctrl: make(chan control)}
	s.warm.init(&cfg)
	s.cache.Store(int64(max(cfg.CacheBlocks, 0)))
	s.holdingNow.Store(cfg.Hold)
	if s.log == nil {
		s.log = slog.Default()
	}
	s.log = s.log.With("endpoint", cfg.Endpoint, "kv_events", cfg.Address)
	s.zopts = zmtp.Options{
		Limits: zmtp.Limits{
			MaxFrameSize:   cfg.MaxMessageBytes,
			MaxMessageSize: cfg.MaxMessageBytes,
			// Three frames, four in a replay reply; a few more do no harm
			// and are reported by Decode.
			MaxFrames: 8,
		},
		HandshakeTimeout: cfg.HandshakeTimeout,
		MaxConns:         cfg.MaxConns,
		Logger:           s.log,
	}
	s.ctx, s.cancel = context.WithCancel(ctx)
	s.queue = make(chan message, cfg.QueueSize)
	s.sock = zmtp.NewSub(s.zopts, s.enqueue)
	var err error
	if cfg.Bind {
		s.addr, err = s.sock.Listen(cfg.Address)
	} else {
		err = s.sock.Dial(cfg.Address)
	}
	if err != nil {
		s.cancel()
		_ = s.sock.Close()
		return nil, fmt.Errorf("kvevents: %s: %w", cfg.Address, err)
	}
	s.stopCtx = context.AfterFunc(ctx, s.shutdown)
	s.wg.Add(1)
	go s.applyLoop()
	return s, nil
}

// shutdown closes the socket (no message arrives after it returns), then
// the queue, which ends the apply loop.
func (s *Sub) shutdown() {
	s.stopOnce.Do(func() {
		s.cancel()
		_ = s.sock.Close()
		s.qmu.Lock()
		s.qclosed = true
		close(s.queue)
		s.qmu.Unlock()
	})
}

// Addr is the bound address in bind mode (useful with port 0), else nil.
func (s *Sub) Addr() net.Addr {
	if !s.cfg.Bind {
		return nil
	}
	return s.addr
}

// Close stops the subscription and waits for its goroutines, including an
// Apply call in progress (so Apply must not block indefinitely). Events
// still queued are discarded.
func (s *Sub) Close() {
	s.stopCtx()
	s.shutdown()
	s.wg.Wait()
}

// Stats returns the counters. It is safe to call concurrently.
func (s *Sub) Stats() Stats {
	z := s.sock.Stats()
	return Stats{
		Messages: s.c.messages.Load(), Events: s.c.events.Load(), Blocks: s.c.blocks.Load(),
		Ignored: s.c.ignored.Load(), Malformed: s.c.malformed.Load(), Dropped: s.c.dropped.Load(),
		Duplicates: s.c.duplicates.Load(), Gaps: s.c.gaps.Load(), Restarts: s.c.restarts.Load(),
		Resyncs: s.c.resyncs.Load(), Replays: s.c.replays.Load(), ReplayFailures: s.c.replayFailures.Load(),
		UnknownParent: s.c.unknownParent.Load(), UnknownBlock: s.c.unknownBlock.Load(),
		IndexLimit: s.c.indexLimit.Load(), ApplyErrors: s.c.applyErrors.Load(), Trusted: s.trusted.Load(),
		Pushed: s.c.pushed.Load(), PushIgnored: s.c.pushIgnored.Load(),
		Covered: s.c.covered.Load(), Turnovers: s.c.turnovers.Load(), Holding: s.holdingNow.Load(),
		Connections: z.Conns, ConnectionsRejected: z.Rejected, ConnectionsEvicted: z.Evicted,
		ConnectionErrors: z.HandshakeFailures + z.Failures,
	}
}

// enqueue moves a message from a connection goroutine to the apply loop;
// it never waits. A message over the queue's count or byte bound is
// dropped: the sequence gap that follows triggers the resync.
func (s *Sub) enqueue(frames [][]byte) { s.put(message{frames: frames}) }

// Push feeds one message of the worker received from elsewhere (a peer
// replica that republished it) into the same queue and apply path as the
// socket's: the same sequence checks (a duplicate is dropped, a gap
// resyncs or makes the view approximate), bounds and decoding. It never
// blocks: over the queue's bounds, or after Close, the message is dropped
// (counted, except after Close). payload is retained until applied and
// must not be modified. Pushed messages are not passed to OnMessage.
func (s *Sub) Push(seq uint64, payload []byte) {
	frames := [][]byte{nil, binary.BigEndian.AppendUint64(make([]byte, 0, 8), seq), payload}
	s.qmu.RLock()
	defer s.qmu.RUnlock()
	if s.qclosed {
		return
	}
	if s.put(message{frames: frames, pushed: true}) {
		s.c.pushed.Add(1)
	}
}

// put queues m unless it is over the queue's count or byte bound (then it
// is dropped and counted); it never waits. The queue must be open.
func (s *Sub) put(m message) bool {
	n := 0
	for _, f := range m.frames {
		n += len(f)
	}
	if s.queued.Add(int64(n)) > int64(s.cfg.QueueBytes) {
		s.queued.Add(-int64(n))
		s.c.dropped.Add(1)
		return false
	}
	select {
	case s.queue <- m:
		return true
	default:
		s.queued.Add(-int64(n))
		s.c.dropped.Add(1)
		return false
	}
}

// applyLoop is the apply goroutine: it takes the queued messages in
// order, and the warm start's requests (warm.go) between two of them.
// While the Sub holds, it takes only those requests.
func (s *Sub) applyLoop() {
	defer s.wg.Done()
	for {
		if s.warm.holding {
			select {
			case c := <-s.ctrl:
				s.control(c)
			case <-s.ctx.Done():
				return
			}
			continue
		}
		if m, ok := s.warm.next(); ok {
			s.take(m)
			continue
		}
		select {
		case m, ok := <-s.queue:
			if !ok {
				return
			}
			s.take(m)
		case c := <-s.ctrl:
			s.control(c)
		}
	}
}

// take applies one message taken off the queue.
func (s *Sub) take(m message) {
	for _, f := range m.frames {
		s.queued.Add(-int64(len(f)))
	}
	if s.ctx.Err() != nil {
		return // closing: discard
	}
	if m.pushed && s.sock.Stats().Conns > 0 {
		s.c.pushIgnored.Add(1)
		return
	}
	if s.covers(m) {
		return
	}
	s.handle(m)
}

func seqOf(frames [][]byte) (uint64, bool) {
	if len(frames) != 3 || len(frames[1]) != 8 {
		return 0, false
	}
	return binary.BigEndian.Uint64(frames[1]), true
}

// handle runs the sequence checks for one live message, then applies it.
func (s *Sub) handle(m message) {
	frames := m.frames
	seq, ok := seqOf(frames)
	if !ok {
		// Without a sequence number we cannot tell whether anything was
		// lost; the next message's number will.
		s.c.malformed.Add(1)
		s.log.Debug("kv events: malformed frames", "frames", len(frames))
		return
	}
	switch {
	case !s.started:
		s.started = true
		if seq == s.cfg.FirstSeq {
			s.setTrust(true)
		} else {
			s.log.Info("kv events: subscribed after the worker started", "seq", seq)
			s.resync(s.cfg.FirstSeq, seq)
		}
	case seq == s.last:
		s.c.duplicates.Add(1)
		return
	case seq < s.last:
		s.c.restarts.Add(1)
		s.log.Info("kv events: worker restarted", "seq", seq, "last", s.last)
		s.clearAll()
		s.warm.cleared()
		if seq == s.cfg.FirstSeq {
			s.resyncNotify()
			s.setTrust(true)
		} else {
			s.resync(s.cfg.FirstSeq, seq)
		}
	case seq > s.last+1:
		s.c.gaps.Add(1)
		s.log.Info("kv events: sequence gap", "from", s.last+1, "to", seq-1)
		s.resync(s.last+1, seq)
		s.resumeGap()
	}
	s.warm.resumed = false
	s.applyMsg(seq, frames, !m.pushed)
}

func (s *Sub) resyncNotify() {
	s.warm.hole()
	s.c.resyncs.Add(1)
	if s.deps.OnResync != nil {
		s.deps.OnResync(s.cfg.Endpoint)
	}
}

// resync reports a discontinuity and fills [from, until) by replay when
// it can; otherwise the view is no longer exact.
func (s *Sub) resync(from, until uint64) {
	s.resyncNotify()
	if s.cfg.ReplayAddress != "" && s.replay(from, until) {
		if s.trust < 0 {
			s.setTrust(true)
		}
		return
	}
	s.setTrust(false)
}

func (s *Sub) setTrust(t bool) {
	v := int8(0)
	if t {
		v = 1
	}
	if s.trust == v {
		return
	}
	s.trust = v
	s.trusted.Store(t)
	if s.deps.OnTrust != nil {
		s.deps.OnTrust(s.cfg.Endpoint, t)
	}
}

// clearAll applies Cleared to every rank seen, after a worker restart.
func (s *Sub) clearAll() {
	if len(s.ranks) == 0 {
		s.ranks[0] = struct{}{}
	}
	for r := range s.ranks {
		s.apply(r, kvindex.Event{Kind: kvindex.Cleared})
	}
}

// applyMsg decodes and applies one message and makes seq the last one;
// tap passes a message from the worker itself to OnMessage.
func (s *Sub) applyMsg(seq uint64, frames [][]byte, tap bool) {
	s.last = seq
	b, err := Decode(frames)
	if err != nil {
		s.c.malformed.Add(1)
		s.log.Warn("kv events: cannot decode, view is no longer exact", "seq", seq, "err", err)
		s.resyncNotify()
		s.setTrust(false)
		return
	}
	if tap && s.deps.OnMessage != nil {
		s.deps.OnMessage(s.cfg.Endpoint, seq, frames[2])
	}
	s.c.messages.Add(1)
	s.c.ignored.Add(uint64(b.Ignored))
	s.c.blocks.Add(uint64(b.Blocks))
	s.ranks[b.Rank] = struct{}{}
	for _, ev := range b.Events {
		s.apply(b.Rank, ev)
		if ev.Kind == kvindex.Cleared && len(s.ranks) == 1 {
			// The engine dropped everything: what follows is exact again.
			s.warm.cleared()
			s.setTrust(true)
		}
	}
}

func (s *Sub) apply(rank int, ev kvindex.Event) {
	s.c.events.Add(1)
	err := s.deps.Apply(s.cfg.Endpoint, rank, ev)
	defer s.turnover(rank, &ev)
	switch {
	case err == nil:
	case errors.Is(err, kvindex.ErrUnknownParent):
		s.c.unknownParent.Add(1)
	case errors.Is(err, kvindex.ErrUnknownBlock):
		s.c.unknownBlock.Add(1)
	case errors.Is(err, kvindex.ErrTierFull):
		// A lower tier (CPU, disk) over its caps: that tier's view is
		// incomplete, the GPU's stays exact.
		s.c.indexLimit.Add(1)
	case errors.Is(err, kvindex.ErrWorkerFull), errors.Is(err, kvindex.ErrTooManyBlockSizes):
		// Blocks the worker holds are missing from the index: its view
		// is approximate until it clears or restarts.
		s.c.indexLimit.Add(1)
		if s.trust != 0 {
			s.log.Warn("kv events: the index refused blocks over its limits, view is no longer exact", "rank", rank, "err", err)
		}
		s.warm.limited = true // no turnover brings refused blocks back
		s.setTrust(false)
	default:
		s.c.applyErrors.Add(1)
		s.log.Debug("kv events: apply", "rank", rank, "kind", ev.Kind, "err", err)
	}
}

// endSeq is vLLM's replay terminator, -1 as 8 big-endian bytes.
const endSeq = ^uint64(0)

// replay asks the worker's replay ROUTER for batches from seq from on and
// applies those below until. The protocol (vLLM ZmqEventPublisher.
// _service_replay): the DEALER sends ["", start_seq(8 bytes BE)]; the
// worker answers ["", seq, payload] per buffered batch with seq ≥ start,
// then ["", -1, ""]. It reports whether [from, until) was filled without a
// hole.
func (s *Sub) replay(from, until uint64) bool {
	s.c.replays.Add(1)
	ok := s.doReplay(from, until)
	if !ok {
		s.c.replayFailures.Add(1)
	}
	return ok
}

func (s *Sub) doReplay(from, until uint64) bool {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.ReplayTimeout)
	defer cancel()
	sock, err := zmtp.DialDealer(ctx, s.cfg.ReplayAddress, s.zopts)
	if err != nil {
		s.log.Warn("kv events: replay dial", "err", err)
		return false
	}
	defer sock.Close()
	// The deadline covers the whole exchange: closing ends a Recv.
	stop := context.AfterFunc(ctx, func() { _ = sock.Close() })
	defer stop()
	start := binary.BigEndian.AppendUint64(nil, from)
	if err := sock.Send([]byte{}, start); err != nil {
		s.log.Warn("kv events: replay request", "err", err)
		return false
	}
	next := from
	for {
		f, err := sock.Recv()
		if err != nil {
			s.log.Warn("kv events: replay receive", "err", err, "next", next)
			return false
		}
		if len(f) > 0 && len(f[0]) == 0 {
			f = f[1:] // the DEALER's empty delimiter
		}
		if len(f) != 2 || len(f[0]) != 8 {
			s.c.malformed.Add(1)
			return false
		}
		seq := binary.BigEndian.Uint64(f[0])
		if seq == endSeq {
			return next >= until
		}
		if seq < next {
			continue
		}
		if seq != next {
			// The worker's buffer no longer holds the start of the gap:
			// apply what is there, but the view stays approximate.
			s.log.Info("kv events: replay buffer starts after the gap", "want", next, "got", seq)
			if seq >= until {
				return false
			}
			s.applyMsg(seq, [][]byte{nil, f[0], f[1]}, true)
			next = seq + 1
			for next < until {
				if !s.replayNext(sock, &next) {
					return false
				}
			}
			return false
		}
		if seq >= until {
			return true
		}
		s.applyMsg(seq, [][]byte{nil, f[0], f[1]}, true)
		next = seq + 1
		if next >= until {
			return true
		}
	}
}

// replayNext applies the next replayed message after a hole.
func (s *Sub) replayNext(sock *zmtp.Conn, next *uint64) bool {
	f, err := sock.Recv()
	if err != nil {
		return false
	}
	if len(f) > 0 && len(f[0]) == 0 {
		f = f[1:]
	}
	if len(f) != 2 || len(f[0]) != 8 {
		return false
	}
	seq := binary.BigEndian.Uint64(f[0])
	if seq == endSeq || seq != *next {
		return false
	}
	s.applyMsg(seq, [][]byte{nil, f[0], f[1]}, true)
	*next = seq + 1
	return true
}
