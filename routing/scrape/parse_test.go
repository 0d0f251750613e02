package scrape_test

import (
	"bytes"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/scrape"
)

func TestParseVLLM(t *testing.T) {
	t.Parallel()
	got, err := scrape.Parse(strings.NewReader(vllmMetrics(2)), 0)
	if err != nil {
		t.Fatal(err)
	}
	want := scrape.Sample{
		Waiting: 1 + 3, Running: 3 + 4, KVUsage: 0.2, Known: true,
		BlockSize: 16, NumGPUBlocks: 27873,
		Adapters: []string{"chat-lora", "sql-lora", "tool-lora"}, MaxLoRA: 4,
		// vllm:request_success_total: 17 per finish reason (stop, length,
		// abort) and rank.
		Finished: 2 * 3 * 17, FinishedKnown: true,
		Ranks: []scrape.RankLoad{
			{Rank: 0, Waiting: 1, Running: 3, KVUsage: 0.1, Finished: 51},
			{Rank: 1, Waiting: 3, Running: 4, KVUsage: 0.2, Finished: 51},
		},
	}
	if d := cmp.Diff(want, got, cmpopts.EquateApprox(0, 1e-9)); d != "" {
		t.Errorf("Parse (-want +got):\n%s", d)
	}
	if l := got.Load(); l != (routing.Load{Waiting: 4, Running: 7, KVUsage: got.KVUsage, Known: true, KVBlocks: 27873, Finished: 102, FinishedKnown: true}) {
		t.Errorf("Load() = %+v", l)
	}
}

func TestParseSGLang(t *testing.T) {
	t.Parallel()
	got, err := scrape.Parse(strings.NewReader(sglangMetrics), 0)
	if err != nil {
		t.Fatal(err)
	}
	want := scrape.Sample{Waiting: 2826, Running: 162, KVUsage: 0.28, Known: true}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("Parse (-want +got):\n%s", d)
	}
}

// TestParseFinished: the workers' counters of finished requests, summed
// over their series, from fixtures: vLLM's vllm:request_success_total
// (every finish reason, per engine), SGLang's sglang:num_requests_total
// (not its received or aborted counters), llm-d-inference-sim's
// finish_reason label; absent, FinishedKnown is false.
func TestParseFinished(t *testing.T) {
	t.Parallel()
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	tests := []struct {
		name, body string
		finished   float64
		known      bool
		ranks      []float64
	}{
		{"vllm fixture", read("vllm_lora.metrics"), 196 + 4 + 0, true, nil},
		{"sglang fixture", read("sglang_finished.metrics"), 27, true, nil},
		{"sglang docs sample, no counter", sglangMetrics, 0, false, nil},
		{"llm-d-inference-sim", `# TYPE vllm:request_success_total counter
vllm:request_success_total{finish_reason="stop",model_name="m"} 5
vllm:request_success_total{finish_reason="length",model_name="m"} 2
vllm:request_success_total{finish_reason="remote_decode",model_name="m"} 1
vllm:num_requests_running{model_name="m"} 0
`, 8, true, nil},
		{"a zero counter is known", "vllm:request_success_total 0\nvllm:num_requests_running 0\n", 0, true, nil},
		{"per rank", `vllm:request_success_total{engine="1",finished_reason="stop"} 4
vllm:request_success_total{engine="0",finished_reason="stop"} 6
vllm:request_success_total{engine="0",finished_reason="length"} 1
vllm:num_requests_running{engine="0"} 1
vllm:num_requests_running{engine="1"} 1
`, 11, true, []float64{7, 4}},
		{"negative and NaN skipped", "vllm:request_success_total{a=\"1\"} -3\nvllm:request_success_total{a=\"2\"} NaN\nvllm:request_success_total{a=\"3\"} 2\nvllm:num_requests_running 0\n", 2, true, nil},
		{"the _created gauge ignored", "# TYPE vllm:request_success_created gauge\nvllm:request_success_created 1.7e+09\nvllm:num_requests_running 0\n", 0, false, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := scrape.Parse(strings.NewReader(tt.body), 0)
			if err != nil {
				t.Fatal(err)
			}
			if got.Finished != tt.finished || got.FinishedKnown != tt.known {
				t.Errorf("Finished = %v (known %v), want %v (%v)", got.Finished, got.FinishedKnown, tt.finished, tt.known)
			}
			if l := got.Load(); l.Finished != tt.finished || l.FinishedKnown != tt.known {
				t.Errorf("Load() = %+v", l)
			}
			for i, want := range tt.ranks {
				if got.Ranks[i].Finished != want {
					t.Errorf("rank %d finished %v, want %v", i, got.Ranks[i].Finished, want)
				}
			}
		})
	}
}

func TestParseVariants(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, body string
		want       scrape.Sample
	}{
		{"older gpu_cache_usage_perc", "vllm:num_requests_running 2\nvllm:gpu_cache_usage_perc 0.5\n",
			scrape.Sample{Running: 2, KVUsage: 0.5, Known: true}},
		{"underscores and _total", "# TYPE vllm_num_requests_waiting_total counter\nvllm_num_requests_waiting_total 5\n",
			scrape.Sample{Waiting: 5, Known: true}},
		{"two models summed, usage max", `vllm:num_requests_waiting{model_name="a"} 1
vllm:num_requests_waiting{model_name="b"} 2
vllm:kv_cache_usage_perc{model_name="a"} 0.3
vllm:kv_cache_usage_perc{model_name="b"} 0.7
`, scrape.Sample{Waiting: 3, KVUsage: 0.7, Known: true}},
		{"NaN, Inf and negative skipped, usage clamped", `vllm:num_requests_waiting NaN
vllm:num_requests_running -3
vllm:num_requests_running{x="1"} +Inf
vllm:kv_cache_usage_perc 1.5
`, scrape.Sample{KVUsage: 1, Known: true}},
		{"block size as float, no gpu blocks", "vllm:cache_config_info{block_size=\"32.0\"} 1\nvllm:num_requests_running 0\n",
			scrape.Sample{BlockSize: 32, Known: true}},
		{"newest lora series wins", `vllm:lora_requests_info{max_lora="2",running_lora_adapters="new",waiting_lora_adapters=""} 200
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters="older"} 100
vllm:num_requests_running 1
`, scrape.Sample{Running: 1, Known: true, Adapters: []string{"new"}, MaxLoRA: 2}},
		{"sglang dp_rank", `sglang:num_queue_reqs{dp_rank="1"} 4
sglang:num_queue_reqs{dp_rank="0"} 2
`, scrape.Sample{Waiting: 6, Known: true, Ranks: []scrape.RankLoad{{Rank: 0, Waiting: 2}, {Rank: 1, Waiting: 4}}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, err := scrape.Parse(strings.NewReader(tt.body), 0)
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Errorf("Parse (-want +got):\n%s", d)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, body string
		limit      int64
		want       error
	}{
		{"html", "<html><body>502 Bad Gateway</body></html>\n", 0, scrape.ErrMalformed},
		{"truncated labels", `vllm:num_requests_running{model_name="a`, 0, scrape.ErrMalformed},
		{"bad value", "vllm:num_requests_running abc\n", 0, scrape.ErrMalformed},
		{"empty", "", 0, scrape.ErrNoLoadMetrics},
		{"not a worker", "go_goroutines 12\n", 0, scrape.ErrNoLoadMetrics},
		{"over limit", vllmMetrics(1), 100, scrape.ErrTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := scrape.Parse(strings.NewReader(tt.body), tt.limit)
			if !errors.Is(err, tt.want) {
				t.Fatalf("Parse error = %v, want %v", err, tt.want)
			}
		})
	}
	// Exactly at the limit is fine.
	body := "vllm:num_requests_running 1\n"
	if _, err := scrape.Parse(strings.NewReader(body), int64(len(body))); err != nil {
		t.Errorf("Parse at the limit: %v", err)
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(vllmMetrics(2)))
	f.Add([]byte(sglangMetrics))
	f.Add([]byte("vllm:request_success_total{engine=\"0\",finished_reason=\"stop\"} 3\nvllm:num_requests_running 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := scrape.Parse(bytes.NewReader(data), 1<<20)
		if err != nil {
			if !errors.Is(err, scrape.ErrMalformed) && !errors.Is(err, scrape.ErrNoLoadMetrics) && !errors.Is(err, scrape.ErrTooLarge) {
				t.Fatalf("unknown error: %v", err)
			}
			return
		}
		if !s.FinishedKnown && s.Finished != 0 {
			t.Fatalf("unknown finished count %v", s.Finished)
		}
		for _, v := range []float64{s.Waiting, s.Running, s.Finished} {
			if math.IsNaN(v) || v < 0 {
				t.Fatalf("bad count %v in %+v", v, s)
			}
		}
		if !(s.KVUsage >= 0 && s.KVUsage <= 1) || s.BlockSize < 0 || s.NumGPUBlocks < 0 || !s.Known {
			t.Fatalf("bad sample %+v", s)
		}
	})
}

// BenchmarkParse parses a vLLM exposition of two DP ranks (about 34 KiB:
// 6 histograms, 6 counters, the load gauges, info series). Run with
// go test -run '^$' -bench Parse -benchmem -count 6 ./routing/scrape.
func BenchmarkParse(b *testing.B) {
	body := []byte(vllmMetrics(2))
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := scrape.Parse(bytes.NewReader(body), 0); err != nil {
			b.Fatal(err)
		}
	}
}
