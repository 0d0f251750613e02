package livebench

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing/sim"
	"github.com/kvbandit/kvbandit/routing/sim/trace"
)

// mooncakeStamps are Mooncake-like arrivals: a 3 s grid stamped with
// ±1 ms jitter (0, 3000, 5999, 9000, ...), several requests per stamp.
func mooncakeStamps(cells, perCell int) []time.Duration {
	rng := rand.New(rand.NewPCG(1, 2))
	var out []time.Duration
	for c := range cells {
		ms := int64(c)*3000 + rng.Int64N(3) - 1
		if c == 0 {
			ms = 0
		}
		for range perCell {
			out = append(out, time.Duration(ms)*time.Millisecond)
		}
	}
	return out
}

func TestDetectGrid(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	var poisson []time.Duration
	var at time.Duration
	for range 2000 {
		at += time.Duration(rng.ExpFloat64() * float64(300*time.Millisecond))
		poisson = append(poisson, at)
	}
	var halfSecond []time.Duration
	for i := range 100 {
		halfSecond = append(halfSecond, time.Duration(i*i%37)*500*time.Millisecond)
	}
	for _, tc := range []struct {
		name     string
		arrivals []time.Duration
		want     time.Duration
		tol      time.Duration
	}{
		{"mooncake 3s jittered, an hour", mooncakeStamps(1180, 10), 3 * time.Second, time.Millisecond},
		{"exact 500ms multiples", halfSecond, 500 * time.Millisecond, 0},
		{"poisson", poisson, 0, 0},
		{"two stamps", []time.Duration{0, 3 * time.Second, 3 * time.Second}, 0, 0},
		{"fine 1ms grid", []time.Duration{0, 1e6, 3e6, 7e6}, 0, 0},
	} {
		got := DetectGrid(tc.arrivals)
		if got < tc.want-tc.tol || got > tc.want+tc.tol {
			t.Errorf("%s: grid %v, want %v ±%v", tc.name, got, tc.want, tc.tol)
		}
	}
}

// traceOf makes trace requests at the given arrivals.
func traceOf(arrivals []time.Duration) []sim.Request {
	reqs := make([]sim.Request, len(arrivals))
	for i, a := range arrivals {
		reqs[i] = sim.Request{Arrival: a, Tokens: []uint32{uint32(i)}, OutputLen: 1 + i%7}
	}
	return reqs
}

// TestSpread: arrivals on the 3 s grid are spread uniformly within their
// cell, sorted, repeatable with a seed and different with another.
func TestSpread(t *testing.T) {
	const cells, per = 20, 500
	reqs := traceOf(mooncakeStamps(cells, per))
	w, err := FromTrace(reqs, Options{Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	if w.Grid < 2999*time.Millisecond || w.Grid > 3001*time.Millisecond {
		t.Fatalf("grid %v, want 3s", w.Grid)
	}
	if !slices.IsSortedFunc(w.Requests, func(a, b Request) int { return int(a.At - b.At) }) {
		t.Fatal("requests are not sorted by send time")
	}
	var quarters [4]int
	for i, r := range w.Requests {
		if r.Index != i {
			t.Fatalf("request %d has index %d", i, r.Index)
		}
		cell := (r.At + time.Millisecond) / (3 * time.Second) // stamps are within 1 ms of the grid
		off := r.At - cell*3*time.Second
		if cell >= cells || off < -2*time.Millisecond || off >= 3*time.Second+2*time.Millisecond {
			t.Fatalf("request at %v is outside its grid cell", r.At)
		}
		quarters[min(max(off, 0)*4/(3*time.Second), 3)]++
	}
	for q, n := range quarters {
		if n < cells*per/4*85/100 || n > cells*per/4*115/100 {
			t.Errorf("quarter %d of the grid cells holds %d of %d requests: not uniform %v", q, n, cells*per, quarters)
		}
	}
	again, _ := FromTrace(reqs, Options{Seed: 7})
	other, _ := FromTrace(reqs, Options{Seed: 8})
	if !slices.EqualFunc(w.Requests, again.Requests, func(a, b Request) bool { return a.At == b.At }) {
		t.Error("the same seed spread differently")
	}
	if slices.EqualFunc(w.Requests, other.Requests, func(a, b Request) bool { return a.At == b.At }) {
		t.Error("another seed spread the same way")
	}
	none, _ := FromTrace(reqs, Options{Grid: -1})
	if none.Grid != 0 || none.Requests[per].At != reqs[per].Arrival {
		t.Errorf("Grid -1: grid %v, request %d at %v: want arrivals kept", none.Grid, per, none.Requests[per].At)
	}
}

// TestWindowRateLimit: the window is trace time from the first arrival,
// the rate scale divides send times, Limit keeps the first requests.
func TestWindowRateLimit(t *testing.T) {
	var arrivals []time.Duration
	for i := range 60 {
		arrivals = append(arrivals, 10*time.Second+time.Duration(i)*time.Second)
	}
	reqs := traceOf(arrivals)
	w, err := FromTrace(reqs, Options{Window: 30 * time.Second, RateScale: 2, Grid: -1, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 30 {
		t.Fatalf("%d requests in a 30 s window of 1 req/s, want 30", len(w.Requests))
	}
	if w.Requests[0].At != 0 || w.Span() != 29*time.Second/2 {
		t.Errorf("first at %v, span %v: want 0 and 14.5s", w.Requests[0].At, w.Span())
	}
	if r := w.Requests[3]; r.MaxTokens != reqs[3].OutputLen || r.Model != "m" || &r.Tokens[0] != &reqs[3].Tokens[0] {
		t.Errorf("request 3 = %+v: want the trace's output length, model m and its tokens", r)
	}
	w, _ = FromTrace(reqs, Options{Limit: 5, Grid: -1})
	if len(w.Requests) != 5 {
		t.Errorf("Limit 5: %d requests", len(w.Requests))
	}
	for _, bad := range []Options{{Window: -1}, {RateScale: -2}, {Limit: -1}} {
		if _, err := FromTrace(reqs, bad); err == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}

// TestAgenticHints: agentic sessions carry their hints as x-prefix-*
// headers that the router's hint parser reads back as the generator's
// hints; StripHints sends none. Turns of a session share their history
// as a text prefix.
func TestAgenticHints(t *testing.T) {
	cfg := trace.AgenticConfig{Sessions: 3, Turns: 3, InputLen: 64, OutputLen: 300, SystemPromptLen: 128, Seed: 1}
	gen, err := trace.Agentic(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w, err := Agentic(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if w.Grid != 0 || len(w.Requests) != len(gen) {
		t.Fatalf("grid %v, %d requests: want no grid and %d requests", w.Grid, len(w.Requests), len(gen))
	}
	bySession := map[string][]string{}
	for i, r := range w.Requests {
		h := r.Header()
		got, probs := hints.Parse(func(name string) (string, bool) {
			v := h.Get(name)
			return v, v != ""
		}, openai.NVExt{})
		if probs.Count != 0 || got != gen[i].Hints {
			t.Errorf("request %d: headers %v parse to %+v (problems %v), want %+v", i, h, got, probs, gen[i].Hints)
		}
		bySession[got.PrefixID] = append(bySession[got.PrefixID], r.Prompt())
	}
	for id, turns := range bySession {
		for i := 1; i < len(turns); i++ {
			if !strings.HasPrefix(turns[i], turns[i-1]+" ") {
				t.Errorf("session %s: turn %d does not extend turn %d's text", id, i, i-1)
			}
		}
	}
	stripped, _ := Agentic(cfg, Options{StripHints: true})
	for _, r := range stripped.Requests {
		if len(r.Header()) != 0 {
			t.Fatalf("StripHints: headers %v", r.Header())
		}
	}
}
