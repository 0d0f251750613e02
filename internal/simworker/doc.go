// Package simworker serves one simulated vLLM worker (routing/sim's worker
// model) over real HTTP, in real time: what `kvbandit demo` and the e2e
// suites run against when no GPU is at hand.
//
// # Overview
//
// A [Server] listens on a loopback address and answers like vLLM with
// prefix caching:
//
//   - POST /v1/chat/completions and /v1/completions, JSON or SSE
//     ("stream": true), with usage (prompt_tokens, completion_tokens,
//     prompt_tokens_details.cached_tokens) in the response, or in a final
//     chunk when stream_options.include_usage is set. Bodies are parsed
//     with extproc/openai, and prompts are tokenized with
//     [extproc.EstimateTokens], the byte estimate kvbandit itself uses when
//     it has no tokenizer; token-id prompts are used as they are. The
//     content is synthetic words, one per generated token; the output
//     length is max_completion_tokens (or max_tokens), else
//     Config.DefaultMaxTokens.
//   - GET /v1/models, /health, and /metrics in Prometheus text with vLLM's
//     names (vllm:num_requests_waiting, vllm:num_requests_running,
//     vllm:kv_cache_usage_perc, vllm:cache_config_info with its block_size
//     and num_gpu_blocks labels, vllm:prefix_cache_queries_total,
//     vllm:prefix_cache_hits_total, vllm:prompt_tokens_total,
//     vllm:generation_tokens_total).
//   - KV events over ZMQ in vLLM's wire format, when Config.KVEventsAddr
//     is set: a PUB socket bound there (or, with Config.KVEventsDial,
//     connected there to a bound subscriber) sends 3-frame messages (topic
//     "kv@<http addr>@<model>", an 8-byte big-endian sequence number from
//     0, a msgpack array_like EventBatch [ts, [events], dp_rank]) with
//     BlockStored and BlockRemoved events. The block hashes are the
//     chained block keys of routing/kvindex and token_ids are the prompt's
//     pseudo-tokens, so an event-fed kvbandit index matches the blocks it
//     computes for the same prompt.
//
// Time: the model's step times (routing/sim, Dynamo's mocker polynomials
// divided by the speed factor) are divided again by Config.SpeedUp, and
// tokens are sent as their steps complete. Requests beyond the worker's
// batch or KV capacity wait, as in the model.
//
// # Concurrency
//
// One goroutine owns the simulated worker: HTTP handlers submit requests to
// it over a channel and wait for its progress notifications, so the Server
// is safe for concurrent use. A second goroutine sends KV events, so a slow
// subscriber never stalls the model (a full queue drops a message, which
// subscribers see as a sequence gap).
//
// # Lifecycle
//
// [New] checks the configuration, [Server.Start] binds the listeners and
// starts serving, and [Server.Close] stops everything and waits for its
// goroutines. A request whose client goes away keeps running in the model
// (the model has no abort); requests still open at Close get an error.
package simworker
