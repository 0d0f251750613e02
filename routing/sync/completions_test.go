package sync

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// Peers' outcomes vouched for by the workers' own count of finished
// requests (completions.go).

// TestHonestShortRequestsLearnt: three replicas under load with requests
// of 5 to 40 ms, far shorter than the 200 ms between scrapes. With the
// workers' counts of finished requests every replica learns (nearly) all
// of its peers' outcomes; with the gauges alone (before: a scrape had to
// see the decision open) most were dropped as unvouched. Both shares are
// logged.
func TestHonestShortRequestsLearnt(t *testing.T) {
	for _, tc := range []struct {
		name    string
		counted bool
	}{{"gauges only", false}, {"finished counts", true}} {
		t.Run(tc.name, func(t *testing.T) {
			h := runHonest(t, honestRun{holdMin: 5 * time.Millisecond, holdMax: 40 * time.Millisecond, run: 3 * time.Second, counted: tc.counted})
			for _, n := range h.nodes {
				learnt, sent := h.share(n)
				unvouched := n.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_unvouched")
				other := n.counter(t, "kvbandit_sync_rejected_total") - unvouched
				t.Logf("%s (%s): learnt %d of its peers' %d outcomes (%.1f%%); %v unvouched, %v refused otherwise",
					n.name, tc.name, learnt, sent, 100*float64(learnt)/float64(sent), unvouched, other)
				if other != 0 {
					t.Errorf("%s refused %v honest items besides unvouched outcomes", n.name, other)
				}
				if tc.counted && float64(learnt) < 0.95*float64(sent) {
					t.Errorf("%s learnt %d of %d peers' outcomes with the workers' counts, want at least 95%%", n.name, learnt, sent)
				}
			}
		})
	}
}

// scrapeCount reports a fresh scrape of ep to n's engine with the
// worker's count of finished requests.
func scrapeCount(n *node, ep string, running, finished float64) {
	n.e.ReportLoad(routing.EndpointKey(ep), routing.Load{Running: running, Known: true, Finished: finished, FinishedKnown: true}, 0)
}

// waitCounted waits until n's check has taken ep's count finished as its
// baseline.
func waitCounted(t *testing.T, n *node, ep string, finished float64) {
	t.Helper()
	waitFor(t, 5*time.Second, "the count checked", func() bool {
		n.s.rmu.Lock()
		defer n.s.rmu.Unlock()
		l := n.s.done.ledgers[routing.EndpointKey(ep)]
		return l != nil && l.known && l.finished == finished
	})
}

// instant is Start, End and a successful outcome of decision id on ep in
// one batch: a request too short for any gauge to see.
func instant(id uint64, ep string) []wire.Item {
	return []wire.Item{start(id, ep, 32), wire.EndItem(id), outcome(id, ep, time.Microsecond, time.Microsecond)}
}

// TestForgedOutcomesOverCount: a peer with valid credentials sends Start,
// End and a 1 us outcome in one batch for 100 requests the worker never
// ran (its count of finished requests does not move): none is learnt,
// all are dropped at the next scrape's check (outcome_unvouched), and
// losing 32 or more at once quarantines the peer (the engine forgets its
// teaching). Before the counts, such outcomes were dropped one by one but
// never held against the peer.
func TestForgedOutcomesOverCount(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, claimsConfig(testConfig(srv, "b")), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	scrapeCount(b, ep1, 0, 1000)
	waitCounted(t, b, ep1, 1000)
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.heartbeats(t, "x", 100*time.Millisecond)
	var items []wire.Item
	for i := range 100 {
		items = append(items, instant(uint64(i+1), ep1)...)
	}
	evil.sendBatch(t, "x", 1, items...)
	waitFor(t, 5*time.Second, "x's outcomes pending", func() bool { return b.s.pendingOutcomes() == 100 })
	time.Sleep(80 * time.Millisecond) // past the 50 ms slack: not the next scrape's
	scrapeCount(b, ep1, 0, 1000)      // the worker finished nothing
	waitFor(t, 5*time.Second, "x quarantined", func() bool { return b.counter(t, "kvbandit_sync_quarantined_total") == 1 })
	if got := b.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_unvouched"); got != 100 {
		t.Errorf("outcome_unvouched = %v, want 100", got)
	}
	if got := b.spy.taught()["x"]; got != 0 {
		t.Errorf("%d of x's forged outcomes learnt", got)
	}
	if !b.spy.forgotten("x") {
		t.Error("the engine was not told to forget x's teaching")
	}
	if got := b.s.pendingOutcomes(); got != 0 {
		t.Errorf("%v outcomes still pending", got)
	}
}

// TestMixedOutcomesCappedAtRealCount: a peer whose 10 requests the worker
// really finished sends their outcomes and 20 forged ones (older, so
// first in line): at most the worker's 10 are learnt, the other 20 are
// dropped and the peer gets a strike. With an honest peer's 6 outcomes
// beside them, counted too (16), the honest peer keeps all 6 and the
// rogue gets the rest. Before the counts none of these instant requests
// was learnt at all.
func TestMixedOutcomesCappedAtRealCount(t *testing.T) {
	srv := startNATS(t)
	cfg := claimsConfig(testConfig(srv, "b"))
	cfg.Claims.QuarantineAt = 1000 // by strikes only here
	b := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	scrapeCount(b, ep1, 0, 0)
	waitCounted(t, b, ep1, 0)
	pub := rawPublisher(t, srv, "kvbandit.p")
	pub.heartbeats(t, "rogue", 100*time.Millisecond)
	pub.heartbeats(t, "honest", 100*time.Millisecond)
	var items []wire.Item
	for i := range 30 {
		items = append(items, instant(uint64(i+1), ep1)...)
	}
	pub.sendBatch(t, "rogue", 1, items...)
	waitFor(t, 5*time.Second, "pending", func() bool { return b.s.pendingOutcomes() == 30 })
	time.Sleep(80 * time.Millisecond)
	scrapeCount(b, ep1, 0, 10) // the worker finished 10 requests
	waitCounted(t, b, ep1, 10)
	waitFor(t, 5*time.Second, "the check done", func() bool { return b.s.pendingOutcomes() == 0 })
	if got := b.spy.taught()["rogue"]; got != 10 {
		t.Errorf("the rogue got %d outcomes learnt, want the worker's 10", got)
	}
	if got := b.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_unvouched"); got != 20 {
		t.Errorf("outcome_unvouched = %v, want 20", got)
	}
	b.s.rmu.Lock()
	sp := b.s.suspects["rogue"]
	b.s.rmu.Unlock()
	if sp == nil || len(sp.strikes) != 1 {
		t.Errorf("the rogue's strikes: %+v, want one", sp)
	}
	// Next scrape: the honest peer's 6 and the rogue's 30 more; the worker
	// finished 16 (6 of them the honest peer's).
	items = items[:0]
	for i := range 30 {
		items = append(items, instant(uint64(100+i), ep1)...)
	}
	pub.sendBatch(t, "rogue", 2, items...)
	items = items[:0]
	for i := range 6 {
		items = append(items, instant(uint64(i+1), ep1)...)
	}
	pub.sendBatch(t, "honest", 1, items...)
	waitFor(t, 5*time.Second, "pending", func() bool { return b.s.pendingOutcomes() == 36 })
	time.Sleep(80 * time.Millisecond)
	scrapeCount(b, ep1, 0, 26)
	waitFor(t, 5*time.Second, "the check done", func() bool { return b.s.pendingOutcomes() == 0 })
	taught := b.spy.taught()
	if taught["honest"] != 6 || taught["rogue"] != 20 {
		t.Errorf("learnt by peer %v, want honest's 6 and the rogue's 10 + 10", taught)
	}
}

// TestWorkerRestartCount: the worker's count going backwards is a
// restart, its new count what it finished since. An honest peer's
// outcomes of requests the restarted worker finished are all learnt
// (none dropped: a decrease read as "nothing finished" would drop them);
// a rogue's forged outcomes across a restart are not (a decrease read as
// a huge increase, or the drop as a count, would vouch for them).
func TestWorkerRestartCount(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, claimsConfig(testConfig(srv, "b")), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	scrapeCount(b, ep1, 0, 500)
	waitCounted(t, b, ep1, 500)
	pub := rawPublisher(t, srv, "kvbandit.p")
	pub.heartbeats(t, "honest", 100*time.Millisecond)
	var items []wire.Item
	for i := range 10 {
		items = append(items, instant(uint64(i+1), ep1)...)
	}
	pub.sendBatch(t, "honest", 1, items...)
	waitFor(t, 5*time.Second, "pending", func() bool { return b.s.pendingOutcomes() == 10 })
	time.Sleep(80 * time.Millisecond)
	scrapeCount(b, ep1, 0, 10) // restarted; finished the honest peer's 10 since
	waitFor(t, 5*time.Second, "the check done", func() bool { return b.s.pendingOutcomes() == 0 })
	if got := b.spy.taught()["honest"]; got != 10 {
		t.Errorf("%d of the honest peer's 10 outcomes learnt across the restart", got)
	}
	if got := b.counter(t, "kvbandit_sync_rejected_total"); got != 0 {
		t.Errorf("%v refused", got)
	}
	// A rogue across another restart (10 -> 3: the worker finished 3
	// requests since, none of them the rogue's: this replica's own,
	// served by ep1).
	pub.heartbeats(t, "rogue", 100*time.Millisecond)
	for i := range 3 {
		d := b.pick(t, "", 100+i)
		d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, Served: ep1, Status: 200, TTFT: time.Millisecond, Latency: 2 * time.Millisecond, PromptTokens: -1, CompletionTokens: -1, CachedTokens: -1})
	}
	items = items[:0]
	for i := range 20 {
		items = append(items, instant(uint64(100+i), ep1)...)
	}
	pub.sendBatch(t, "rogue", 1, items...)
	waitFor(t, 5*time.Second, "pending", func() bool { return b.s.pendingOutcomes() == 20 })
	time.Sleep(80 * time.Millisecond)
	scrapeCount(b, ep1, 0, 3)
	waitFor(t, 5*time.Second, "the check done", func() bool { return b.s.pendingOutcomes() == 0 })
	if got := b.spy.taught()["rogue"]; got != 0 {
		t.Errorf("%d of the rogue's forged outcomes learnt across a restart", got)
	}
}

// TestOutcomesWithoutCountsKeepTheGaugeRule: an endpoint that does not
// export a count of finished requests keeps the rule of vouch.go (an
// instant decision is unvouched, one a scrape saw open is learnt at
// once), and one without fresh load learns at once (caps only); neither
// waits in the queue.
func TestOutcomesWithoutCountsKeepTheGaugeRule(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, claimsConfig(testConfig(srv, "b")), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	b.e.ReportLoad(ep1, routing.Load{Running: 1, Known: true}, 0) // no count
	evil := rawPublisher(t, srv, "kvbandit.p")
	evil.heartbeats(t, "x", 100*time.Millisecond)
	items := append(instant(1, ep1), instant(2, ep2)...) // ep2: never scraped
	evil.sendBatch(t, "x", 1, items...)
	waitFor(t, 5*time.Second, "decided", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_unvouched") == 1 && b.spy.taught()["x"] == 1
	})
	if got := b.s.pendingOutcomes(); got != 0 {
		t.Errorf("%v pending", got)
	}
	// An outcome of another kind on a counting endpoint: the gauge rule.
	scrapeCount(b, ep2, 0, 7)
	waitCounted(t, b, ep2, 7)
	o := outcome(3, ep2, time.Microsecond, time.Microsecond)
	o.Outcome.Kind = uint8(routing.OutcomeUpstreamError)
	evil.sendBatch(t, "x", 2, start(3, ep2, 32), wire.EndItem(3), o)
	waitFor(t, 5*time.Second, "the error outcome unvouched", func() bool {
		return b.counter(t, "kvbandit_sync_rejected_total", "reason", "outcome_unvouched") == 2
	})
	if got := b.s.pendingOutcomes(); got != 0 {
		t.Errorf("%v pending", got)
	}
	if strings.Contains(b.log.String(), "quarantined") {
		t.Error("x quarantined")
	}
}

// checkedSyncer is a Syncer that never connects, on a real engine (spied)
// over testFleet, for direct calls to the outcome check.
func checkedSyncer(t *testing.T, cc ClaimCheck) (*Syncer, *spyEngine) {
	t.Helper()
	pol, err := policy.Builtin().New("least_loaded", policy.Deps{Rand: routing.NewRand(1)})
	if err != nil {
		t.Fatal(err)
	}
	e := engine.Must(pol, engine.Options{}, engine.Deps{Rand: routing.NewRand(1), Logger: slog.New(slog.DiscardHandler)})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: testFleet}); err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Servers: []string{"nats://127.0.0.1:1"}, Pool: "p", Replica: "me", Token: "t", Claims: cc}, Deps{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	spy := &spyEngine{Engine: e}
	s.eng = spy
	return s, spy
}

// pendingFrom is a peer's successful outcome on ep, as hold gets it.
func pendingFrom(p *peer, ep string) routing.RemoteOutcome {
	it := outcome(1, ep, time.Millisecond, 2*time.Millisecond)
	ro := remoteOutcome(&it.Outcome)
	ro.Peer = p.replica
	return ro
}

// counted is a fresh scrape of ep with the worker's count w at at, and
// own of this replica's outcomes ended by then.
func counted(ep string, w float64, at time.Time, own int) []freshLoad {
	return []freshLoad{{sl: engine.ScrapedLoad{Endpoint: routing.EndpointKey(ep), At: at,
		Load: routing.Load{Known: true, Finished: w, FinishedKnown: true}}, own: own}}
}

// TestVouchLedger: the budget of one endpoint's checks, step by step: the
// first count is a baseline; an increase covers the oldest pending
// outcomes; uncovered ones younger than the slack wait for the next
// count, older ones are dropped; this replica's own outcomes come off
// the budget; what a check leaves unused carries to the next, at most
// 4 + 10% of the increase, so a quiet stretch cannot bank budget for a
// burst of forged outcomes.
func TestVouchLedger(t *testing.T) {
	s, spy := checkedSyncer(t, ClaimCheck{Slack: 250 * time.Millisecond})
	h, x := &peer{replica: "h"}, &peer{replica: "x"}
	t0 := time.Now()
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	check := func(w float64, ms, own int) map[*peer]int {
		struck := map[*peer]int{}
		s.checkCompletions(counted(ep1, w, at(ms), own), at(ms), struck)
		return struck
	}
	hold := func(p *peer, n, ms int) {
		for range n {
			s.hold(p, pendingFrom(p, ep1), false, ep1, at(ms))
		}
	}
	learnt := func() int { return spy.taught()["h"] + spy.taught()["x"] }
	check(100, 0, 0) // the baseline
	hold(h, 5, 100)
	hold(h, 2, 900) // young at the next count (within 250 ms of it)
	check(105, 1000, 0)
	if learnt() != 5 || s.done.n != 2 {
		t.Fatalf("after +5: %d learnt, %d pending; want the 5 oldest learnt, the 2 young waiting", learnt(), s.done.n)
	}
	check(107, 2000, 0)
	if learnt() != 7 || s.done.n != 0 {
		t.Fatalf("after +2: %d learnt, %d pending; want all 7", learnt(), s.done.n)
	}
	// Own outcomes come off: +6, 4 of them this replica's; 3 pending
	// (old): 2 learnt, 1 dropped.
	hold(h, 3, 2100)
	check(113, 3000, 4)
	if learnt() != 9 || s.done.n != 0 {
		t.Fatalf("own outcomes: %d learnt, %d pending; want 9, 0", learnt(), s.done.n)
	}
	// Unused budget carries (outcomes still in transit at the count)...
	check(116, 4000, 0) // +3, nothing pending
	hold(h, 3, 4100)
	check(116, 5000, 0) // +0: the carry covers them
	if learnt() != 12 {
		t.Fatalf("carry: %d learnt, want 12", learnt())
	}
	// ...but at most 4 + 10% of the increase: +1,000 unused, then 200
	// forged outcomes at +0.
	check(1116, 6000, 0)
	hold(x, 200, 6100)
	struck := check(1116, 7000, 0)
	if got := spy.taught()["x"]; got != 4+100 {
		t.Errorf("a quiet stretch banked %d outcomes' budget, want 104 (4 + 10%% of 1,000)", got)
	}
	if struck[x] != 96 {
		t.Errorf("struck %v, want x for 96 lost", struck)
	}
	if s.done.n != 0 || len(s.done.ledgers[ep1].byPeer) != 0 {
		t.Errorf("%d pending, by peer %v", s.done.n, s.done.ledgers[ep1].byPeer)
	}
}

// TestPendingOutcomesBounded: the queue of outcomes waiting for a
// worker's count is bounded per endpoint (past it the peer with the most
// there loses its oldest, or its new one), in total count and bytes (new
// ones dropped), and in age (settled by the gauge rule once no fresh
// count comes); a forgotten peer's outcomes go with it, and an endpoint
// that left takes its own. The counts stay consistent throughout.
func TestPendingOutcomesBounded(t *testing.T) {
	s, spy := checkedSyncer(t, ClaimCheck{PendingOutcomes: 8, PendingOutcomesTotal: 20, MaxLoadAge: time.Second})
	h, x := &peer{replica: "h"}, &peer{replica: "x"}
	now := time.Now()
	consistent := func() {
		t.Helper()
		n, bytes := 0, 0
		for _, l := range s.done.ledgers {
			byPeer := map[*peer]int{}
			for _, po := range l.pending {
				byPeer[po.p]++
				bytes += po.size
			}
			n += len(l.pending)
			if len(byPeer) != len(l.byPeer) {
				t.Fatalf("by peer %v, counted %v", l.byPeer, byPeer)
			}
			for p, k := range byPeer {
				if l.byPeer[p] != k {
					t.Fatalf("by peer %v, counted %v", l.byPeer, byPeer)
				}
			}
		}
		if n != s.done.n || bytes != s.done.bytes {
			t.Fatalf("%d pending (%d bytes), counted %d (%d)", n, bytes, s.done.n, s.done.bytes)
		}
	}
	full := func() float64 { return counterValue(t, s.m.rejected.WithLabelValues("outcome_pending_full")) }
	for range 50 {
		s.hold(x, pendingFrom(x, ep1), false, ep1, now)
	}
	if got := len(s.done.ledgers[ep1].pending); got != 8 || full() != 42 {
		t.Fatalf("ep1 holds %d (cap 8), %v dropped as full", got, full())
	}
	s.hold(h, pendingFrom(h, ep1), false, ep1, now) // evicts x's oldest
	if l := s.done.ledgers[ep1]; l.byPeer[h] != 1 || l.byPeer[x] != 7 || full() != 43 {
		t.Fatalf("ep1 by peer %v", l.byPeer)
	}
	consistent()
	for _, ep := range []string{ep2, "10.0.0.3:8000"} {
		for range 8 {
			s.hold(x, pendingFrom(x, ep), false, routing.EndpointKey(ep), now)
		}
	}
	if s.done.n != 20 || full() != 43+4 {
		t.Fatalf("%d pending (total cap 20), %v dropped", s.done.n, full())
	}
	consistent()
	s.dropPendingOf(h)
	consistent()
	if s.done.n != 19 {
		t.Fatalf("%d pending after h left, want 19", s.done.n)
	}
	// No fresh load: past MaxLoadAge they are learnt (caps only).
	s.expirePending(now.Add(1500 * time.Millisecond))
	consistent()
	if s.done.n != 0 || spy.taught()["x"] != 19 {
		t.Fatalf("%d pending, %d learnt after expiry; want 0 and 19", s.done.n, spy.taught()["x"])
	}
	// Bytes: outcomes with long strings stop at the byte bound.
	s2, _ := checkedSyncer(t, ClaimCheck{PendingOutcomeBytes: 64 << 10})
	long := strings.Repeat("p", wire.MaxStringLen)
	for range 1000 {
		ro := pendingFrom(x, ep1)
		ro.PrefixID, ro.Tenant, ro.Model = long, long, routing.ModelName(long)
		s2.hold(x, ro, false, ep1, now)
	}
	if s2.done.bytes > 64<<10 || s2.done.n != (64<<10)/(256+3*wire.MaxStringLen+len(ep1)+1) {
		t.Fatalf("%d pending in %d bytes (bound 64 KiB)", s2.done.n, s2.done.bytes)
	}
	// An endpoint that left takes its outcomes.
	if err := s2.eng.(*spyEngine).Update(routing.EndpointSet{Source: "test", Endpoints: testFleet[1:]}); err != nil {
		t.Fatal(err)
	}
	s2.expirePending(now)
	if s2.done.n != 0 || len(s2.done.ledgers) != 0 {
		t.Fatalf("%d pending on %d ledgers after the endpoint left", s2.done.n, len(s2.done.ledgers))
	}
}

// counterValue reads one counter.
func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
