package app

import (
	"encoding/binary"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
)

// chainPub is a worker's KV-event publisher (a bound PUB, vLLM style)
// that stores one block per message, each the child of the one before, so
// that a subscriber that missed the start cannot index the later ones
// without the parents (kvindex.ErrUnknownParent).
type chainPub struct {
	pub    zmq4.Socket
	addr   string
	next   atomic.Uint64 // the next sequence number
	paused atomic.Bool
	mu     sync.Mutex
	stop   chan struct{}
	done   chan struct{}
}

func startChainPub(t *testing.T) *chainPub {
	t.Helper()
	pub := zmq4.NewPub(t.Context())
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	p := &chainPub{pub: pub, addr: "tcp://" + pub.Addr().String(), stop: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(func() { close(p.stop); <-p.done; pub.Close() })
	return p
}

func (p *chainPub) msg(t *testing.T, seq uint64) [][]byte {
	tokens := make([]any, 16)
	for i := range tokens {
		tokens[i] = uint32(seq*16 + uint64(i) + 1)
	}
	var parent any
	if seq > 0 {
		parent = 1000 + seq - 1
	}
	ev := []any{"BlockStored", []any{1000 + seq}, parent, tokens, 16, nil, "GPU", nil}
	payload, err := msgpack.Marshal([]any{1.0, []any{ev}, 0})
	if err != nil {
		t.Error(err)
	}
	return [][]byte{[]byte("kv@127.0.0.1@m"), binary.BigEndian.AppendUint64(nil, seq), payload}
}

// send publishes seq (again, for the first: a PUB drops what goes out
// before a subscriber is connected).
func (p *chainPub) send(t *testing.T, seq uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.pub.Send(zmq4.NewMsgFrom(p.msg(t, seq)...)); err != nil {
		t.Error(err)
	}
}

// run publishes the next message every 10 ms while not paused.
func (p *chainPub) run(t *testing.T) {
	go func() {
		defer close(p.done)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-p.stop:
				return
			case <-tick.C:
			}
			if !p.paused.Load() {
				p.send(t, p.next.Add(1)-1)
			}
		}
	}()
}

// waitMetrics polls base's /metrics until every line is there.
func waitMetrics(t *testing.T, what, base string, within time.Duration, lines ...string) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		body := get(t, base+"/metrics")
		ok := true
		for _, l := range lines {
			ok = ok && strings.Contains(body, l)
		}
		if ok {
			return time.Since(start)
		}
		if time.Since(start) > within {
			t.Fatalf("%s: want %q within %v in\n%s", what, lines, within, grepLines(body, "kvbandit_index_entries", "kvbandit_kv_events", "kvbandit_sync_warm"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestServeWarmStart: replica A has followed a worker's KV events from its
// first message (trusted); replica B starts later, while the worker keeps
// publishing a chain of blocks. B takes A's state over NATS and trusts the
// worker's view at once, indexes the chain's next blocks (whose parents
// came with A's state: no unknown parent), and ends with A's index. With
// the warm start off (the control), B stays untrusted and refuses the
// chain's blocks.
func TestServeWarmStart(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{User: "kvb", Password: "warm"})
	pub := startChainPub(t)
	cfg := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfg, []byte(fmt.Sprintf("sync: {heartbeat_interval_ms: 100, peer_ttl_ms: 1000, nats: {user: kvb, password: warm}}\nendpoints:\n- address: 127.0.0.1:8001\n  block_size: 16\n  kv_events: %s\n", pub.addr)), 0o644)
	replica := func(id string, warm bool) func(*ServeOptions) {
		return func(o *ServeOptions) {
			o.SyncNATS, o.ReplicaID, o.Policy = srv.URL(), id, "kvbandit"
			if !warm {
				o.set = map[string]string{"sync-warm-start": "false"}
				o.SyncWarmStart = false
			}
		}
	}
	a := serveConfig(t, cfg, replica("replica-a", true))
	// A joins at message 0: trusted.
	deadline := time.Now().Add(15 * time.Second)
	for !strings.Contains(get(t, a+"/metrics"), `kvbandit_kv_events_trusted{endpoint="127.0.0.1:8001"} 1`) {
		if time.Now().After(deadline) {
			t.Fatal("A never took the worker's first message")
		}
		pub.send(t, 0)
		time.Sleep(20 * time.Millisecond)
	}
	pub.next.Store(1)
	pub.run(t)
	waitMetrics(t, "A applies the chain", a, 10*time.Second, `kvbandit_kv_events_total{endpoint="127.0.0.1:8001",kind="messages"} 2`)

	start := time.Now()
	b := serveConfig(t, cfg, replica("replica-b", true))
	took := waitMetrics(t, "B trusts the worker after the warm start", b, 5*time.Second, `kvbandit_kv_events_trusted{endpoint="127.0.0.1:8001"} 1`)
	t.Logf("B trusted the worker %v after its Serve returned ready (%v after start)", took, time.Since(start))
	waitMetrics(t, "B's warm start", b, 5*time.Second, `kvbandit_sync_warm_start_endpoints{state="trusted"} 1`, `kvbandit_sync_warm_start_fetches_total{result="ok"} 1`)
	time.Sleep(200 * time.Millisecond) // more of the chain
	pub.paused.Store(true)
	last := pub.next.Load()
	entries := fmt.Sprintf(`kvbandit_index_entries{mode="event"} %d`, last)
	waitMetrics(t, "A holds the whole chain", a, 10*time.Second, entries)
	waitMetrics(t, "B holds the whole chain, no parent unknown", b, 10*time.Second, entries,
		`kvbandit_kv_events_total{endpoint="127.0.0.1:8001",kind="unknown_parent"} 0`,
		`kvbandit_kv_events_total{endpoint="127.0.0.1:8001",kind="gaps"} 0`,
		`kvbandit_kv_events_trusted{endpoint="127.0.0.1:8001"} 1`)
	var rep struct {
		WarmStart WarmReport `json:"warm_start"`
	}
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	getJSON(t, &http.Client{Transport: tr}, b+"/debug/replicas", &rep)
	if w := rep.WarmStart; w.State != "done" || w.Peer != "replica-a" || w.Endpoints["127.0.0.1:8001"] != "trusted" || w.Blocks == 0 {
		t.Errorf("/debug/replicas warm_start %+v", w)
	}

	// The control: without the warm start, a late replica is untrusted
	// and cannot index the chain.
	pub.paused.Store(false)
	c := serveConfig(t, cfg, replica("replica-c", false))
	waitMetrics(t, "C (no warm start) is untrusted and refuses the chain", c, 10*time.Second,
		`kvbandit_kv_events_trusted{endpoint="127.0.0.1:8001"} 0`, `kind="unknown_parent"} 1`)
}

// TestSyncWarmConfig: sync.warm_start and router.kv_cache_blocks decode
// strictly and are validated; --sync-warm-start=false disables it.
func TestSyncWarmConfig(t *testing.T) {
	c, err := ParseConfig([]byte("sync: {warm_start: {max_bytes: 1048576, timeout_ms: 800, ready_wait_ms: 300, attempts: 2, serve_every_ms: 50}}\nrouter: {kv_cache_blocks: 4096}\n"))
	if err != nil {
		t.Fatal(err)
	}
	w := c.Sync.WarmStart
	if w.MaxBytes != 1<<20 || w.readyWait() != 300*time.Millisecond || w.attempts() != 2 || c.Router.KVCacheBlocks != 4096 {
		t.Fatalf("decoded %+v, kv_cache_blocks %d", w, c.Router.KVCacheBlocks)
	}
	if sc := w.syncConfig(); sc.MaxBytes != 1<<20 || sc.Timeout != 800*time.Millisecond || sc.ServeEvery != 50*time.Millisecond || sc.Disabled {
		t.Errorf("sync config %+v", sc)
	}
	var zero SyncWarmConfig
	if zero.readyWait() != time.Second || zero.attempts() != 3 {
		t.Errorf("defaults: ready wait %v, attempts %d", zero.readyWait(), zero.attempts())
	}
	for _, bad := range []string{
		"sync: {warm_start: {max_bytes: -1}}",
		"sync: {warm_start: {max_bytes: 8589934592}}",
		"sync: {warm_start: {attempts: 11}}",
		"sync: {warm_start: {timeout_ms: -5}}",
		"sync: {warm_start: {nope: 1}}",
		"router: {kv_cache_blocks: -1}",
	} {
		if _, err := ParseConfig([]byte(bad)); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
	o := ServeOptions{set: map[string]string{"sync-warm-start": "false"}}
	cfg := DefaultFileConfig()
	if err := o.applyFlags(&cfg); err != nil || !cfg.Sync.WarmStart.Disabled {
		t.Errorf("--sync-warm-start=false: disabled %v, %v", cfg.Sync.WarmStart.Disabled, err)
	}
}
