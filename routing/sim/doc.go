// Package sim is a vLLM-like fleet simulator that runs in virtual time and
// routes every request through the real routing engine.
//
// Each simulated worker models vLLM with prefix caching: a KV cache of
// KVBlocks blocks of BlockSize tokens whose full prompt blocks are keyed by
// chained block hashes (the router's own recipe, so prefix reuse is real),
// LRU eviction of unreferenced blocks, continuous batching bounded by
// MaxNumSeqs, and chunked prefill bounded by MaxBatchedTokens per step.
//
// Step time follows Dynamo's mocker: a step that prefills N new tokens
// costs Prefill(N) (the decode tokens of the same step ride along for
// free, the prefill dominates the batch); a step with decode tokens only
// costs Decode(u), u being the KV utilisation (KV tokens of the running
// requests over the cache's tokens). Both are divided by the worker's
// speed factor. A fully cached prompt still recomputes its last token, as
// vLLM does, so every prompt costs at least one prefill step.
//
// [Run] is a discrete-event loop (arrivals, step ends, schedule changes,
// one queue sample per second) that advances the engine's virtual clock to
// each event, so that the engine's timers fire deterministically: the same
// configuration, seed and requests give the same [Result] (apart from the
// wall-clock fields). Runs of identical decode steps are computed in one
// event up to the next request completion; an arrival on the worker cuts
// the run at the step in progress, so the result is the same as stepping
// one token at a time.
//
// # Replicas
//
// With Config.Replicas R > 1 the fleet sits behind R pickers: R
// independent engines with the same policy and options, each with its own
// random source (seeded from Config.Seed), prefix store and index, all on
// the one virtual clock. Each request enters through a replica chosen at
// random (seeded). The workers' own signals reach every replica (load,
// every Config.ScrapeInterval; KV events, which vLLM publishes to every
// subscriber). With SyncNone that is all they share; SyncNATS models
// routing/sync: each decision's start, first token, end and outcome are
// applied on every other replica Config.SyncDelay later. One replica is
// exactly the run without replicas.
//
// # Prefill/decode disaggregation
//
// With Config.Roles (prefill, decode or both per worker) and Config.PD the
// engines decide P/D as serve's do (routing/pd). A request disaggregated
// to prefill worker P and decode worker D runs as llm-d's sidecar makes
// it: its prefill leg is queued on P with one output token (P's batch and
// chunked prefill, its cache keeps the prompt's blocks and publishes KV
// events); when it ends, the prompt's blocks that D's cache does not hold
// are sent to D in Config.Transfer's time (a latency per transfer plus
// bytes over bandwidth); the decode leg is then queued on D, whose cache
// takes the blocks as computed ones (and publishes them), and its first
// decode step gives the first token: TTFT = prefill on P + transfer +
// first step on D. The decision's Prefilled is called at that token, as
// the response path does, releasing P's load. Every request records its
// mean inter-token latency (ReqResult.ITL).
package sim
