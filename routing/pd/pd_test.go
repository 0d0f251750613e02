package pd_test

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	dec1 = "10.0.0.1:8000"
	dec2 = "10.0.0.2:8000"
	pre1 = "10.0.1.1:8000"
	pre2 = "10.0.1.2:8000"
	both = "10.0.2.1:8000"
)

func ep(key string, r routing.Role) routing.Endpoint {
	return routing.Endpoint{Key: routing.EndpointKey(key), Role: r}
}

// engine builds an engine with policy name, seed 1, synchronous index
// inserts, and the P/D decider when threshold >= 0.
func newEngine(t testing.TB, name string, threshold int, eps ...routing.Endpoint) *engine.Engine {
	t.Helper()
	rnd := routing.NewRand(1)
	p, err := policy.Builtin().New(name, policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	deps := engine.Deps{Rand: rnd, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if threshold >= 0 {
		d, err := pd.New(pd.Config{ThresholdTokens: threshold})
		if err != nil {
			t.Fatal(err)
		}
		deps.PD = d
	}
	_, bench := t.(*testing.B)
	e, err := engine.New(p, engine.Options{SyncIndex: !bench}, deps)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Source: "test", Endpoints: eps}); err != nil {
		t.Fatal(err)
	}
	return e
}

func tokens(n int, base uint32) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

func req(toks []uint32) *routing.Request {
	return &routing.Request{Model: "m", Tokens: toks, TokenCount: len(toks)}
}

func pick(t testing.TB, e *engine.Engine, r *routing.Request) *routing.Decision {
	t.Helper()
	d, err := e.Pick(t.Context(), r)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// cache records toks as cached on key's worker in the index.
func cache(t testing.TB, e *engine.Engine, key string, toks []uint32) {
	t.Helper()
	keys := kvindex.AppendBlockKeys(nil, toks, routing.DefaultBlockSize, kvindex.Seed("", ""))
	if err := e.Index().InsertApprox(e.Index().Worker(key, -1), routing.DefaultBlockSize, keys, time.Now()); err != nil {
		t.Fatal(err)
	}
}

// load is an endpoint's live counters.
type load struct{ inflight, prefill int64 }

func loads(e *engine.Engine) map[routing.EndpointKey]load {
	out := map[routing.EndpointKey]load{}
	for _, st := range e.Endpoints() {
		out[st.Key] = load{st.InFlight.Load(), st.InFlightPrefill()}
	}
	return out
}

func wantLoads(t *testing.T, e *engine.Engine, what string, want map[routing.EndpointKey]load) {
	t.Helper()
	got := loads(e)
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s: %s carries %+v, want %+v (all %v)", what, k, got[k], w, got)
		}
	}
}

// TestNoPrefillEndpointsRoutesAsBefore: a pool without prefill endpoints
// (both and decode roles) makes the very same decisions, on the same seed,
// with the decider as without it, for every policy.
func TestNoPrefillEndpointsRoutesAsBefore(t *testing.T) {
	for _, name := range []string{"kv", "kvbandit", "round_robin", "least_loaded", "random", "thompson", "weighted"} {
		t.Run(name, func(t *testing.T) {
			eps := []routing.Endpoint{ep(dec1, routing.RoleBoth), ep(dec2, routing.RoleDecode), ep(both, routing.RoleBoth)}
			with, without := newEngine(t, name, 0, eps...), newEngine(t, name, -1, eps...)
			var open []*routing.Decision
			for i := range 40 {
				r := req(tokens(64+97*(i%7), uint32(1+i%5*1000)))
				a, b := pick(t, with, r), pick(t, without, r)
				if a.Endpoint != b.Endpoint || a.Overlap != b.Overlap || a.Prefill != "" || a.PD != routing.PDNoPrefillEndpoints {
					t.Fatalf("request %d: with the decider %s (overlap %d, prefill %q, %v), without %s (overlap %d)", i, a.Endpoint, a.Overlap, a.Prefill, a.PD, b.Endpoint, b.Overlap)
				}
				open = append(open, a, b)
				if i%3 == 0 {
					for _, d := range open {
						d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: 50 * time.Millisecond, Latency: time.Second, CompletionTokens: 20})
					}
					open = open[:0]
				}
			}
			for _, d := range open {
				d.Done(routing.NoUsage(routing.OutcomeCancelled))
			}
		})
	}
}

// TestThreshold: a long uncached prompt is disaggregated; a short one, or
// one whose prefix the decode endpoint caches, stays aggregated.
func TestThreshold(t *testing.T) {
	e := newEngine(t, "kv", 512, ep(dec1, routing.RoleDecode), ep(pre1, routing.RolePrefill), ep(pre2, routing.RolePrefill))
	long := pick(t, e, req(tokens(2048, 1)))
	if long.PD != routing.PDDisaggregated || long.Endpoint != dec1 || (long.Prefill != pre1 && long.Prefill != pre2) {
		t.Fatalf("long prompt: %v, decode %s, prefill %q", long.PD, long.Endpoint, long.Prefill)
	}
	long.Done(routing.NoUsage(routing.OutcomeSuccess))
	short := pick(t, e, req(tokens(511, 50000)))
	if short.PD != routing.PDBelowThreshold || short.Prefill != "" || short.Endpoint != dec1 {
		t.Fatalf("short prompt: %v, prefill %q", short.PD, short.Prefill)
	}
	short.Done(routing.NoUsage(routing.OutcomeSuccess))
	at := pick(t, e, req(tokens(512, 90000)))
	if at.PD != routing.PDDisaggregated {
		t.Fatalf("a prompt of exactly the threshold: %v", at.PD)
	}
	at.Done(routing.NoUsage(routing.OutcomeSuccess))
	// The first long prompt is now cached on dec1 (the approximate index
	// records the prompt on both endpoints): its next turn adds 100 tokens.
	next := pick(t, e, req(tokens(2148, 1)))
	if next.PD != routing.PDBelowThreshold || next.Overlap != 128 {
		t.Fatalf("cached follow-up: %v with overlap %d", next.PD, next.Overlap)
	}
	next.Done(routing.NoUsage(routing.OutcomeSuccess))
}

// TestNoBodyAndNoEligiblePrefill: a request without prompt tokens, or
// whose subset hint leaves no prefill endpoint, stays aggregated; a pool
// of prefill endpoints only has nowhere to decode.
func TestNoBodyAndNoEligiblePrefill(t *testing.T) {
	e := newEngine(t, "kv", 0, ep(dec1, routing.RoleDecode), ep(pre1, routing.RolePrefill), ep(both, routing.RoleBoth))
	d := pick(t, e, &routing.Request{Model: "m"})
	if d.PD != routing.PDNoBody || d.Prefill != "" || d.Endpoint == pre1 {
		t.Fatalf("no body: %v prefill %q on %s", d.PD, d.Prefill, d.Endpoint)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	r := req(tokens(4096, 1))
	r.Subset = routing.NewSubset([]string{dec1})
	d = pick(t, e, r)
	if d.PD != routing.PDNoEligiblePrefill || d.Prefill != "" || d.Endpoint != dec1 {
		t.Fatalf("subset without prefill endpoints: %v prefill %q on %s", d.PD, d.Prefill, d.Endpoint)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	// A both endpoint chosen for decode is no prefill choice for itself.
	r.Subset = routing.NewSubset([]string{both})
	d = pick(t, e, r)
	if d.PD != routing.PDNoEligiblePrefill || d.Endpoint != both {
		t.Fatalf("both alone: %v on %s prefill %q", d.PD, d.Endpoint, d.Prefill)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	r.Subset = routing.NewSubset([]string{pre1})
	if _, err := e.Pick(t.Context(), r); !errors.Is(err, routing.ErrNoEndpoints) {
		t.Fatalf("prefill endpoints only: %v, want ErrNoEndpoints", err)
	}
	wantLoads(t, e, "after", map[routing.EndpointKey]load{dec1: {}, pre1: {}, both: {}})
}

// TestPrefillFollowsOverlap: kv and kvbandit send the prefill where the
// prompt's prefix is cached, and away from prefill load.
func TestPrefillFollowsOverlap(t *testing.T) {
	for _, name := range []string{"kv", "kvbandit"} {
		t.Run(name, func(t *testing.T) {
			e := newEngine(t, name, 0, ep(dec1, routing.RoleDecode), ep(pre1, routing.RolePrefill), ep(pre2, routing.RolePrefill))
			var prompt []uint32
			for i, warm := range []string{pre2, pre1} {
				prompt = tokens(4096, uint32(1+i*50000))
				cache(t, e, warm, prompt[:3072])
				d := pick(t, e, req(prompt))
				if d.Prefill != routing.EndpointKey(warm) || d.PrefillOverlap != 192 {
					t.Fatalf("prefix cached on %s: prefill on %s (overlap %d)", warm, d.Prefill, d.PrefillOverlap)
				}
				d.Done(routing.NoUsage(routing.OutcomeSuccess))
			}
			// Both cache it now (pre1 since the pick, pre2 by hand); pre1 is busy
			// prefilling others' prompts.
			cache(t, e, pre2, prompt[:3072])
			var busy []*routing.Decision
			for i := range 3 {
				r := req(tokens(8192, uint32(100000*(i+1))))
				r.Subset = routing.NewSubset([]string{dec1, pre1})
				busy = append(busy, pick(t, e, r))
			}
			d := pick(t, e, req(prompt))
			if d.Prefill != pre2 {
				t.Fatalf("pre1 busy: prefill on %s", d.Prefill)
			}
			d.Done(routing.NoUsage(routing.OutcomeSuccess))
			for _, b := range busy {
				b.Done(routing.NoUsage(routing.OutcomeSuccess))
			}
		})
	}
}

// TestRolesPickedIndependently: round_robin rotates prefill endpoints with
// a rotation of its own; random and least_loaded pick a prefill endpoint
// among the prefill ones.
func TestRolesPickedIndependently(t *testing.T) {
	e := newEngine(t, "round_robin", 0, ep(dec1, routing.RoleDecode), ep(dec2, routing.RoleDecode), ep(pre1, routing.RolePrefill), ep(pre2, routing.RolePrefill), ep("10.0.1.3:8000", routing.RolePrefill))
	var got []string
	for i := range 6 {
		d := pick(t, e, req(tokens(1024, uint32(1+i*5000))))
		got = append(got, string(d.Endpoint)+"<"+string(d.Prefill))
		d.Done(routing.NoUsage(routing.OutcomeSuccess))
	}
	want := fmt.Sprint([]string{dec1 + "<" + pre1, dec2 + "<" + pre2, dec1 + "<10.0.1.3:8000", dec2 + "<" + pre1, dec1 + "<" + pre2, dec2 + "<10.0.1.3:8000"})
	if fmt.Sprint(got) != want {
		t.Fatalf("round robin: got %v, want %v", got, want)
	}
	for _, name := range []string{"random", "least_loaded", "thompson", "weighted"} {
		e := newEngine(t, name, 0, ep(dec1, routing.RoleDecode), ep(pre1, routing.RolePrefill), ep(pre2, routing.RolePrefill))
		seen := map[routing.EndpointKey]int{}
		for i := range 40 {
			d := pick(t, e, req(tokens(1024, uint32(1+i*5000))))
			if d.Endpoint != dec1 || d.PD != routing.PDDisaggregated {
				t.Fatalf("%s: %s %v", name, d.Endpoint, d.PD)
			}
			seen[d.Prefill]++
			d.Done(routing.Outcome{Kind: routing.OutcomeSuccess, TTFT: 40 * time.Millisecond, Latency: time.Second, CompletionTokens: 10})
		}
		if name == "random" && (seen[pre1] == 0 || seen[pre2] == 0) || len(seen) > 2 || seen[""] > 0 {
			t.Errorf("%s: prefill endpoints %v", name, seen)
		}
	}
}

// TestAccounting: the prefill endpoint carries the request (in flight and
// its prompt's prefill tokens) until the first token, then only the decode
// endpoint does (with no prefill tokens: it receives the KV cache); every
// exit path releases both, and the index records the prompt on both.
func TestAccounting(t *testing.T) {
	e := newEngine(t, "kv", 0, ep(dec1, routing.RoleDecode), ep(pre1, routing.RolePrefill))
	prompt := tokens(1000, 1)
	d := pick(t, e, req(prompt))
	if d.Prefill != pre1 || !d.PrefillHeld() {
		t.Fatalf("not disaggregated: %v %q", d.PD, d.Prefill)
	}
	wantLoads(t, e, "picked", map[routing.EndpointKey]load{dec1: {1, 0}, pre1: {1, 1000}})
	keys := kvindex.AppendBlockKeys(nil, prompt, routing.DefaultBlockSize, kvindex.Seed("", ""))
	if m := e.Index().Overlaps(routing.DefaultBlockSize, keys, nil); len(m) != 2 || m[0].Blocks != 62 || m[1].Blocks != 62 {
		t.Fatalf("index after the pick: %+v, want the prompt's 62 blocks on both", m)
	}
	d.Prefilled()
	if d.PrefillHeld() {
		t.Fatal("prefill still held after the first token")
	}
	wantLoads(t, e, "first token", map[routing.EndpointKey]load{dec1: {1, 0}, pre1: {0, 0}})
	d.Prefilled()
	wantLoads(t, e, "second first token", map[routing.EndpointKey]load{dec1: {1, 0}, pre1: {0, 0}})
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	wantLoads(t, e, "done", map[routing.EndpointKey]load{dec1: {}, pre1: {}})

	for _, k := range []routing.OutcomeKind{routing.OutcomeUpstreamError, routing.OutcomeCancelled, routing.OutcomeReset, routing.OutcomeAbandoned, routing.OutcomeRejected, routing.OutcomeExpired} {
		d := pick(t, e, req(tokens(1000, uint32(k+2)*10000)))
		if d.Prefill != pre1 {
			t.Fatalf("%v: not disaggregated", k)
		}
		if !d.Done(routing.NoUsage(k)) || d.Done(routing.NoUsage(k)) {
			t.Fatalf("%v: Done not exactly once", k)
		}
		d.Prefilled() // after Done: nothing
		wantLoads(t, e, k.String(), map[routing.EndpointKey]load{dec1: {}, pre1: {}})
	}
	var blocks int64
	for _, st := range e.Endpoints() {
		for _, b := range st.ActiveBlocks() {
			blocks += b
		}
	}
	if blocks != 0 {
		t.Fatalf("%d active blocks left", blocks)
	}
}

// TestScoreHasNoSideEffects: Engine.Score of a pool with prefill endpoints
// names the prefill endpoint but holds nothing.
func TestScoreHasNoSideEffects(t *testing.T) {
	e := newEngine(t, "round_robin", 0, ep(dec1, routing.RoleDecode), ep(pre1, routing.RolePrefill), ep(pre2, routing.RolePrefill))
	for range 3 {
		d, err := e.Score(t.Context(), req(tokens(1024, 1)))
		if err != nil || d.Prefill != pre1 || d.PD != routing.PDDisaggregated {
			t.Fatalf("score: %v %q %v", err, d.Prefill, d.PD)
		}
	}
	wantLoads(t, e, "score", map[routing.EndpointKey]load{dec1: {}, pre1: {}, pre2: {}})
}

func TestConfig(t *testing.T) {
	if err := pd.DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{-1, pd.MaxThresholdTokens + 1} {
		if _, err := pd.New(pd.Config{ThresholdTokens: n}); !errors.Is(err, pd.ErrConfig) {
			t.Errorf("threshold %d: %v", n, err)
		}
	}
}

// TestEjection: an ejected prefill endpoint is no prefill choice (requests
// stay aggregated); when every decode endpoint is ejected, requests still
// route to them (as when a whole pool is ejected) instead of failing.
func TestEjection(t *testing.T) {
	e := newEngine(t, "kv", 0, ep(dec1, routing.RoleDecode), ep(pre1, routing.RolePrefill))
	for range engine.DefaultScrapeFailures {
		e.ReportScrapeFailure(pre1)
	}
	d := pick(t, e, req(tokens(2048, 1)))
	if d.PD != routing.PDNoEligiblePrefill || d.Endpoint != dec1 {
		t.Fatalf("prefill ejected: %v on %s prefill %q", d.PD, d.Endpoint, d.Prefill)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	e.ReportLoad(pre1, routing.Load{Known: true}, 0) // a good scrape ends it
	for range engine.DefaultScrapeFailures {
		e.ReportScrapeFailure(dec1)
	}
	d = pick(t, e, req(tokens(2048, 5000)))
	if d.Endpoint != dec1 || d.Prefill != pre1 {
		t.Fatalf("decode ejected: %v on %s prefill %q", d.PD, d.Endpoint, d.Prefill)
	}
	d.Done(routing.NoUsage(routing.OutcomeSuccess))
	wantLoads(t, e, "after", map[routing.EndpointKey]load{dec1: {}, pre1: {}})
}
