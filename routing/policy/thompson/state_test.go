package thompson_test

import (
	"math"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/policy/thompson"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// TestImportStateChecked: a peer's arms and bandits are taken for
// endpoints that have learnt nothing here, out-of-range values are
// refused and counted, and a learner that learnt here keeps its own.
func TestImportStateChecked(t *testing.T) {
	src := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000", "10.0.0.2:8000")
	for range 5 {
		d := src.pick(t, routing.Hints{})
		d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: 10 * time.Millisecond, Latency: 100 * time.Millisecond, CompletionTokens: 10})
	}
	var snap warmstate.Snapshot
	src.e.ExportState(&snap)
	if len(snap.Arms) == 0 || len(snap.Betas) == 0 || snap.Baselines == nil {
		t.Fatalf("export: %d arms, %d betas, baselines %v", len(snap.Arms), len(snap.Betas), snap.Baselines != nil)
	}
	dst := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000")
	got := dst.e.ImportState(&snap)
	if got.Arms == 0 || got.Betas == 0 || got.Malformed != 0 {
		t.Fatalf("import %+v", got)
	}
	for _, es := range src.p.Stats().Endpoints {
		if es.Endpoint == "10.0.0.1:8000" && math.Abs(dst.endpoint(t, es.Endpoint).Mean-es.Mean) > 1e-12 {
			t.Errorf("beta mean %v after import, %v on the exporter", dst.endpoint(t, es.Endpoint).Mean, es.Mean)
		}
	}
	if again := dst.e.ImportState(&snap); again.Arms != 0 || again.Betas != 0 {
		t.Errorf("second import %+v: learners already set were replaced", again)
	}
	arm := snap.Arms[0]
	bad := []warmstate.Snapshot{
		{Arms: []warmstate.Arm{func() warmstate.Arm { a := arm; a.A[0] = math.NaN(); return a }()}},
		{Arms: []warmstate.Arm{func() warmstate.Arm { a := arm; a.A[10] = 0; return a }()}},
		{Arms: []warmstate.Arm{func() warmstate.Arm { a := arm; a.B[3] = 1e13; return a }()}},
		{Arms: []warmstate.Arm{func() warmstate.Arm { a := arm; a.Rank = -7; return a }()}},
		{Betas: []warmstate.Beta{{Endpoint: "10.0.0.1:8000", Alpha: 0, Beta: 1}}},
		{Betas: []warmstate.Beta{{Endpoint: "10.0.0.1:8000", Alpha: 1, Beta: math.Inf(1)}}},
		{Betas: []warmstate.Beta{{Endpoint: "10.0.0.1:8000", Alpha: 1, Beta: 1, LastReward: 2}}},
		{Betas: []warmstate.Beta{{Endpoint: "10.0.0.1:8000", Alpha: 1, Beta: 1, Buckets: [18]warmstate.EMA{{V: -1, OK: true}}}}},
		{Baselines: &warmstate.Baselines{Global: [2]warmstate.EMA{{V: math.NaN(), OK: true}}}},
	}
	fresh := newFixture(t, thompson.DefaultConfig(), "10.0.0.1:8000")
	for i := range bad {
		if got := fresh.e.ImportState(&bad[i]); got.Malformed != 1 || got.Arms+got.Betas != 0 {
			t.Errorf("bad state %d: %+v, want refused", i, got)
		}
	}
	if len(fresh.p.Stats().Endpoints) != 0 {
		t.Error("a refused import created endpoint state")
	}
}
