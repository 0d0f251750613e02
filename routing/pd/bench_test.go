package pd_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// BenchmarkPickRoles measures one decision (Pick and Done, with the first
// token in between) at 64 endpoints and an 8,192-token prompt, with one
// role (every endpoint both: the decider never runs) and two roles (32
// prefill and 32 decode endpoints, threshold 0: every request is
// disaggregated, so the policy also chooses a prefill endpoint). Each
// endpoint caches a different prefix of the prompt and 8 requests per
// endpoint are in flight, as in routing's BenchmarkPick. The budget:
// roles=2 within 1.3x of roles=1.
//
//	go test -run '^$' -bench PickRoles -benchmem -count 6 ./routing/pd/
func BenchmarkPickRoles(b *testing.B) {
	const n, ntok = 64, 8192
	for _, pol := range []string{"kv", "kvbandit"} {
		for _, roles := range []int{1, 2} {
			b.Run(fmt.Sprintf("policy=%s/endpoints=%d/tokens=%d/roles=%d", pol, n, ntok, roles), func(b *testing.B) {
				eps := make([]routing.Endpoint, n)
				for i := range eps {
					eps[i] = routing.Endpoint{Key: routing.EndpointKey(fmt.Sprintf("10.0.%d.1:8000", i))}
					if roles == 2 {
						eps[i].Role = routing.RoleDecode
						if i%2 == 1 {
							eps[i].Role = routing.RolePrefill
						}
					}
				}
				e := newEngine(b, pol, 0, eps...)
				family := tokens(ntok, 1)
				for i := range n {
					keys := kvindex.AppendBlockKeys(nil, family[:ntok*(i+1)/(n+1)], routing.DefaultBlockSize, kvindex.Seed("", ""))
					if err := e.Index().InsertApprox(e.Index().Worker(string(eps[i].Key), -1), routing.DefaultBlockSize, keys, time.Now()); err != nil {
						b.Fatal(err)
					}
				}
				var open []*routing.Decision
				for i := range 8 * n {
					open = append(open, pick(b, e, req(tokens(ntok/4, uint32(1+i%3*7)))))
				}
				r := req(family)
				b.ReportAllocs()
				b.ResetTimer()
				for b.Loop() {
					d := pick(b, e, r)
					if roles == 2 && d.Prefill == "" {
						b.Fatalf("not disaggregated: %v", d.PD)
					}
					d.Prefilled()
					d.Done(routing.NoUsage(routing.OutcomeCancelled))
				}
				b.StopTimer()
				for _, d := range open {
					d.Done(routing.NoUsage(routing.OutcomeCancelled))
				}
			})
		}
	}
}
