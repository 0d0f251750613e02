// Package kvindex tracks which workers' KV caches hold which prompt
// prefixes, and scores a request's prefix overlap with each worker, as
// NVIDIA Dynamo's KV router does.
//
// # Overview
//
// A prompt is cut into blocks of the engine's block size; only complete
// blocks count. [AppendBlockKeys] gives each block a chained key, bit for bit
// Dynamo's: XXH3-64 of the block's tokens as 4-byte little-endian integers
// with seed 1337 (salted by LoRA name and cache namespace, see [Seed]),
// chained as key[i] = XXH3-64(le64(key[i-1]) || le64(local[i]), 1337). A key
// thus names a block together with everything before it.
//
// An [Index] maps keys to the workers holding them. A worker is an (endpoint,
// data-parallel rank) pair, named by a compact [WorkerID] from [Index.Worker].
// Keys of different block sizes never meet: each block size has its own key
// space inside the index, made on first write, and every method takes the
// block size. [Index.Overlaps] returns, for each worker holding the first
// block, how many leading blocks it holds in a row; [Index.Size] gives each
// worker's block count for tie-breaks.
//
// A worker's entries come from one of two sources, chosen by the caller:
//
//   - KV events ([Index.Apply]): Stored, Removed and Cleared events from the
//     engine. Engine block hashes are opaque ids; the index keeps, per
//     worker, engine hash → key, and computes keys from the events' tokens.
//   - Approximate mode ([Index.InsertApprox]): the router records its own
//     routing decisions. Entries expire TTL after their last insert and are
//     pruned least-recently-inserted first above a cap. Expiry runs on the
//     injected [clock.Clock] through AfterFunc; [Index.Close] stops it.
//
// Entries carry no mode of their own beyond an expiry stamp, so a caller
// should use one source per worker. If both name the same block, the event
// wins: the entry stops expiring.
//
// # Concurrency
//
// Everything is safe for concurrent use. Each key space has 64 shards, each
// an open-addressing hash table behind a sync.RWMutex and a sequence
// counter, chosen by a keyed mix of the key. Writers lock one shard per key
// and keep its counter odd while they write, storing slot words atomically.
// Overlaps reads each key without locking (a seqlock: read the counter, the
// slot, the counter again) and decides from those words alone whether the
// key changes the set of workers still matching: sets are compared by a
// 64-bit sum of per-worker fingerprints, stored in spilled entries, and
// equal sums are taken as equal sets (a 2^-64 event). It takes the shard's
// read lock only when it met a writer mid-write or must list a spilled
// entry's workers. So Overlaps writes no shared memory in the common case
// and sees each key's workers atomically, but not a whole event at once. The worker registry and the list of key
// spaces are copy-on-write behind atomic pointers, so Overlaps and Size
// take no other lock.
//
// Apply serialises on a per-worker mutex. Events of one worker must be
// applied in the engine's order, so a caller feeds each worker's events from
// one goroutine (as Dynamo pins each worker to one thread); different workers
// may be applied in parallel. InsertApprox, expiry and pruning share one
// mutex. Lock order: worker, then approximate mode, then the index's
// registry mutex (workers, key spaces), then shard.
//
// # Memory
//
// An entry of up to two workers sits inline in a 24-byte slot (8-byte key,
// two 4-byte worker ids, two 4-byte expiry stamps); more workers spill to a
// per-shard record with no pointer in the slot. Tables grow at 3/4 load and
// shrink below 1/8. Event-fed workers add a Go map entry (engine hash → key)
// per block; approximate entries add a 16-byte queue item per distinct
// second they were inserted in, compacted when stale items outnumber live
// entries. BenchmarkIndexMemory reports bytes per (block, worker) entry.
//
// # Lower tiers
//
// Events whose [Event.Medium] is host memory or disk (vLLM's
// OffloadingConnector, SGLang HiCache, Dynamo KVBM, LMCache) are kept per
// worker, apart from the GPU's shared table: per medium and block size, a
// map engine hash → key and the set of keys held. [Index.TierOverlap]
// continues a worker's GPU run through them; it takes that worker's tier
// read lock and costs a map lookup per block walked, so it is cheap only
// while few workers hold long prompts in lower tiers (BenchmarkPickTiers
// measures the worst case). Location-only events (no tokens) name blocks
// by the engine hashes the GPU reported for them.
//
// Everything is bounded, since KV events come from peers kvbandit cannot
// authenticate: approximate entries by MaxEntries (pruned), each worker's
// event-fed blocks by MaxEventEntries (further blocks refused with
// [ErrWorkerFull]), and key spaces by MaxBlockSizes in all and
// [WorkerBlockSizes] per worker (further block sizes refused with
// [ErrTooManyBlockSizes]; a space no worker's events use and that holds no
// entry is reclaimed for the next). The bound on spaces also bounds the
// linear search for a block size's space on every lookup.
package kvindex
