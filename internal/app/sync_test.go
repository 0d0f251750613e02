package app

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/routing/sync/natstest"
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
	srv := natstest.Start(t, natstest.Options{})
	w := startWorker(t, worker.Config{TokenDelay: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	replica := func(id string) func(*ServeOptions) {
		return func(o *ServeOptions) { o.SyncNATS, o.ReplicaID, o.DrainTimeout = srv.URL(), id, 2*time.Second }
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
`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Sync.NATS.Servers[0] != "nats://10.0.0.1:4222" || c.Sync.NATS.TLS.ServerName != "nats.internal" || c.Sync.PeerTTLMs != 6000 {
		t.Fatalf("decoded %+v", c.Sync)
	}
	for _, bad := range []string{
		"sync: {nats: {user: a, token: b}}",
		"sync: {peer_ttl_ms: -1}",
		"sync: {nats: {tls: {cert: x}}}",
		"sync: {nats: {nope: 1}}",
	} {
		if _, err := ParseConfig([]byte(bad)); err == nil {
			t.Errorf("%q: accepted", bad)
		}
	}
}
