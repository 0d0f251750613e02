package slo_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/slo"
)

// BenchmarkFilter is the rule's cost per decision on top of the policy's
// Predict (here a table lookup): go test -run '^$' -bench Filter ./routing/slo/
func BenchmarkFilter(b *testing.B) {
	for _, n := range []int{8, 64, 512} {
		b.Run(fmt.Sprintf("endpoints=%d", n), func(b *testing.B) {
			g, err := slo.New(slo.Config{})
			if err != nil {
				b.Fatal(err)
			}
			overlaps := make([]int, n)
			pred := make([]time.Duration, n)
			for i := range n {
				overlaps[i] = (i * 37) % 97
				pred[i] = time.Duration((i*53)%600) * time.Millisecond
			}
			s := scoring(300*time.Millisecond, nil, overlaps...)
			p := &predictor{byIndex: pred}
			b.ReportAllocs()
			for b.Loop() {
				if _, err := g.Filter(s, p, true); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
