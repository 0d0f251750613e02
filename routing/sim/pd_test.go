package sim

import (
	"reflect"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/pd"
)

// pdFleet is one prefill and one decode worker, disaggregating at threshold.
func pdFleet(threshold int) Config {
	return Config{
		Workers: make([]WorkerConfig, 2), Policy: "kv", KVEvents: true, Seed: 1,
		Roles:    []routing.Role{routing.RolePrefill, routing.RoleDecode},
		PD:       &pd.Config{ThresholdTokens: threshold},
		Transfer: Transfer{Latency: 2 * time.Millisecond, BytesPerSec: 10e9, BytesPerToken: 131072},
	}
}

func inFlight(s *simulation, w int) (int64, int64) {
	st := s.reps[0].eng.Endpoints()[w]
	return st.InFlight.Load(), st.InFlightPrefill()
}

// On an idle fleet a disaggregated request's TTFT is its prefill on the
// prefill worker, the transfer and one decode step on the decode worker;
// the prefill worker carries it until the first token, the decode worker
// holds its blocks after the transfer.
func TestPDIdleTTFTAndAccounting(t *testing.T) {
	const prompt, out = 4096, 10
	cfg := pdFleet(0)
	keys := kvindex.AppendBlockKeys(nil, seq(prompt, 1), DefaultBlockSize, kvindex.BaseSeed)
	var steps []string
	cfg.observe = func(s *simulation, a *active, step string) {
		steps = append(steps, step)
		pIn, pPre := inFlight(s, 0)
		dIn, _ := inFlight(s, 1)
		switch step {
		case "handoff", "land":
			if pIn != 1 || pPre != prompt || dIn != 1 {
				t.Errorf("%s: prefill worker in flight %d, prefill tokens %d; decode worker in flight %d", step, pIn, pPre, dIn)
			}
		case "first":
			if pIn != 0 || pPre != 0 || dIn != 1 {
				t.Errorf("first token: prefill worker in flight %d, prefill tokens %d; decode worker in flight %d", pIn, pPre, dIn)
			}
			if got := s.workers[1].cache.prefix(keys); got != len(keys) {
				t.Errorf("decode worker holds %d of %d prompt blocks", got, len(keys))
			}
			for w := range 2 {
				if got := s.workers[w].cache.prefix(keys); got != len(keys) {
					t.Errorf("worker %d cache holds %d of %d blocks", w, got, len(keys))
				}
			}
		}
	}
	res := run(t, cfg, []Request{{Tokens: seq(prompt, 1), OutputLen: out}})
	if !reflect.DeepEqual(steps, []string{"handoff", "land", "first"}) {
		t.Fatalf("steps %v", steps)
	}
	r := res.Requests[0]
	if r.Err != "" || r.Worker != 1 || r.PrefillWorker != 0 || r.OutputTokens != out || r.TransferBlocks != prompt/DefaultBlockSize {
		t.Fatalf("result %+v", r)
	}
	xfer := cfg.Transfer.Time(prompt/DefaultBlockSize, DefaultBlockSize)
	bytes := float64(prompt) * 131072
	if want := 2*time.Millisecond + time.Duration(bytes/10e9*1e9); (xfer-want).Abs() > time.Microsecond || r.Transfer != xfer {
		t.Fatalf("transfer %v, Time %v, want %v", r.Transfer, xfer, want)
	}
	step := MockerDecode(float64(prompt) / float64(DefaultKVBlocks*DefaultBlockSize))
	want := MockerPrefill(prompt) + xfer + step
	if (r.TTFT - want).Abs() > 10*time.Microsecond {
		t.Fatalf("TTFT %v, want prefill %v + transfer %v + step %v = %v", r.TTFT, MockerPrefill(prompt), xfer, step, want)
	}
	if r.ITL < step || r.ITL > 2*step || r.E2E <= r.TTFT {
		t.Fatalf("ITL %v (first step %v), E2E %v", r.ITL, step, r.E2E)
	}
	if p, d := res.Workers[0], res.Workers[1]; p.PrefillTokens != prompt || d.PrefillTokens != 0 || res.KVEventErrors != 0 {
		t.Fatalf("prefill tokens: prefill worker %d, decode worker %d; kv event errors %d", p.PrefillTokens, d.PrefillTokens, res.KVEventErrors)
	}
}

// Below the threshold a request stays aggregated on the decode worker;
// above it, it is disaggregated; every decision ends.
func TestPDConditional(t *testing.T) {
	cfg := pdFleet(1024)
	reqs := []Request{
		{Tokens: seq(256, 1), OutputLen: 5},
		{Arrival: time.Second, Tokens: seq(4096, 100_000), OutputLen: 5},
	}
	res := run(t, cfg, reqs)
	if a, b := res.Requests[0], res.Requests[1]; a.PrefillWorker != -1 || a.Worker != 1 || b.PrefillWorker != 0 || b.Worker != 1 || a.Err != "" || b.Err != "" {
		t.Fatalf("short %+v, long %+v", a, b)
	}
	if a := res.Requests[0]; a.TTFT != MockerPrefill(256) {
		t.Fatalf("aggregated TTFT %v, want %v", a.TTFT, MockerPrefill(256))
	}
}

// A fleet of both workers with P/D on routes exactly as without it.
func TestPDAggregatedPoolUnchanged(t *testing.T) {
	reqs := synthetic(300, 4, 2048, 256, 30, 3)
	base := Config{Workers: make([]WorkerConfig, 3), Policy: "kvbandit", KVEvents: true, Seed: 5}
	with := base
	with.Roles, with.PD = make([]routing.Role, 3), &pd.Config{ThresholdTokens: 0}
	a, b := run(t, base, reqs), run(t, with, reqs)
	if !reflect.DeepEqual(a.Requests, b.Requests) || !reflect.DeepEqual(a.Workers, b.Workers) {
		t.Fatal("a pool of both workers routes differently with P/D on")
	}
	for i, r := range a.Requests {
		if r.PrefillWorker != -1 || r.OutputTokens > 1 && r.ITL <= 0 {
			t.Fatalf("request %d: %+v", i, r)
		}
	}
}

// Under load on a mixed fleet every request finishes and the prefill leg
// is never counted as the client's output.
func TestPDLoadedFleet(t *testing.T) {
	reqs := synthetic(400, 4, 4096, 1024, 20, 9)
	cfg := pdFleet(512)
	cfg.Workers = make([]WorkerConfig, 4)
	cfg.Roles = []routing.Role{routing.RolePrefill, routing.RoleDecode, routing.RoleDecode, routing.RoleBoth}
	cfg.Policy = "kvbandit"
	res := run(t, cfg, reqs)
	disagg := 0
	for i, r := range res.Requests {
		if r.Err != "" || r.OutputTokens != reqs[i].OutputLen || r.TTFT <= 0 || r.Worker == 0 {
			t.Fatalf("request %d: %+v", i, r)
		}
		if r.PrefillWorker >= 0 {
			disagg++
			if r.PrefillWorker == r.Worker || r.Transfer <= 0 {
				t.Fatalf("request %d: %+v", i, r)
			}
		}
	}
	if disagg == 0 || res.KVEventErrors != 0 {
		t.Fatalf("%d disaggregated, %d kv event errors", disagg, res.KVEventErrors)
	}
}

func TestPDConfigErrors(t *testing.T) {
	reqs := []Request{{Tokens: seq(10, 1), OutputLen: 1}}
	for name, mod := range map[string]func(*Config){
		"roles count": func(c *Config) { c.Roles = c.Roles[:1] },
		"threshold":   func(c *Config) { c.PD = &pd.Config{ThresholdTokens: -1} },
		"latency":     func(c *Config) { c.Transfer.Latency = -time.Second },
		"bandwidth":   func(c *Config) { c.Transfer.BytesPerSec = -1 },
		"bytes/token": func(c *Config) { c.Transfer.BytesPerToken = -1 },
	} {
		cfg := pdFleet(0)
		mod(&cfg)
		if _, err := Run(t.Context(), cfg, reqs); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}
