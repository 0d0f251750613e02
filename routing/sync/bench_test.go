package sync

import (
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy"
)

// remoteOpen counts the peers' decisions the Syncer holds.
func (s *Syncer) remoteOpen() int {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	n := 0
	for _, p := range s.peers {
		n += len(p.decisions)
	}
	return n
}

// BenchmarkLocalSide is a decision's whole cost (Pick, first token, Done)
// without the Syncer's hooks (sync=off) and with them (sync=on: the
// enqueue of its Start, First, End and Outcome plus the amortised flush
// to a real nats-server): the difference is the local-side overhead per
// decision. sync=on+peer adds a peer Syncer in the same process, so it
// also counts the remote side (decode, StartRemote, End, LearnRemote).
//
//	go test -run '^$' -bench LocalSide -benchmem ./routing/sync/
func BenchmarkLocalSide(b *testing.B) {
	srv := startNATS(b)
	for _, c := range []struct {
		name        string
		hooks, peer bool
	}{{"sync=off", false, false}, {"sync=on", true, false}, {"sync=on+peer", true, true}} {
		b.Run(c.name, func(b *testing.B) {
			a := newNodeWith(b, testConfig(srv, "a-"+c.name), engine.Options{}, c.hooks)
			if c.peer {
				waitConnected(b, a, newNode(b, testConfig(srv, "peer-"+c.name), engine.Options{}))
			} else {
				waitFor(b, 10*time.Second, "connected", func() bool { return !a.s.Degraded() })
			}
			out := routing.Outcome{Kind: routing.OutcomeSuccess, Status: 200, TTFT: 1000, Latency: 2000, PromptTokens: 256, CompletionTokens: 5, CachedTokens: -1}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				d := a.pick(b, "", i%64)
				d.Prefilled()
				d.Done(out)
				i++
			}
		})
	}
}

// BenchmarkClaimCheck is one sweep's claim check (vouch.go) with every
// endpoint freshly scraped and peers' decisions spread over them: the
// flusher pays it at most once per scrape. Nothing is refuted (the
// workers vouch for every claim), so each iteration checks them all.
//
//	go test -run '^$' -bench ClaimCheck -benchmem ./routing/sync/
func BenchmarkClaimCheck(b *testing.B) {
	for _, c := range []struct{ peers, each int }{{3, 100}, {16, 1000}} {
		b.Run(fmt.Sprintf("peers=%d/decisions=%d", c.peers, c.each), func(b *testing.B) {
			pol, err := policy.Builtin().New("least_loaded", policy.Deps{Rand: routing.NewRand(1)})
			if err != nil {
				b.Fatal(err)
			}
			e := engine.Must(pol, engine.Options{}, engine.Deps{Rand: routing.NewRand(1)})
			b.Cleanup(e.Close)
			if err := e.Update(routing.EndpointSet{Source: "bench", Endpoints: testFleet}); err != nil {
				b.Fatal(err)
			}
			s, err := New(Config{Servers: []string{"nats://127.0.0.1:1"}, Pool: "p", Replica: "me", Token: "t"}, Deps{})
			if err != nil {
				b.Fatal(err)
			}
			s.eng = e
			past := time.Now().Add(-time.Hour)
			for p := range c.peers {
				pr := &peer{replica: fmt.Sprintf("peer-%d", p), decisions: map[uint64]*remote{}}
				for i := range c.each {
					ep := testFleet[i%len(testFleet)].Key
					rd, err := e.StartRemote(routing.RemoteStart{Endpoint: ep, DPRank: -1, BlockSize: 16, ISL: 32})
					if err != nil {
						b.Fatal(err)
					}
					pr.decisions[uint64(i)] = &remote{rd: rd, applied: past, endpoint: ep, rank: -1, isl: 32, prefilled: true}
				}
				s.peers[pr.replica] = pr
			}
			b.Cleanup(func() {
				for _, p := range s.peers {
					p.endAll()
				}
			})
			load := routing.Load{Running: float64(c.peers * c.each / len(testFleet)), Known: true}
			b.ReportAllocs()
			for b.Loop() {
				for _, ep := range testFleet {
					e.ReportLoad(ep.Key, load, 0)
				}
				now := time.Now()
				fresh := s.freshLoads(now)
				s.rmu.Lock()
				s.checkClaims(fresh, now)
				s.rmu.Unlock()
			}
			if n := s.remoteOpen(); n != c.peers*c.each {
				b.Fatalf("%d decisions left of %d: the check refuted some", n, c.peers*c.each)
			}
		})
	}
}

// BenchmarkOutcomeCheck is one scrape's worth of peers' outcomes on every
// endpoint held for the workers' counts, then the check that learns them
// (completions.go): receive pays hold per outcome, the flusher the check
// once per scrape. The counts cover every outcome (the usual case).
//
//	go test -run '^$' -bench OutcomeCheck -benchmem ./routing/sync/
func BenchmarkOutcomeCheck(b *testing.B) {
	for _, c := range []struct{ peers, each int }{{3, 100}, {16, 1000}} {
		b.Run(fmt.Sprintf("peers=%d/outcomes=%d", c.peers, c.each), func(b *testing.B) {
			pol, err := policy.Builtin().New("least_loaded", policy.Deps{Rand: routing.NewRand(1)})
			if err != nil {
				b.Fatal(err)
			}
			e := engine.Must(pol, engine.Options{}, engine.Deps{Rand: routing.NewRand(1), Logger: slog.New(slog.DiscardHandler)})
			b.Cleanup(e.Close)
			if err := e.Update(routing.EndpointSet{Source: "bench", Endpoints: testFleet}); err != nil {
				b.Fatal(err)
			}
			s, err := New(Config{Servers: []string{"nats://127.0.0.1:1"}, Pool: "p", Replica: "me", Token: "t",
				Claims: ClaimCheck{PendingOutcomes: 1 << 16, PendingOutcomesTotal: 1 << 20, PendingOutcomeBytes: 1 << 30}}, Deps{})
			if err != nil {
				b.Fatal(err)
			}
			s.eng = e
			peers := make([]*peer, c.peers)
			ros := make([]routing.RemoteOutcome, c.peers)
			for i := range peers {
				peers[i] = &peer{replica: fmt.Sprintf("peer-%d", i)}
				it := outcome(1, string(testFleet[0].Key), time.Millisecond, 2*time.Millisecond)
				ros[i] = remoteOutcome(&it.Outcome)
				ros[i].Peer = peers[i].replica
			}
			now := time.Now()
			w := 0.0
			fresh := make([]freshLoad, len(testFleet))
			check := func() {
				now = now.Add(time.Second)
				for i, ep := range testFleet {
					fresh[i] = freshLoad{sl: engine.ScrapedLoad{Endpoint: ep.Key, At: now, Load: routing.Load{Known: true, Finished: w, FinishedKnown: true}}}
				}
				s.checkCompletions(fresh, now, map[*peer]int{})
			}
			check() // the baselines
			b.ReportAllocs()
			for b.Loop() {
				at := now.Add(100 * time.Millisecond)
				for _, ep := range testFleet {
					for i := range c.peers * c.each / len(testFleet) {
						ro := ros[i%c.peers]
						ro.Endpoint = ep.Key
						s.hold(peers[i%c.peers], ro, false, ep.Key, at)
					}
				}
				w += float64(c.peers * c.each / len(testFleet))
				check()
			}
			if s.done.n != 0 {
				b.Fatalf("%d outcomes left pending", s.done.n)
			}
		})
	}
}
