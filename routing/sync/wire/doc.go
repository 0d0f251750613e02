// Package wire is the binary format of the messages kvbandit replicas
// exchange to share their in-flight decisions, outcomes and KV events
// (issue 12). It holds the message types, [Append] to encode one message
// and [Decode] (or a [Decoder], which interns repeated strings) to read
// one back. It does no I/O and knows nothing of NATS or of package
// routing: package routing/sync carries the bytes and maps the values.
//
// # Defensive decoding
//
// Every message comes from the network and is hostile until bounded.
// Decoding runs twice over the bytes: a first pass checks the whole
// message (every declared count or length against the limits below and
// against the bytes left, every varint, every value range, no trailing
// bytes) without allocating anything; only a message that passed is
// decoded for real, into exactly sized slices. An error wraps one of
// [ErrMalformed], [ErrTooLarge] or [ErrVersion]. Encoding refuses a value
// over a limit with [ErrTooLarge], so what [Append] writes always
// decodes.
//
// Limits: a whole message is at most [MaxMessage] bytes (1 MiB, NATS's
// default max_payload); a batch at most [MaxItems] items; a snapshot at
// most [MaxSnapshotStarts] starts; a start at most [MaxBlocks] block keys
// and a message at most [MaxTotalBlocks] (the 1 MiB bound is the tighter
// one: about 131,000 keys fit); pool and replica ids at most [MaxIDLen]
// bytes; endpoints, prefix ids, tenants and models at most [MaxStringLen]
// bytes; a KV-event payload at most [MaxPayload] bytes (again the message
// bound is tighter, as it is for snapshots: about 58,000 minimal starts
// fit, fewer with block keys, so a sender of a large in-flight set trims
// block keys from its snapshot). Strings are bytes: they need not be UTF-8.
//
// # Format
//
// Notation: u8 is one byte; uvarint is encoding/binary's unsigned varint
// (at most 10 bytes); varint is its zigzag signed varint; u64le is 8
// bytes little-endian; str and bytes are a uvarint length then that many
// bytes. A field typed uint32, uint16 or int32 in Go is a (u)varint whose
// value must fit the type, or the message is malformed. Every message is:
//
//	u8       version        1 (anything else: ErrVersion)
//	u8       kind           1 batch, 2 snapshot, 3 heartbeat, 4 KV events,
//	                        5 state request, 6 state chunk
//	str      pool           ≤ 128 bytes
//	str      replica        ≤ 128 bytes
//	u64le    epoch          random per process start
//	uvarint  seq            per replica and epoch, +1 per message
//	...      body           by kind, below; no byte may follow it
//
// Batch (kind 1):
//
//	uvarint  count          ≤ 8192, then count items, each:
//	u8       item kind      1 start, 2 first token, 3 end, 4 outcome
//	...      item           start: as below; first, end: uvarint id;
//	                        outcome: as below
//
// Start (a batch item of kind 1, and each entry of a snapshot):
//
//	uvarint  id             the sender's decision number
//	str      endpoint       ≤ 512 bytes
//	varint   dp rank        int32, -1 = none
//	uvarint  block size     uint32
//	uvarint  n              ≤ 16384 block keys, then n × u64le
//	uvarint  isl            uint32, prompt tokens
//	uvarint  overlap        uint32, blocks cached at the decision
//	uvarint  decode blocks  uint32, expected decode blocks
//	str      prefix id      ≤ 512 bytes
//	str      tenant         ≤ 512 bytes
//	str      model          ≤ 512 bytes
//	uvarint  ttl            uint32 milliseconds
//	uvarint  total requests uint32, the session's announced requests
//	u8       osl            output-length level (routing.Level)
//	uvarint  osl tokens     uint32, output-length hint in tokens
//	u8       iat            inter-arrival level (routing.Level)
//	uvarint  max tokens     uint32, the request's max_tokens
//	u8       flags          bit 0: prefilled; bit 1: disaggregated (the
//	                        three fields below follow); other bits must be 0
//	str      prefill endpoint  bit 1 only: ≤ 512 bytes, not empty
//	varint   prefill rank      bit 1 only: int32, -1 = none
//	uvarint  prefill cached    bit 1 only: uint32, prompt tokens the
//	                           prefill endpoint had cached
//
// Outcome (a batch item of kind 4):
//
//	uvarint  id
//	str      endpoint       ≤ 512 bytes
//	varint   dp rank        int32
//	u8       outcome kind   routing.OutcomeKind
//	uvarint  status         uint16, HTTP status
//	uvarint  ttft           uint32 microseconds
//	uvarint  latency        uint32 microseconds
//	varint   prompt tokens      int32, -1 = unknown
//	varint   completion tokens  int32, -1 = unknown
//	varint   cached tokens      int32, -1 = unknown
//	str      prefix id      ≤ 512 bytes
//	str      tenant         ≤ 512 bytes
//	str      model          ≤ 512 bytes
//	str      served         ≤ 512 bytes, empty: the endpoint above
//	uvarint  block size     uint32
//	uvarint  isl            uint32, prompt tokens
//	uvarint  overlap        uint32, blocks cached at the decision
//	uvarint  queued prefill uint64, prompt tokens in flight on the rank
//	u8       osl            output-length level (routing.Level)
//
// Snapshot (kind 2): uvarint count (≤ 65536), then count starts as above.
// It replaces the sender's whole contribution.
//
// Heartbeat (kind 3): uvarint in-flight (uint32), uvarint interval
// (uint32 milliseconds).
//
// KV events (kind 4): str endpoint (≤ 512 bytes), bytes payload (a vLLM
// msgpack KV-event batch as received), uvarint seq (the worker's sequence
// number).
//
// # The warm start's messages
//
// A replica that starts asks a peer for its state (routing/sync's
// warm start) with a state request on the peer's own subject and gets the
// chunks of the answer on its reply subject. Their envelope's seq is 0
// (they are outside the sender's numbered stream). Floats (f64) are
// IEEE-754 bits as u64le and must be finite; ranks are varints in [-1,
// 1024] (a block run's a uvarint ≤ 1024).
//
// State request (kind 5):
//
//	u64le    transfer       the requester's number for the transfer
//	uvarint  from           uint32, the first chunk wanted (0: a new transfer)
//	uvarint  max bytes      ≤ 2^32, the most the requester takes in all
//
// State chunk (kind 6):
//
//	u64le    transfer       the request's
//	uvarint  index          uint32, from 0
//	uvarint  total          uint32 ≤ 4096, the transfer's chunks (0: refused)
//	u8       flags          bit 0: refused (ask another peer); others 0
//	uvarint  streams        ≤ 2^20, each: str endpoint ≤ 512, u8 flags
//	                        (bit 0 started, bit 1 trusted), uvarint seq
//	uvarint  block runs     ≤ 2^20, each: str endpoint, uvarint rank,
//	                        u8 medium (0 GPU, 1 CPU, 2 disk), uvarint block
//	                        size (1..65536), uvarint factor (1..1024),
//	                        uvarint n, n × (u64le engine hash, u64le key);
//	                        at most 65,536 blocks in a chunk
//	u8       latency        0 or 1, then: 7 × f64 coefficients, uvarint
//	                        observations, 25 + 5 f64 (TTFT fit: S, xy),
//	                        4 + 2 f64 (decode fit)
//	uvarint  speeds         ≤ 2^20, each: str endpoint, varint rank, f64
//	                        mean, f64 precision, f64 running, uvarint
//	                        observations (uint32), uvarint age ms (uint32)
//	uvarint  arms           ≤ 2^20, each: str endpoint, varint rank,
//	                        uvarint updates, 81 f64 (A), 9 f64 (b)
//	uvarint  betas          ≤ 2^20, each: str endpoint, f64 α, f64 β,
//	                        uvarint rewards, f64 last reward, 20 EMAs
//	                        (18 buckets, 2 overall): u8 set (0/1), f64
//	u8       baselines      0 or 1, then 2 EMAs
//	uvarint  sessions       ≤ 2^20, each: str tenant, str prefix id,
//	                        uvarint total, uvarint processed (both ≤
//	                        2^31−1), u8 pinned (0/1), if pinned: str
//	                        endpoint, varint rank, f64 decode cost, f64
//	                        prefill cost, f64 iat factor, uvarint pin age
//	                        ms; then uvarint idle ms (uint32)
//
// [SplitState] cuts a state into chunk bodies of at most [ChunkBudget]
// bytes (long block runs into several), so that every chunk is one
// message. The values mean what routing/warmstate says; their ranges
// beyond the above (a precision > 0, a Beta parameter > 0) are the
// importers' to check.
//
// Varints need not be minimal: a decoder accepts any encoding
// encoding/binary accepts, and [Append] always writes the minimal one.
//
// # Compatibility
//
// A decoder refuses flag bits it does not know, and a message with one
// is malformed as a whole. Bit 1 (a disaggregated start, issue 22) is set
// only when a start has a prefill endpoint, so an aggregated start is
// byte for byte what it was before, and replicas that predate bit 1
// decode every message of a pool without prefill endpoints. In a rolling
// upgrade of a pool that disaggregates, an old replica drops (as
// malformed, counted in kvbandit_sync_dropped_total{reason="malformed"})
// every batch and snapshot of an upgraded peer that holds a P/D start,
// with that message's other items: it misses the upgraded peers'
// disaggregated decisions, and an aggregated decision whose end or first
// token travelled in such a batch stays applied on it until its TTL (the
// start's, 5 minutes by default) or its peer's departure, since the
// snapshots that would repair it hold P/D starts too. Upgraded replicas
// read old ones' messages whole. Upgrade the pickers of a P/D pool
// together, or expect that drift for the rollout's length.
package wire
