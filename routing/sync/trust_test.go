package sync

import (
	"fmt"
	"math/rand/v2"
	"strings"
	stdsync "sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// The forged-peer cases of issue 22, with an authenticated client: the
// rogue here has the replicas' own credentials (a raw NATS connection
// speaking routing/sync/wire), so only the bounds below stop it.

const ep1, ep2 = "10.0.0.1:8000", "10.0.0.2:8000"

// claimsConfig is cfg with a short claim-check slack, so a test need not
// wait half a second before a scrape counts a decision.
func claimsConfig(cfg Config) Config {
	cfg.Claims.Slack = 50 * time.Millisecond
	return cfg
}

// TestPeerCaps: one peer may claim at most MaxPeerInFlight open decisions
// and MaxPeerPrefillTokens prompt tokens not prefilled yet; over-cap
// Starts are refused and counted by reason, and a first token frees its
// prompt's tokens. Before the caps, all 14 Starts were applied.
func TestPeerCaps(t *testing.T) {
	srv := startNATS(t)
	cfg := testConfig(srv, "b")
	cfg.MaxPeerInFlight, cfg.MaxPeerPrefillTokens = 5, 3000
	b := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	var items []wire.Item
	for i := range 10 {
		items = append(items, start(uint64(i+1), ep1, 32))
	}
	evil.sendBatch(t, "x", 1, items...)
	waitFor(t, 5*time.Second, "x's Starts seen", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "peer_inflight") == 5
	})
	if got := b.remoteInFlight(); got != 5 {
		t.Fatalf("B carries %d of x's decisions, cap 5", got)
	}
	// Prefill tokens: 4 prompts of 1,000 tokens, cap 3,000.
	evil.sendBatch(t, "y", 1, start(1, ep2, 1000), start(2, ep2, 1000), start(3, ep2, 1000), start(4, ep2, 1000))
	waitFor(t, 5*time.Second, "y's Starts seen", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "peer_prefill_tokens") == 1
	})
	if got := b.remoteInFlight(); got != 8 {
		t.Fatalf("B carries %d decisions, want 5 of x and 3 of y", got)
	}
	// A first token frees 1,000 of y's prefill tokens: the 4th fits now.
	evil.sendBatch(t, "y", 2, wire.FirstItem(1), start(4, ep2, 1000))
	waitFor(t, 5*time.Second, "y's 4th Start applied after a first token", func() bool { return b.remoteInFlight() == 9 })
	st := b.s.Status()
	for _, p := range st.Peers {
		if p.Replica == "y" && p.PrefillTokens != 3000 {
			t.Errorf("y holds %d prefill tokens, want 3000", p.PrefillTokens)
		}
	}
}

// TestKVCapacityCap: where the endpoint's KV capacity is known (scraped
// num_gpu_blocks x block size), a peer's decision may claim no longer a
// prompt than it holds.
func TestKVCapacityCap(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	b.e.ReportLoad(ep1, routing.Load{Known: true, KVBlocks: 100}, 16) // 1,600 tokens
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.sendBatch(t, "x", 1, start(1, ep1, 1601), start(2, ep1, 1600), start(3, ep2, 100000))
	waitFor(t, 5*time.Second, "x's Starts seen", func() bool { return b.remoteInFlight() == 2 })
	if got := b.counter(t, "kvbandit_sync_rejected_total", "reason", "over_kv_capacity"); got != 1 {
		t.Errorf("over_kv_capacity = %v, want 1 (ep2's capacity is not known: only the caps apply)", got)
	}
}

// TestClaimsRefutedAndQuarantined: a peer claims 100 decisions on an
// endpoint whose worker counts 3 requests: at the next fresh scrape the
// excess over what the worker vouches for (3 + 4 + 1 of slack) ends, its
// outcomes are not learnt, and its ids are not applied again; refuted
// three scrapes in a row, the peer is quarantined (its decisions end,
// its Starts and outcomes are refused, the engine forgets its teaching)
// until the quarantine ends. Log lines stay within their budgets. Before
// the check, all 300 claims stayed until their TTL.
func TestClaimsRefutedAndQuarantined(t *testing.T) {
	srv := startNATS(t)
	cfg := claimsConfig(testConfig(srv, "b"))
	cfg.Claims.Quarantine = 1500 * time.Millisecond
	cfg.Claims.QuarantineAt = 1000 // by strikes here: TestQuarantineAtOnce
	cfg.PeerTTL = 5 * time.Second
	b := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.heartbeats(t, "x", 100*time.Millisecond)
	scrape := func() { b.e.ReportLoad(ep1, routing.Load{Running: 2, Waiting: 1, Known: true}, 0) }
	var seq uint64
	claim := func(round int) {
		var items []wire.Item
		for i := range 100 {
			items = append(items, start(uint64(round*1000+i), ep1, 32))
		}
		seq++
		evil.sendBatch(t, "x", seq, items...)
	}
	for round := range 3 {
		claim(round)
		waitFor(t, 5*time.Second, "x's claims applied", func() bool { return b.remoteInFlight() >= 100 })
		time.Sleep(80 * time.Millisecond) // past the 50 ms slack
		before := b.counter(t, "kvbandit_sync_refuted_total")
		scrape()
		if round == 2 {
			break // the third strike: quarantine, below
		}
		// 3 requests on the worker + 4 + 10% of them: 8 vouched.
		waitFor(t, 5*time.Second, "refuted down to what the worker vouches for", func() bool { return b.remoteInFlight() == 8 })
		if got, want := b.counter(t, "kvbandit_sync_refuted_total")-before, float64(92+8*round); got != want {
			t.Errorf("round %d: %v refuted, want %v", round, got, want)
		}
	}
	waitFor(t, 5*time.Second, "x quarantined", func() bool { return b.counter(t, "kvbandit_sync_quarantined_total") == 1 })
	waitFor(t, time.Second, "x's decisions ended", func() bool { return b.remoteInFlight() == 0 })
	if !b.spy.forgotten("x") {
		t.Error("the engine was not told to forget x's teaching")
	}
	if got := b.counter(t, "kvbandit_sync_peers_quarantined"); got != 1 {
		t.Errorf("peers_quarantined = %v, want 1", got)
	}
	// Quarantined: its Starts and outcomes are refused.
	seq++
	evil.sendBatch(t, "x", seq, start(5000, ep1, 32), outcome(5000, ep1, time.Millisecond, time.Millisecond))
	waitFor(t, 5*time.Second, "x's Start refused", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "quarantined") == 2
	})
	// A refuted decision's outcome is not learnt, nor is it applied again
	// (the peer's snapshots would list it).
	if got := b.spy.taught()["x"]; got != 0 {
		t.Errorf("%d of x's outcomes learnt", got)
	}
	logs := b.log.String()
	if n := strings.Count(logs, "peer replica quarantined"); n != 1 {
		t.Errorf("%d quarantine lines, want 1:\n%s", n, logs)
	}
	if n := strings.Count(logs, "decisions refuted"); n < 1 || n > quarantineLinesBurst/2 {
		t.Errorf("%d refutation lines, want 1 to %d", n, quarantineLinesBurst/2)
	}
	// The quarantine ends: x's Starts are applied again.
	waitFor(t, 5*time.Second, "quarantine over", func() bool {
		seq++
		evil.sendBatch(t, "x", seq, start(6000+seq, ep1, 32))
		time.Sleep(20 * time.Millisecond)
		return b.remoteInFlight() > 0
	})
}

// TestRefutedOutcomesDropped: a refuted decision's outcome is dropped
// (outcome_refuted), and its id is not applied again by a Start.
func TestRefutedOutcomesDropped(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, claimsConfig(testConfig(srv, "b")), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.heartbeats(t, "x", 100*time.Millisecond)
	var items []wire.Item
	for i := range 20 {
		items = append(items, start(uint64(i+1), ep1, 32))
	}
	evil.sendBatch(t, "x", 1, items...)
	waitFor(t, 5*time.Second, "applied", func() bool { return b.remoteInFlight() == 20 })
	time.Sleep(80 * time.Millisecond)
	b.e.ReportLoad(ep1, routing.Load{Known: true}, 0) // an idle worker vouches for 4 (the slack)
	waitFor(t, 5*time.Second, "refuted", func() bool { return b.remoteInFlight() == 4 })
	// The oldest claims went first; all were sent at once, so any 16.
	var refuted []uint64
	b.s.rmu.Lock()
	for id, d := range b.s.peers["x"].trust.ended {
		if d.refuted {
			refuted = append(refuted, id)
		}
	}
	b.s.rmu.Unlock()
	if len(refuted) != 16 {
		t.Fatalf("%d refuted ids remembered, want 16", len(refuted))
	}
	evil.sendBatch(t, "x", 2, wire.EndItem(refuted[0]), outcome(refuted[0], ep1, time.Millisecond, 10*time.Millisecond), start(refuted[1], ep1, 32))
	waitFor(t, 5*time.Second, "counted", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_refuted") == 1 &&
			b.counter(t, "kvbandit_sync_rejected_total", "reason", "refuted") == 1
	})
	if got := b.remoteInFlight(); got != 4 {
		t.Errorf("B carries %d, want the 4 vouched", got)
	}
}

// TestClaimsBlameTheLargest: an honest peer with 6 decisions on an
// endpoint (the worker counts exactly those) and a rogue with 50 there:
// the check cuts the rogue down to the level the worker vouches for and
// leaves the honest peer's decisions alone; only the rogue gets a strike.
func TestClaimsBlameTheLargest(t *testing.T) {
	srv := startNATS(t)
	cfg := claimsConfig(testConfig(srv, "b"))
	cfg.Claims.QuarantineAt = 1000 // it would lose 45 at once: see the strike
	b := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	pub := rawPublisher(t, srv, "kvbandit.p")
	pub.heartbeats(t, "honest", 100*time.Millisecond)
	pub.heartbeats(t, "rogue", 100*time.Millisecond)
	var honest, rogue []wire.Item
	for i := range 6 {
		honest = append(honest, start(uint64(i+1), ep1, 32))
	}
	for i := range 50 {
		rogue = append(rogue, start(uint64(i+1), ep1, 32))
	}
	pub.sendBatch(t, "honest", 1, honest...)
	pub.sendBatch(t, "rogue", 1, rogue...)
	waitFor(t, 5*time.Second, "applied", func() bool { return b.remoteInFlight() == 56 })
	time.Sleep(80 * time.Millisecond)
	b.e.ReportLoad(ep1, routing.Load{Running: 6, Known: true}, 0) // vouched: 6 + 4 + 1
	waitFor(t, 5*time.Second, "refuted", func() bool { return b.remoteInFlight() == 11 })
	b.s.rmu.Lock()
	h, r := len(b.s.peers["honest"].decisions), len(b.s.peers["rogue"].decisions)
	hs, rs := b.s.suspects["honest"], b.s.suspects["rogue"]
	b.s.rmu.Unlock()
	if h != 6 || r != 5 {
		t.Errorf("honest keeps %d of 6, rogue %d of 50; want 6 and 5", h, r)
	}
	if hs != nil || rs == nil || len(rs.strikes) != 1 {
		t.Errorf("strikes: honest %v, rogue %v; want none and one", hs, rs)
	}
}

func TestFairCut(t *testing.T) {
	a, b, c := &peer{replica: "a"}, &peer{replica: "b"}, &peer{replica: "c"}
	mk := func(n int) []claim { return make([]claim, n) }
	for _, tc := range []struct {
		counts  map[*peer]int
		vouched int
		want    map[*peer]int
	}{
		{map[*peer]int{a: 5, b: 1000}, 9, map[*peer]int{b: 996}},           // a keeps 5, b 4
		{map[*peer]int{a: 10, b: 12}, 14, map[*peer]int{a: 3, b: 5}},       // 7 each
		{map[*peer]int{a: 10, b: 12, c: 1}, 14, map[*peer]int{a: 3, b: 6}}, // c 1, then 6.5: a 7, b 6
		{map[*peer]int{a: 3}, 0, map[*peer]int{a: 3}},
	} {
		byPeer := map[*peer][]claim{}
		for p, n := range tc.counts {
			byPeer[p] = mk(n)
		}
		got := fairCut(byPeer, tc.vouched)
		if fmt.Sprint(names(got)) != fmt.Sprint(names(tc.want)) {
			t.Errorf("fairCut(%v, %d) = %v, want %v", names(tc.counts), tc.vouched, names(got), names(tc.want))
		}
	}
}

func names(m map[*peer]int) map[string]int {
	out := map[string]int{}
	for p, n := range m {
		out[p.replica] = n
	}
	return out
}

// TestOutcomesBounded: a peer's outcome is learnt only for its own
// decision applied here, once, with that decision's endpoint and rank,
// and with timings that fit how long the decision was open here; the
// rest is counted by reason. Before, every one of them was learnt.
func TestOutcomesBounded(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.heartbeats(t, "x", 100*time.Millisecond)
	ms := time.Millisecond
	evil.sendBatch(t, "x", 1,
		outcome(1, ep1, time.Microsecond, time.Microsecond), // no such decision
		start(2, ep1, 32), outcome(2, ep2, ms, ms), // another endpoint
		start(3, ep1, 32), wire.EndItem(3), outcome(3, ep1, 4000*time.Second, 4000*time.Second), // open for ~0 s here
		start(4, ep1, 32), wire.EndItem(4), outcome(4, ep1, time.Microsecond, ms), outcome(4, ep1, ms, ms), // the 2nd is a duplicate
	)
	waitFor(t, 5*time.Second, "the batch applied", func() bool { return b.counter(t, "kvbandit_sync_rejected_total") >= 4 })
	for reason, want := range map[string]float64{"outcome_unmatched": 1, "outcome_mismatch": 1, "outcome_implausible": 1, "outcome_duplicate": 1} {
		if got := b.counter(t, "kvbandit_sync_rejected_total", "reason", reason); got != want {
			t.Errorf("rejected{reason=%q} = %v, want %v", reason, got, want)
		}
	}
	if got := b.spy.taught(); got["x"] != 1 || len(got) != 1 {
		t.Errorf("outcomes learnt by peer: %v, want x's one plausible outcome, with its peer id", got)
	}
	// Held open here for 600 ms, it cannot have taken 1 ms at the peer
	// (the slack is 500 ms), nor 2 s.
	evil.sendBatch(t, "x", 2, start(5, ep1, 32), start(6, ep1, 32), start(7, ep1, 32))
	time.Sleep(600 * time.Millisecond)
	evil.sendBatch(t, "x", 3, wire.EndItem(5), outcome(5, ep1, ms, ms), wire.EndItem(6), outcome(6, ep1, ms, 2*time.Second),
		wire.EndItem(7), outcome(7, ep1, 300*ms, 600*ms))
	waitFor(t, 5*time.Second, "the second batch applied", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_implausible") == 3
	})
	waitFor(t, time.Second, "the honest one learnt", func() bool { return b.spy.taught()["x"] == 2 })
}

// TestForgetPeerWhenForgotten: the engine is told to forget a peer's
// teaching when the peer goes silent past the peer TTL or is evicted as a
// newcomer (quarantine: TestClaimsRefutedAndQuarantined), not when it
// merely restarts.
func TestForgetPeerWhenForgotten(t *testing.T) {
	srv := startNATS(t)
	cfg := testConfig(srv, "b")
	cfg.MaxPeers = 1
	b := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.sendBatch(t, "silent", 1)
	waitFor(t, 5*time.Second, "silent forgotten after the peer TTL", func() bool { return b.spy.forgotten("silent") })
	evil.sendBatch(t, "newcomer", 1)
	waitFor(t, 5*time.Second, "newcomer admitted", func() bool { return len(b.s.Status().Peers) == 1 })
	for seq := range uint64(3) {
		evil.sendBatch(t, "louder", seq+1) // heard more often than the newcomer
	}
	waitFor(t, 5*time.Second, "newcomer evicted and forgotten", func() bool { return b.spy.forgotten("newcomer") })
	if b.spy.forgotten("louder") {
		t.Error("the peer that took the slot was forgotten")
	}
}

// TestEpochFlipsIgnored: a client that sends heartbeats with a live
// peer's id and other epochs (each one was a "restart" that ended the
// peer's decisions) is dropped as epoch_conflict while the peer is heard;
// the peer's decisions stay. A real restart (the old process silent) is
// still taken within two heartbeat intervals.
func TestEpochFlipsIgnored(t *testing.T) {
	srv := startNATS(t)
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	cfg := testConfig(srv, "b")
	// A backlog behind the flood on a loaded machine must not outlast the
	// peer TTL (that would be a silent peer, not a forged restart).
	cfg.PeerTTL = 5 * time.Second
	b := newNode(t, cfg, engine.Options{})
	waitConnected(t, a, b)
	ds := []*routing.Decision{a.pick(t, "", 1), a.pick(t, "", 2), a.pick(t, "", 3)}
	waitFor(t, time.Second, "B applies A's decisions", func() bool { return b.remoteInFlight() == 3 })
	evil := rawPublisher(t, srv, "kvbandit.p")
	deadline := time.Now().Add(time.Second)
	lowest := int64(3)
	for i := 0; time.Now().Before(deadline); i++ {
		m := &wire.Message{Kind: wire.KindHeartbeat, Pool: "p", Replica: "a", Epoch: uint64(i%2 + 1), Seq: 1, Heartbeat: wire.Heartbeat{Interval: 100}}
		raw, err := wire.Append(nil, m)
		if err != nil {
			t.Fatal(err)
		}
		_ = evil.nc.Publish("kvbandit.p.heartbeat", raw)
		if i%100 == 0 {
			lowest = min(lowest, b.remoteInFlight())
		}
	}
	_ = evil.nc.Flush()
	if lowest != 3 {
		t.Errorf("A's decisions on B fell to %d during the flood", lowest)
	}
	if b.counter(t, "kvbandit_sync_dropped_total", "reason", "epoch_conflict") == 0 {
		t.Error("no epoch_conflict counted")
	}
	if strings.Contains(b.log.String(), "peer replica restarted") {
		t.Error("a forged epoch was taken for a restart")
	}
	for _, d := range ds {
		d.Done(routing.NoUsage(routing.OutcomeCancelled))
	}
	// The flood may still be queued ahead of the Ends (or have pushed
	// them out: the next snapshot repairs that).
	waitFor(t, 10*time.Second, "A's ends applied", func() bool { return b.remoteInFlight() == 0 })
	// A real restart: A stops, a new process takes its id.
	_ = a.s.Close()
	a2 := newNode(t, testConfig(srv, "a"), engine.Options{})
	d := a2.pick(t, "", 4)
	defer d.Done(routing.NoUsage(routing.OutcomeCancelled))
	waitFor(t, 3*time.Second, "the restarted A taken", func() bool {
		st := b.s.Status()
		return len(st.Peers) == 1 && st.Peers[0].Epoch == a2.s.Epoch() && b.remoteInFlight() == 1
	})
}

// TestHonestReplicasNotRefuted: three replicas under concurrent load
// (decisions open 50 ms to 1 s, ending with the timings the data plane
// would report), their engines fed a worker's-eye count (every replica's
// own open decisions per endpoint, as running; no count of finished
// requests) every 200 ms with the default claim-check settings: no
// decision is refuted, no outcome dropped but those of decisions that
// began and ended between two scrapes (no worker count saw them:
// outcome_unvouched), and every replica learns its peers' outcomes, keyed
// by peer. With the workers' counts of finished requests too, at least
// 95% of the peers' outcomes are learnt (short requests:
// TestHonestShortRequestsLearnt).
func TestHonestReplicasNotRefuted(t *testing.T) {
	for _, counted := range []bool{false, true} {
		t.Run(fmt.Sprintf("finished_counts=%v", counted), func(t *testing.T) {
			h := runHonest(t, honestRun{holdMin: 50 * time.Millisecond, holdMax: time.Second, run: 4 * time.Second, counted: counted})
			for _, n := range h.nodes {
				unvouched := n.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_unvouched")
				if got := n.counter(t, "kvbandit_sync_rejected_total") - unvouched; got != 0 {
					t.Errorf("%s rejected %v honest items (besides outcomes of decisions no scrape saw)", n.name, got)
				}
				taught := n.spy.taught()
				learnt, sent := h.share(n)
				t.Logf("%s learnt %v outcomes by peer (%d of %d); %v not learnt (unvouched)", n.name, taught, learnt, sent, unvouched)
				for _, p := range h.nodes {
					if p != n && taught[p.name] == 0 {
						t.Errorf("%s learnt no outcome of %s", n.name, p.name)
					}
				}
				if counted && float64(learnt) < 0.95*float64(sent) {
					t.Errorf("%s learnt %d of %d peers' outcomes with the workers' counts, want at least 95%%", n.name, learnt, sent)
				}
			}
		})
	}
}

// honestRun is one run of honest replicas under load (runHonest).
type honestRun struct {
	holdMin, holdMax time.Duration // how long a request takes
	run              time.Duration
	// counted: the workers export their count of finished requests
	// (vllm:request_success_total).
	counted bool
}

// honestFleet is what runHonest leaves: the nodes and how many outcomes
// each one sent its peers.
type honestFleet struct {
	nodes []*node
	sent  map[string]int
}

// share is the part of its peers' outcomes node n learnt.
func (h *honestFleet) share(n *node) (learnt, sent int) {
	for _, p := range h.nodes {
		if p != n {
			learnt += n.spy.taught()[p.name]
			sent += h.sent[p.name]
		}
	}
	return learnt, sent
}

// runHonest runs three replicas under concurrent load (4 clients each,
// requests of holdMin to holdMax ending with the timings the data plane
// would report) with their engines fed a worker's-eye count every
// 200 ms: every replica's own open decisions per endpoint as running,
// and, when counted, the requests finished there (counted before the
// replica sees the end, as a worker counts before its response is out).
// It checks that no decision was refuted and no replica quarantined, and
// keeps scraping after the load until no outcome is pending (at most
// 3 s).
func runHonest(t *testing.T, r honestRun) *honestFleet {
	srv := startNATS(t)
	h := &honestFleet{sent: map[string]int{}}
	for _, id := range []string{"a", "b", "c"} {
		h.nodes = append(h.nodes, newNode(t, testConfig(srv, id), engine.Options{}))
	}
	waitConnected(t, h.nodes...)
	var finished stdsync.Map // endpoint -> *atomic.Int64
	count := func(ep routing.EndpointKey) *atomic.Int64 {
		v, _ := finished.LoadOrStore(ep, new(atomic.Int64))
		return v.(*atomic.Int64)
	}
	stop := make(chan struct{})
	var wg stdsync.WaitGroup
	wg.Add(1)
	go func() { // the workers' /metrics, scraped by every replica
		defer wg.Done()
		tk := time.NewTicker(200 * time.Millisecond)
		defer tk.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tk.C:
			}
			truth := map[routing.EndpointKey]routing.Load{}
			for _, n := range h.nodes {
				for _, st := range n.e.Endpoints() {
					ld := truth[st.Key]
					ld.Running += float64(st.InFlight.Load())
					ld.Known = true
					if r.counted {
						ld.Finished, ld.FinishedKnown = float64(count(st.Key).Load()), true
					}
					truth[st.Key] = ld
				}
			}
			for _, n := range h.nodes {
				for k, ld := range truth {
					n.e.ReportLoad(k, ld, 0)
				}
			}
		}
	}()
	var decided stdsync.WaitGroup
	var mu stdsync.Mutex
	for i, n := range h.nodes {
		for w := range 4 {
			decided.Add(1)
			go func() {
				defer decided.Done()
				rng := rand.New(rand.NewPCG(uint64(i), uint64(w)))
				end := time.Now().Add(r.run)
				sent := 0
				for k := 0; time.Now().Before(end); k++ {
					d := n.pick(t, fmt.Sprintf("s-%d-%d-%d", i, w, k%5), i*10000+w*1000+k)
					hold := r.holdMin + time.Duration(rng.Int64N(int64(r.holdMax-r.holdMin)))
					time.Sleep(hold / 3)
					d.Prefilled()
					time.Sleep(hold * 2 / 3)
					took := time.Since(d.At)
					count(d.Endpoint).Add(1)
					d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, Status: 200, TTFT: took / 3, Latency: took, PromptTokens: 256, CompletionTokens: 20, CachedTokens: -1})
					sent++
				}
				mu.Lock()
				h.sent[n.name] += sent
				mu.Unlock()
			}()
		}
	}
	decided.Wait()
	// The last outcomes wait for the next scrapes' counts (and some may
	// still be on their way): until none is pending on two looks a scrape
	// apart, at most 3 s.
	idle := func() bool {
		for _, n := range h.nodes {
			if n.s.pendingOutcomes() > 0 {
				return false
			}
		}
		return true
	}
	for deadline, quiet := time.Now().Add(3*time.Second), 0; quiet < 2 && time.Now().Before(deadline); {
		if idle() {
			quiet++
		} else {
			quiet = 0
		}
		time.Sleep(250 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	for _, n := range h.nodes {
		waitFor(t, 2*time.Second, n.name+" back to 0", func() bool { return n.remoteInFlight() == 0 })
		if got := n.counter(t, "kvbandit_sync_refuted_total"); got != 0 {
			t.Errorf("%s refuted %v honest decisions", n.name, got)
		}
		if got := n.counter(t, "kvbandit_sync_quarantined_total"); got != 0 {
			t.Errorf("%s quarantined %v honest peers", n.name, got)
		}
	}
	return h
}

// TestInstantOutcomesUnvouched: where the endpoint's load is freshly
// scraped, a peer that opens and closes decisions between two scrapes
// (Start, End and a 1 us outcome in one batch, 100 times) teaches
// nothing: no worker count saw those decisions. A decision the next
// scrape counted has its outcome learnt.
func TestInstantOutcomesUnvouched(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, claimsConfig(testConfig(srv, "b")), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.heartbeats(t, "x", 100*time.Millisecond)
	b.e.ReportLoad(ep1, routing.Load{Running: 1, Known: true}, 0)
	var items []wire.Item
	for i := range 100 {
		id := uint64(i + 1)
		items = append(items, start(id, ep1, 32), wire.EndItem(id), outcome(id, ep1, time.Microsecond, time.Microsecond))
	}
	items = append(items, start(1000, ep1, 32))
	evil.sendBatch(t, "x", 1, items...)
	waitFor(t, 5*time.Second, "the instant outcomes dropped", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_unvouched") == 100
	})
	time.Sleep(80 * time.Millisecond) // past the slack
	b.e.ReportLoad(ep1, routing.Load{Running: 1, Known: true}, 0)
	waitFor(t, 5*time.Second, "decision 1000 vouched for", func() bool {
		b.s.rmu.Lock()
		defer b.s.rmu.Unlock()
		r := b.s.peers["x"].decisions[1000]
		return r != nil && r.vouched
	})
	evil.sendBatch(t, "x", 2, wire.EndItem(1000), outcome(1000, ep1, 50*time.Millisecond, 100*time.Millisecond))
	waitFor(t, 5*time.Second, "its outcome learnt", func() bool { return b.spy.taught()["x"] == 1 })
	if got := b.counter(t, "kvbandit_sync_refuted_total"); got != 0 {
		t.Errorf("%v refuted", got)
	}
}

// TestQuarantineAtOnce: one check that refutes Claims.QuarantineAt (32)
// or more of a peer's decisions quarantines it at once.
func TestQuarantineAtOnce(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, claimsConfig(testConfig(srv, "b")), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.heartbeats(t, "x", 100*time.Millisecond)
	var items []wire.Item
	for i := range 100 {
		items = append(items, start(uint64(i+1), ep1, 32), start(uint64(i+1001), ep2, 32))
	}
	evil.sendBatch(t, "x", 1, items...)
	waitFor(t, 5*time.Second, "applied", func() bool { return b.remoteInFlight() == 200 })
	time.Sleep(80 * time.Millisecond)
	b.e.ReportLoad(ep1, routing.Load{Known: true}, 0)
	waitFor(t, 5*time.Second, "quarantined at the first check", func() bool { return b.counter(t, "kvbandit_sync_quarantined_total") == 1 })
	// Its claims on ep2, which no scrape checked, end with the quarantine.
	waitFor(t, time.Second, "all its decisions ended", func() bool { return b.remoteInFlight() == 0 })
	if got := b.counter(t, "kvbandit_sync_refuted_total"); got != 96 {
		t.Errorf("%v refuted on ep1, want 96 (an idle worker vouches for 4)", got)
	}
}
