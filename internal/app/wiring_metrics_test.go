package app

import (
	"fmt"
	"log/slog"
	"math"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvbandit/kvbandit/routing"
)

// evenFleet builds serve's engine for policy on four identical endpoints
// and runs sessions of turns requests each through Pick and Done, every
// outcome from the same latency law whichever endpoint served it. It
// returns the gathered metrics by name.
func evenFleet(t *testing.T, policy string, sessions, turns int) map[string]*dto.MetricFamily {
	t.Helper()
	cfg := DefaultFileConfig()
	reg := prometheus.NewRegistry()
	parts, err := buildEngine(ServeOptions{Policy: policy, Seed: 7}, &cfg, slog.New(slog.DiscardHandler), reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer parts.close()
	set, _ := routing.ParseEndpointList("127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003,127.0.0.1:8004")
	if err := parts.engine.Update(set); err != nil {
		t.Fatal(err)
	}
	for turn := range turns {
		for s := range sessions {
			// A session resends its history plus a new turn.
			n := 64 * (turn + 2)
			toks := make([]uint32, n)
			for i := range toks {
				toks[i] = uint32(s*100000 + i)
			}
			r := &routing.Request{Model: "m", Tokens: toks, TokenCount: n}
			r.Hints.PrefixID = fmt.Sprintf("session-%d", s)
			r.Hints.TotalRequests = turns
			d, err := parts.engine.Pick(t.Context(), r)
			if err != nil {
				t.Fatal(err)
			}
			uncached := n - d.Overlap*cfg.Router.BlockSize
			ttft := 20*time.Millisecond + time.Duration(uncached)*20*time.Microsecond
			d.Done(routing.Outcome{
				Kind: routing.OutcomeSuccess, Served: d.Endpoint, Status: 200, TTFT: ttft, Latency: ttft + 160*time.Millisecond,
				PromptTokens: n, CompletionTokens: 16, CachedTokens: n - uncached,
			})
		}
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	byName := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		byName[mf.GetName()] = mf
	}
	return byName
}

// TestSessionDecisionsFirstTurnIsNoSwitch: a session's first request has no
// previous endpoint to stay on or leave; it counts as "first", and every
// later turn as sticky or switch.
func TestSessionDecisionsFirstTurnIsNoSwitch(t *testing.T) {
	t.Parallel()
	const sessions, turns = 12, 4
	for _, policy := range []string{"kvbandit", "thompson"} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			mf := evenFleet(t, policy, sessions, turns)["kvbandit_session_decisions_total"]
			got := map[string]float64{}
			for _, m := range mf.GetMetric() {
				for _, l := range m.GetLabel() {
					got[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
			if got["first"] != sessions || got["sticky"]+got["switch"] != sessions*(turns-1) || len(got) > 3 {
				t.Fatalf("session decisions %v: want first=%d and sticky+switch=%d", got, sessions, sessions*(turns-1))
			}
		})
	}
	// A policy that keeps no sessions reports none.
	if mf := evenFleet(t, "round_robin", 2, 2)["kvbandit_session_decisions_total"]; len(mf.GetMetric()) != 0 {
		t.Fatalf("round_robin: %v", mf)
	}
}

// TestPosteriorSpeedFactorEvenFleet: on four identical workers the exported
// speed factor is relative to the fleet: about 1 for every endpoint, their
// geometric mean exactly 1 — whatever scale the pooled fit has reached.
func TestPosteriorSpeedFactorEvenFleet(t *testing.T) {
	t.Parallel()
	mf := evenFleet(t, "kvbandit", 16, 6)["kvbandit_posterior_speed_factor"]
	if len(mf.GetMetric()) != 4 {
		t.Fatalf("want a factor per endpoint, got %v", mf)
	}
	var logSum float64
	for _, m := range mf.GetMetric() {
		f := m.GetGauge().GetValue()
		if !(f > 0.8 && f < 1.25) {
			t.Errorf("%v: factor %v on an even fleet", m.GetLabel(), f)
		}
		logSum += math.Log(f)
	}
	if math.Abs(logSum) > 1e-9 {
		t.Errorf("geometric mean of the factors %v, want 1", math.Exp(logSum/4))
	}
}
