package engine_test

import (
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// pickDone picks r and ends the decision at once.
func pickDone(t *testing.T, e *engine.Engine, r *routing.Request) *routing.Decision {
	t.Helper()
	d, err := e.Pick(t.Context(), r)
	if err != nil {
		t.Fatal(err)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	return d
}

// TestInsertBudgetPerSecond: approximate inserts spend a per-second block
// budget; a prompt over it has only its leading blocks inserted (so its
// overlap is credited up to them), a prompt after it is spent inserts
// nothing, and the budget comes back with the clock.
func TestInsertBudgetPerSecond(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(1000, 0))
	e := engineWith(t, "kv", engine.Options{InsertBlocksPerSecond: 100}, vc, ep("10.0.0.1:8000"))
	entries := func() int64 { return e.Index().Stats().ApproxEntries }
	// 64 blocks of 16 tokens each, distinct prompts.
	pickDone(t, e, req(tokens(1024, 1)))
	if got := entries(); got != 64 {
		t.Fatalf("after the first prompt: %d entries, want 64", got)
	}
	second := tokens(1024, 1_000_000)
	pickDone(t, e, req(second))
	if got, lim := entries(), e.InsertBlocksLimited(); got != 100 || lim != 28 {
		t.Fatalf("after the second prompt: %d entries, %d limited; want 100, 28", got, lim)
	}
	// The second prompt's first 36 blocks are in the index.
	if d := pickDone(t, e, req(second)); d.Overlap != 36 {
		t.Fatalf("second prompt again: overlap %d, want 36", d.Overlap)
	}
	pickDone(t, e, req(tokens(1024, 2_000_000)))
	if got := entries(); got != 100 {
		t.Fatalf("with the budget spent: %d entries, want 100", got)
	}
	vc.Step(time.Second)
	pickDone(t, e, req(tokens(1024, 3_000_000)))
	if got := entries(); got != 164 {
		t.Fatalf("a second later: %d entries, want 164", got)
	}
}

// TestMaxInsertBlocks: one prompt inserts at most MaxInsertBlocks leading
// blocks; the rest are counted as limited.
func TestMaxInsertBlocks(t *testing.T) {
	e := engineWith(t, "kv", engine.Options{MaxInsertBlocks: 8}, nil, ep("10.0.0.1:8000"))
	r := req(tokens(32*16, 1))
	pickDone(t, e, r)
	if got, lim := e.Index().Stats().ApproxEntries, e.InsertBlocksLimited(); got != 8 || lim != 24 {
		t.Fatalf("%d entries, %d limited; want 8, 24", got, lim)
	}
	if d := pickDone(t, e, r); d.Overlap != 8 {
		t.Fatalf("same prompt again: overlap %d, want 8", d.Overlap)
	}
}

// TestInsertBudgetPerRank: each rank has its own per-second budget (1600
// tokens: 100 blocks of 16) under the engine-wide one; a rank that spent its own still lets another rank
// insert, and the engine-wide budget still caps the sum.
func TestInsertBudgetPerRank(t *testing.T) {
	vc := clock.NewVirtual(time.Unix(1000, 0))
	e := engineWith(t, "round_robin", engine.Options{InsertTokensPerRank: 1600, InsertBlocksPerSecond: 150}, vc, ep("10.0.0.1:8000"), ep("10.0.0.2:8000"))
	entries := func() int64 { return e.Index().Stats().ApproxEntries }
	// Round robin: the first two prompts go to different endpoints; each
	// of 64 blocks fits its rank's budget.
	first := pickDone(t, e, req(tokens(1024, 1)))
	second := pickDone(t, e, req(tokens(1024, 1_000_000)))
	if first.Endpoint == second.Endpoint {
		t.Fatalf("round robin sent both prompts to %s", first.Endpoint)
	}
	if got := entries(); got != 128 {
		t.Fatalf("after two prompts on two ranks: %d entries, want 128", got)
	}
	// The third goes to the first rank: 36 left of its 100, and 22 left of
	// the engine's 150 — the engine's bound wins.
	third := pickDone(t, e, req(tokens(1024, 2_000_000)))
	if third.Endpoint != first.Endpoint {
		t.Fatalf("third prompt on %s, want %s", third.Endpoint, first.Endpoint)
	}
	if got, lim := entries(), e.InsertBlocksLimited(); got != 150 || lim != 42 {
		t.Fatalf("after the third prompt: %d entries, %d limited; want 150, 42", got, lim)
	}
	// A second later both refill: the first rank's own bound (100) cuts
	// a 128-block prompt under the engine's 150; then the second rank gets
	// what the engine has left (50) of a 64-block prompt.
	vc.Step(time.Second)
	pickDone(t, e, req(tokens(8, 3_000_000))) // second rank, no complete block
	fourth := pickDone(t, e, req(tokens(2048, 4_000_000)))
	if fourth.Endpoint != first.Endpoint {
		t.Fatalf("fourth prompt on %s, want %s", fourth.Endpoint, first.Endpoint)
	}
	if got, lim := entries(), e.InsertBlocksLimited(); got != 250 || lim != 42+28 {
		t.Fatalf("a second later: %d entries, %d limited; want 250, %d", got, lim, 42+28)
	}
	pickDone(t, e, req(tokens(1024, 5_000_000)))
	if got, lim := entries(), e.InsertBlocksLimited(); got != 300 || lim != 42+28+14 {
		t.Fatalf("last prompt: %d entries, %d limited; want 300, %d", got, lim, 42+28+14)
	}
}

// TestInsertBudgetUnbounded: negative options turn the bounds off.
func TestInsertBudgetUnbounded(t *testing.T) {
	e := engineWith(t, "kv", engine.Options{MaxInsertBlocks: -1, InsertBlocksPerSecond: -1, InsertTokensPerRank: -1}, nil, ep("10.0.0.1:8000"))
	for i := range 4 {
		pickDone(t, e, req(tokens(20_000*16, uint32(1+i)*50_000_000)))
	}
	if got, lim := e.Index().Stats().ApproxEntries, e.InsertBlocksLimited(); got != 80_000 || lim != 0 {
		t.Fatalf("%d entries, %d limited; want 80000, 0", got, lim)
	}
}
