package sim

import (
	"bufio"
	"encoding/json"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
	"time"
)

// seq returns n tokens base, base+1, ...
func seq(n int, base uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

// cat concatenates token slices into a new one.
func cat(parts ...[]uint32) []uint32 {
	var out []uint32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// synthetic is a trace with heavy prefix sharing: groups system prompts of
// prefixLen tokens, each request one of them plus a unique suffix, Poisson
// arrivals at rate per second.
func synthetic(n, groups, prefixLen, suffixLen int, rate float64, seed uint64) []Request {
	rnd := rand.New(rand.NewPCG(seed, 1))
	reqs := make([]Request, n)
	var t time.Duration
	for i := range reqs {
		t += time.Duration(rnd.ExpFloat64() / rate * float64(time.Second))
		g := rnd.IntN(groups)
		reqs[i] = Request{
			Arrival:   t,
			Tokens:    cat(seq(prefixLen, uint32(1+g*100_000)), seq(suffixLen, uint32(50_000_000+i*suffixLen))),
			OutputLen: 20 + rnd.IntN(200),
		}
	}
	return reqs
}

const mooncakeConversation = "../../traces/mooncake/conversation_trace.jsonl"

// loadMooncake reads up to limit lines (0 = all) of a Mooncake JSONL trace:
// timestamp in ms, hash_ids of 512-token blocks. Block j of hash id h has
// tokens h·512+1+k, so equal ids share tokens; tokens past the hashed
// blocks (the floor convention) are unique to the request.
func loadMooncake(tb testing.TB, path string, limit int) []Request {
	tb.Helper()
	f, err := os.Open(path)
	if err != nil {
		tb.Fatalf("bundled trace (traces/README.md): %v", err)
	}
	defer f.Close()
	type line struct {
		Timestamp    int64    `json:"timestamp"`
		InputLength  int      `json:"input_length"`
		OutputLength int      `json:"output_length"`
		HashIDs      []uint32 `json:"hash_ids"`
	}
	const bs = 512
	var reqs []Request
	unique := uint32(1 << 31)
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() && (limit == 0 || len(reqs) < limit) {
		var l line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			tb.Fatalf("line %d: %v", len(reqs)+1, err)
		}
		toks := make([]uint32, l.InputLength)
		for i := range toks {
			if j := i / bs; j < len(l.HashIDs) {
				toks[i] = l.HashIDs[j]*bs + 1 + uint32(i%bs)
			} else {
				toks[i] = unique
				unique++
			}
		}
		reqs = append(reqs, Request{Arrival: time.Duration(l.Timestamp) * time.Millisecond, Tokens: toks, OutputLen: max(l.OutputLength, 1)})
	}
	if err := sc.Err(); err != nil {
		tb.Fatal(err)
	}
	return reqs
}

// pct is the q-quantile of ds (sorted in place).
func pct(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	return ds[min(int(q*float64(len(ds))), len(ds)-1)]
}
