package thompson

import (
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/evidence"
)

// local applies a local success (or, with lat 0, an upstream error) on
// ep as Done does for a decision without LinTS features.
func local(p *Policy, ep routing.EndpointKey, lat time.Duration) {
	o := routing.Outcome{Kind: routing.OutcomeSuccess, Latency: lat, CompletionTokens: 100}
	if lat == 0 {
		o = routing.Outcome{Kind: routing.OutcomeUpstreamError}
	}
	p.reward(p.endpointFor(ep, t0.UnixNano()), nil, nil, ep, -1, 1, 0, o, evidence.Local)
}

func remote(p *Policy, peer string, ep routing.EndpointKey, lat time.Duration) {
	o := routing.RemoteOutcome{Endpoint: ep, DPRank: -1, BlockSize: 16, ISL: 100, OSL: routing.LevelMedium, Peer: peer,
		Outcome: routing.Outcome{Kind: routing.OutcomeSuccess, Latency: lat, CompletionTokens: 100}}
	if lat == 0 {
		o.Outcome = routing.Outcome{Kind: routing.OutcomeUpstreamError}
	}
	p.LearnRemote(&o)
}

// learntSnap is what the policy learnt from outcomes: each endpoint's Beta
// parameters and baselines, and the global baselines.
type learntSnap struct {
	beta    map[routing.EndpointKey]betaParams
	overall map[routing.EndpointKey][2]ema
	bucket  map[routing.EndpointKey][3][3][2]ema
	global  [2]ema
}

func snapshot(p *Policy) learntSnap {
	l := learntSnap{beta: map[routing.EndpointKey]betaParams{}, overall: map[routing.EndpointKey][2]ema{}, bucket: map[routing.EndpointKey][3][3][2]ema{}}
	p.emaMu.Lock()
	defer p.emaMu.Unlock()
	l.global = p.global
	for k, ep := range p.learned.Load().endpoints {
		l.beta[k] = *ep.beta.Load()
		l.overall[k] = ep.overall
		l.bucket[k] = ep.bucket
	}
	return l
}

func sameEMA(a, b ema) bool {
	return a.ok == b.ok && math.Abs(a.v-b.v) <= 1e-9*max(1, math.Abs(b.v))
}

// compare reports where got differs from want (beyond rounding).
func compare(got, want learntSnap) error {
	for i := range want.global {
		if !sameEMA(got.global[i], want.global[i]) {
			return fmt.Errorf("global baseline %d: %+v, want %+v", i, got.global[i], want.global[i])
		}
	}
	for k, wb := range want.beta {
		gb := got.beta[k]
		if math.Abs(gb.alpha-wb.alpha) > 1e-9 || math.Abs(gb.beta-wb.beta) > 1e-9 {
			return fmt.Errorf("%s: Beta(%v, %v), want Beta(%v, %v)", k, gb.alpha, gb.beta, wb.alpha, wb.beta)
		}
		for i := range 2 {
			if !sameEMA(got.overall[k][i], want.overall[k][i]) {
				return fmt.Errorf("%s: baseline %d: %+v, want %+v", k, i, got.overall[k][i], want.overall[k][i])
			}
		}
		for o := range 3 {
			for b := range 3 {
				for i := range 2 {
					if !sameEMA(got.bucket[k][o][b][i], want.bucket[k][o][b][i]) {
						return fmt.Errorf("%s: bucket (%d, %d, %d): %+v, want %+v", k, o, b, i, got.bucket[k][o][b][i], want.bucket[k][o][b][i])
					}
				}
			}
		}
	}
	return nil
}

// TestForgetPeerUndoesForgedRewards: a peer's forged outcomes (1 µs on A,
// errors and 4,000 s on B) move the Beta bandits and the baselines;
// ForgetPeer brings both back to what this replica's and an honest peer's
// outcomes alone taught (the reference policy saw only those), and the
// learning that follows is the reference's too.
func TestForgetPeerUndoesForgedRewards(t *testing.T) {
	p, ref := newPolicy(t, DefaultConfig(), nil), newPolicy(t, DefaultConfig(), nil)
	both := func(f func(*Policy)) { f(p); f(ref) }
	for i := range 40 {
		lat := time.Duration(800+10*i) * time.Millisecond
		both(func(q *Policy) { local(q, epA, lat) })
		both(func(q *Policy) { local(q, epB, lat+200*time.Millisecond) })
		both(func(q *Policy) { remote(q, "honest", []routing.EndpointKey{epA, epB}[i%2], lat) })
	}
	honest := snapshot(ref)
	for range 30 {
		remote(p, "rogue", epA, time.Microsecond)
		remote(p, "rogue", epB, 4000*time.Second)
		remote(p, "rogue", epB, 0)
		remote(p, "rogue", epC, time.Microsecond)
	}
	forged := snapshot(p)
	if forged.beta[epA].alpha < honest.beta[epA].alpha+20 || forged.beta[epB].beta < honest.beta[epB].beta+40 {
		t.Fatalf("forged outcomes did not move the bandits: A %+v (was %+v), B %+v (was %+v)",
			forged.beta[epA], honest.beta[epA], forged.beta[epB], honest.beta[epB])
	}
	if err := compare(forged, honest); err == nil {
		t.Fatal("forged outcomes left the baselines as they were")
	}
	p.ForgetPeer("rogue")
	if err := compare(snapshot(p), honest); err != nil {
		t.Fatalf("after ForgetPeer: %v", err)
	}
	// C was taught by the forger only: it is back at the prior, unset.
	ep := p.learned.Load().endpoints[epC]
	if b := *ep.beta.Load(); b != betaPrior || ep.overall[1].ok {
		t.Fatalf("C after ForgetPeer: Beta %+v, baseline %+v: want the prior, unset", b, ep.overall[1])
	}
	for i := range 20 {
		lat := time.Duration(700+5*i) * time.Millisecond
		both(func(q *Policy) { local(q, epA, lat) })
		both(func(q *Policy) { local(q, epB, 2*lat) })
	}
	if err := compare(snapshot(p), snapshot(ref)); err != nil {
		t.Fatalf("learning after ForgetPeer: %v", err)
	}
}

// TestThompsonPeersBounded: at most evidence.MaxPeers peers are kept
// apart; the least recently heard is forgotten for a new one.
func TestThompsonPeersBounded(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	for i := range evidence.MaxPeers + 10 {
		remote(p, fmt.Sprintf("peer-%d", i), epA, time.Second)
	}
	ep := p.learned.Load().endpoints[epA]
	ep.mu.Lock()
	n := ep.betaEv.Peers()
	ep.mu.Unlock()
	if n != evidence.MaxPeers || p.sources.Len() != evidence.MaxPeers {
		t.Fatalf("%d parts, %d peers: want %d", n, p.sources.Len(), evidence.MaxPeers)
	}
	if b := ep.beta.Load(); math.Abs(b.alpha+b.beta-2-float64(evidence.MaxPeers)) > 1e-9 {
		t.Fatalf("Beta %+v: want the %d peers kept (10 evicted)", b, evidence.MaxPeers)
	}
}

// TestThompsonConcurrentForget (run with -race): Choose, local and peers'
// outcomes and ForgetPeer at once; with every peer forgotten at the end,
// no learner keeps a peer's part.
func TestThompsonConcurrentForget(t *testing.T) {
	p := newPolicy(t, DefaultConfig(), nil)
	peers := []string{"p1", "p2", "p3"}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 400 {
				ep := []routing.EndpointKey{epA, epB}[i%2]
				switch {
				case g == 0:
					local(p, ep, time.Duration(100+i)*time.Millisecond)
				case i%40 == 0:
					p.ForgetPeer(peers[i%3])
				default:
					remote(p, peers[(g+i)%3], ep, time.Duration(50+i)*time.Millisecond)
				}
				sc := workedExample(t, p)
				if _, err := p.Choose(sc, false); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	for _, peer := range peers {
		p.ForgetPeer(peer)
	}
	for _, ep := range p.learned.Load().endpoints {
		ep.mu.Lock()
		n := ep.betaEv.Peers()
		ep.mu.Unlock()
		p.emaMu.Lock()
		n += ep.overall[0].ev.Peers() + ep.overall[1].ev.Peers()
		p.emaMu.Unlock()
		if n != 0 {
			t.Fatalf("%s keeps %d peers' parts", ep.key, n)
		}
	}
}
