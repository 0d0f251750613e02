package wire

import "errors"

// Version is the format version this package reads and writes.
const Version = 1

// Limits. See the package documentation.
const (
	// MaxMessage bounds a whole encoded message, in bytes (NATS's default
	// max_payload).
	MaxMessage = 1 << 20
	// MaxIDLen bounds Message.Pool and Message.Replica, in bytes.
	MaxIDLen = 128
	// MaxStringLen bounds every other string (endpoints, prefix ids,
	// tenants, models), in bytes.
	MaxStringLen = 512
	// MaxItems bounds the items of one batch.
	MaxItems = 8192
	// MaxSnapshotStarts bounds the starts of one snapshot.
	MaxSnapshotStarts = 65536
	// MaxBlocks bounds the block keys of one Start.
	MaxBlocks = 16384
	// MaxTotalBlocks bounds the block keys of one message. MaxMessage is
	// the tighter bound (8 bytes a key).
	MaxTotalBlocks = 262144
	// MaxPayload bounds a KV-event payload, in bytes. MaxMessage is the
	// tighter bound (the envelope takes a few bytes).
	MaxPayload = 1 << 20
)

// Errors. Every error from [Append], [Decode] and [Decoder.Decode] wraps
// exactly one of them.
var (
	// ErrMalformed: the bytes are not a message (truncated, a bad varint,
	// a value out of its type's range, an unknown kind, trailing bytes),
	// or a Message to encode has an unknown kind.
	ErrMalformed = errors.New("wire: malformed message")
	// ErrTooLarge: a count, length or the whole message is over its limit.
	ErrTooLarge = errors.New("wire: message over a limit")
	// ErrVersion: the message's version byte is not [Version].
	ErrVersion = errors.New("wire: unsupported version")
)

// Kind is a message's kind.
type Kind uint8

// Message kinds.
const (
	// KindBatch: decisions' starts, first tokens, ends and outcomes.
	KindBatch Kind = 1
	// KindSnapshot: every decision of the sender still in flight.
	KindSnapshot Kind = 2
	// KindHeartbeat: the sender is alive.
	KindHeartbeat Kind = 3
	// KindKVEvents: a worker's KV events, republished.
	KindKVEvents Kind = 4
	// KindStateRequest: a starting replica asks a peer for its state
	// (the warm start, state.go).
	KindStateRequest Kind = 5
	// KindStateChunk: one chunk of a peer's state, the answer.
	KindStateChunk Kind = 6
)

// String names the kind.
func (k Kind) String() string {
	switch k {
	case KindBatch:
		return "batch"
	case KindSnapshot:
		return "snapshot"
	case KindHeartbeat:
		return "heartbeat"
	case KindKVEvents:
		return "kv_events"
	case KindStateRequest:
		return "state_request"
	case KindStateChunk:
		return "state_chunk"
	}
	return "unknown"
}

// Message is one sync message: the envelope and the body of its Kind.
// Only the body field of Kind is encoded; the others are ignored by
// [Append] and left zero by decoding.
type Message struct {
	Kind Kind
	// Pool is the sender's pool (≤ MaxIDLen bytes).
	Pool string
	// Replica is the sender's replica id (≤ MaxIDLen bytes).
	Replica string
	// Epoch is random per process start: a restarted peer is a new
	// incarnation.
	Epoch uint64
	// Seq numbers the sender's messages within its epoch, +1 per message.
	Seq uint64

	// Batch is the body of KindBatch (≤ MaxItems).
	Batch []Item
	// Snapshot is the body of KindSnapshot (≤ MaxSnapshotStarts): every
	// decision of the sender still in flight. It replaces the sender's
	// whole contribution.
	Snapshot []Start
	// Heartbeat is the body of KindHeartbeat.
	Heartbeat Heartbeat
	// KVEvents is the body of KindKVEvents.
	KVEvents KVEvents
	// StateRequest and StateChunk are the bodies of KindStateRequest and
	// KindStateChunk (state.go).
	StateRequest StateRequest
	StateChunk   StateChunk
}

// ItemKind is a batch item's kind.
type ItemKind uint8

// Batch item kinds.
const (
	// ItemStart: a decision was made (Item.Start).
	ItemStart ItemKind = 1
	// ItemFirst: a decision's first token came: its prefill is done
	// (Item.ID).
	ItemFirst ItemKind = 2
	// ItemEnd: a decision ended (Item.ID).
	ItemEnd ItemKind = 3
	// ItemOutcome: how a decision ended (Item.Outcome).
	ItemOutcome ItemKind = 4
)

// String names the item kind.
func (k ItemKind) String() string {
	switch k {
	case ItemStart:
		return "start"
	case ItemFirst:
		return "first"
	case ItemEnd:
		return "end"
	case ItemOutcome:
		return "outcome"
	}
	return "unknown"
}

// Item is one entry of a batch. Kind says which field holds it: Start for
// ItemStart, ID for ItemFirst and ItemEnd, Outcome for ItemOutcome. The
// other fields are ignored by [Append] and left zero by decoding. Build
// one with [StartItem], [FirstItem], [EndItem] or [OutcomeItem].
type Item struct {
	Kind    ItemKind
	ID      uint64
	Start   Start
	Outcome Outcome
}

// StartItem returns the batch item for s.
func StartItem(s Start) Item { return Item{Kind: ItemStart, Start: s} }

// FirstItem returns the batch item for decision id's first token.
func FirstItem(id uint64) Item { return Item{Kind: ItemFirst, ID: id} }

// EndItem returns the batch item for decision id's end.
func EndItem(id uint64) Item { return Item{Kind: ItemEnd, ID: id} }

// OutcomeItem returns the batch item for o.
func OutcomeItem(o Outcome) Item { return Item{Kind: ItemOutcome, Outcome: o} }

// DecisionID returns the number of the decision the item is about,
// whatever its kind.
func (it *Item) DecisionID() uint64 {
	switch it.Kind {
	case ItemStart:
		return it.Start.ID
	case ItemOutcome:
		return it.Outcome.ID
	}
	return it.ID
}

// Start is one decision of the sender, in flight.
type Start struct {
	// ID is the sender's own decision number.
	ID uint64
	// Endpoint is the chosen endpoint's key (≤ MaxStringLen bytes).
	Endpoint string
	// DPRank is the data-parallel rank, -1 for none.
	DPRank int32
	// BlockSize is the tokens per block of Blocks.
	BlockSize uint32
	// Blocks are the prompt's block keys (≤ MaxBlocks). Decoding gives
	// every Start of a message a capacity-limited window of one shared
	// array.
	Blocks []uint64
	// ISL is the prompt's length in tokens.
	ISL uint32
	// Overlap is how many of Blocks were cached at the decision.
	Overlap uint32
	// ExpectedDecodeBlocks is the decode blocks the decision expects.
	ExpectedDecodeBlocks uint32
	// PrefixID, Tenant and Model are the request's hint keys (≤
	// MaxStringLen bytes each; empty when absent).
	PrefixID string
	Tenant   string
	Model    string
	// TTL is how long, in milliseconds, peers keep the decision without
	// an end: it bounds drift.
	TTL uint32
	// The request's session hints, recorded with PrefixID by peers'
	// policies: the announced requests of the session, the output-length
	// and inter-arrival levels (routing.Level values, 0 = not given; a
	// value over routing.LevelHigh decodes and is refused by routing),
	// the output-length hint in tokens and max_tokens (0 = none).
	TotalRequests uint32
	OSL           uint8
	OSLTokens     uint32
	IAT           uint8
	MaxTokens     uint32
	// Prefilled says the first token came (the prefill is done).
	Prefilled bool
	// PrefillEndpoint is a disaggregated decision's prefill endpoint (≤
	// MaxStringLen bytes; empty: aggregated), PrefillDPRank its rank (-1
	// for none) and PrefillCached the prompt tokens it had cached. They
	// are encoded only with a prefill endpoint (flags bit 1).
	PrefillEndpoint string
	PrefillDPRank   int32
	PrefillCached   uint32
}

// Outcome is how one decision of the sender ended.
type Outcome struct {
	// ID is the sender's decision number.
	ID uint64
	// Endpoint is the endpoint that served it (≤ MaxStringLen bytes).
	Endpoint string
	// DPRank is the data-parallel rank, -1 for none.
	DPRank int32
	// Kind is a routing.OutcomeKind value.
	Kind uint8
	// Status is the HTTP status from the worker; 0 when none arrived.
	Status uint16
	// TTFTMicros and LatencyMicros are the time from the decision to the
	// first token and to the end, in microseconds.
	TTFTMicros    uint32
	LatencyMicros uint32
	// PromptTokens, CompletionTokens and CachedTokens are the worker's
	// usage; -1 when unknown.
	PromptTokens     int32
	CompletionTokens int32
	CachedTokens     int32
	// PrefixID, Tenant and Model are the request's hint keys (≤
	// MaxStringLen bytes each).
	PrefixID string
	Tenant   string
	Model    string
	// Served is the endpoint the data plane really used when it is not
	// Endpoint (≤ MaxStringLen bytes); empty: Endpoint served it.
	Served string
	// BlockSize, ISL and Overlap are the decision's block size, prompt
	// tokens and cached blocks; QueuedPrefillTokens the prompt tokens
	// in flight on the endpoint rank when the sender decided; OSL the
	// request's output-length level (routing.Level).
	BlockSize           uint32
	ISL                 uint32
	Overlap             uint32
	QueuedPrefillTokens uint64
	OSL                 uint8
}

// Heartbeat says the sender is alive.
type Heartbeat struct {
	// InFlight is the sender's decisions in flight.
	InFlight uint32
	// Interval is the sender's heartbeat interval in milliseconds.
	Interval uint32
}

// KVEvents is one of a worker's KV-event batches, republished by the
// replica that received it.
type KVEvents struct {
	// Endpoint is the worker's key (≤ MaxStringLen bytes).
	Endpoint string
	// Payload is the vLLM msgpack event batch as received (≤ MaxPayload
	// bytes, and the whole message ≤ MaxMessage).
	Payload []byte
	// Seq is the worker's sequence number of the batch.
	Seq uint64
}
