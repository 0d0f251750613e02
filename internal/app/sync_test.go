package app

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
)

// getJSON decodes a GET's JSON body into v.
func getJSON(t *testing.T, c *http.Client, url string, v any) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("%s: %v", url, err)
	}
}

// TestServeSyncReplicas: two serve replicas with --sync-nats on one real
// nats-server list each other in /debug/replicas, and a request streaming
// through A shows on B's /debug/endpoints as remote_inflight, then goes.
func TestServeSyncReplicas(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{Token: "sync-test-token"})
	creds := syncCredsConfig(t, srv)
	w := startWorker(t, worker.Config{TokenDelay: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	replica := func(id string) func(*ServeOptions) {
		return func(o *ServeOptions) {
			o.SyncNATS, o.ReplicaID, o.DrainTimeout, o.ConfigPath = srv.URL(), id, 2*time.Second, creds
		}
	}
	a := startServe(t, ctx, w, replica("replica-a"))
	b := startServe(t, ctx, w, replica("replica-b"))
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}

	type replicas struct {
		Enabled   bool   `json:"enabled"`
		Replica   string `json:"replica"`
		Connected bool   `json:"connected"`
		Peers     []struct {
			Replica          string `json:"replica"`
			InFlightReported int    `json:"inflight_reported"`
		} `json:"peers"`
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var ra, rb replicas
		getJSON(t, c, a.metrics+"/debug/replicas", &ra)
		getJSON(t, c, b.metrics+"/debug/replicas", &rb)
		if ra.Connected && rb.Connected && len(ra.Peers) == 1 && ra.Peers[0].Replica == "replica-b" && len(rb.Peers) == 1 && rb.Peers[0].Replica == "replica-a" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replicas do not see each other: A %+v, B %+v", ra, rb)
		}
		time.Sleep(20 * time.Millisecond)
	}

	type endpoints struct {
		Endpoints []struct {
			Address        string `json:"address"`
			InFlight       int64  `json:"inflight"`
			RemoteInFlight int64  `json:"remote_inflight"`
			FleetInFlight  int64  `json:"fleet_inflight"`
		} `json:"endpoints"`
	}
	inflight := func(url string) (local, remote int64) {
		var e endpoints
		getJSON(t, c, url+"/debug/endpoints", &e)
		for _, r := range e.Endpoints {
			local += r.InFlight
			remote += r.RemoteInFlight
		}
		return local, remote
	}
	wait := func(what string, cond func() bool) {
		t.Helper()
		end := time.Now().Add(5 * time.Second)
		for !cond() {
			if time.Now().After(end) {
				t.Fatalf("%s: not within 5 s", what)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	stream := streamRequest(t, c, a.proxy, 40)
	wait("B shows A's request as remote in-flight", func() bool {
		la, _ := inflight(a.metrics)
		lb, rb := inflight(b.metrics)
		return la == 1 && lb == 0 && rb == 1
	})
	stream.Body.Close()
	wait("in-flight back to 0 on both", func() bool {
		la, ra := inflight(a.metrics)
		lb, rb := inflight(b.metrics)
		return la == 0 && ra == 0 && lb == 0 && rb == 0
	})
	cancel()
	for _, d := range []<-chan error{a.done, b.done} {
		select {
		case err := <-d:
			if err != nil && err != context.Canceled {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("serve did not stop")
		}
	}
}

// syncCredsConfig writes a config file with srv's credentials in the
// sync section (sync refuses to connect without credentials).
func syncCredsConfig(t *testing.T, srv *natsenv.Server) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "sync.yaml")
	if err := os.WriteFile(p, []byte(syncCredsYAML(srv)), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// syncCredsYAML is the sync section with srv's credentials.
func syncCredsYAML(srv *natsenv.Server) string {
	o := srv.Options()
	switch {
	case o.User != "":
		return fmt.Sprintf("sync:\n  nats:\n    user: %q\n    password: %q\n", o.User, o.Password)
	case o.Token != "":
		return fmt.Sprintf("sync:\n  nats:\n    token: %q\n", o.Token)
	case o.Nkey:
		return fmt.Sprintf("sync:\n  nats:\n    nkey_file: %q\n", srv.NkeySeedFile())
	}
	return "sync:\n  allow_anonymous: true\n"
}

// TestServeSyncNeedsCredentials: --sync-nats without credentials is a
// usage error that names the fix; --sync-allow-anonymous connects to a
// server that lets anyone in; a config with an nkey seed file connects
// to a server that requires that nkey.
func TestServeSyncNeedsCredentials(t *testing.T) {
	anon := natsenv.Start(t, natsenv.Options{})
	w := startWorker(t, worker.Config{})
	o := ServeOptions{Endpoints: w.Addr(), Policy: "kv", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second,
		LogLevel: "info", LogFormat: "text", SyncNATS: anon.URL(), ReplicaID: "r"}
	err := Serve(t.Context(), o, slog.New(slog.DiscardHandler), &Listeners{})
	if !errors.Is(err, ErrUsage) || !strings.Contains(err.Error(), "needs NATS credentials") || !strings.Contains(err.Error(), "--sync-allow-anonymous") {
		t.Fatalf("serve --sync-nats without credentials: %v, want a usage error naming the fix", err)
	}
	connected := func(edit func(*ServeOptions)) {
		t.Helper()
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		a := startServe(t, ctx, w, edit)
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		c := &http.Client{Transport: tr}
		deadline := time.Now().Add(10 * time.Second)
		for {
			var st struct {
				Connected bool `json:"connected"`
			}
			getJSON(t, c, a.metrics+"/debug/replicas", &st)
			if st.Connected {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("not connected within 10 s")
			}
			time.Sleep(20 * time.Millisecond)
		}
		cancel()
		if err := <-a.done; err != nil && !errors.Is(err, context.Canceled) {
			t.Fatal(err)
		}
	}
	connected(func(o *ServeOptions) {
		o.SyncNATS, o.ReplicaID, o.SyncAllowAnonymous, o.DrainTimeout = anon.URL(), "anon", true, time.Second
	})
	nk := natsenv.Start(t, natsenv.Options{Nkey: true})
	cfg := syncCredsConfig(t, nk)
	connected(func(o *ServeOptions) {
		o.SyncNATS, o.ReplicaID, o.ConfigPath, o.DrainTimeout = nk.URL(), "nkey", cfg, time.Second
	})
}

// TestSyncConfig: the sync section decodes strictly and is validated.
func TestSyncConfig(t *testing.T) {
	c, err := ParseConfig([]byte(`
sync:
  nats:
    servers: [nats://10.0.0.1:4222]
    user: kv
    password: pw
    tls: {ca: /etc/ca.pem, server_name: nats.internal}
    subject_prefix: kvbandit.prod
  batch_interval_ms: 5
  snapshot_interval_ms: 2000
  peer_ttl_ms: 6000
  allow_anonymous: true
  max_peer_inflight: 100
  max_peer_prefill_tokens: 1000000
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Sync.NATS.Servers[0] != "nats://10.0.0.1:4222" || c.Sync.NATS.TLS.ServerName != "nats.internal" || c.Sync.PeerTTLMs != 6000 ||
		!c.Sync.AllowAnonymous || c.Sync.MaxPeerInFlight != 100 || c.Sync.MaxPeerPrefillTokens != 1000000 {
		t.Fatalf("decoded %+v", c.Sync)
	}
	for _, bad := range []string{
		"sync: {nats: {user: a, token: b}}",
		"sync: {nats: {token: a, nkey_file: b}}",
		"sync: {max_peer_inflight: -1}",
		"sync: {peer_ttl_ms: -1}",
		"sync: {nats: {tls: {cert: x}}}",
		"sync: {nats: {nope: 1}}",
	} {
		if _, err := ParseConfig([]byte(bad)); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}

// freeAddr is a loopback address with a port free now.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// TestServeSyncRepublishesBoundKVEvents: a worker that dials only replica
// A's bound KV-event socket (kv_events_bind, llm-d-inference-sim style)
// feeds replica B's event index too: A republishes its messages over NATS
// and B pushes them into its own subscriber for the endpoint (B binds
// another port for it: one host). A's other bound endpoint is unknown to
// B: counted, not applied.
func TestServeSyncRepublishesBoundKVEvents(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{User: "kvb", Password: "kv-events"})
	dir := t.TempDir()
	aAddr, aOther, bAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	cfgA, cfgB := filepath.Join(dir, "a.yaml"), filepath.Join(dir, "b.yaml")
	os.WriteFile(cfgA, []byte(syncCredsYAML(srv)+fmt.Sprintf("router: {kv_events: true}\nendpoints:\n- address: 127.0.0.1:8001\n  kv_events: tcp://%s\n  kv_events_bind: true\n- address: 127.0.0.1:8002\n  kv_events: tcp://%s\n  kv_events_bind: true\n", aAddr, aOther)), 0o644)
	os.WriteFile(cfgB, []byte(syncCredsYAML(srv)+fmt.Sprintf("router: {kv_events: true}\nendpoints:\n- address: 127.0.0.1:8001\n  kv_events: tcp://%s\n  kv_events_bind: true\n", bAddr)), 0o644)
	replica := func(id string) func(*ServeOptions) {
		return func(o *ServeOptions) { o.SyncNATS, o.ReplicaID = srv.URL(), id }
	}
	a := serveConfig(t, cfgA, replica("replica-a"))
	b := serveConfig(t, cfgB, replica("replica-b"))

	// Only messages A receives after B listens are republished to it:
	// wait until they hear each other.
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var ra, rb struct {
			Peers []struct{} `json:"peers"`
		}
		getJSON(t, c, a+"/debug/replicas", &ra)
		getJSON(t, c, b+"/debug/replicas", &rb)
		if len(ra.Peers) == 1 && len(rb.Peers) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("replicas do not see each other")
		}
		time.Sleep(20 * time.Millisecond)
	}

	tokens := make([]any, 32)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	msg := func(seq uint64, hashes []any, parent any) [][]byte {
		ev := []any{"BlockStored", hashes, parent, tokens, 16, nil, "GPU", nil}
		payload, err := msgpack.Marshal([]any{1.0, []any{ev}, 0})
		if err != nil {
			t.Fatal(err)
		}
		return [][]byte{[]byte("kv@127.0.0.1@m"), binary.BigEndian.AppendUint64(nil, seq), payload}
	}
	dial := func(addr string) zmq4.Socket {
		pub := zmq4.NewPub(t.Context())
		if err := pub.Dial("tcp://" + addr); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pub.Close() })
		return pub
	}
	pub, other := dial(aAddr), dial(aOther)
	// PUB drops what is sent before the connection is up: repeat the first
	// message (A drops the repeats as duplicates and republishes it once)
	// until B has it, then send the next one.
	want := func(what, base string, sends func(), lines ...string) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for {
			if sends != nil {
				sends()
			}
			body := get(t, base+"/metrics")
			ok := true
			for _, l := range lines {
				ok = ok && strings.Contains(body, l)
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: want %q in\n%s", what, lines, grepLines(body, "kvbandit_index_entries", "kvbandit_kv_events", "kvbandit_sync"))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	send := func(s zmq4.Socket, f [][]byte) func() {
		return func() {
			if err := s.Send(zmq4.NewMsgFrom(f...)); err != nil {
				t.Fatal(err)
			}
		}
	}
	want("B indexes the first message", b, send(pub, msg(0, []any{uint64(11), uint64(12)}, nil)),
		`kvbandit_index_entries{mode="event"} 2`, `kvbandit_kv_events_trusted{endpoint="127.0.0.1:8001"} 1`)
	send(pub, msg(1, []any{uint64(13), uint64(14)}, uint64(12)))()
	want("B indexes the second message in order", b, nil,
		`kvbandit_index_entries{mode="event"} 4`, `kvbandit_kv_events_trusted{endpoint="127.0.0.1:8001"} 1`,
		`kvbandit_kv_events_total{endpoint="127.0.0.1:8001",kind="messages"} 2`, `kvbandit_kv_events_total{endpoint="127.0.0.1:8001",kind="gaps"} 0`)
	want("A indexes them too", a, nil, `kvbandit_kv_events_total{endpoint="127.0.0.1:8001",kind="messages"} 2`, `kvbandit_kv_events_trusted{endpoint="127.0.0.1:8001"} 1`)
	want("B refuses the endpoint it does not know", b, send(other, msg(0, []any{uint64(21), uint64(22)}, nil)),
		`kvbandit_sync_rejected_total{reason="unknown_endpoint"} 1`)
	want("A sent three kv_events messages", a, nil, `kvbandit_sync_messages_total{direction="sent",kind="kv_events"} 3`)
}
