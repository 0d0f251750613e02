package kvevents

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// Errors returned by [Decode]. Every decoding failure wraps ErrMalformed.
var (
	// ErrMalformed means the message is not a vLLM KV event batch, or one
	// that exceeds the decoder's limits.
	ErrMalformed = errors.New("kvevents: malformed message")
	// ErrTokenCount means a BlockStored event's token_ids do not fill its
	// block_hashes × block_size exactly; it also wraps kvindex.ErrBlockSize.
	ErrTokenCount = errors.New("kvevents: token count does not match blocks × block size")
)

// Limits of one decoded message. A message over any of them is rejected
// whole with ErrMalformed (the subscriber then treats the endpoint's view
// as approximate). They bound what Decode allocates: at most about
// 4 B × MaxTokensPerBatch + 40 B × MaxBlocksPerBatch + 104 B ×
// MaxEventsPerBatch ≈ 25 MiB for the largest accepted batch, whatever the
// message declares.
//
// What engines send, for scale: vLLM publishes one batch per scheduler
// step, with about one BlockStored per request that filled blocks in that
// step and the BlockRemoved of the blocks it evicted for them. A step
// schedules at most max_num_batched_tokens (2,048–16,384 by default,
// 131,072 in the largest configurations we know of) and max_num_seqs
// requests (256–1,024), so a batch holds at most a few thousand blocks of
// 16 tokens and about a thousand events. SGLang with page size 1 makes
// every token a block: up to max_num_batched_tokens blocks.
const (
	// MaxEventsPerBatch bounds the events of one batch: 64× the largest
	// max_num_seqs.
	MaxEventsPerBatch = 1 << 16
	// MaxBlocksPerEvent bounds the block hashes of one event: a whole
	// 131,072-token step stored at page size 1.
	MaxBlocksPerEvent = 1 << 17
	// MaxBlocksPerBatch bounds the block hashes of one batch, stored and
	// removed together: twice MaxBlocksPerEvent, for a step that evicts as
	// many blocks as it stores.
	MaxBlocksPerBatch = 1 << 18
	// MaxTokensPerEvent bounds the token ids of one event: 8× the largest
	// step.
	MaxTokensPerEvent = 1 << 20
	// MaxTokensPerBatch bounds the token ids of one batch (8 MiB decoded).
	MaxTokensPerBatch = 1 << 21
	// MaxStringBytes bounds type tags, map keys, medium, lora_name and
	// kv_cache_spec_kind. vLLM's are short words and adapter names.
	MaxStringBytes = 256
	// MaxHashBytes bounds a byte-string block hash: vLLM sends 32-byte
	// sha256 digests.
	MaxHashBytes = 64
)

// maxBlockSize bounds block_size so a hostile value cannot make us allocate.
const maxBlockSize = 1 << 16

// Batch is one decoded ZMQ message of a worker's KV event publisher.
type Batch struct {
	// Topic is the first frame, e.g. "kv@10.0.0.1:8000@model".
	Topic string
	// Seq is the publisher's sequence number (vLLM starts at 0).
	Seq uint64
	// TS is the batch timestamp in seconds since the epoch.
	TS float64
	// Rank is data_parallel_rank; 0 when absent or nil.
	Rank int
	// Events are the events to apply, in order. Events of other KV cache
	// groups or media are left out and counted in Ignored.
	Events []kvindex.Event
	// Ignored counts events skipped on purpose: non-main KV cache groups
	// (group_idx != 0, or a kv_cache_spec_kind other than full or MLA
	// attention), media that are neither the GPU nor a CPU or disk tier
	// (see mediumOf), and unknown event types. CPU and disk events are
	// kept, with their kvindex.Medium.
	Ignored int
	// Blocks is the number of stored blocks in Events.
	Blocks int
}

// Decode decodes one 3-frame vLLM KV event message: topic, 8-byte
// big-endian sequence number, msgpack EventBatch. It accepts both
// encodings vLLM uses: msgspec array_like tagged tuples
// (["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
// lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
// kv_cache_spec_sliding_window]) and maps with a "type" key (newer vLLM,
// llm-d-inference-sim --use-vllm-map-event-format). Missing trailing fields
// take their defaults and extra fields are ignored.
//
// Engine block hashes may be msgpack integers (signed values are taken
// bitwise) or byte strings (vLLM's sha256 hashes), which become the xxh3-64
// of their bytes. Decode never panics and allocates nothing a length
// declared in the message asks for: it allocates only for values present
// in the payload, within the limits above ([MaxEventsPerBatch] and the
// others). Any malformed or over-limit input returns an error wrapping
// ErrMalformed, and the returned events do not alias frames.
func Decode(frames [][]byte) (Batch, error) {
	if len(frames) != 3 {
		return Batch{}, fmt.Errorf("%w: %d frames, want 3", ErrMalformed, len(frames))
	}
	if len(frames[1]) != 8 {
		return Batch{}, fmt.Errorf("%w: sequence frame of %d bytes, want 8", ErrMalformed, len(frames[1]))
	}
	if len(frames[0]) > maxTopicBytes {
		return Batch{}, fmt.Errorf("%w: topic of %d bytes, limit %d", ErrMalformed, len(frames[0]), maxTopicBytes)
	}
	b := Batch{Topic: string(frames[0]), Seq: binary.BigEndian.Uint64(frames[1])}
	if err := decodePayload(frames[2], &b); err != nil {
		return Batch{Topic: b.Topic, Seq: b.Seq}, err
	}
	return b, nil
}

// maxTopicBytes bounds the topic frame; vLLM's is "kv@<host>@<model>".
const maxTopicBytes = 4096

func decodePayload(p []byte, b *Batch) error {
	dc := decoder{mpReader: mpReader{b: p}}
	if err := dc.batch(b); err != nil {
		return err
	}
	if dc.left() != 0 {
		return dc.errf("%d trailing bytes", dc.left())
	}
	return nil
}

// decoder reads one EventBatch and counts what it has taken against the
// per-batch limits.
type decoder struct {
	mpReader
	blocks int // block hashes read, stored and removed
	tokens int // token ids read
}

func (dc *decoder) batch(b *Batch) error {
	cls, _, err := dc.peek()
	if err != nil {
		return err
	}
	switch cls {
	case clsArray:
		n, err := dc.length(cls)
		if err != nil {
			return err
		}
		if n < 2 {
			return dc.errf("batch array of %d fields, want ≥ 2", n)
		}
		if b.TS, err = dc.float(); err != nil {
			return err
		}
		if err := dc.events(b); err != nil {
			return err
		}
		if n >= 3 {
			if b.Rank, err = dc.rank(); err != nil {
				return err
			}
		}
		return dc.skip(n - 3)
	case clsMap:
		n, err := dc.length(cls)
		if err != nil {
			return err
		}
		sawEvents := false
		for range n {
			k, err := dc.str("map key", MaxStringBytes)
			if err != nil {
				return err
			}
			switch string(k) {
			case "ts":
				b.TS, err = dc.float()
			case "events":
				if sawEvents {
					return dc.errf("events given twice")
				}
				sawEvents = true
				err = dc.events(b)
			case "data_parallel_rank":
				b.Rank, err = dc.rank()
			default:
				err = dc.skip(1)
			}
			if err != nil {
				return err
			}
		}
		if !sawEvents {
			return dc.errf("batch map without events")
		}
		return nil
	}
	return dc.errf("batch is neither an array nor a map")
}
