package e2e

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"

	"github.com/kvbandit/kvbandit/e2e/envoysim"
	"github.com/kvbandit/kvbandit/e2e/worker"
)

// conversation builds turn n of an agent session: a shared system prompt,
// then the session's growing history.
func conversation(session, turns int) []byte {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	msgs := []msg{{"system", "You are a careful coding agent working in a large repository. Follow the house style."}}
	for i := range turns {
		msgs = append(msgs, msg{"user", fmt.Sprintf("session %d step %d: please inspect the next file and summarise what it does in detail", session, i)})
		if i < turns-1 {
			msgs = append(msgs, msg{"assistant", fmt.Sprintf("step %d summary: the file defines handlers, tests and a config loader for session %d", i, session)})
		}
	}
	b, _ := json.Marshal(map[string]any{"model": "test-model", "max_tokens": 4, "messages": msgs})
	return b
}

// TestKVPoliciesKeepSessionsTogether: with the KV-aware policies (the
// default kvbandit, and kv), every turn of an agent session goes to the
// worker that served its first turn (its cache holds the growing prefix).
// kvbandit also spreads the sessions, because each announces its remaining
// work (x-prefix-total-requests); kv, with the fleet idle between these
// sequential requests, sends every new session to the worker that already
// caches the shared system prompt (Dynamo's behaviour: cache wins when load
// is equal), which this test records rather than forbids.
func TestKVPoliciesKeepSessionsTogether(t *testing.T) {
	for _, policy := range []string{"", "kv"} {
		name := policy
		if name == "" {
			name = "default"
		}
		t.Run(name, func(t *testing.T) {
			_, addrs := startWorkers(t, 3, worker.Config{})
			var extra []string
			if policy != "" {
				extra = []string{"--policy", policy}
			}
			k := startKvbandit(t, addrs, extra...)
			p := startProxy(t, k, envoysim.Config{})
			c := httpClient(t)
			home := map[int]string{}
			used := map[string]bool{}
			for turn := 1; turn <= 5; turn++ {
				for s := range 6 {
					hdr := map[string]string{"x-prefix-id": fmt.Sprintf("session-%d", s), "x-prefix-total-requests": "5"}
					resp := send(t, c, "POST", p.URL()+chatPath, conversation(s, turn), hdr)
					if resp.status != http.StatusOK {
						t.Fatalf("session %d turn %d: %d %s", s, turn, resp.status, resp.body)
					}
					w := resp.worker()
					if turn == 1 {
						home[s] = w
						used[w] = true
					} else if w != home[s] {
						t.Errorf("session %d turn %d went to %s, its first turn to %s", s, turn, w, home[s])
					}
				}
			}
			if policy == "" && len(used) < 2 {
				t.Errorf("kvbandit started all 6 sessions on one worker: %v", home)
			}
			k.waitReleased(t)
		})
	}
}
