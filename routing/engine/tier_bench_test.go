package engine_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// BenchmarkPickTiers is BenchmarkPick's kv case with every endpoint also
// holding the whole prompt in host memory (CPU-medium events with tokens),
// the worst case for the lower-tier walk: Candidate.OverlapCPU runs from
// each endpoint's GPU overlap to the prompt's end.
func BenchmarkPickTiers(b *testing.B) {
	for _, n := range []int{8, 64} {
		for _, ntok := range []int{1024, 8192} {
			b.Run(fmt.Sprintf("policy=kv/endpoints=%d/tokens=%d", n, ntok), func(b *testing.B) {
				eps := make([]routing.Endpoint, n)
				for i := range eps {
					eps[i] = routing.Endpoint{Key: routing.EndpointKey(fmt.Sprintf("10.%d.%d.1:8000", i/250, i%250))}
				}
				e := engineWith(b, "kv", engine.Options{}, nil, eps...)
				family := tokens(ntok, 1)
				cpu := kvindex.Event{Kind: kvindex.Stored, BlockSize: 16, Medium: kvindex.MediumCPU}
				for j := range ntok / 16 {
					cpu.Blocks = append(cpu.Blocks, kvindex.StoredBlock{EngineHash: uint64(j + 1), Tokens: family[16*j : 16*j+16]})
				}
				for i := range n {
					l := (ntok * (i + 1)) / (n + 1)
					keys := kvindex.AppendBlockKeys(nil, family[:l], 16, kvindex.Seed("", ""))
					w := e.Index().Worker(string(eps[i].Key), -1)
					if err := e.Index().InsertApprox(w, 16, keys, time.Now()); err != nil {
						b.Fatal(err)
					}
					if err := e.Index().Apply(w, cpu); err != nil {
						b.Fatal(err)
					}
				}
				r := req(family)
				d, err := e.Pick(b.Context(), r)
				if err != nil {
					b.Fatal(err)
				}
				if d.Overlap+d.OverlapCPU != ntok/16 {
					b.Fatalf("overlap %d + cpu %d, want %d", d.Overlap, d.OverlapCPU, ntok/16)
				}
				d.Done(routing.NoUsage(routing.OutcomeCancelled))
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					d, err := e.Pick(b.Context(), r)
					if err != nil {
						b.Fatal(err)
					}
					d.Done(routing.NoUsage(routing.OutcomeCancelled))
				}
			})
		}
	}
}
