package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/zeebo/xxh3"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// Errors returned by [Decode]. Every decoding failure wraps ErrMalformed.
var (
	// ErrMalformed means the message is not a vLLM KV event batch.
	ErrMalformed = errors.New("kvevents: malformed message")
	// ErrTokenCount means a BlockStored event's token_ids do not fill its
	// block_hashes × block_size exactly; it also wraps kvindex.ErrBlockSize.
	ErrTokenCount = errors.New("kvevents: token count does not match blocks × block size")
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
	// attention), media other than GPU, and unknown event types.
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
// of their bytes. Decode never panics; any malformed input returns an
// error wrapping ErrMalformed, and the returned events do not alias frames.
func Decode(frames [][]byte) (Batch, error) {
	if len(frames) != 3 {
		return Batch{}, fmt.Errorf("%w: %d frames, want 3", ErrMalformed, len(frames))
	}
	if len(frames[1]) != 8 {
		return Batch{}, fmt.Errorf("%w: sequence frame of %d bytes, want 8", ErrMalformed, len(frames[1]))
	}
	b := Batch{Topic: string(frames[0]), Seq: binary.BigEndian.Uint64(frames[1])}
	if err := decodePayload(frames[2], &b); err != nil {
		return Batch{Topic: b.Topic, Seq: b.Seq}, err
	}
	return b, nil
}

func decodePayload(p []byte, b *Batch) error {
	r := bytes.NewReader(p)
	d := msgpack.GetDecoder()
	defer msgpack.PutDecoder(d)
	d.Reset(r)
	dec := decoder{d: d, r: r}
	if err := dec.batch(b); err != nil {
		return err
	}
	if r.Len() != 0 {
		return dec.errf("%d trailing bytes", r.Len())
	}
	return nil
}

type decoder struct {
	d *msgpack.Decoder
	r *bytes.Reader
}

func (dc *decoder) errf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

func (dc *decoder) wrap(what string, err error) error {
	return fmt.Errorf("%w: %s: %v", ErrMalformed, what, err)
}

// msgpack format classes, from the first byte.
type class uint8

const (
	clsOther class = iota
	clsNil
	clsInt
	clsFloat
	clsStr
	clsBin
	clsArray
	clsMap
)

func classify(c byte) class {
	switch {
	case c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3):
		return clsInt
	case c >= 0x80 && c <= 0x8f, c == 0xde, c == 0xdf:
		return clsMap
	case c >= 0x90 && c <= 0x9f, c == 0xdc, c == 0xdd:
		return clsArray
	case c >= 0xa0 && c <= 0xbf, c >= 0xd9 && c <= 0xdb:
		return clsStr
	case c == 0xc0:
		return clsNil
	case c >= 0xc4 && c <= 0xc6:
		return clsBin
	case c == 0xca, c == 0xcb:
		return clsFloat
	}
	return clsOther
}

func (dc *decoder) peek() (class, byte, error) {
	c, err := dc.d.PeekCode()
	if err != nil {
		return clsOther, 0, dc.wrap("truncated", err)
	}
	return classify(c), c, nil
}

// length reads an array or map header and checks it against the bytes
// left, so hostile lengths cannot make us allocate.
func (dc *decoder) length(cls class) (int, error) {
	var n int
	var err error
	if cls == clsArray {
		n, err = dc.d.DecodeArrayLen()
	} else {
		n, err = dc.d.DecodeMapLen()
	}
	if err != nil {
		return 0, dc.wrap("length", err)
	}
	if n < 0 || n > dc.r.Len() {
		return 0, dc.errf("length %d exceeds the %d bytes left", n, dc.r.Len())
	}
	return n, nil
}

// skip skips n values without recursion, so deeply nested input cannot
// exhaust the stack.
func (dc *decoder) skip(n int) error {
	for n > 0 {
		n--
		cls, _, err := dc.peek()
		if err != nil {
			return err
		}
		if cls == clsArray || cls == clsMap {
			l, err := dc.length(cls)
			if err != nil {
				return err
			}
			if cls == clsMap {
				l *= 2
			}
			n += l
			continue
		}
		if err := dc.d.Skip(); err != nil {
			return dc.wrap("skip", err)
		}
	}
	return nil
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
			k, err := dc.key()
			if err != nil {
				return err
			}
			switch k {
			case "ts":
				b.TS, err = dc.float()
			case "events":
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

func (dc *decoder) key() (string, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return "", err
	}
	if cls != clsStr {
		return "", dc.errf("map key is not a string")
	}
	s, err := dc.d.DecodeString()
	if err != nil {
		return "", dc.wrap("key", err)
	}
	return s, nil
}

func (dc *decoder) float() (float64, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return 0, err
	}
	switch cls {
	case clsFloat:
		f, err := dc.d.DecodeFloat64()
		if err != nil {
			return 0, dc.wrap("float", err)
		}
		return f, nil
	case clsInt:
		i, err := dc.d.DecodeInt64()
		if err != nil {
			return 0, dc.wrap("ts", err)
		}
		return float64(i), nil
	}
	return 0, dc.errf("timestamp is not a number")
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
	cls, c, err := dc.peek()
	if err != nil {
		return 0, false, err
	}
	switch cls {
	case clsNil:
		return 0, false, dc.skip(1)
	case clsInt:
		if c == 0xcf {
			u, err := dc.d.DecodeUint64()
			if err != nil {
				return 0, false, dc.wrap("int", err)
			}
			if u > math.MaxInt64 {
				return 0, false, dc.errf("integer %d out of range", u)
			}
			return int64(u), true, nil
		}
		i, err := dc.d.DecodeInt64()
		if err != nil {
			return 0, false, dc.wrap("int", err)
		}
		return i, true, nil
	}
	return 0, false, dc.errf("expected an integer or nil")
}

// optString reads a string or nil.
func (dc *decoder) optString() (string, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return "", err
	}
	switch cls {
	case clsNil:
		return "", dc.skip(1)
	case clsStr:
		s, err := dc.d.DecodeString()
		if err != nil {
			return "", dc.wrap("string", err)
		}
		return s, nil
	}
	return "", dc.errf("expected a string or nil")
}

// hash reads an engine block hash: an integer (taken bitwise), or bytes or
// a string (xxh3-64 of the bytes). ok is false for nil.
func (dc *decoder) hash() (h uint64, ok bool, err error) {
	cls, c, err := dc.peek()
	if err != nil {
		return 0, false, err
	}
	switch cls {
	case clsNil:
		return 0, false, dc.skip(1)
	case clsInt:
		if c == 0xcf || c <= 0x7f || (c >= 0xcc && c <= 0xce) {
			u, err := dc.d.DecodeUint64()
			if err != nil {
				return 0, false, dc.wrap("hash", err)
			}
			return u, true, nil
		}
		i, err := dc.d.DecodeInt64()
		if err != nil {
			return 0, false, dc.wrap("hash", err)
		}
		return uint64(i), true, nil
	case clsBin, clsStr:
		var bs []byte
		if cls == clsBin {
			bs, err = dc.d.DecodeBytes()
		} else {
			var s string
			s, err = dc.d.DecodeString()
			bs = []byte(s)
		}
		if err != nil {
			return 0, false, dc.wrap("hash", err)
		}
		return xxh3.Hash(bs), true, nil
	}
	return 0, false, dc.errf("block hash is neither an integer nor bytes")
}

func (dc *decoder) hashes(dst []uint64) ([]uint64, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return nil, err
	}
	if cls == clsNil {
		return dst, dc.skip(1)
	}
	if cls != clsArray {
		return nil, dc.errf("block_hashes is not an array")
	}
	n, err := dc.length(cls)
	if err != nil {
		return nil, err
	}
	for range n {
		h, ok, err := dc.hash()
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, dc.errf("nil block hash")
		}
		dst = append(dst, h)
	}
	return dst, nil
}

func (dc *decoder) tokens() ([]uint32, error) {
	cls, _, err := dc.peek()
	if err != nil {
		return nil, err
	}
	if cls == clsNil {
		return nil, dc.skip(1)
	}
	if cls != clsArray {
		return nil, dc.errf("token_ids is not an array")
	}
	n, err := dc.length(cls)
	if err != nil {
		return nil, err
	}
	toks := make([]uint32, n)
	for i := range toks {
		cls, c, err := dc.peek()
		if err != nil {
			return nil, err
		}
		if cls != clsInt {
			// Eagle bigram pairs and other shapes are not token ids.
			return nil, dc.errf("token id %d is not an integer", i)
		}
		if c <= 0x7f { // positive fixint: the common case, no decoder call
			_, _ = dc.r.ReadByte()
			toks[i] = uint32(c)
			continue
		}
		v, err := dc.d.DecodeInt64()
		if err != nil {
			return nil, dc.wrap("token id", err)
		}
		if v < 0 || v > math.MaxUint32 {
			return nil, dc.errf("token id %d out of range", v)
		}
		toks[i] = uint32(v)
	}
	return toks, nil
}

// rawEvent holds the fields of one event before it becomes a kvindex.Event.
type rawEvent struct {
	typ       string
	hashes    []uint64
	parent    uint64
	hasParent bool
	tokens    []uint32
	blockSize int64
	loraID    int64
	hasLoRAID bool
	loraName  string
	medium    string
	groupIdx  int64
	specKind  string
}

// Field order of msgspec's array_like encoding, after the tag
// (vllm/distributed/kv_events.py).
var (
	storedFields  = []string{"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"}
	removedFields = []string{"block_hashes", "medium", "group_idx"}
)

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
		if ev.typ, err = dc.key(); err != nil {
			return err
		}
		var names []string
		switch ev.typ {
		case "BlockStored":
			names = storedFields
		case "BlockRemoved":
			names = removedFields
		}
		for i := 1; i < n; i++ {
			name := ""
			if i-1 < len(names) {
				name = names[i-1]
			}
			if err := dc.field(ev, name); err != nil {
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
			k, err := dc.key()
			if err != nil {
				return err
			}
			if k == "type" {
				if ev.typ, err = dc.key(); err != nil {
					return err
				}
				continue
			}
			if err := dc.field(ev, k); err != nil {
				return err
			}
		}
		return nil
	}
	return dc.errf("event is neither an array nor a map")
}

func (dc *decoder) field(ev *rawEvent, name string) error {
	var err error
	switch name {
	case "block_hashes":
		ev.hashes, err = dc.hashes(ev.hashes[:0])
	case "parent_block_hash":
		ev.parent, ev.hasParent, err = dc.hash()
	case "token_ids":
		ev.tokens, err = dc.tokens()
	case "block_size":
		ev.blockSize, _, err = dc.optInt()
	case "lora_id":
		ev.loraID, ev.hasLoRAID, err = dc.optInt()
	case "medium":
		ev.medium, err = dc.optString()
	case "lora_name":
		ev.loraName, err = dc.optString()
	case "group_idx":
		ev.groupIdx, _, err = dc.optInt()
	case "kv_cache_spec_kind":
		ev.specKind, err = dc.optString()
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
	k := strings.ToLower(ev.specKind)
	return k == "" || strings.Contains(k, "full") || strings.Contains(k, "mla")
}

// gpuMedium reports whether an event is about the device KV cache.
func (ev *rawEvent) gpuMedium() bool {
	switch strings.ToUpper(ev.medium) {
	case "", "GPU", "DEVICE":
		return true
	}
	return false
}

func (b *Batch) add(ev *rawEvent) error {
	switch ev.typ {
	case "AllBlocksCleared":
		b.Events = append(b.Events, kvindex.Event{Kind: kvindex.Cleared})
		return nil
	case "BlockRemoved":
		if !ev.mainGroup() || !ev.gpuMedium() {
			b.Ignored++
			return nil
		}
		b.Events = append(b.Events, kvindex.Event{Kind: kvindex.Removed, RemovedHashes: ev.hashes})
		return nil
	case "BlockStored":
	default:
		b.Ignored++
		return nil
	}
	if !ev.mainGroup() || !ev.gpuMedium() {
		b.Ignored++
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
		LoRA:      ev.loraName,
		Blocks:    make([]kvindex.StoredBlock, len(ev.hashes)),
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
