package sync

import (
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
)

// pdFleet is two decode and two prefill endpoints.
var pdFleet = []routing.Endpoint{
	{Key: "10.0.0.1:8000", Role: routing.RoleDecode}, {Key: "10.0.0.2:8000", Role: routing.RoleDecode},
	{Key: "10.0.0.3:8000", Role: routing.RolePrefill}, {Key: "10.0.0.4:8000", Role: routing.RolePrefill},
}

// newPDNode is a node whose engine always disaggregates over pdFleet
// (policy kv).
func newPDNode(t testing.TB, cfg Config) *node {
	t.Helper()
	n := &node{name: cfg.Replica, reg: prometheus.NewRegistry(), log: &syncBuf{}}
	s, err := New(cfg, Deps{Logger: slog.New(slog.NewTextHandler(n.log, nil)), Registry: n.reg})
	if err != nil {
		t.Fatal(err)
	}
	n.s = s
	rnd := routing.NewRand(int64(len(cfg.Replica)) + 3)
	p, err := policy.Builtin().New("kv", policy.Deps{Rand: rnd, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	dis, err := pd.New(pd.Config{ThresholdTokens: 0})
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(p, engine.Options{SyncIndex: true}, engine.Deps{Rand: rnd, Logger: slog.New(slog.DiscardHandler), PD: dis,
		OnDecision: s.OnDecision, OnFirst: s.OnFirst, OnDone: s.OnDone})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: pdFleet}); err != nil {
		t.Fatal(err)
	}
	n.e = e
	t.Cleanup(e.Close)
	t.Cleanup(func() { _ = s.Close() })
	if err := s.Start(e); err != nil {
		t.Fatal(err)
	}
	return n
}

// loadOn is n's view of endpoint key: peers' decisions in flight there,
// and the prompt tokens in flight not prefilled yet.
func (n *node) loadOn(key routing.EndpointKey) (remote, prefill int64) {
	for _, st := range n.e.Endpoints() {
		if st.Key == key {
			return st.RemoteInFlight.Load(), st.InFlightPrefill()
		}
	}
	return -1, -1
}

// TestPDSharesBothEndpoints: over a real nats-server, A's disaggregated
// decision shows on B as A holds it: the prefill endpoint carries its
// prompt's prefill tokens and the decision, the decode endpoint the
// decision without prefill tokens; A's first token releases B's prefill
// endpoint, A's end the rest.
func TestPDSharesBothEndpoints(t *testing.T) {
	srv := startNATS(t)
	a, b := newPDNode(t, testConfig(srv, "a")), newPDNode(t, testConfig(srv, "b"))
	waitConnected(t, a, b)
	toks := make([]uint32, 3000)
	for i := range toks {
		toks[i] = uint32(i + 1)
	}
	d, err := a.e.Pick(t.Context(), &routing.Request{Model: "m", Tokens: toks, TokenCount: len(toks)})
	if err != nil {
		t.Fatal(err)
	}
	if d.Prefill == "" {
		t.Fatalf("A did not disaggregate (%v)", d.PD)
	}
	_, want := localLoadOn(a, d.Prefill)
	if want == 0 {
		t.Fatal("A holds no prefill tokens on its prefill endpoint")
	}
	waitFor(t, 5*time.Second, "B carries the prefill", func() bool {
		r, p := b.loadOn(d.Prefill)
		return r == 1 && p == want
	})
	if r, p := b.loadOn(d.Endpoint); r != 1 || p != 0 {
		t.Fatalf("B's decode endpoint %s: %d peers' decisions, %d prefill tokens; want 1 and 0", d.Endpoint, r, p)
	}
	d.Prefilled()
	waitFor(t, 5*time.Second, "A's first token releases B's prefill endpoint", func() bool {
		r, p := b.loadOn(d.Prefill)
		return r == 0 && p == 0
	})
	if r, _ := b.loadOn(d.Endpoint); r != 1 {
		t.Fatalf("B's decode endpoint released at the first token: %d", r)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	waitFor(t, 5*time.Second, "A's end releases B", func() bool { return b.remoteInFlight() == 0 })
	if got := b.counter(t, "kvbandit_sync_rejected_total"); got != 0 {
		t.Fatalf("B rejected %v items", got)
	}
}

// localLoadOn is n's own decisions in flight on key and the prefill
// tokens there.
func localLoadOn(n *node, key routing.EndpointKey) (inflight, prefill int64) {
	for _, st := range n.e.Endpoints() {
		if st.Key == key {
			return st.InFlight.Load(), st.InFlightPrefill()
		}
	}
	return -1, -1
}
