package latency

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

// BenchmarkReads measures the Pick path's reads of a speed factor
// (Factor, Draw) on a belief that learnt from this replica only and from
// this replica and 8 peers: they read the published posterior and must
// neither lock nor allocate whatever the parts behind it. Compare with
// benchstat against the commit before peers were kept apart:
//
//	go test -run '^$' -bench BenchmarkReads -benchmem -count 6 ./routing/latency/
func BenchmarkReads(b *testing.B) {
	for _, peers := range []int{0, 8} {
		m := newModel(b, DefaultConfig())
		r := rand.New(rand.NewPCG(1, 2))
		for i := range 400 {
			f := randFeatures(r)
			o := obs("a:1", f, fleet.ttft(f), fleet.decode(f.Running), 20)
			if peers > 0 && i%2 == 1 {
				o.Remote = true
				setPeer(&o, fmt.Sprintf("peer-%d", i%(2*peers)/2))
			}
			m.Observe(o)
		}
		// A candidate as an engine makes it: its rank holds the memo.
		c := cand("a:1")
		c.State.Live = &routing.Live{Ranks: []*routing.Rank{{}}}
		m.Factor(c) // memoise the belief, as the first Pick does
		b.Run(fmt.Sprintf("Factor/peers=%d", peers), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_, _ = m.Factor(c)
			}
		})
		b.Run(fmt.Sprintf("Draw/peers=%d", peers), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = m.Draw(c, r, false)
			}
		})
	}
}
