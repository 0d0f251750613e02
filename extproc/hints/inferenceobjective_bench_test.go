package hints

import (
	"fmt"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

// BenchmarkResolvePriority: the request-path cost of an InferenceObjective
// lookup with 4096 objectives known.
func BenchmarkResolvePriority(b *testing.B) {
	lookup := prios{}
	for i := range 4096 {
		lookup[fmt.Sprintf("objective-%d", i)] = i%20 - 10
	}
	g := func(name string) (string, bool) {
		if name == HeaderInferenceObjective {
			return "objective-1234", true
		}
		return "", false
	}
	b.ReportAllocs()
	for b.Loop() {
		h := routing.Hints{}
		if r, _ := ResolvePriority(g, lookup, PriorityPolicy{}, &h); r != ObjectiveFound {
			b.Fatal("not found")
		}
	}
}
