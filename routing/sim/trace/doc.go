// Package trace reads public LLM request traces and generates agentic
// workloads as [sim.Request] slices for the fleet simulator.
//
// Three sources are supported:
//
//   - [ReadMooncake]: Mooncake JSONL (timestamp in ms, input_length,
//     output_length, hash_ids of 512-token blocks). Token ids are
//     synthesized per hash id, so that requests sharing a hash id share the
//     same tokens (and hence the same KV blocks at any smaller block size).
//   - [ReadAzure]: the Azure LLM inference trace 2023 CSV
//     (TIMESTAMP,ContextTokens,GeneratedTokens). There is no prefix
//     information, so every request gets tokens of its own.
//   - [Agentic]: a seeded generator of multi-turn agent sessions that
//     resend a growing history, with x-prefix-* style hints.
//
// [Detect] names the format of a file from its first bytes, so a caller
// can suggest the right reader instead of reporting every line bad.
//
// Readers report malformed lines with their line number. With
// [Options.Strict] the first bad line is fatal; otherwise bad lines are
// skipped and counted in a [Report]. An empty trace is an error.
//
// Everything here is deterministic: the same input (and seed) gives the
// same requests, token for token.
package trace
