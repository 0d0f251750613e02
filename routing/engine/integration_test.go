package engine_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/admission"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/policy"
)

func tokens(n int, base uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

func engineWith(t testing.TB, name string, opts engine.Options, clk clock.Clock, eps ...routing.Endpoint) *engine.Engine {
	t.Helper()
	if _, bench := t.(*testing.B); !bench {
		opts.SyncIndex = true // tests look at the index right after a pick
	}
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New(name, policy.Deps{Rand: rnd, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	e, err := engine.New(p, opts, engine.Deps{Rand: rnd, Clock: clk, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	if c, ok := p.(interface{ Close() error }); ok {
		t.Cleanup(func() { c.Close() })
	}
	if err := e.Update(routing.EndpointSet{Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return e
}

func req(toks []uint32) *routing.Request {
	return &routing.Request{Model: "m", Tokens: toks, TokenCount: len(toks)}
}

// TestApproximateIndexMakesFollowUpsSticky: the kv policy sends a prompt
// somewhere, the approximate index remembers it, and a follow-up sharing the
// prefix goes to the same endpoint with the overlap credited.
func TestApproximateIndexMakesFollowUpsSticky(t *testing.T) {
	e := engineWith(t, "kv", engine.Options{}, nil, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"), ep("10.0.0.3:8000"))
	first, err := e.Pick(t.Context(), req(tokens(256, 1)))
	if err != nil {
		t.Fatal(err)
	}
	first.Done(routing.NoUsage(routing.OutcomeSuccess))
	for i := range 5 {
		follow, err := e.Pick(t.Context(), req(tokens(256+32*(i+1), 1)))
		if err != nil {
			t.Fatal(err)
		}
		if follow.Endpoint != first.Endpoint || follow.Overlap < 16 {
			t.Fatalf("follow-up %d went to %s with overlap %d (first: %s)", i, follow.Endpoint, follow.Overlap, first.Endpoint)
		}
		follow.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
	// A different prompt has no overlap anywhere.
	other, _ := e.Pick(t.Context(), req(tokens(256, 1_000_000)))
	if other.Overlap != 0 {
		t.Fatalf("unrelated prompt overlap %d", other.Overlap)
	}
	other.Done(routing.NoUsage(routing.OutcomeSuccess))
}

// TestSaltsAndLoRASeparateCaches: the same tokens under another cache_salt
// or LoRA share nothing.
func TestSaltsAndLoRASeparateCaches(t *testing.T) {
	e := engineWith(t, "kv", engine.Options{}, nil, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	d, _ := e.Pick(t.Context(), req(tokens(128, 5)))
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	for _, r := range []*routing.Request{{Tokens: tokens(128, 5), TokenCount: 128, CacheSalt: "tenant-b"}, {Tokens: tokens(128, 5), TokenCount: 128, LoRA: "adapter"}} {
		d, _ := e.Pick(t.Context(), r)
		if d.Overlap != 0 {
			t.Fatalf("salted request overlapped %d blocks", d.Overlap)
		}
		d.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
}

// TestActiveLoadThroughExitPaths: prefill tokens and blocks are charged at
// pick, prefill is released at the first token, blocks at Done, whatever
// the outcome; a decision whose Done never comes is released by the sweeper.
func TestActiveLoadThroughExitPaths(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(0, 0))
	e := engineWith(t, "kv", engine.Options{StaleAfter: time.Minute}, vc, ep("10.0.0.1:8000"))
	load := func() (int64, int64) { return activePrefill(t, e), activeBlocks(t, e) }
	for i, end := range []routing.OutcomeKind{routing.OutcomeSuccess, routing.OutcomeUpstreamError, routing.OutcomeCancelled, routing.OutcomeReset, routing.OutcomeAbandoned} {
		// A fresh prompt each time: a repeated one would be cached by now.
		d, err := e.Pick(t.Context(), req(tokens(100, uint32(7+1000*i))))
		if err != nil {
			t.Fatal(err)
		}
		if p, b := load(); p != 100 || b != 6 {
			t.Fatalf("after pick: prefill %d blocks %d, want 100 and 6", p, b)
		}
		d.Prefilled()
		if p, b := load(); p != 0 || b != 6 {
			t.Fatalf("after first token: prefill %d blocks %d", p, b)
		}
		d.Done(routing.NoUsage(end))
		if p, b := load(); p != 0 || b != 0 {
			t.Fatalf("after Done(%v): prefill %d blocks %d", end, p, b)
		}
	}
	d, _ := e.Pick(t.Context(), req(tokens(100, 7)))
	vc.Step(59 * time.Second)
	if d.Finished() {
		t.Fatal("swept too early")
	}
	vc.Step(2 * time.Second)
	if !d.Finished() || e.Expired() != 1 || activeBlocks(t, e) != 0 || e.Endpoints()[0].InFlight.Load() != 0 {
		t.Fatalf("sweeper: finished=%v expired=%d", d.Finished(), e.Expired())
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess)) // a late Done is harmless
}

func activePrefill(t *testing.T, e *engine.Engine) int64 {
	return e.Endpoints()[0].InFlightPrefill()
}

func activeBlocks(t *testing.T, e *engine.Engine) int64 {
	var n int64
	for _, b := range e.Endpoints()[0].ActiveBlocks() {
		n += b
	}
	return n
}

func TestDataParallelRanksAreCandidates(t *testing.T) {
	e := engineWith(t, "round_robin", engine.Options{}, nil, routing.Endpoint{Key: "10.0.0.1:8000", DataParallelSize: 4})
	seen := map[int]bool{}
	for range 8 {
		d, err := e.Pick(t.Context(), req(tokens(32, 1)))
		if err != nil {
			t.Fatal(err)
		}
		seen[d.DPRank] = true
		d.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
	if len(seen) != 4 || !seen[0] || !seen[3] {
		t.Fatalf("ranks chosen: %v", seen)
	}
}

func TestAdmissionQueueWaitsAndSheds(t *testing.T) {
	opts := engine.Options{Admission: admission.Config{Threshold: 0.5, MaxWait: time.Minute}}
	e := engineWith(t, "kv", opts, nil, routing.Endpoint{Key: "10.0.0.1:8000", MaxBatchedTokens: 100})
	busy, err := e.Pick(t.Context(), req(tokens(80, 1))) // 80 > 0.5 × 100: saturated
	if err != nil {
		t.Fatal(err)
	}
	shed := req(tokens(10, 50))
	shed.Hints = routing.Hints{HasPriority: true, Priority: -1}
	if _, err := e.Pick(t.Context(), shed); !errors.Is(err, routing.ErrOverloaded) {
		t.Fatalf("sheddable request while saturated: %v", err)
	}
	got := make(chan error, 1)
	go func() {
		d, err := e.Pick(context.Background(), req(tokens(10, 99)))
		if err == nil {
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
		}
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("admitted while saturated: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	busy.Prefilled() // capacity frees: the waiter is woken
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("waiter not admitted after prefill completed")
	}
	busy.Done(routing.NoUsage(routing.OutcomeSuccess))
	ctx, cancel := context.WithCancelCause(t.Context())
	busy2, _ := e.Pick(t.Context(), req(tokens(80, 5000))) // uncached: saturates again
	cause := fmt.Errorf("decision deadline")
	cancel(cause)
	if _, err := e.Pick(ctx, req(tokens(10, 7))); !errors.Is(err, cause) {
		t.Fatalf("cancelled wait returned %v", err)
	}
	busy2.Done(routing.NoUsage(routing.OutcomeSuccess))
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// TestSameSeedSameDecisions: with a seed and the index applied in-line, a
// sequence of requests and outcomes gives the same decisions every run,
// for every policy that draws random numbers.
func TestSameSeedSameDecisions(t *testing.T) {
	for _, name := range []string{"kvbandit", "thompson", "random", "least_loaded"} {
		t.Run(name, func(t *testing.T) {
			run := func() []string {
				vc := clock.NewVirtual(time.Unix(1000, 0))
				e := engineWith(t, name, engine.Options{}, vc, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"), ep("10.0.0.3:8000"))
				var out []string
				for i := range 60 {
					r := req(tokens(64+16*(i%7), uint32(1+i%3)))
					r.Hints = routing.Hints{PrefixID: fmt.Sprintf("s%d", i%4), TotalRequests: 10, IAT: routing.LevelLow}
					d, err := e.Pick(t.Context(), r)
					if err != nil {
						t.Fatal(err)
					}
					out = append(out, string(d.Endpoint))
					vc.Step(time.Duration(50+i%5*10) * time.Millisecond)
					d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, Latency: time.Duration(20+i%9) * time.Millisecond, CompletionTokens: 10, PromptTokens: -1, CachedTokens: -1})
				}
				return out
			}
			a, b := run(), run()
			for i := range a {
				if a[i] != b[i] {
					t.Fatalf("decision %d differs: %s vs %s", i, a[i], b[i])
				}
			}
		})
	}
}

// TestEventFedEndpoint: KV events from a worker make its cache contents
// exact; an unknown parent is rejected; approximate inserts stop for it.
func TestEventFedEndpoint(t *testing.T) {
	e := engineWith(t, "kv", engine.Options{}, nil, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	prompt := tokens(64, 40)
	var blocks []kvindex.StoredBlock
	for i := range 4 {
		blocks = append(blocks, kvindex.StoredBlock{EngineHash: uint64(1000 + i), Tokens: prompt[16*i : 16*i+16]})
	}
	e.TrustKVEvents("10.0.0.2:8000", true)
	if err := e.ApplyKVEvent("10.0.0.2:8000", -1, kvindex.Event{Kind: kvindex.Stored, BlockSize: 16, Blocks: blocks}); err != nil {
		t.Fatal(err)
	}
	d, err := e.Pick(t.Context(), req(prompt))
	if err != nil {
		t.Fatal(err)
	}
	if d.Endpoint != "10.0.0.2:8000" || d.Overlap != 4 {
		t.Fatalf("went to %s with overlap %d, want the event-fed holder with 4", d.Endpoint, d.Overlap)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	orphan := kvindex.Event{Kind: kvindex.Stored, BlockSize: 16, HasParent: true, Parent: 77, Blocks: blocks[:1]}
	if err := e.ApplyKVEvent("10.0.0.2:8000", -1, orphan); !errors.Is(err, kvindex.ErrUnknownParent) {
		t.Fatalf("unknown parent: %v", err)
	}
	if err := e.ApplyKVEvent("10.0.0.2:8000", -1, kvindex.Event{Kind: kvindex.Cleared}); err != nil {
		t.Fatal(err)
	}
	// Cleared, and no approximate insert came from the pick above: nothing
	// is cached on the event-fed endpoint any more.
	d, _ = e.Pick(t.Context(), req(prompt))
	if d.Endpoint == "10.0.0.2:8000" && d.Overlap != 0 {
		t.Fatalf("overlap %d after Cleared", d.Overlap)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	if err := e.ApplyKVEvent("10.9.9.9:1", -1, kvindex.Event{Kind: kvindex.Cleared}); !errors.Is(err, kvindex.ErrUnknownWorker) {
		t.Fatalf("unknown endpoint: %v", err)
	}
}

func TestExtremePromptLengths(t *testing.T) {
	for _, name := range []string{"kv", "kvbandit", "thompson"} {
		e := engineWith(t, name, engine.Options{}, nil, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
		for _, n := range []int{0, 1, 15, 17, 500_000} {
			d, err := e.Pick(t.Context(), req(tokens(n, 3)))
			if err != nil {
				t.Fatalf("%s, %d tokens: %v", name, n, err)
			}
			if want := n / 16; d.Overlap > want {
				t.Fatalf("%s, %d tokens: overlap %d > %d complete blocks", name, n, d.Overlap, want)
			}
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
		}
		if activeBlocks(t, e) != 0 || activePrefill(t, e) != 0 {
			t.Fatalf("%s: load not released", name)
		}
	}
}

// TestMixedBlockSizes: endpoints with different block sizes keep separate
// key spaces, and each candidate is scored and recorded with its own.
func TestMixedBlockSizes(t *testing.T) {
	e := engineWith(t, "kv", engine.Options{}, nil,
		routing.Endpoint{Key: "10.0.0.1:8000", BlockSize: 16},
		routing.Endpoint{Key: "10.0.0.2:8000", BlockSize: 32},
		routing.Endpoint{Key: "10.0.0.3:8000", BlockSize: 16})
	prompt := tokens(320, 9)
	for ep, blocks := range map[string]int{"10.0.0.1:8000": 20, "10.0.0.2:8000": 10, "10.0.0.3:8000": 20} {
		for round := range 2 {
			r := req(prompt)
			r.Subset = routing.NewSubset([]string{ep})
			d, err := e.Pick(t.Context(), r)
			if err != nil {
				t.Fatal(err)
			}
			if want := []int{0, blocks}[round]; d.Overlap != want {
				t.Fatalf("%s round %d: overlap %d, want %d", ep, round, d.Overlap, want)
			}
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
		}
	}
}

func TestReportedBlockSizeAndLoad(t *testing.T) {
	e := engineWith(t, "kv", engine.Options{}, nil, ep("10.0.0.1:8000"))
	if e.ReportLoad("10.9.9.9:1", routing.Load{Known: true}, 32) {
		t.Fatal("unknown endpoint accepted")
	}
	if !e.ReportLoad("10.0.0.1:8000", routing.Load{Known: true, Waiting: 3, KVUsage: 0.5}, 32) {
		t.Fatal("report refused")
	}
	prompt := tokens(320, 5)
	d, _ := e.Pick(t.Context(), req(prompt))
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	d, _ = e.Pick(t.Context(), req(prompt))
	if d.Overlap != 10 { // 320 tokens in blocks of 32, as the worker reported
		t.Fatalf("overlap %d, want 10 blocks of 32", d.Overlap)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
}
