package latency

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// TestExportImportState: a model trained on a fleet with one slow
// endpoint, exported and imported into a fresh one, predicts the same and
// knows the same factors (with their ages); a model that learnt more
// keeps its own fit, and endpoints outside the set are left out.
func TestExportImportState(t *testing.T) {
	src := newModel(t, DefaultConfig())
	r := rand.New(rand.NewPCG(3, 4))
	at := time.Unix(1000, 0)
	for i := range 600 {
		f := randFeatures(r)
		ep, slow := "fast", 1.0
		if i%2 == 1 {
			ep, slow = "slow", 2.0
		}
		o := obs(ep, f, slow*fleet.ttft(f), fleet.decode(f.Running), 64)
		o.At = at
		src.Observe(o)
	}
	var snap warmstate.Snapshot
	now := at.Add(3 * time.Second)
	src.ExportState(&snap, now)
	if snap.Latency == nil || len(snap.Speeds) != 2 {
		t.Fatalf("export: latency %v, %d speeds", snap.Latency != nil, len(snap.Speeds))
	}
	dst := newModel(t, DefaultConfig())
	got := dst.ImportState(&snap, now, nil)
	if !got.Latency || got.Speeds != 2 || got.Malformed != 0 {
		t.Fatalf("import %+v", got)
	}
	f := Features{Queued: 4000, Uncached: 3000, Running: 12}
	if a, b := src.Estimate(f).Total, dst.Estimate(f).Total; math.Abs(a-b) > 1e-9*a {
		t.Errorf("estimate %v after import, %v on the exporter", b, a)
	}
	for _, ep := range []string{"fast", "slow"} {
		ma, sa := src.Factor(cand(ep))
		mb, sb := dst.Factor(cand(ep))
		if ma != mb || sa != sb {
			t.Errorf("%s: factor (%v, %v) after import, (%v, %v) on the exporter", ep, mb, sb, ma, sa)
		}
	}
	// The import's ages: "slow" was last seen at `at`, 3 s before now.
	dst.Forget(at.Add(-time.Millisecond))
	if len(dst.Speeds()) != 2 {
		t.Error("imported factors aged wrong (forgotten as older than they are)")
	}
	dst.Forget(at.Add(time.Millisecond))
	if len(dst.Speeds()) != 0 {
		t.Error("imported factors aged wrong (kept past their last-seen time)")
	}

	// A model that has learnt more keeps its own; unknown endpoints stay out.
	again := dst.ImportState(&snap, now, func(ep routing.EndpointKey, _ int) bool { return ep == "fast" })
	if again.Latency || again.Speeds != 1 || again.Skipped != 2 {
		t.Errorf("second import %+v: want the fit skipped, only fast imported", again)
	}
	if again := dst.ImportState(&snap, now, nil); again.Speeds != 1 {
		t.Errorf("third import took %d speeds, want slow's (forgotten above)", again.Speeds)
	}
	if again := dst.ImportState(&snap, now, nil); again.Speeds != 0 {
		t.Errorf("fourth import took %d speeds already known as well", again.Speeds)
	}
}

// TestImportStateChecked: out-of-range values are refused, counted, and
// leave the model as it was.
func TestImportStateChecked(t *testing.T) {
	m := newModel(t, DefaultConfig())
	before := m.Coefficients()
	fit := func(n int) warmstate.Fit { return warmstate.Fit{S: make([]float64, n*n), XY: make([]float64, n)} }
	bad := func(mut func(*warmstate.Latency)) *warmstate.Latency {
		l := &warmstate.Latency{Observations: 10, TTFT: fit(5), Decode: fit(2)}
		mut(l)
		return l
	}
	for i, l := range []*warmstate.Latency{
		bad(func(l *warmstate.Latency) { l.TTFT.S = l.TTFT.S[:3] }),
		bad(func(l *warmstate.Latency) { l.Decode.XY = nil }),
		bad(func(l *warmstate.Latency) { l.TTFT.S[0] = math.NaN() }),
		bad(func(l *warmstate.Latency) { l.TTFT.XY[1] = math.Inf(-1) }),
		bad(func(l *warmstate.Latency) { l.Decode.S[3] = -1 }),
		bad(func(l *warmstate.Latency) { l.TTFT.S[1] = 1e300 }),
	} {
		if got := m.ImportState(&warmstate.Snapshot{Latency: l}, time.Now(), nil); got.Malformed != 1 || got.Latency {
			t.Errorf("fit %d: %+v, want refused", i, got)
		}
	}
	for i, sp := range []warmstate.Speed{
		{Endpoint: "e", Mean: math.Log(9), Precision: 1, Observations: 1},
		{Endpoint: "e", Mean: 0, Precision: 0, Observations: 1},
		{Endpoint: "e", Mean: 0, Precision: math.Inf(1), Observations: 1},
		{Endpoint: "e", Mean: math.NaN(), Precision: 1, Observations: 1},
		{Endpoint: "e", Mean: 0, Precision: 1, Running: -1, Observations: 1},
		{Endpoint: "e", Rank: -2, Mean: 0, Precision: 1, Observations: 1},
	} {
		if got := m.ImportState(&warmstate.Snapshot{Speeds: []warmstate.Speed{sp}}, time.Now(), nil); got.Malformed != 1 || got.Speeds != 0 {
			t.Errorf("speed %d: %+v, want refused", i, got)
		}
	}
	if m.Coefficients() != before || len(m.Speeds()) != 0 {
		t.Error("a refused import changed the model")
	}
	// A fit that solves to nothing sensible (all zero) falls back to the
	// prior, as the model's own solve does.
	ok := &warmstate.Latency{Observations: 10, TTFT: fit(5), Decode: fit(2)}
	if got := m.ImportState(&warmstate.Snapshot{Latency: ok}, time.Now(), nil); !got.Latency {
		t.Fatalf("zero fit: %+v", got)
	}
	if k := m.Coefficients(); k.PerBatch != before.PerBatch || k.Observations != 10 {
		t.Errorf("zero fit solved to %+v, want the prior's coefficients", k)
	}
}
