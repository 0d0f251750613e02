package engine_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/burst"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// primeBursts gives e a history of bursts, as replica 2 of 4 sees them:
// every 500 ms three own arrivals at one instant and nine peer decisions
// a sync delay later.
func primeBursts(t *testing.T, e *engine.Engine, vc *clock.Virtual) {
	t.Helper()
	for range 30 {
		now := vc.Now()
		for range 3 {
			if at := e.Turn(&routing.Request{Arrival: now}); !at.IsZero() {
				vc.Advance(at)
			}
			pickDone(t, e, req(tokens(64, 1)))
		}
		vc.Step(2 * time.Millisecond)
		for range 9 {
			rd, err := e.StartRemote(routing.RemoteStart{Endpoint: "10.0.0.1:8000", DPRank: -1, BlockSize: 16, ISL: 64})
			if err != nil {
				t.Fatal(err)
			}
			rd.End()
		}
		vc.Advance(now.Add(500 * time.Millisecond))
	}
}

// TestPickWaitsForItsTurn: in a burst, Pick on replica 2 of 4 waits two
// steps of the engine's clock after the request's arrival, then decides;
// ctx ends the wait with its cause; with ExternalTurns it never waits.
func TestPickWaitsForItsTurn(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(1000, 0))
	cfg := burst.Config{Delay: 2 * time.Millisecond}
	e := engineWith(t, "kv", engine.Options{Burst: cfg, ExternalTurns: true}, vc, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	e.SetReplicas(2, 4)
	primeBursts(t, e, vc)
	if s := e.BurstStats(); s.Simultaneous < 1 || s.Rank != 2 || s.Replicas != 4 {
		t.Fatalf("after the bursts: %+v", s)
	}

	w := engineWith(t, "kv", engine.Options{Burst: cfg}, vc, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	w.SetReplicas(2, 4)
	// The same history, through Turn (Pick would wait in it).
	for range 30 {
		now := vc.Now()
		for range 3 {
			w.Turn(&routing.Request{Arrival: now})
		}
		vc.Step(2 * time.Millisecond)
		for range 9 {
			rd, err := w.StartRemote(routing.RemoteStart{Endpoint: "10.0.0.1:8000", DPRank: -1, BlockSize: 16, ISL: 64})
			if err != nil {
				t.Fatal(err)
			}
			rd.End()
		}
		vc.Advance(now.Add(500 * time.Millisecond))
	}
	arrival := vc.Now()
	done := make(chan error, 1)
	go func() {
		r := req(tokens(64, 9))
		r.Arrival = arrival
		d, err := w.Pick(context.Background(), r)
		if err == nil {
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
		}
		done <- err
	}()
	step := 2*time.Millisecond + 2*time.Millisecond/8
	waitTimer(t, vc)
	select {
	case err := <-done:
		t.Fatalf("Pick returned (%v) before its turn", err)
	case <-time.After(50 * time.Millisecond):
	}
	vc.Advance(arrival.Add(2*step - time.Nanosecond))
	select {
	case err := <-done:
		t.Fatalf("Pick returned (%v) a nanosecond before its turn", err)
	case <-time.After(50 * time.Millisecond):
	}
	vc.Advance(arrival.Add(2 * step))
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// A cancelled wait ends with the context's cause.
	cause := errors.New("decision timeout")
	ctx, cancel := context.WithCancelCause(context.Background())
	go func() {
		r := req(tokens(64, 10))
		r.Arrival = vc.Now()
		_, err := w.Pick(ctx, r)
		done <- err
	}()
	waitTimer(t, vc)
	cancel(cause)
	if err := <-done; !errors.Is(err, cause) {
		t.Fatalf("cancelled wait: %v, want %v", err, cause)
	}
}

// waitTimer waits until the virtual clock holds a timer (Pick's wait).
func waitTimer(t *testing.T, vc *clock.Virtual) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, ok := vc.NextAt(); ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("Pick never armed its turn's timer")
		}
		time.Sleep(time.Millisecond)
	}
}
