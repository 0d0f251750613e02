// Package decisionlog writes an optional per-decision log, as CSV or JSON
// Lines, for offline analysis of routing behaviour.
//
// # Overview
//
// A [Record] carries the columns of the reference Thompson-sampling
// router's router_metrics.csv (ts_epoch_ms, tokens_len, prefix_id,
// reuse_after, chosen_worker, overlap_chosen, decode_cost, prefill_cost,
// iat_level, stickiness, load_mod), then decision_id, policy, tenant,
// dp_rank, estimated_tokens and the policy's per-endpoint scores: one CSV
// column "scores" holding "ip:port=score;ip:port=score", or a JSON object
// {"ip:port": score}. [Columns] lists the CSV header. Non-finite floats are
// written as NaN, +Inf and -Inf in CSV and as null in JSON. The tenant and
// prefix id come from clients: they are logged as the prefix state stores
// them ([prefixstate.BoundID]: a long id becomes its SHA-256), so neither a
// queued record nor a line grows with what a client sends.
//
// # Concurrency
//
// [Log.Record] never blocks and never does I/O: it hands the record to a
// bounded channel (Options.Buffer, default 4096) and, when the channel is
// full, drops the record and counts it ([Log.Dropped]). One writer goroutine
// per Log encodes records into a buffered writer, flushes it every
// Options.FlushInterval on the injected clock (clock.AfterFunc, so a
// virtual clock drives it in tests) and on [Log.Close]. Write errors are
// counted and logged once; they never reach the request path.
//
// # Lifecycle
//
// [Open] appends to a file (writing the CSV header only when the file is
// empty) and, with Options.MaxBytes, rotates it: when the next record would
// push the file past MaxBytes, the file is renamed to path + ".1"
// (replacing the previous one) and a new file is started. [New] writes to
// any io.Writer, which it never closes. [Log.Close] stops accepting
// records, writes everything already accepted, flushes and closes the file
// it opened. A record passed to Record after Close is dropped and counted.
package decisionlog
