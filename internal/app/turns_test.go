package app

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
)

// TestServeSyncTurns: three replicas on a real nats-server learn their
// ranks (by replica id, among established peers); bursts of requests
// reaching all three at one instant make them bursty, and then the
// replicas after the first wait for their turn while the first never
// does (routing/burst, sync.turns).
func TestServeSyncTurns(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{User: "kvb", Password: "turns"})
	creds := syncCredsConfig(t, srv)
	w := startWorker(t, worker.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	ids := []string{"turn-a", "turn-b", "turn-c"}
	var reps []serveAddrs
	for _, id := range ids {
		reps = append(reps, startServe(t, ctx, w, func(o *ServeOptions) {
			o.SyncNATS, o.ReplicaID, o.DrainTimeout, o.DecisionTimeout, o.ConfigPath = srv.URL(), id, 2*time.Second, 5*time.Second, creds
		}))
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 16}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	type turns struct {
		Turns struct {
			Rank         int     `json:"rank"`
			Replicas     int     `json:"replicas"`
			Simultaneous float64 `json:"simultaneous"`
			Held         int64   `json:"held"`
		} `json:"turns"`
	}
	state := func(i int) turns {
		var st turns
		getJSON(t, c, reps[i].metrics+"/debug/replicas", &st)
		return st
	}
	deadline := time.Now().Add(15 * time.Second)
	for i := 0; i < len(reps); {
		if st := state(i); st.Turns.Replicas == 3 && st.Turns.Rank == i {
			i++
			continue
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica %s: %+v, want rank %d of 3", ids[i], state(i), i)
		}
		time.Sleep(20 * time.Millisecond)
	}

	post := func(url string) {
		body := `{"model":"test-model","max_tokens":2,"messages":[{"role":"user","content":"a burst"}]}`
		resp, err := c.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Error(err)
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("status %d", resp.StatusCode)
		}
	}
	for range 16 {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for _, r := range reps {
			for range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					post(r.proxy)
				}()
			}
		}
		close(start)
		wg.Wait()
		time.Sleep(150 * time.Millisecond)
	}
	first, last := state(0), state(2)
	t.Logf("rank 0: %+v; rank 2: %+v", first.Turns, last.Turns)
	if last.Turns.Simultaneous < 1 || last.Turns.Held == 0 {
		t.Errorf("rank 2 after 16 bursts: %+v, want bursty (>= 1) and decisions held", last.Turns)
	}
	if first.Turns.Held != 0 {
		t.Errorf("rank 0 held %d decisions: the first turn never waits", first.Turns.Held)
	}
	cancel()
	for _, r := range reps {
		select {
		case err := <-r.done:
			if err != nil && err != context.Canceled {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("serve did not stop")
		}
	}
}
