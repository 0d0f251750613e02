package routing_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// BenchmarkPick measures one routing decision on a warm index: block hashing
// of the prompt (inside the measured call), the index and in-flight walks,
// the policy's scoring, and the decision's Done. Tokenization is excluded.
// Every endpoint caches a different prefix length of the request's prompt
// family, and 8 requests per endpoint are in flight.
//
//	go test -run '^$' -bench 'Pick/policy=kvbandit/endpoints=64/tokens=8192' -benchmem ./routing/
func BenchmarkPick(b *testing.B) {
	for _, pol := range []string{"kv", "thompson", "kvbandit"} {
		for _, n := range []int{8, 64, 512} {
			for _, ntok := range []int{1024, 8192, 32768} {
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
	e := engineWith(b, pol, routing.Options{}, nil, eps...)
	// Warm: each endpoint caches a prefix of the family (length by index)
	// and holds in-flight requests.
	family := tokens(ntok, 1)
	var open []*routing.Decision
	for i := range n {
		l := (ntok * (i + 1)) / (n + 1)
		keys := kvindex.AppendBlockKeys(nil, family[:l], 16, kvindex.Seed("", ""))
		w := e.Index().Worker(string(eps[i].Key), -1)
		if err := e.Index().InsertApprox(w, 16, keys, time.Now()); err != nil {
			b.Fatal(err)
		}
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
	for _, d := range open {
		d.Done(routing.NoUsage(routing.OutcomeCancelled))
	}
}
