// Package scrape reads the load of vLLM and SGLang workers from their
// Prometheus /metrics endpoints.
//
// [Parse] turns one text exposition into a [Sample]: waiting and running
// requests, KV cache usage, the KV block size, LoRA adapters, the count
// of requests the worker finished (vllm:request_success_total,
// sglang:num_requests_total: routing/sync vouches for peers' outcomes
// with it) and per-rank load for data-parallel workers. A [Scraper] polls every target each
// interval with bounded concurrency, publishes each good sample, and marks
// a target stale when it has not answered for a while. [EnginePublish]
// hands samples to a [engine.Engine] (load, block size, per-rank load and
// LoRA adapters) and [EngineFailure] reports failed scrapes to it, which
// ejects endpoints whose metrics stop answering.
//
// # Concurrency
//
// [Scraper.Run] owns one goroutine plus one per in-flight scrape (bounded by
// Config.MaxInFlight). Rounds are driven by the injected clock, so tests and
// the benchmark can run it in virtual time; HTTP timeouts use context
// deadlines in real time.
package scrape
