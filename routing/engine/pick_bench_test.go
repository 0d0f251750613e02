package engine_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// BenchmarkPick measures one routing decision on a warm index: block hashing
// of the prompt (inside the measured call), the index and in-flight walks,
// the policy's scoring, and the decision's Done. Tokenization is excluded.
// Every endpoint caches a different prefix length of the request's prompt
// family, and 8 requests per endpoint are in flight. Besides ns/op it
// reports ns/block (per 16-token block of the prompt) and ns/endpoint.
// 131072 tokens run for kv and kvbandit only, which keeps make bench-smoke
// short: the warm-up of a 512 × 128k case takes about 2 s.
//
//	go test -run '^$' -bench 'Pick/policy=kvbandit/endpoints=64/tokens=8192' -benchmem ./routing/
func BenchmarkPick(b *testing.B) {
	for _, pol := range []string{"kv", "thompson", "kvbandit"} {
		for _, n := range []int{8, 64, 512} {
			for _, ntok := range []int{1024, 8192, 32768, 131072} {
				if ntok > 32768 && pol == "thompson" {
					continue
				}
				b.Run(fmt.Sprintf("policy=%s/endpoints=%d/tokens=%d", pol, n, ntok), func(b *testing.B) {
					benchPick(b, pol, n, ntok)
				})
			}
		}
	}
}

func benchPick(b *testing.B, pol string, n, ntok int) {
	benchPickWith(b, pol, n, ntok, nil)
}

// benchPickWith is benchPick with the measured request prepared by prep
// (nil: none).
func benchPickWith(b *testing.B, pol string, n, ntok int, prep func(*routing.Request)) {
	eps := make([]routing.Endpoint, n)
	for i := range eps {
		eps[i] = routing.Endpoint{Key: routing.EndpointKey(fmt.Sprintf("10.%d.%d.1:8000", i/250, i%250))}
	}
	// The warm prefixes hold about n·ntok/32 entries (2.1M at 512 × 128k),
	// more than the default cap; a cap that never prunes keeps every
	// endpoint's prefix, as the smaller cases have it.
	e := engineWith(b, pol, engine.Options{Index: kvindex.Options{MaxEntries: 1 << 24}}, nil, eps...)
	// Warm: each endpoint caches a prefix of the family (length by index)
	// and holds in-flight requests. Prefix keys of a chain are the chain's
	// leading keys, so the family is hashed once.
	family := tokens(ntok, 1)
	all := kvindex.AppendBlockKeys(nil, family, 16, kvindex.Seed("", ""))
	var open []*routing.Decision
	warm := 0
	for i := range n {
		l := (ntok * (i + 1)) / (n + 1)
		w := e.Index().Worker(string(eps[i].Key), -1)
		if err := e.Index().InsertApprox(w, 16, all[:l/16], time.Now()); err != nil {
			b.Fatal(err)
		}
		warm += l / 16
	}
	if got := e.Index().Stats().Entries; got != int64(warm) {
		b.Fatalf("warm index holds %d entries, want %d", got, warm)
	}
	for i := range 8 * n {
		d, err := e.Pick(b.Context(), req(tokens(ntok/4, uint32(1+i%3*7))))
		if err != nil {
			b.Fatal(err)
		}
		open = append(open, d)
	}
	r := req(family)
	if prep != nil {
		prep(r)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		d, err := e.Pick(b.Context(), r)
		if err != nil {
			b.Fatal(err)
		}
		d.Done(routing.NoUsage(routing.OutcomeCancelled))
	}
	b.StopTimer()
	ns := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(ns/float64(ntok/16), "ns/block")
	b.ReportMetric(ns/float64(n), "ns/endpoint")
	for _, d := range open {
		d.Done(routing.NoUsage(routing.OutcomeCancelled))
	}
}
