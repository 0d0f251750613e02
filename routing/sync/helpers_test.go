package sync

import (
	"cmp"
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

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
