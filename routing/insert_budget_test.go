package routing_test

import (
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
)

// pickDone picks r and ends the decision at once.
func pickDone(t *testing.T, e *routing.Engine, r *routing.Request) *routing.Decision {
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
	e := engineWith(t, "kv", routing.Options{InsertBlocksPerSecond: 100}, vc, ep("10.0.0.1:8000"))
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
	e := engineWith(t, "kv", routing.Options{MaxInsertBlocks: 8}, nil, ep("10.0.0.1:8000"))
	r := req(tokens(32*16, 1))
	pickDone(t, e, r)
	if got, lim := e.Index().Stats().ApproxEntries, e.InsertBlocksLimited(); got != 8 || lim != 24 {
		t.Fatalf("%d entries, %d limited; want 8, 24", got, lim)
	}
	if d := pickDone(t, e, r); d.Overlap != 8 {
		t.Fatalf("same prompt again: overlap %d, want 8", d.Overlap)
	}
}

// TestInsertBudgetUnbounded: negative options turn both bounds off.
func TestInsertBudgetUnbounded(t *testing.T) {
	e := engineWith(t, "kv", routing.Options{MaxInsertBlocks: -1, InsertBlocksPerSecond: -1}, nil, ep("10.0.0.1:8000"))
	for i := range 4 {
		pickDone(t, e, req(tokens(20_000*16, uint32(1+i)*50_000_000)))
	}
	if got, lim := e.Index().Stats().ApproxEntries, e.InsertBlocksLimited(); got != 80_000 || lim != 0 {
		t.Fatalf("%d entries, %d limited; want 80000, 0", got, lim)
	}
}
