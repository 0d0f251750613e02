package latency

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/evidence"
)

// refModel is the single speed posterior per endpoint that routing/latency
// kept before peers' evidence was kept apart, written out again: the
// reference the kept-apart beliefs must reproduce. Observations from the
// sources in ignore discount the posterior but add no precision: the
// reference for what ForgetPeer of those sources must leave.
type refModel struct {
	cfg    Config
	post   map[string]*refPost
	sum    float64
	n      int
	ignore map[string]bool
}

type refPost struct {
	m, p float64
	n    int
}

func newRef(cfg Config) *refModel {
	return &refModel{cfg: cfg, post: map[string]*refPost{}, ignore: map[string]bool{}}
}

func (r *refModel) fleet() float64 {
	if r.n == 0 {
		return 0
	}
	return r.sum / float64(r.n)
}

// observe is observeSpeed's recursion (peer "" is local).
func (r *refModel) observe(ep string, rel float64, peer string) {
	obs := 1 / (r.cfg.ObsSigma * r.cfg.ObsSigma)
	keep := r.cfg.SpeedForget
	if peer != "" {
		obs *= r.cfg.RemoteWeight
		keep = math.Pow(r.cfg.SpeedForget, r.cfg.RemoteWeight)
	}
	if r.ignore[peer] {
		obs = 0
	}
	prev, ok := r.post[ep]
	if !ok {
		prev = &refPost{p: 1 / (r.cfg.PriorSigma * r.cfg.PriorSigma), m: r.fleet()}
	}
	kept := keep * prev.p
	next := &refPost{p: kept + obs, n: prev.n + 1}
	next.m = (kept*prev.m + obs*rel) / next.p
	r.post[ep] = next
	if ok {
		r.sum += next.m - prev.m
	} else {
		r.sum += next.m
		r.n++
	}
}

// observeRel feeds one log ratio from peer ("" local) into m as Observe
// does after the pooled fit.
func observeRel(m *Model, ep string, rel float64, peer string) {
	k := key{routing.EndpointKey(ep), -1}
	if peer == "" {
		m.observeSpeed(k, rel, time.Time{}, 0, evidence.Local)
		return
	}
	m.sources.Use(peer, m.forgetSource, func(src evidence.Source) { m.observeSpeed(k, rel, time.Time{}, 0, src) })
}

func beliefOf(t testing.TB, m *Model, ep string) *belief {
	t.Helper()
	bi, ok := m.speeds.Load(key{routing.EndpointKey(ep), -1})
	if !ok {
		t.Fatalf("no belief for %s", ep)
	}
	return bi.(*belief)
}

// TestSpeedMatchesSinglePosterior (property): over random sequences of
// local and peers' outcomes on a few endpoints, at several remote
// weights, every factor (mean and standard deviation) and the fleet's
// prior are bit for bit the single posterior's, and each belief's parts
// sum to its posterior (TestSpeedPartsSumToPosterior's invariant).
func TestSpeedMatchesSinglePosterior(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	peers := []string{"", "", "p1", "p2", "p3"}
	eps := []string{"a:1", "b:1", "c:1", "d:1"}
	for trial := range 60 {
		cfg := DefaultConfig()
		cfg.RemoteWeight = []float64{1, 0.5, 0.25, 1}[trial%4]
		m, ref := newModel(t, cfg), newRef(cfg)
		for range 1 + rng.IntN(1500) {
			ep, peer := eps[rng.IntN(len(eps))], peers[rng.IntN(len(peers))]
			rel := 0.4 * rng.NormFloat64()
			if ep == "a:1" {
				rel += 0.7 // one slow endpoint
			}
			observeRel(m, ep, rel, peer)
			ref.observe(ep, rel, peer)
		}
		for _, ep := range eps {
			mu, sd := m.Factor(cand(ep))
			want, ok := ref.post[ep]
			if !ok {
				if mu != m.fleetPrior() || sd != cfg.PriorSigma {
					t.Fatalf("trial %d: unseen %s: factor (%v, %v)", trial, ep, mu, sd)
				}
				continue
			}
			if mu != want.m || sd != 1/math.Sqrt(want.p) {
				t.Fatalf("trial %d: %s: factor (%v, %v), single posterior (%v, %v)", trial, ep, mu, sd, want.m, 1/math.Sqrt(want.p))
			}
			checkParts(t, m, ep)
		}
		if got, want := m.fleetPrior(), ref.fleet(); got != want {
			t.Fatalf("trial %d: fleet prior %v, single posteriors' %v", trial, got, want)
		}
	}
}

// checkParts: the belief's parts sum to its posterior, up to rounding.
func checkParts(t testing.TB, m *Model, ep string) {
	t.Helper()
	b := beliefOf(t, m, ep)
	b.mu.Lock()
	defer b.mu.Unlock()
	v, tot := b.v.Load(), b.ev.Total()
	if v == nil {
		return
	}
	if math.Abs(tot.W-v.p) > 1e-9*v.p || math.Abs(tot.Mean()-v.m) > 1e-9*max(1, math.Abs(v.m)) {
		t.Fatalf("%s: parts sum to precision %v mean %v, posterior %v %v", ep, tot.W, tot.Mean(), v.p, v.m)
	}
}

// TestSpeedPartsSumToPosterior: the invariant ForgetPeer relies on, over
// a long run (the parts' scale is renormalised many times).
func TestSpeedPartsSumToPosterior(t *testing.T) {
	m := newModel(t, DefaultConfig())
	rng := rand.New(rand.NewPCG(5, 6))
	for i := range 20000 {
		observeRel(m, "a:1", 0.3*rng.NormFloat64(), []string{"", "p1", "p2"}[i%3])
	}
	checkParts(t, m, "a:1")
}

// forge sends n outcomes from peer: 1 µs TTFTs for fast, 4,000 s for the
// others (the forged-peer case), through Observe.
func forge(m *Model, peer, fast string, slow []string, n int) {
	f := Features{Uncached: 1000}
	for range n {
		o := obs(fast, f, 0.001, 0, 0)
		o.Remote, o.Peer = true, peer
		m.Observe(o)
		for _, ep := range slow {
			o := obs(ep, f, 4e6, 0, 0)
			o.Remote, o.Peer = true, peer
			m.Observe(o)
		}
	}
}

// TestForgetPeerUndoesForgedOutcomes: a peer's forged outcomes move the
// factors (the fast endpoint far below the others); ForgetPeer brings
// every factor exactly to the posterior without that peer's evidence (the
// reference in which its outcomes discount but add nothing), keeps an
// honest peer's, and makes the endpoint only the forger taught unseen
// again; the fleet's prior follows.
func TestForgetPeerUndoesForgedOutcomes(t *testing.T) {
	cfg := DefaultConfig()
	m, ref := newModel(t, cfg), newRef(cfg)
	rng := rand.New(rand.NewPCG(7, 8))
	eps := []string{"a:1", "b:1", "c:1"}
	feed := func(ep string, rel float64, peer string) {
		observeRel(m, ep, rel, peer)
		ref.observe(ep, rel, peer)
	}
	for i := range 90 {
		peer := []string{"", "honest"}[i%2]
		feed(eps[i%3], 0.1*rng.NormFloat64(), peer)
	}
	honest := map[string]float64{}
	for _, ep := range eps {
		honest[ep], _ = m.Factor(cand(ep))
	}
	// The forger's outcomes, through the whole Observe path; the
	// reference learns the same log ratios with no weight.
	ref.ignore["rogue"] = true
	lim := math.Log(cfg.MaxFactor)
	forge(m, "rogue", "a:1", []string{"b:1", "c:1", "d:1"}, 3)
	for range 3 {
		ref.observe("a:1", -lim, "rogue")
		for _, ep := range []string{"b:1", "c:1", "d:1"} {
			ref.observe(ep, lim, "rogue")
		}
	}
	fa, _ := m.Factor(cand("a:1"))
	fb, _ := m.Factor(cand("b:1"))
	if !(fa < honest["a:1"]-0.5 && fb > honest["b:1"]+0.5) {
		t.Fatalf("forged outcomes moved a's log factor %v → %v and b's %v → %v: want both far", honest["a:1"], fa, honest["b:1"], fb)
	}
	delete(ref.post, "d:1") // only the forger taught d
	ref.sum, ref.n = 0, 0
	for _, p := range ref.post {
		ref.sum += p.m
		ref.n++
	}

	m.ForgetPeer("rogue")
	for _, ep := range eps {
		mu, sd := m.Factor(cand(ep))
		want := ref.post[ep]
		if math.Abs(mu-want.m) > 1e-9 || math.Abs(sd-1/math.Sqrt(want.p)) > 1e-9 {
			t.Fatalf("%s after ForgetPeer: (%v, %v), want the posterior without the forger (%v, %v)", ep, mu, sd, want.m, 1/math.Sqrt(want.p))
		}
		if 1/(sd*sd) < m.priorPrecision() {
			t.Fatalf("%s: precision %v under the prior's: the floor would apply, pick a gentler case", ep, 1/(sd*sd))
		}
		b := beliefOf(t, m, ep)
		b.mu.Lock()
		if b.ev.Part(1).W == 0 || b.ev.Peers() != 1 {
			t.Errorf("%s: the honest peer's part is gone (%d peers)", ep, b.ev.Peers())
		}
		b.mu.Unlock()
	}
	if mu, sd := m.Factor(cand("d:1")); mu != m.fleetPrior() || sd != cfg.PriorSigma {
		t.Fatalf("d (only the forger's outcomes): (%v, %v), want unseen (%v, %v)", mu, sd, m.fleetPrior(), cfg.PriorSigma)
	}
	if len(m.Speeds()) != 3 {
		t.Fatalf("speeds %+v: want a, b, c", m.Speeds())
	}
	if got := m.fleetPrior(); math.Abs(got-ref.fleet()) > 1e-9 {
		t.Fatalf("fleet prior %v, want %v (the mean of a, b, c)", got, ref.fleet())
	}
	m.ForgetPeer("rogue") // a second time: nothing left to forget
	if mu, _ := m.Factor(cand("a:1")); math.Abs(mu-ref.post["a:1"].m) > 1e-9 {
		t.Fatalf("a second ForgetPeer moved a to %v", mu)
	}
}

// TestForgetPeerAfterAFlood: 98 forged outcomes (the count)
// discount this replica's own evidence to nothing (0.9^98); after
// ForgetPeer the factors have the prior's certainty at the
// mean of what is left (this replica's own evidence), not wider.
func TestForgetPeerAfterAFlood(t *testing.T) {
	cfg := DefaultConfig()
	m := newModel(t, cfg)
	for i := range 60 {
		observeRel(m, []string{"a:1", "b:1"}[i%2], 0.05, "")
	}
	forge(m, "rogue", "a:1", []string{"b:1"}, 98)
	m.ForgetPeer("rogue")
	for _, ep := range []string{"a:1", "b:1"} {
		mu, sd := m.Factor(cand(ep))
		if math.Abs(sd-cfg.PriorSigma) > 1e-12 || math.Abs(mu-0.05) > 0.01 {
			t.Fatalf("%s after a flood and ForgetPeer: (%v, %v), want about (0.05, prior sigma %v)", ep, mu, sd, cfg.PriorSigma)
		}
	}
}

// TestPeerPartsBounded: a belief keeps at most evidence.MaxPeers peers'
// parts; the least recently heard peer is forgotten for a new one.
func TestPeerPartsBounded(t *testing.T) {
	m := newModel(t, DefaultConfig())
	for i := range evidence.MaxPeers + 44 {
		observeRel(m, "a:1", 0.1, fmt.Sprintf("peer-%d", i))
	}
	b := beliefOf(t, m, "a:1")
	b.mu.Lock()
	n := b.ev.Peers()
	b.mu.Unlock()
	if n != evidence.MaxPeers || m.sources.Len() != evidence.MaxPeers {
		t.Fatalf("%d parts, %d peers interned; want %d", n, m.sources.Len(), evidence.MaxPeers)
	}
	checkParts(t, m, "a:1")
}

// TestConcurrentPeersAndForget (run with -race): local and peers'
// outcomes, ForgetPeer and Pick-path reads at once; afterwards, with
// every peer forgotten, no belief keeps a peer's part and each one's
// parts still sum to its posterior.
func TestConcurrentPeersAndForget(t *testing.T) {
	m := newModel(t, DefaultConfig())
	var wg sync.WaitGroup
	peers := []string{"p1", "p2", "p3"}
	for g := range 4 {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(g), 1))
			c := cand("a:1")
			for i := range 800 {
				f := randFeatures(r)
				o := obs([]string{"a:1", "b:1"}[i%2], f, fleet.ttft(f), fleet.decode(f.Running), 20)
				if g > 0 {
					o.Remote, o.Peer = true, peers[(g+i)%3]
				}
				m.Observe(o)
				if i%50 == 0 {
					m.ForgetPeer(peers[i%3])
				}
				if f := m.Draw(c, r, false); !(f > 0) {
					t.Errorf("draw %v", f)
					return
				}
			}
		})
	}
	wg.Wait()
	for _, p := range peers {
		m.ForgetPeer(p)
	}
	for _, ep := range []string{"a:1", "b:1"} {
		b := beliefOf(t, m, ep)
		b.mu.Lock()
		n := b.ev.Peers()
		b.mu.Unlock()
		if n != 0 {
			t.Fatalf("%s keeps %d peers' parts after every peer was forgotten", ep, n)
		}
		checkParts(t, m, ep)
	}
	if m.sources.Len() != 0 {
		t.Fatalf("%d peers still interned", m.sources.Len())
	}
}

// setPeer marks o as peer's (BenchmarkReads).
func setPeer(o *Observation, peer string) { o.Peer = peer }
