package engine_test

import (
	"fmt"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// BenchmarkPickBurst is a burst of distinct prompts (no shared prefix, 64
// blocks each) to 64 endpoints without KV events, with the index goroutine
// applying the approximate inserts as when serving. Beside the time per
// decision (the index goroutine's CPU shows in the process's, not in
// ns/op: compare -cpuprofile or user time), it reports the index's
// approximate entries and pruned entries per decision at the end: with the
// insert bounds, a burst stops growing the table instead of churning it.
//
//	go test -run '^$' -bench 'PickBurst' -benchmem ./routing/
func BenchmarkPickBurst(b *testing.B) {
	for _, cap := range []int{1 << 16, kvindex.DefaultMaxEntries} {
		b.Run(fmt.Sprintf("cap=%d", cap), func(b *testing.B) {
			eps := make([]routing.Endpoint, 64)
			for i := range eps {
				eps[i] = routing.Endpoint{Key: routing.EndpointKey(fmt.Sprintf("10.0.%d.1:8000", i))}
			}
			e := engineWith(b, "kvbandit", engine.Options{Index: kvindex.Options{MaxEntries: cap}}, nil, eps...)
			prompt := tokens(1024, 1)
			b.ReportAllocs()
			b.ResetTimer()
			i := uint32(0)
			for b.Loop() {
				i++
				for j := range prompt {
					prompt[j] = i<<12 + uint32(j)
				}
				d, err := e.Pick(b.Context(), req(prompt))
				if err != nil {
					b.Fatal(err)
				}
				d.Done(routing.NoUsage(routing.OutcomeSuccess))
			}
			b.StopTimer()
			e.Close() // applies what is queued
			st := e.Index().Stats()
			b.ReportMetric(float64(st.ApproxEntries), "entries")
			b.ReportMetric(float64(st.Pruned)/float64(b.N), "pruned/op")
			b.ReportMetric(float64(e.DroppedInserts())/float64(b.N), "dropped/op")
		})
	}
}
