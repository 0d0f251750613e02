package scrape_test

import (
	"fmt"
	"strings"
)

// vllmMetrics returns a vLLM V1 /metrics exposition shaped like the sample
// in vLLM's docs (docs/usage/metrics.md: prometheus_client text, float
// values, model_name labels) for a data-parallel worker with the given
// ranks (vLLM adds an engine label per DP rank). Rank r has 2r+1 waiting
// requests, r+3 running and KV usage 0.1·(r+1).
func vllmMetrics(ranks int) string {
	const model = "unsloth/Llama-3.2-1B-Instruct"
	var b strings.Builder
	w := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	w(`# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12154.0
python_gc_objects_collected_total{generation="1"} 1719.0
python_gc_objects_collected_total{generation="2"} 1032.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.013306624e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27873",num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7476e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql-lora,chat-lora",waiting_lora_adapters="tool-lora"} 1.7477e+09
`)
	gauge := func(name, help string, val func(r int) float64) {
		w("# HELP %s %s\n# TYPE %s gauge\n", name, help, name)
		for r := range ranks {
			w("%s{engine=\"%d\",model_name=%q} %.1f\n", name, r, model, val(r))
		}
	}
	gauge("vllm:num_requests_running", "Number of requests in model execution batches.", func(r int) float64 { return float64(r + 3) })
	gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", func(r int) float64 { return float64(2*r + 1) })
	gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", func(r int) float64 { return 0.1 * float64(r+1) })
	counter := func(name, help string) {
		w("# HELP %s_total %s\n# TYPE %s_total counter\n", name, help, name)
		for r := range ranks {
			w("%s_total{engine=\"%d\",model_name=%q} %d.0\n", name, r, model, 1000*(r+1))
		}
		w("# HELP %s_created %s\n# TYPE %s_created gauge\n", name, help, name)
		for r := range ranks {
			w("%s_created{engine=\"%d\",model_name=%q} 1.7476e+09\n", name, r, model)
		}
	}
	counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
	counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
	counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
	counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
	counter("vllm:generation_tokens", "Number of generation tokens processed.")
	w("# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\n")
	for r := range ranks {
		for _, reason := range []string{"stop", "length", "abort"} {
			w("vllm:request_success_total{engine=\"%d\",finished_reason=%q,model_name=%q} 17.0\n", r, reason, model)
		}
	}
	hist := func(name, help string, les []string) {
		w("# HELP %s %s\n# TYPE %s histogram\n", name, help, name)
		for r := range ranks {
			for i, le := range les {
				w("%s_bucket{engine=\"%d\",le=%q,model_name=%q} %d.0\n", name, r, le, model, 3*i)
			}
			w("%s_bucket{engine=\"%d\",le=\"+Inf\",model_name=%q} %d.0\n", name, r, model, 3*len(les))
			w("%s_count{engine=\"%d\",model_name=%q} %d.0\n", name, r, model, 3*len(les))
			w("%s_sum{engine=\"%d\",model_name=%q} 12.5\n", name, r, model)
		}
	}
	secs := []string{"0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0"}
	toks := []string{"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0", "5000.0", "10000.0"}
	hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", toks)
	hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", secs)
	hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", secs)
	hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", secs)
	hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", secs)
	hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", toks)
	return b.String()
}

// sglangMetrics is an SGLang /metrics exposition (sglang:* gauges with
// model_name labels, as SGLang's docs/references/production_metrics.md
// shows).
const sglangMetrics = `# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The cache hit rate
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.3518979474117756e+06
sglang:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 27.0
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 27.0
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 162.0
# HELP sglang:num_used_tokens The number of used tokens
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 123859.0
# HELP sglang:gen_throughput The generate throughput (token/s)
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct"} 86.50814177726902
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2826.0
`
