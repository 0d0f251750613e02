package sync

import (
	"cmp"
	"slices"
	stdsync "sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// sendBatch publishes one batch of items as replica (epoch 42).
func (p *publisher) sendBatch(t testing.TB, replica string, seq uint64, items ...wire.Item) {
	t.Helper()
	b, err := wire.Append(nil, &wire.Message{Kind: wire.KindBatch, Pool: "p", Replica: replica, Epoch: 42, Seq: seq, Batch: items})
	if err != nil {
		t.Fatal(err)
	}
	p.send(t, "batch", b)
}

// heartbeats publishes a heartbeat as replica (epoch 42) every interval
// until the test ends.
func (p *publisher) heartbeats(t testing.TB, replica string, interval time.Duration) {
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(interval)
		defer tk.Stop()
		for seq := uint64(1 << 20); ; seq++ {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			m := &wire.Message{Kind: wire.KindHeartbeat, Pool: "p", Replica: replica, Epoch: 42, Seq: seq, Heartbeat: wire.Heartbeat{Interval: uint32(interval / time.Millisecond)}}
			if raw, err := wire.Append(nil, m); err == nil {
				_ = p.nc.Publish(p.prefix+".heartbeat", raw)
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
}

// start is a Start item of decision id on ep with isl prompt tokens.
func start(id uint64, ep string, isl uint32) wire.Item {
	return wire.StartItem(wire.Start{ID: id, Endpoint: ep, DPRank: -1, BlockSize: 16, ISL: isl, TTL: 60000})
}

// outcome is an Outcome item of decision id on ep.
func outcome(id uint64, ep string, ttft, latency time.Duration) wire.Item {
	return wire.OutcomeItem(wire.Outcome{ID: id, Endpoint: ep, DPRank: -1, Kind: uint8(routing.OutcomeSuccess), Status: 200,
		TTFTMicros: uint32(ttft / time.Microsecond), LatencyMicros: uint32(latency / time.Microsecond),
		PromptTokens: 32, CompletionTokens: 4, CachedTokens: -1, BlockSize: 16, ISL: 32})
}

// spyEngine is the real engine as a Syncer sees it, recording the
// outcomes it is taught and the peers it is told to forget.
type spyEngine struct {
	*engine.Engine
	mu      stdsync.Mutex
	learned []routing.RemoteOutcome
	forgot  []string
}

func (e *spyEngine) LearnRemote(o routing.RemoteOutcome) error {
	e.mu.Lock()
	e.learned = append(e.learned, o)
	e.mu.Unlock()
	return e.Engine.LearnRemote(o)
}

func (e *spyEngine) ForgetPeer(peer string) {
	e.mu.Lock()
	e.forgot = append(e.forgot, peer)
	e.mu.Unlock()
	e.Engine.ForgetPeer(peer)
}

// taught returns the outcomes learnt so far, by peer.
func (e *spyEngine) taught() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	m := map[string]int{}
	for _, o := range e.learned {
		m[o.Peer]++
	}
	return m
}

func (e *spyEngine) forgotten(peer string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Contains(e.forgot, peer)
}

// startNATS starts a nats-server that requires a user and password (as
// every deployment should: routing/sync refuses to connect without
// credentials unless told to).
func startNATS(t testing.TB) *natsenv.Server {
	t.Helper()
	return natsenv.Start(t, natsenv.Options{User: "kvbandit", Password: "test-secret"})
}

// publisher is a raw NATS connection that sends hand-made sync messages.
type publisher struct {
	nc     *nats.Conn
	prefix string
}

func rawPublisher(t testing.TB, srv *natsenv.Server, prefix string) *publisher {
	t.Helper()
	nc, err := nats.Connect(srv.URL(), srv.ClientOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return &publisher{nc: nc, prefix: prefix}
}

func (p *publisher) send(t testing.TB, kind string, b []byte) {
	t.Helper()
	if err := p.nc.Publish(p.prefix+"."+kind, b); err != nil {
		t.Fatal(err)
	}
	if err := p.nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

// wireMsg describes a batch of Starts.
type wireMsg struct {
	pool, replica string
	starts        int
	firstID       uint64
	endpoint      string // default 10.0.0.1:8000
	seq           uint64
	ttl           uint32 // milliseconds; default 60 s
	noTTL         bool   // send TTL 0
	isl           uint32 // prompt tokens; default 32
}

func (p *publisher) sendMsg(t testing.TB, w *wireMsg) {
	t.Helper()
	ep := w.endpoint
	if ep == "" {
		ep = "10.0.0.1:8000"
	}
	ttl, isl := cmp.Or(w.ttl, 60000), cmp.Or(w.isl, 32)
	if w.noTTL {
		ttl = 0
	}
	m := &wire.Message{Kind: wire.KindBatch, Pool: w.pool, Replica: w.replica, Epoch: 42, Seq: max(w.seq, 1)}
	for i := range w.starts {
		m.Batch = append(m.Batch, wire.StartItem(wire.Start{
			ID: w.firstID + uint64(i) + 1, Endpoint: ep, DPRank: -1, BlockSize: 16, Blocks: []uint64{uint64(i), uint64(i) + 1}, ISL: isl, TTL: ttl,
		}))
	}
	b, err := wire.Append(nil, m)
	if err != nil {
		t.Fatal(err)
	}
	p.send(t, "batch", b)
}
