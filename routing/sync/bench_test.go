package sync

import (
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// BenchmarkLocalSide is a decision's whole cost (Pick, first token, Done)
// without the Syncer's hooks (sync=off) and with them (sync=on: the
// enqueue of its Start, First, End and Outcome plus the amortised flush
// to a real nats-server): the difference is the local-side overhead per
// decision. sync=on+peer adds a peer Syncer in the same process, so it
// also counts the remote side (decode, StartRemote, End, LearnRemote).
//
//	go test -run '^$' -bench LocalSide -benchmem ./routing/sync/
func BenchmarkLocalSide(b *testing.B) {
	srv := startNATS(b)
	for _, c := range []struct {
		name        string
		hooks, peer bool
	}{{"sync=off", false, false}, {"sync=on", true, false}, {"sync=on+peer", true, true}} {
		b.Run(c.name, func(b *testing.B) {
			a := newNodeWith(b, testConfig(srv, "a-"+c.name), engine.Options{}, c.hooks)
			if c.peer {
				waitConnected(b, a, newNode(b, testConfig(srv, "peer-"+c.name), engine.Options{}))
			} else {
				waitFor(b, 10*time.Second, "connected", func() bool { return !a.s.Degraded() })
			}
			out := routing.Outcome{Kind: routing.OutcomeSuccess, Status: 200, TTFT: 1000, Latency: 2000, PromptTokens: 256, CompletionTokens: 5, CachedTokens: -1}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				d := a.pick(b, "", i%64)
				d.Prefilled()
				d.Done(out)
				i++
			}
		})
	}
}
