package app

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
)

// TestServeSyncCredentialsFromEnv: the NATS user and password come from
// KVBANDIT_SYNC_NATS_USER / _PASSWORD when the config has none (the Helm
// chart passes them from a Secret): the replica connects to a real
// nats-server that requires them.
func TestServeSyncCredentialsFromEnv(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{User: "kvb", Password: "s3cret"})
	t.Setenv("KVBANDIT_SYNC_NATS_USER", "kvb")
	t.Setenv("KVBANDIT_SYNC_NATS_PASSWORD", "s3cret")
	w := startWorker(t, worker.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	a := startServe(t, ctx, w, func(o *ServeOptions) { o.SyncNATS, o.ReplicaID, o.DrainTimeout = srv.URL(), "env-creds", time.Second })
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
			t.Fatal("not connected to the nats-server that requires the user/password from the environment after 10 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	select {
	case err := <-a.done:
		if err != nil && err != context.Canceled {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not stop")
	}
}
