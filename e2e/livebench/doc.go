// Package livebench is the workload and the client of the live benchmark
// (make bench-live): it replays a trace as real streaming chat
// completions against real servers (llm-d-inference-sim workers behind
// e2e/envoysim and a picker) and measures them at the client.
//
// Workload. A trace request becomes an OpenAI chat request whose prompt
// is real text in which shared prefixes are the same text. The readers
// of routing/sim/trace give every request its trace tokens (a Mooncake
// hash id stands for the same 512 tokens wherever it appears; an agentic
// session resends its history); each trace token renders as one word of
// a fixed list of 512 common English words (see [Word]), so a hash id's
// block is a deterministic chunk of about 512 real tokens, the last block
// of a request is cut to its input_length, and the text of a shared
// token prefix is a shared text prefix. The output length becomes
// max_tokens with ignore_eos (honoured by llm-d-inference-sim v0.10.2,
// which ignores min_tokens). [Options] take the first minutes of the
// trace, scale its rate, and spread arrivals stamped on a coarse grid
// (Mooncake's conversation trace: 3 s, see [DetectGrid]) uniformly over
// their grid cell with a seeded RNG. Agentic sessions carry their hints
// as x-prefix-* headers unless [Options.StripHints].
//
// Client. [Client.Run] is open-loop: each request is sent at its time
// whatever the others do, with at most [Client.MaxInFlight] in flight
// (a request due beyond it is not sent and counts as failed). Requests
// stream (stream_options.include_usage) and are measured as vLLM's
// benchmark_serving does: TTFT to the first chunk with non-empty
// content, ITL between content chunks, E2E to the last byte. Every
// failure counts, with a [Reason]. Canceling the context stops the run
// promptly. With several entries ([Client.URLs], one proxy per picker
// replica) each request goes to one of them at random, the same one for
// the same request and seed.
//
// Summary. [Summarize] gives percentiles of TTFT, ITL and E2E, the
// achieved request rate and the failures as a JSON-friendly [Summary];
// [WriteTTFTCDF] plots TTFT CDFs.
package livebench
