package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"

	"github.com/zeebo/xxh3"

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

func (dc *decoder) rank() (int, error) {
	v, ok, err := dc.optInt()
	if err != nil {
		return 0, err
	}
	if !ok {
		return 0, nil
	}
	if v < 0 || v > math.MaxInt32 {
		return 0, dc.errf("data_parallel_rank %d out of range", v)
	}
	return int(v), nil
}

// optInt reads an integer or nil.
func (dc *decoder) optInt() (int64, bool, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return 0, false, err
	}
	switch cls {
	case clsNil:
		dc.off++
		return 0, false, nil
	case clsInt:
		i, err := dc.int()
		return i, err == nil, err
	}
	return 0, false, dc.errf("expected an integer or nil")
}

// optString reads a string of at most MaxStringBytes, or nil (as an empty
// view). The result aliases the payload.
func (dc *decoder) optString(what string) ([]byte, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return nil, err
	}
	switch cls {
	case clsNil:
		dc.off++
		return nil, nil
	case clsStr:
		return dc.bytesOf(what, MaxStringBytes)
	}
	return nil, dc.errf("%s is neither a string nor nil", what)
}

// hash reads an engine block hash: an integer (taken bitwise), or bytes or
// a string of at most MaxHashBytes (xxh3-64 of the bytes). ok is false for
// nil.
func (dc *decoder) hash() (h uint64, ok bool, err error) {
	cls, c, err := dc.peek()
	if err != nil {
		return 0, false, err
	}
	switch cls {
	case clsNil:
		dc.off++
		return 0, false, nil
	case clsInt:
		if c <= 0x7f {
			dc.off++
			return uint64(c), true, nil
		}
		u, _, err := dc.integer()
		return u, err == nil, err
	case clsBin, clsStr:
		bs, err := dc.bytesOf("block hash", MaxHashBytes)
		if err != nil {
			return 0, false, err
		}
		return xxh3.Hash(bs), true, nil
	}
	return 0, false, dc.errf("block hash is neither an integer nor bytes")
}

func (dc *decoder) hashes() ([]uint64, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return nil, err
	}
	if cls == clsNil {
		dc.off++
		return nil, nil
	}
	if cls != clsArray {
		return nil, dc.errf("block_hashes is not an array")
	}
	n, err := dc.length(cls)
	if err != nil {
		return nil, err
	}
	if n > MaxBlocksPerEvent {
		return nil, dc.errf("%d block hashes in one event, limit %d", n, MaxBlocksPerEvent)
	}
	if dc.blocks += n; dc.blocks > MaxBlocksPerBatch {
		return nil, dc.errf("more than %d block hashes in one batch", MaxBlocksPerBatch)
	}
	if n == 0 {
		return nil, nil
	}
	out := make([]uint64, n)
	for i := range out {
		h, ok, err := dc.hash()
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, dc.errf("nil block hash")
		}
		out[i] = h
	}
	return out, nil
}

func (dc *decoder) tokenIDs() ([]uint32, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return nil, err
	}
	if cls == clsNil {
		dc.off++
		return nil, nil
	}
	if cls != clsArray {
		return nil, dc.errf("token_ids is not an array")
	}
	n, err := dc.length(cls)
	if err != nil {
		return nil, err
	}
	if n > MaxTokensPerEvent {
		return nil, dc.errf("%d token ids in one event, limit %d", n, MaxTokensPerEvent)
	}
	if dc.tokens += n; dc.tokens > MaxTokensPerBatch {
		return nil, dc.errf("more than %d token ids in one batch", MaxTokensPerBatch)
	}
	toks := make([]uint32, n)
	p := dc.b
	for i := range toks {
		// Fast paths for the unsigned formats tokens come in; the length
		// check above guarantees a first byte per remaining element, not
		// the bytes after it.
		off := dc.off
		if off >= len(p) {
			return nil, dc.errf("truncated")
		}
		switch c := p[off]; {
		case c <= 0x7f: // positive fixint
			toks[i] = uint32(c)
			dc.off = off + 1
			continue
		case c == 0xcd && off+3 <= len(p): // uint16
			toks[i] = uint32(binary.BigEndian.Uint16(p[off+1:]))
			dc.off = off + 3
			continue
		case c == 0xce && off+5 <= len(p): // uint32
			toks[i] = binary.BigEndian.Uint32(p[off+1:])
			dc.off = off + 5
			continue
		case classes[c] != clsInt:
			// Eagle bigram pairs and other shapes are not token ids.
			return nil, dc.errf("token id %d is not an integer", i)
		}
		v, err := dc.int()
		if err != nil {
			return nil, err
		}
		if v < 0 || v > math.MaxUint32 {
			return nil, dc.errf("token id %d out of range", v)
		}
		toks[i] = uint32(v)
	}
	return toks, nil
}

// Event types.
type evType uint8

const (
	evOther evType = iota
	evStored
	evRemoved
	evCleared
)

// rawEvent holds the fields of one event before it becomes a kvindex.Event.
// Its byte slices alias the payload.
type rawEvent struct {
	typ       evType
	hashes    []uint64
	parent    uint64
	hasParent bool
	tokens    []uint32
	blockSize int64
	loraID    int64
	hasLoRAID bool
	loraName  []byte
	medium    []byte
	groupIdx  int64
	specKind  []byte
}

// Field order of msgspec's array_like encoding, after the tag
// (vllm/distributed/kv_events.py).
const (
	fOther = iota
	fBlockHashes
	fParent
	fTokenIDs
	fBlockSize
	fLoRAID
	fMedium
	fLoRAName
	fGroupIdx
	fSpecKind
)

var (
	storedFields  = [...]uint8{fBlockHashes, fParent, fTokenIDs, fBlockSize, fLoRAID, fMedium, fLoRAName, fOther /* extra_keys */, fGroupIdx, fSpecKind, fOther /* kv_cache_spec_sliding_window */}
	removedFields = [...]uint8{fBlockHashes, fMedium, fGroupIdx}
)

func fieldOf(name []byte) uint8 {
	switch string(name) {
	case "block_hashes":
		return fBlockHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokenIDs
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoRAID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoRAName
	case "group_idx":
		return fGroupIdx
	case "kv_cache_spec_kind":
		return fSpecKind
	}
	return fOther
}

func typeOf(tag []byte) evType {
	switch string(tag) {
	case "BlockStored":
		return evStored
	case "BlockRemoved":
		return evRemoved
	case "AllBlocksCleared":
		return evCleared
	}
	return evOther
}

func (dc *decoder) events(b *Batch) error {
	cls, _, err := dc.peek()
	if err != nil {
		return err
	}
	if cls != clsArray {
		return dc.errf("events is not an array")
	}
	n, err := dc.length(cls)
	if err != nil {
		return err
	}
	if n > MaxEventsPerBatch {
		return dc.errf("%d events in one batch, limit %d", n, MaxEventsPerBatch)
	}
	b.Events = make([]kvindex.Event, 0, n)
	for i := range n {
		var ev rawEvent
		if err := dc.event(&ev); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
		if err := b.add(&ev); err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
	}
	return nil
}

func (dc *decoder) event(ev *rawEvent) error {
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
		if n < 1 {
			return dc.errf("empty event array")
		}
		tag, err := dc.str("event tag", MaxStringBytes)
		if err != nil {
			return err
		}
		ev.typ = typeOf(tag)
		var names []uint8
		switch ev.typ {
		case evStored:
			names = storedFields[:]
		case evRemoved:
			names = removedFields[:]
		}
		for i := 1; i < n; i++ {
			f := uint8(fOther)
			if i-1 < len(names) {
				f = names[i-1]
			}
			if err := dc.field(ev, f); err != nil {
				return err
			}
		}
		return nil
	case clsMap:
		n, err := dc.length(cls)
		if err != nil {
			return err
		}
		for range n {
			k, err := dc.str("map key", MaxStringBytes)
			if err != nil {
				return err
			}
			if string(k) == "type" {
				tag, err := dc.str("event type", MaxStringBytes)
				if err != nil {
					return err
				}
				ev.typ = typeOf(tag)
				continue
			}
			if err := dc.field(ev, fieldOf(k)); err != nil {
				return err
			}
		}
		return nil
	}
	return dc.errf("event is neither an array nor a map")
}

func (dc *decoder) field(ev *rawEvent, f uint8) error {
	var err error
	switch f {
	case fBlockHashes:
		ev.hashes, err = dc.hashes()
	case fParent:
		ev.parent, ev.hasParent, err = dc.hash()
	case fTokenIDs:
		ev.tokens, err = dc.tokenIDs()
	case fBlockSize:
		ev.blockSize, _, err = dc.optInt()
	case fLoRAID:
		ev.loraID, ev.hasLoRAID, err = dc.optInt()
	case fMedium:
		ev.medium, err = dc.optString("medium")
	case fLoRAName:
		ev.loraName, err = dc.optString("lora_name")
	case fGroupIdx:
		ev.groupIdx, _, err = dc.optInt()
	case fSpecKind:
		ev.specKind, err = dc.optString("kv_cache_spec_kind")
	default:
		err = dc.skip(1)
	}
	return err
}

// mainGroup reports whether an event belongs to the main (full or MLA
// attention, group 0) KV cache group.
func (ev *rawEvent) mainGroup() bool {
	if ev.groupIdx != 0 {
		return false
	}
	k := ev.specKind
	return len(k) == 0 || containsFold(k, "full") || containsFold(k, "mla")
}

// containsFold reports whether s contains the lower-case ASCII word sub,
// ignoring ASCII case.
func containsFold(s []byte, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if bytes.EqualFold(s[i:i+len(sub)], []byte(sub)) {
			return true
		}
	}
	return false
}

// mediumOf maps an event's medium string to a tier, ignoring ASCII case;
// ok is false for media kvbandit does not score (remote or shared stores).
// The strings are those publishers send: vLLM "GPU" (nil when offloading is
// off) and its OffloadingConnector's "CPU"; SGLang HiCache and Dynamo KVBM
// "CPU_TIER1" (host memory) and "CPU_TIER2" (disk); llm-d's lower-case
// "gpu", "cpu"; "DEVICE", "CPU_PINNED", "DISK", "NVME" and "STORAGE" as other
// routers read them.
func mediumOf(m []byte) (kvindex.Medium, bool) {
	if len(m) == 0 {
		return kvindex.MediumGPU, true
	}
	for _, c := range mediumNames {
		if bytes.EqualFold(m, []byte(c.name)) {
			return c.medium, true
		}
	}
	return 0, false
}

var mediumNames = [...]struct {
	name   string
	medium kvindex.Medium
}{
	{"GPU", kvindex.MediumGPU},
	{"DEVICE", kvindex.MediumGPU},
	{"CPU", kvindex.MediumCPU},
	{"CPU_TIER1", kvindex.MediumCPU},
	{"CPU_PINNED", kvindex.MediumCPU},
	{"CPU_TIER2", kvindex.MediumDisk},
	{"DISK", kvindex.MediumDisk},
	{"NVME", kvindex.MediumDisk},
	{"STORAGE", kvindex.MediumDisk},
}

func (b *Batch) add(ev *rawEvent) error {
	switch ev.typ {
	case evCleared:
		b.Events = append(b.Events, kvindex.Event{Kind: kvindex.Cleared})
		return nil
	case evRemoved:
		m, ok := mediumOf(ev.medium)
		if !ev.mainGroup() || !ok {
			b.Ignored++
			return nil
		}
		b.Events = append(b.Events, kvindex.Event{Kind: kvindex.Removed, RemovedHashes: ev.hashes, Medium: m})
		return nil
	case evStored:
	default:
		b.Ignored++
		return nil
	}
	m, ok := mediumOf(ev.medium)
	if !ev.mainGroup() || !ok {
		b.Ignored++
		return nil
	}
	if m != kvindex.MediumGPU && len(ev.tokens) == 0 {
		// Location only: vLLM's OffloadingConnector names offloaded blocks
		// by their GPU block hashes, with no tokens, no parent and a block
		// size of 0 (newer vLLM) or the offloaded block size.
		if ev.blockSize < 0 || ev.blockSize > maxBlockSize {
			return fmt.Errorf("%w: block_size %d", ErrMalformed, ev.blockSize)
		}
		out := kvindex.Event{Kind: kvindex.Stored, BlockSize: int(ev.blockSize), Medium: m, Blocks: make([]kvindex.StoredBlock, len(ev.hashes))}
		for i, h := range ev.hashes {
			out.Blocks[i] = kvindex.StoredBlock{EngineHash: h}
		}
		b.Events = append(b.Events, out)
		b.Blocks += len(ev.hashes)
		return nil
	}
	if ev.blockSize <= 0 || ev.blockSize > maxBlockSize {
		return fmt.Errorf("%w: block_size %d", ErrMalformed, ev.blockSize)
	}
	bs := int(ev.blockSize)
	if len(ev.tokens) != len(ev.hashes)*bs {
		return fmt.Errorf("%w: %w (%w): %d token ids for %d blocks of %d",
			ErrMalformed, ErrTokenCount, kvindex.ErrBlockSize, len(ev.tokens), len(ev.hashes), bs)
	}
	out := kvindex.Event{
		Kind:      kvindex.Stored,
		BlockSize: bs,
		// A parent of 0 means none: llm-d-inference-sim (and llm-d's
		// adapters) send 0 for a first block in the array encoding, where
		// vLLM sends nil; a real hash of 0 has probability 2^-64.
		HasParent: ev.hasParent && ev.parent != 0,
		Parent:    ev.parent,
		LoRA:      string(ev.loraName),
		Blocks:    make([]kvindex.StoredBlock, len(ev.hashes)),
		Medium:    m,
	}
	if out.LoRA == "" && ev.hasLoRAID {
		// Old vLLM sends only the adapter's integer id.
		out.LoRA = strconv.FormatInt(ev.loraID, 10)
	}
	for i, h := range ev.hashes {
		out.Blocks[i] = kvindex.StoredBlock{EngineHash: h, Tokens: ev.tokens[i*bs : (i+1)*bs : (i+1)*bs]}
	}
	b.Events = append(b.Events, out)
	b.Blocks += len(ev.hashes)
	return nil
}
