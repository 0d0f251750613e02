package sync

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"strings"
	stdsync "sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/policy/kvbandit"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// syncBuf is a goroutine-safe log sink.
type syncBuf struct {
	mu stdsync.Mutex
	b  bytes.Buffer
}

func (w *syncBuf) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuf) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// node is one replica of a test: a real engine (kvbandit policy, its own
// prefix store) and a Syncer connected to it.
type node struct {
	name string
	e    *engine.Engine
	spy  *spyEngine // e as the Syncer sees it
	pol  *kvbandit.Policy
	s    *Syncer
	reg  *prometheus.Registry
	log  *syncBuf
}

var testFleet = []routing.Endpoint{
	{Key: "10.0.0.1:8000"}, {Key: "10.0.0.2:8000"}, {Key: "10.0.0.3:8000"}, {Key: "10.0.0.4:8000"},
}

// testConfig is a Config with short intervals for tests.
func testConfig(srv *natsenv.Server, replica string) Config {
	c := Config{
		Servers: []string{srv.URL()}, Pool: "p", Replica: replica,
		SnapshotInterval: 300 * time.Millisecond, HeartbeatInterval: 100 * time.Millisecond, PeerTTL: 800 * time.Millisecond,
		ReconnectWait: 100 * time.Millisecond,
	}
	o := srv.Options()
	c.User, c.Password, c.Token, c.NkeyFile = o.User, o.Password, o.Token, srv.NkeySeedFile()
	if f := srv.TLSFiles(); f.CA != "" {
		c.TLS = TLSConfig{CA: f.CA, Cert: f.ClientCert, Key: f.ClientKey}
	}
	return c
}

func newNode(t testing.TB, cfg Config, opts engine.Options) *node {
	t.Helper()
	return newNodeWith(t, cfg, opts, true)
}

// newNodeWith makes a node; without hooks the engine does not feed the
// Syncer (a baseline for benchmarks).
func newNodeWith(t testing.TB, cfg Config, opts engine.Options, hooks bool) *node {
	t.Helper()
	return newNodeDeps(t, cfg, opts, hooks, Deps{})
}

// newNodeDeps makes a node whose Syncer gets deps (Logger and Registry
// are the node's).
func newNodeDeps(t testing.TB, cfg Config, opts engine.Options, hooks bool, deps Deps) *node {
	t.Helper()
	n := &node{name: cfg.Replica, reg: prometheus.NewRegistry(), log: &syncBuf{}}
	deps.Logger, deps.Registry = slog.New(slog.NewTextHandler(n.log, nil)), n.reg
	s, err := New(cfg, deps)
	if err != nil {
		t.Fatal(err)
	}
	n.s = s
	store, err := prefixstate.New(prefixstate.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	rnd := routing.NewRand(int64(len(cfg.Replica)) + 7)
	p, err := policy.Builtin().New("kvbandit", policy.Deps{Rand: rnd, Prefixes: store, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	n.pol = p.(*kvbandit.Policy)
	opts.SyncIndex = true
	rdeps := engine.Deps{Rand: rnd, Logger: slog.New(slog.DiscardHandler)}
	if hooks {
		rdeps.OnDecision, rdeps.OnFirst, rdeps.OnDone = s.OnDecision, s.OnFirst, s.OnDone
	}
	e, err := engine.New(p, opts, rdeps)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: testFleet}); err != nil {
		t.Fatal(err)
	}
	n.e = e
	// Stop order: the syncer before the engine (StartRemote after the
	// engine's Close would panic), the store last.
	t.Cleanup(func() {
		store.Close()
		if c, ok := p.(interface{ Close() error }); ok {
			_ = c.Close()
		}
	})
	t.Cleanup(e.Close)
	t.Cleanup(func() { _ = s.Close() })
	n.spy = &spyEngine{Engine: e}
	if err := s.Start(n.spy); err != nil {
		t.Fatal(err)
	}
	return n
}

// remoteInFlight is the peers' decisions this node carries, over all
// endpoints.
func (n *node) remoteInFlight() (total int64) {
	for _, st := range n.e.Endpoints() {
		total += st.RemoteInFlight.Load()
	}
	return total
}

func (n *node) localInFlight() (total int64) {
	for _, st := range n.e.Endpoints() {
		total += st.InFlight.Load()
	}
	return total
}

func (n *node) pick(t testing.TB, prefixID string, promptSeed int) *routing.Decision {
	t.Helper()
	toks := make([]uint32, 256)
	for i := range toks {
		toks[i] = uint32(promptSeed*1000 + i)
	}
	r := &routing.Request{Model: "m", Tokens: toks, TokenCount: len(toks), Hints: routing.Hints{PrefixID: prefixID, TotalRequests: 10}}
	d, err := n.e.Pick(t.Context(), r)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func (n *node) counter(t testing.TB, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := n.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
						found = true
					}
				}
				if !found {
					continue metric
				}
			}
			switch {
			case m.GetCounter() != nil:
				sum += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				sum += m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

// waitFor polls cond every 2 ms until it holds or d passes; it returns
// how long it took.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(2 * time.Millisecond)
	}
	return time.Since(start)
}

func waitConnected(t testing.TB, nodes ...*node) {
	t.Helper()
	for _, n := range nodes {
		waitFor(t, 10*time.Second, n.name+" connected", func() bool { return !n.s.Degraded() })
	}
	// Every node has heard every other (heartbeats), so the subscriptions
	// are live.
	for _, n := range nodes {
		waitFor(t, 10*time.Second, n.name+" sees its peers", func() bool { return len(n.s.Status().Peers) == len(nodes)-1 })
	}
}

// TestSharesInFlightAndEnds: A's decisions appear in B's and C's
// RemoteInFlight within 100 ms and disappear at their End; A's outcomes
// teach B's posteriors; a session pinned through A sticks on B.
func TestSharesInFlightAndEnds(t *testing.T) {
	srv := startNATS(t)
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	c := newNode(t, testConfig(srv, "c"), engine.Options{})
	waitConnected(t, a, b, c)

	var ds []*routing.Decision
	var worst time.Duration
	for i := range 8 {
		ds = append(ds, a.pick(t, fmt.Sprintf("session-%d", i), i))
		want := int64(len(ds))
		for _, n := range []*node{b, c} {
			if took := waitFor(t, time.Second, "decision applied on "+n.name, func() bool { return n.remoteInFlight() == want }); took > worst {
				worst = took
			}
		}
	}
	t.Logf("worst publish-to-apply delay: %v", worst)
	if worst > 100*time.Millisecond {
		t.Errorf("a decision took %v to reach a peer, want <= 100ms", worst)
	}
	// Per endpoint, B sees exactly A's load.
	for _, st := range a.e.Endpoints() {
		for _, peer := range b.e.Endpoints() {
			if peer.Key == st.Key && peer.RemoteInFlight.Load() != st.InFlight.Load() {
				t.Errorf("%s: B carries %d, A has %d", st.Key, peer.RemoteInFlight.Load(), st.InFlight.Load())
			}
		}
	}
	// The session pinned by A's decision sticks on B.
	d0 := ds[0]
	bd := b.pick(t, "session-0", 999)
	if bd.Endpoint != d0.Endpoint {
		t.Errorf("session-0 went to %s on B, %s on A", bd.Endpoint, d0.Endpoint)
	}
	bd.Done(routing.NoUsage(routing.OutcomeCancelled))

	for _, d := range ds {
		d.Prefilled()
		// Timings as the data plane measures them: since the decision
		// (peers check them against how long it was open on their clock).
		took := time.Since(d.At)
		o := routing.Outcome{Kind: routing.OutcomeSuccess, Status: 200, TTFT: took / 2, Latency: took, PromptTokens: 256, CompletionTokens: 10, CachedTokens: 0}
		d.Done(o)
	}
	for _, n := range []*node{b, c} {
		waitFor(t, time.Second, "ends applied on "+n.name, func() bool { return n.remoteInFlight() == 0 })
	}
	waitFor(t, time.Second, "B learns A's outcomes", func() bool {
		obs := 0
		for _, p := range b.pol.Posteriors() {
			obs += p.Observations
		}
		return obs >= len(ds)
	})
	if got := b.counter(t, "kvbandit_sync_rejected_total"); got != 0 {
		t.Errorf("B rejected %v items", got)
	}
	// 8 decisions, each a Start, a First, an End and an Outcome: batched,
	// plus heartbeats and snapshots.
	sent := a.counter(t, "kvbandit_sync_messages_total", "direction", "sent", "kind", "batch")
	t.Logf("A sent %v batch messages for %d decisions", sent, len(ds))
}

// TestSnapshotRepairsDroppedEnd: an End lost on the way (dropped here
// from A's in-flight set and queue, as a full queue or a lost message
// would) is repaired by A's next snapshot.
func TestSnapshotRepairsDroppedEnd(t *testing.T) {
	srv := startNATS(t)
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitConnected(t, a, b)
	d1, d2 := a.pick(t, "", 1), a.pick(t, "", 2)
	waitFor(t, time.Second, "B applies A's decisions", func() bool { return b.remoteInFlight() == 2 })
	// d1 ends, but its End never leaves A.
	a.s.lmu.Lock()
	delete(a.s.inflight, d1.Number())
	a.s.lmu.Unlock()
	d1.Done(routing.NoUsage(routing.OutcomeCancelled))
	time.Sleep(50 * time.Millisecond)
	if got := b.remoteInFlight(); got != 2 {
		t.Fatalf("B carries %d before the snapshot, want 2 (the End was dropped)", got)
	}
	took := waitFor(t, 2*time.Second, "snapshot repairs the dropped End", func() bool { return b.remoteInFlight() == 1 })
	t.Logf("repaired after %v (snapshot interval 300ms)", took)
	if b.counter(t, "kvbandit_sync_snapshot_repairs_total", "action", "ended") < 1 {
		t.Error("no repair counted")
	}
	d2.Done(routing.NoUsage(routing.OutcomeCancelled))
	waitFor(t, time.Second, "d2 ends on B", func() bool { return b.remoteInFlight() == 0 })
}

// TestPeerTTLExpiry: a replica that goes away without a word has its
// decisions dropped by its peers after the peer TTL.
func TestPeerTTLExpiry(t *testing.T) {
	srv := startNATS(t)
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitConnected(t, a, b)
	var ds []*routing.Decision
	for i := range 5 {
		ds = append(ds, a.pick(t, "", i))
	}
	waitFor(t, time.Second, "B applies A's decisions", func() bool { return b.remoteInFlight() == 5 })
	// A stops talking (as if SIGKILLed): its connection closes, its
	// decisions stay in flight locally, no End is ever sent.
	_ = a.s.Close()
	t0 := time.Now()
	time.Sleep(300 * time.Millisecond)
	if got := b.remoteInFlight(); got != 5 {
		t.Fatalf("B dropped A's decisions before the TTL: %d left", got)
	}
	waitFor(t, 3*time.Second, "A's load dropped on B", func() bool { return b.remoteInFlight() == 0 })
	t.Logf("A's load gone from B %v after A went silent (peer TTL 800ms)", time.Since(t0))
	if len(b.s.Status().Peers) != 0 {
		t.Error("B still lists A")
	}
	for _, d := range ds {
		d.Done(routing.NoUsage(routing.OutcomeCancelled))
	}
}

// TestNATSKillRestart: a killed nats-server degrades every replica to
// local state (gauge 1, decisions still made); after a restart on the
// same port the replicas converge (peers' in-flight equal to the truth,
// including decisions made and ended during the outage) within 2 s.
func TestNATSKillRestart(t *testing.T) {
	srv := startNATS(t)
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitConnected(t, a, b)
	before := []*routing.Decision{a.pick(t, "", 1), a.pick(t, "", 2), a.pick(t, "", 3)}
	waitFor(t, time.Second, "B applies A's decisions", func() bool { return b.remoteInFlight() == 3 })

	srv.Kill()
	for _, n := range []*node{a, b} {
		waitFor(t, 5*time.Second, n.name+" degraded", func() bool { return n.counter(t, "kvbandit_sync_degraded") == 1 })
	}
	// Routing goes on, on local state.
	during := []*routing.Decision{a.pick(t, "", 4), a.pick(t, "", 5), b.pick(t, "", 6)}
	before[0].Done(routing.NoUsage(routing.OutcomeCancelled)) // its End is lost
	if !strings.Contains(a.log.String(), "NATS connection lost") {
		t.Errorf("no log line about the lost connection:\n%s", a.log.String())
	}

	srv.Restart(t)
	truthA, truthB := a.localInFlight(), b.localInFlight() // 4 and 1
	took := waitFor(t, 2*time.Second, "converged after the restart", func() bool {
		return !a.s.Degraded() && !b.s.Degraded() && b.remoteInFlight() == truthA && a.remoteInFlight() == truthB
	})
	t.Logf("converged %v after the restart (A %d, B %d in flight)", took, truthA, truthB)
	for _, d := range append(before[1:], during...) {
		d.Done(routing.NoUsage(routing.OutcomeCancelled))
	}
	waitFor(t, 2*time.Second, "in-flight back to 0", func() bool { return a.remoteInFlight() == 0 && b.remoteInFlight() == 0 })
}

// TestTLSUserPassword: TLS with a generated CA and user/password works.
func TestTLSUserPassword(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{TLS: true, User: "kv", Password: "s3cret"})
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitConnected(t, a, b)
	d := a.pick(t, "", 1)
	waitFor(t, time.Second, "B applies A's decision over TLS", func() bool { return b.remoteInFlight() == 1 })
	d.Done(routing.NoUsage(routing.OutcomeCancelled))
	waitFor(t, time.Second, "B applies the End", func() bool { return b.remoteInFlight() == 0 })
}

// TestMTLSToken: mutual TLS with a token works.
func TestMTLSToken(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{MTLS: true, Token: "tok-123"})
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitConnected(t, a, b)
}

// TestWrongPassword: wrong credentials are a clear error line per period,
// not a crash loop; the replica stays degraded and routes on local state.
func TestWrongPassword(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{User: "kv", Password: "right"})
	cfg := testConfig(srv, "a")
	cfg.Password = "wrong"
	a := newNode(t, cfg, engine.Options{})
	time.Sleep(1500 * time.Millisecond) // ~10 attempts at 100 ms + jitter
	if !a.s.Degraded() || a.counter(t, "kvbandit_sync_degraded") != 1 {
		t.Fatal("connected with a wrong password?")
	}
	logs := a.log.String()
	if n := strings.Count(logs, "NATS rejected the credentials"); n != 1 {
		t.Errorf("%d credential error lines in 1.5 s, want exactly 1:\n%s", n, logs)
	}
	// It keeps trying (the server saw the attempts), it did not give up.
	srvLog, err := os.ReadFile(srv.LogFile())
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(srvLog), "authentication error"); n < 3 {
		t.Errorf("%d attempts in 1.5 s: it stopped retrying", n)
	}
	d := a.pick(t, "", 1) // routing goes on
	d.Done(routing.NoUsage(routing.OutcomeCancelled))
}

// TestUnreachableAtStart: no server at all: Start returns at once, the
// replica is degraded and routes.
func TestUnreachableAtStart(t *testing.T) {
	srv := startNATS(t)
	cfg := testConfig(srv, "a")
	srv.Kill()
	t0 := time.Now()
	a := newNode(t, cfg, engine.Options{})
	if d := time.Since(t0); d > time.Second {
		t.Errorf("Start blocked %v on an unreachable server", d)
	}
	if !a.s.Degraded() {
		t.Fatal("not degraded without a server")
	}
	d := a.pick(t, "", 1)
	srv.Restart(t)
	waitFor(t, 5*time.Second, "connects once the server is up", func() bool { return !a.s.Degraded() })
	d.Done(routing.NoUsage(routing.OutcomeCancelled))
}

// TestHostileMessages: garbage, another pool, unknown endpoints and a
// replica flooding Starts are counted and bounded, never a crash.
func TestHostileMessages(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, testConfig(srv, "b"), engine.Options{MaxRemoteDecisions: 100})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	// The attacker is another Syncer-shaped publisher: a raw connection.
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.send(t, "batch", []byte("garbage \x00\xff"))
	evil.send(t, "batch", make([]byte, 100))
	evil.sendMsg(t, &wireMsg{pool: "other", replica: "x", starts: 1})
	evil.sendMsg(t, &wireMsg{pool: "p", replica: "x", starts: 1, endpoint: "10.9.9.9:1"})
	// Flood: 20 batches of 500 Starts, far over MaxRemoteDecisions.
	for i := range 20 {
		evil.sendMsg(t, &wireMsg{pool: "p", replica: "flood", starts: 500, firstID: uint64(i * 500), seq: uint64(i + 1)})
	}
	waitFor(t, 5*time.Second, "flood counted", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "limit") >= 20*500-100
	})
	if got := b.remoteInFlight(); got != 100 {
		t.Errorf("B carries %d flooded decisions, limit 100", got)
	}
	for _, c := range []struct {
		name, label, value string
		want               float64
	}{
		{"kvbandit_sync_dropped_total", "reason", "malformed", 2},
		{"kvbandit_sync_dropped_total", "reason", "other_pool", 1},
		{"kvbandit_sync_rejected_total", "reason", "unknown_endpoint", 1},
	} {
		if got := b.counter(t, c.name, c.label, c.value); got != c.want {
			t.Errorf("%s{%s=%q} = %v, want %v", c.name, c.label, c.value, got, c.want)
		}
	}
	// B still routes, and its own decisions are unaffected.
	d := b.pick(t, "", 1)
	d.Done(routing.NoUsage(routing.OutcomeCancelled))
	// The flooder is silent: its decisions go with the peer TTL.
	waitFor(t, 3*time.Second, "flooder expired", func() bool { return b.remoteInFlight() == 0 })
}

// TestMessagesPerDecisionUnderLoad: concurrent decisions (start, first
// token, end, outcome) are batched: far fewer than 2 messages a decision,
// and the peer ends with nothing in flight.
func TestMessagesPerDecisionUnderLoad(t *testing.T) {
	srv := startNATS(t)
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitConnected(t, a, b)
	const workers, each = 4, 500
	before := a.counter(t, "kvbandit_sync_messages_total", "direction", "sent", "kind", "batch")
	var wg stdsync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var open []*routing.Decision
			for i := range each {
				open = append(open, a.pick(t, "", w*each+i))
				if len(open) == 8 {
					for _, d := range open {
						d.Prefilled()
						d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, Status: 200, TTFT: 20 * time.Millisecond, Latency: 100 * time.Millisecond, PromptTokens: 256, CompletionTokens: 5, CachedTokens: -1})
					}
					open = open[:0]
				}
			}
			for _, d := range open {
				d.Done(routing.NoUsage(routing.OutcomeCancelled))
			}
		}()
	}
	wg.Wait()
	waitFor(t, 2*time.Second, "B back to 0", func() bool { return b.remoteInFlight() == 0 })
	batches := a.counter(t, "kvbandit_sync_messages_total", "direction", "sent", "kind", "batch") - before
	perDecision := batches / (workers * each)
	t.Logf("%d decisions: %v batch messages, %.3f a decision", workers*each, batches, perDecision)
	if perDecision > 2 {
		t.Errorf("%.2f batch messages a decision, want <= 2", perDecision)
	}
	if got := b.counter(t, "kvbandit_sync_dropped_total"); got != 0 {
		t.Errorf("B dropped %v", got)
	}
}

// TestRestartFloodBounded: a client claiming one peer id with alternating
// epochs (each message a "restart") writes at most peerLinesBurst log
// lines, and re-snapshots come at most every quarter of the snapshot
// interval; the subscription holds at most MaxPendingMsgs messages
// beside MaxPendingBytes; the replica still routes.
func TestRestartFloodBounded(t *testing.T) {
	srv := startNATS(t)
	cfg := testConfig(srv, "b")
	b := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	msgs, pbytes, err := b.s.sub.PendingLimits()
	if err != nil || msgs != DefaultMaxPendingMsgs || pbytes != DefaultMaxPendingBytes {
		t.Fatalf("pending limits %d messages, %d bytes (%v); want %d, %d", msgs, pbytes, err, DefaultMaxPendingMsgs, DefaultMaxPendingBytes)
	}
	snapsBefore := b.counter(t, "kvbandit_sync_messages_total", "direction", "sent", "kind", "snapshot")
	evil := rawPublisher(t, srv, "kvbandit.p")
	const n = 4000
	start := time.Now()
	for i := range n {
		m := &wire.Message{Kind: wire.KindHeartbeat, Pool: "p", Replica: "x", Epoch: uint64(i%2 + 1), Seq: 1,
			Heartbeat: wire.Heartbeat{Interval: 100}}
		raw, err := wire.Append(nil, m)
		if err != nil {
			t.Fatal(err)
		}
		if err := evil.nc.Publish("kvbandit.p.heartbeat", raw); err != nil {
			t.Fatal(err)
		}
	}
	if err := evil.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the flood received", func() bool {
		return b.counter(t, "kvbandit_sync_messages_total", "direction", "received", "kind", "heartbeat") >= n
	})
	elapsed := time.Since(start)
	if got := strings.Count(b.log.String(), "peer replica restarted"); got > peerLinesBurst {
		t.Errorf("%d restart lines for %d forged restarts, want at most %d", got, n, peerLinesBurst)
	}
	gap := min(cfg.SnapshotInterval/4, maxResnapGap)
	snaps := b.counter(t, "kvbandit_sync_messages_total", "direction", "sent", "kind", "snapshot") - snapsBefore
	if limit := float64(elapsed/gap) + 2; snaps > limit {
		t.Errorf("%v snapshots in %v of flood, want at most %v (one per %v)", snaps, elapsed.Round(time.Millisecond), limit, gap)
	}
	d := b.pick(t, "", 1)
	d.Done(routing.NoUsage(routing.OutcomeCancelled))
}

func TestLineBudget(t *testing.T) {
	b := lineBudget{burst: 2, window: time.Minute}
	t0 := time.Unix(1000, 0)
	for i, want := range []bool{true, true, false, false} {
		if ok, _ := b.take(t0.Add(time.Duration(i) * time.Second)); ok != want {
			t.Fatalf("line %d: %v, want %v", i, ok, want)
		}
	}
	ok, held := b.take(t0.Add(time.Minute))
	if !ok || held != 2 {
		t.Errorf("next window: %v, %d held back; want true, 2", ok, held)
	}
	if _, held := b.take(t0.Add(time.Minute + time.Second)); held != 0 {
		t.Errorf("held back reported twice: %d", held)
	}
}

// TestPeerStartBounds: a peer's Start without a TTL, or claiming more
// prompt tokens than MaxRemoteTokens, is refused and counted by reason;
// a TTL over MaxRemoteTTL is cut to it (the decision ends then, though
// its peer keeps heartbeating).
func TestPeerStartBounds(t *testing.T) {
	srv := startNATS(t)
	cfg := testConfig(srv, "b")
	cfg.MaxRemoteTTL, cfg.MaxRemoteTokens = 400*time.Millisecond, 4096
	cfg.PeerTTL = 5 * time.Second
	b := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.sendMsg(t, &wireMsg{pool: "p", replica: "x", starts: 3, noTTL: true, seq: 1})
	evil.sendMsg(t, &wireMsg{pool: "p", replica: "x", starts: 2, firstID: 10, isl: 4097, seq: 2})
	evil.sendMsg(t, &wireMsg{pool: "p", replica: "x", starts: 1, firstID: 20, isl: 4096, ttl: 1 << 31, seq: 3})
	waitFor(t, 5*time.Second, "the capped decision applied", func() bool { return b.remoteInFlight() == 1 })
	for reason, want := range map[string]float64{"no_ttl": 3, "too_many_tokens": 2} {
		if got := b.counter(t, "kvbandit_sync_rejected_total", "reason", reason); got != want {
			t.Errorf("rejected{reason=%q} = %v, want %v", reason, got, want)
		}
	}
	// The peer stays alive (heartbeats) while its decision's TTL, cut to
	// 400 ms, runs out.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		tk := time.NewTicker(100 * time.Millisecond)
		defer tk.Stop()
		for seq := uint64(4); ; seq++ {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			m := &wire.Message{Kind: wire.KindHeartbeat, Pool: "p", Replica: "x", Epoch: 42, Seq: seq, Heartbeat: wire.Heartbeat{InFlight: 1, Interval: 100}}
			raw, err := wire.Append(nil, m)
			if err == nil {
				_ = evil.nc.Publish("kvbandit.p.heartbeat", raw)
			}
		}
	}()
	took := waitFor(t, 5*time.Second, "the capped decision expired", func() bool { return b.remoteInFlight() == 0 })
	if took > 2*time.Second {
		t.Errorf("the decision with a 24-day TTL lasted %v, want about the 400 ms cap", took)
	}
}

// TestForgedIDsCannotLockOut: with every peer slot taken by ids that
// each send a single heartbeat (a stream of them), a real replica that
// joins is admitted at its second message and keeps its slot; forged ids
// never evict each other.
func TestForgedIDsCannotLockOut(t *testing.T) {
	// Each forged id once; and 75 ids in turn, each heard every 300 ms
	// (three heartbeat intervals, within the peer TTL): those had become
	// established, never evicted, and kept a real replica out.
	t.Run("new ids", func(t *testing.T) { forgedIDsCannotLockOut(t, 0) })
	t.Run("ids heard every three heartbeats", func(t *testing.T) { forgedIDsCannotLockOut(t, 75) })
}

// forgedIDsCannotLockOut fills b's peer slots with forged ids, one
// heartbeat every 4 ms (cycle ids in turn, or a new one each time when
// cycle is 0), and checks that a real replica is admitted and kept.
func forgedIDsCannotLockOut(t *testing.T, cycle int) {
	srv := startNATS(t)
	cfg := testConfig(srv, "b")
	cfg.MaxPeers = 8
	b := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tk := time.NewTicker(4 * time.Millisecond) // 250 new ids a second
		defer tk.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			id, seq := i, uint64(1)
			if cycle > 0 {
				id, seq = i%cycle, uint64(1+i/cycle)
			}
			m := &wire.Message{Kind: wire.KindHeartbeat, Pool: "p", Replica: fmt.Sprintf("fake-%d", id), Epoch: 1, Seq: seq, Heartbeat: wire.Heartbeat{Interval: 100}}
			if raw, err := wire.Append(nil, m); err == nil {
				_ = evil.nc.Publish("kvbandit.p.heartbeat", raw)
			}
		}
	}()
	defer func() { close(stop); <-done }()
	hasPeer := func(id string) bool {
		for _, p := range b.s.Status().Peers {
			if p.Replica == id {
				return true
			}
		}
		return false
	}
	waitFor(t, 5*time.Second, "the slots full of forged ids", func() bool {
		return len(b.s.Status().Peers) == cfg.MaxPeers && b.counter(t, "kvbandit_sync_dropped_total", "reason", "too_many_peers") > 0
	})
	time.Sleep(time.Second) // re-heard forged ids have sent three messages each
	newNode(t, testConfig(srv, "c"), engine.Options{})
	waitFor(t, 5*time.Second, "the real replica admitted", func() bool { return hasPeer("c") })
	// A second of forged ids later it is still there.
	time.Sleep(time.Second)
	if !hasPeer("c") {
		t.Fatal("the real replica lost its slot to forged ids")
	}
	if got := b.counter(t, "kvbandit_sync_dropped_total", "reason", "peer_evicted"); got < 1 {
		t.Errorf("%v newcomers evicted, want one at least (for c)", got)
	}
}

func TestSeenIDs(t *testing.T) {
	tb := seenIDs{max: 16}
	t0 := time.Unix(1000, 0)
	for range 5 {
		tb.hear("real", t0)
	}
	for i := range 1000 {
		tb.hear(fmt.Sprintf("fake-%d", i), t0.Add(time.Duration(i)*time.Millisecond))
		if len(tb.ids) > tb.max {
			t.Fatalf("%d ids held, max %d", len(tb.ids), tb.max)
		}
	}
	if got := tb.hear("real", t0); got != 6 {
		t.Errorf("the real id, heard 5 times among 1,000 one-message ids, now counts %d, want 6", got)
	}
	tb.put("evicted", 3, t0)
	tb.forget("real")
	if _, ok := tb.ids["real"]; ok || tb.ids["evicted"].msgs != 3 {
		t.Errorf("forget/put: %v", tb.ids)
	}
}
