package kvbandit

import (
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
)

// TestForgetPeerUndoesForgedOutcomes replays the forged-peer case
// on the policy: three equal endpoints whose queues spread the routes,
// then a peer's 98 forged outcomes (1 µs TTFT on one, 4,000 s on the
// others) send every route to the one. Without ForgetPeer it stays so
// under this replica's own traffic (the others get no outcome to correct
// them: the control); after ForgetPeer the routes are spread again at
// once.
func TestForgetPeerUndoesForgedOutcomes(t *testing.T) {
	keys := []routing.EndpointKey{"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"}
	const isl, window = 2000, 6 // a request queues on its endpoint for the next 6 routes
	run := func(forget bool) (honest, forged, after map[routing.EndpointKey]int) {
		p, err := New(DefaultConfig(), nil)
		if err != nil {
			t.Fatal(err)
		}
		cs := cands(string(keys[0]), string(keys[1]), string(keys[2]))
		rnd := routing.NewRand(3)
		var recent []int // endpoint index of the last routes
		route := func(n int) map[routing.EndpointKey]int {
			picks := map[routing.EndpointKey]int{}
			for range n {
				for i := range cs {
					cs[i].ActivePrefillTokens = 0
				}
				for _, j := range recent {
					cs[j].ActivePrefillTokens += isl
				}
				s := &routing.Scoring{Req: &routing.Request{}, BlockSize: 16, ISL: isl, Candidates: cs, Rand: rnd, Now: time.Unix(100, 0)}
				idx, d := decide(t, p, s)
				picks[cs[idx].Key()]++
				ttft := 20*time.Millisecond + time.Duration(cs[idx].ActivePrefillTokens+isl)*20*time.Microsecond
				p.Done(d, routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: ttft, Latency: time.Second, CompletionTokens: 100})
				if recent = append(recent, idx); len(recent) > window {
					recent = recent[1:]
				}
			}
			return picks
		}
		honest = route(300)
		for range 98 {
			for i, k := range keys {
				ttft := 4000 * time.Second
				if i == 0 {
					ttft = time.Microsecond
				}
				p.LearnRemote(&routing.RemoteOutcome{Endpoint: k, DPRank: -1, BlockSize: 16, ISL: isl, Peer: "rogue",
					Outcome: routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: ttft}})
			}
		}
		forged = route(100)
		if forget {
			p.ForgetPeer("rogue")
		}
		return honest, forged, route(300)
	}
	honest, forged, stuck := run(false)
	for _, k := range keys {
		if n := honest[k]; n < 70 {
			t.Fatalf("honest routes %v: %s got %d of 300, want them spread (the premise of this test)", honest, k, n)
		}
	}
	if forged[keys[0]] < 95 || stuck[keys[0]] < 285 {
		t.Fatalf("forged: %v, then without ForgetPeer %v: want (nearly) all on %s, the forgery holding (the control)", forged, stuck, keys[0])
	}
	_, _, spread := run(true)
	t.Logf("honest %v, forged %v, stuck %v, after ForgetPeer %v", honest, forged, stuck, spread)
	for _, k := range keys {
		if n := spread[k]; n < 70 {
			t.Fatalf("after ForgetPeer: %v; %s got %d of 300 routes, want the honest spread back (%v)", spread, k, n, honest)
		}
	}
}
