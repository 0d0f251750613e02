package decisionlog

import (
	"strconv"
	"testing"
	"time"
)

// BenchmarkEncode measures the writer goroutine's encoding cost per record,
// which bounds the sustainable logging rate.
//
//	go test -run '^$' -bench Encode -benchmem ./routing/decisionlog/
func BenchmarkEncode(b *testing.B) {
	scores := make([]Score, 8)
	for i := range scores {
		scores[i] = Score{Endpoint: "10.0.0." + strconv.Itoa(i) + ":8000", Score: float64(i) / 8}
	}
	r := Record{
		Time: time.UnixMilli(1_767_923_263_058), TokensLen: 4096, PrefixID: "session-42", ReuseAfter: 3,
		ChosenWorker: "10.0.0.3:8000", OverlapChosen: 0.5, DecodeCost: 12, PrefillCost: 0.25, IATLevel: "LOW",
		Stickiness: 1, LoadMod: 0.9, DecisionID: "d-1", Policy: "kvbandit", Tenant: "acme", DPRank: -1, Scores: scores,
	}
	for _, c := range []struct {
		name string
		enc  func([]byte, *Record) []byte
	}{{"csv", appendCSV}, {"jsonl", appendJSON}} {
		b.Run(c.name, func(b *testing.B) {
			buf := make([]byte, 0, 1024)
			b.ReportAllocs()
			for b.Loop() {
				buf = c.enc(buf[:0], &r)
			}
			b.SetBytes(int64(len(buf)))
		})
	}
}
