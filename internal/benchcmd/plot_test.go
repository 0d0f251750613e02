package benchcmd

import (
	"testing"
)

func TestBestPolicy(t *testing.T) {
	t.Parallel()
	ps := []policySummary{{Policy: "a", Served: 10, TTFTP90: 2}, {Policy: "none", TTFTP90: 0}, {Policy: "b", Served: 10, TTFTP90: 1}, {Policy: "c", Served: 10, TTFTP90: 1}}
	if got := bestPolicy(ps); got != 2 {
		t.Fatalf("best %d, want 2 (the first with the lowest p90 among those that served)", got)
	}
	if got := bestPolicy([]policySummary{{Policy: "none"}}); got != 0 {
		t.Fatalf("best %d with nothing served", got)
	}
}
