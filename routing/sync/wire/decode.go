package wire

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// Minimal encoded sizes, to check a declared count against the bytes left
// before allocating: an item is at least its kind and a one-byte id; a
// Start at least 18 one-byte fields (id, endpoint length, dp rank, block
// size, block count, isl, overlap, decode blocks, three string lengths,
// ttl, total requests, osl, osl tokens, iat, max tokens, flags).
const (
	minItem  = 2
	minStart = 18
)

// maxInterned bounds the strings a Decoder keeps; past it, it starts over.
const maxInterned = 1024

// Decoder decodes messages like [Decode] and interns the strings that
// repeat from one message to the next (pools, replica ids, endpoints,
// tenants, models; not prefix ids, which are per session), so that
// decoding them allocates once. It keeps at most 1024 strings (512 KiB)
// and starts over when full. Its zero value is ready to use. A
// Decoder is not safe for concurrent use. The messages it returns share
// no memory with the input, with each other or with the Decoder, except
// interned strings (immutable).
type Decoder struct {
	strs map[string]string
}

// Decode decodes one whole message from b. It does not keep b. An error
// wraps [ErrMalformed], [ErrTooLarge] or [ErrVersion]; a message that does
// not decode costs no allocation but the error's.
func Decode(b []byte) (*Message, error) {
	return decode(b, nil)
}

// Decode decodes one whole message from b, as the package-level [Decode].
func (d *Decoder) Decode(b []byte) (*Message, error) {
	return decode(b, d)
}

func decode(b []byte, d *Decoder) (*Message, error) {
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("%w: message is %d bytes, limit %d", ErrTooLarge, len(b), MaxMessage)
	}
	// Pass 1: check everything, allocate nothing.
	check := reader{b: b}
	var scratch Message
	check.message(&scratch)
	if check.err != nil {
		return nil, check.err
	}
	// Pass 2: the same walk, into exactly sized storage.
	r := reader{b: b, fill: true, d: d}
	if check.blocks > 0 {
		r.arena = make([]uint64, check.blocks)
	}
	if check.stateBlocks > 0 {
		r.stateArena = make([]warmstate.Block, check.stateBlocks)
	}
	m := new(Message)
	r.message(m)
	if r.err != nil { // cannot happen: pass 1 read the same bytes
		return nil, r.err
	}
	return m, nil
}

// reader walks one message. The first error sticks: every later read
// returns zero values.
type reader struct {
	b   []byte
	off int
	err error
	// fill is false on the checking pass: nothing is allocated or stored
	// but counts.
	fill bool
	// d interns strings on the filling pass; nil: no interning.
	d *Decoder
	// blocks counts the block keys read so far in the message.
	blocks int
	// arena holds every block key of the message (filling pass).
	arena []uint64
	// stateBlocks and stateArena are the same for a state chunk's block
	// runs (state.go).
	stateBlocks int
	stateArena  []warmstate.Block
}

// fail records the first error, about the field that starts at byte at.
func (r *reader) fail(at int, sentinel error, format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("%w: %s at byte %d", sentinel, fmt.Sprintf(format, args...), at)
	}
}

func (r *reader) left() int { return len(r.b) - r.off }

func (r *reader) byte1(what string) byte {
	if r.err != nil {
		return 0
	}
	if r.left() < 1 {
		r.fail(r.off, ErrMalformed, "truncated %s", what)
		return 0
	}
	c := r.b[r.off]
	r.off++
	return c
}

func (r *reader) u64le(what string) uint64 {
	if r.err != nil {
		return 0
	}
	if r.left() < 8 {
		r.fail(r.off, ErrMalformed, "truncated %s", what)
		return 0
	}
	v := binary.LittleEndian.Uint64(r.b[r.off:])
	r.off += 8
	return v
}

func (r *reader) uvarint(what string) uint64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Uvarint(r.b[r.off:])
	if n <= 0 {
		r.fail(r.off, ErrMalformed, "truncated or overflowing varint (%s)", what)
		return 0
	}
	r.off += n
	return v
}

func (r *reader) varint(what string) int64 {
	if r.err != nil {
		return 0
	}
	v, n := binary.Varint(r.b[r.off:])
	if n <= 0 {
		r.fail(r.off, ErrMalformed, "truncated or overflowing varint (%s)", what)
		return 0
	}
	r.off += n
	return v
}

func (r *reader) u32(what string) uint32 {
	at := r.off
	v := r.uvarint(what)
	if v > math.MaxUint32 {
		r.fail(at, ErrMalformed, "%s %d out of range", what, v)
		return 0
	}
	return uint32(v)
}

func (r *reader) u16(what string) uint16 {
	at := r.off
	v := r.uvarint(what)
	if v > math.MaxUint16 {
		r.fail(at, ErrMalformed, "%s %d out of range", what, v)
		return 0
	}
	return uint16(v)
}

func (r *reader) i32(what string) int32 {
	at := r.off
	v := r.varint(what)
	if v < math.MinInt32 || v > math.MaxInt32 {
		r.fail(at, ErrMalformed, "%s %d out of range", what, v)
		return 0
	}
	return int32(v)
}

// count reads a count of things at least minEach bytes long, checked
// against limit and against the bytes left.
func (r *reader) count(what string, limit, minEach int) int {
	at := r.off
	v := r.uvarint(what)
	if r.err != nil {
		return 0
	}
	if v > uint64(limit) {
		r.fail(at, ErrTooLarge, "%s: %d, limit %d", what, v, limit)
		return 0
	}
	if int(v) > r.left()/minEach {
		r.fail(at, ErrMalformed, "%s: %d need at least %d bytes, %d left", what, v, int(v)*minEach, r.left())
		return 0
	}
	return int(v)
}

// bytes reads a length-prefixed byte string and returns it as a window of
// the input (not to be kept).
func (r *reader) bytes(what string, limit int) []byte {
	at := r.off
	v := r.uvarint(what)
	if r.err != nil {
		return nil
	}
	if v > uint64(limit) {
		r.fail(at, ErrTooLarge, "%s: %d bytes, limit %d", what, v, limit)
		return nil
	}
	if int(v) > r.left() {
		r.fail(at, ErrMalformed, "%s: %d bytes, %d left", what, v, r.left())
		return nil
	}
	b := r.b[r.off : r.off+int(v) : r.off+int(v)]
	r.off += int(v)
	return b
}

// str reads a string of at most limit bytes.
func (r *reader) str(what string, limit int) string {
	b := r.bytes(what, limit)
	if !r.fill || len(b) == 0 {
		return ""
	}
	return string(b)
}

// interned reads a string of at most limit bytes that repeats across
// messages (a pool, a replica, an endpoint, a tenant, a model) and
// interns it when the reader has a Decoder.
func (r *reader) interned(what string, limit int) string {
	return r.intern(r.bytes(what, limit))
}

// intern returns b as a string, interned when the reader has a Decoder
// ("" in the checking pass).
func (r *reader) intern(b []byte) string {
	if !r.fill || len(b) == 0 {
		return ""
	}
	if r.d == nil {
		return string(b)
	}
	if s, ok := r.d.strs[string(b)]; ok {
		return s
	}
	if r.d.strs == nil {
		r.d.strs = make(map[string]string)
	} else if len(r.d.strs) >= maxInterned {
		clear(r.d.strs)
	}
	s := string(b)
	r.d.strs[s] = s
	return s
}

func (r *reader) message(m *Message) {
	if len(r.b) == 0 {
		r.fail(r.off, ErrMalformed, "empty message")
		return
	}
	if v := r.byte1("version"); v != Version {
		r.fail(0, ErrVersion, "version %d, want %d", v, Version)
		return
	}
	m.Kind = Kind(r.byte1("kind"))
	m.Pool = r.interned("pool", MaxIDLen)
	m.Replica = r.interned("replica", MaxIDLen)
	m.Epoch = r.u64le("epoch")
	m.Seq = r.uvarint("seq")
	if r.err != nil {
		return
	}
	switch m.Kind {
	case KindBatch:
		r.batch(m)
	case KindSnapshot:
		r.snapshot(m)
	case KindHeartbeat:
		m.Heartbeat.InFlight = r.u32("in-flight")
		m.Heartbeat.Interval = r.u32("interval")
	case KindKVEvents:
		r.kvEvents(&m.KVEvents)
	case KindStateRequest:
		r.stateRequest(&m.StateRequest)
	case KindStateChunk:
		r.stateChunk(&m.StateChunk)
	default:
		r.fail(1, ErrMalformed, "unknown message kind %d", m.Kind)
		return
	}
	if r.err == nil && r.left() > 0 {
		r.fail(r.off, ErrMalformed, "%d trailing bytes", r.left())
	}
}

func (r *reader) batch(m *Message) {
	n := r.count("batch items", MaxItems, minItem)
	if n == 0 {
		return
	}
	if r.fill {
		m.Batch = make([]Item, n)
	}
	var scratch Item
	for i := 0; i < n && r.err == nil; i++ {
		it := &scratch
		if r.fill {
			it = &m.Batch[i]
		}
		at := r.off
		it.Kind = ItemKind(r.byte1("item kind"))
		switch it.Kind {
		case ItemStart:
			r.start(&it.Start)
		case ItemFirst, ItemEnd:
			it.ID = r.uvarint("item id")
		case ItemOutcome:
			r.outcome(&it.Outcome)
		default:
			r.fail(at, ErrMalformed, "batch item %d has unknown kind %d", i, it.Kind)
		}
	}
}

func (r *reader) snapshot(m *Message) {
	n := r.count("snapshot starts", MaxSnapshotStarts, minStart)
	if n == 0 {
		return
	}
	if r.fill {
		m.Snapshot = make([]Start, n)
	}
	var scratch Start
	for i := 0; i < n && r.err == nil; i++ {
		s := &scratch
		if r.fill {
			s = &m.Snapshot[i]
		}
		r.start(s)
	}
}

func (r *reader) start(s *Start) {
	s.ID = r.uvarint("start id")
	s.Endpoint = r.interned("endpoint", MaxStringLen)
	s.DPRank = r.i32("dp rank")
	s.BlockSize = r.u32("block size")
	at := r.off
	n := r.count("start blocks", MaxBlocks, 8)
	if r.err == nil && r.blocks+n > MaxTotalBlocks {
		r.fail(at, ErrTooLarge, "blocks in the message: over %d", MaxTotalBlocks)
	}
	if r.err != nil {
		return
	}
	if n > 0 {
		if r.fill {
			blocks := r.arena[r.blocks : r.blocks+n : r.blocks+n]
			for j := range blocks {
				blocks[j] = binary.LittleEndian.Uint64(r.b[r.off+8*j:])
			}
			s.Blocks = blocks
		}
		r.blocks += n
		r.off += 8 * n
	}
	s.ISL = r.u32("isl")
	s.Overlap = r.u32("overlap")
	s.ExpectedDecodeBlocks = r.u32("expected decode blocks")
	s.PrefixID = r.str("prefix id", MaxStringLen)
	s.Tenant = r.interned("tenant", MaxStringLen)
	s.Model = r.interned("model", MaxStringLen)
	s.TTL = r.u32("ttl")
	s.TotalRequests = r.u32("total requests")
	s.OSL = r.byte1("osl")
	s.OSLTokens = r.u32("osl tokens")
	s.IAT = r.byte1("iat")
	s.MaxTokens = r.u32("max tokens")
	at = r.off
	flags := r.byte1("start flags")
	if flags&^(flagPrefilled|flagPrefill) != 0 {
		r.fail(at, ErrMalformed, "unknown start flags %#x", flags)
	}
	s.Prefilled = flags&flagPrefilled != 0
	if flags&flagPrefill == 0 || r.err != nil {
		return
	}
	at = r.off
	pe := r.bytes("prefill endpoint", MaxStringLen)
	if r.err == nil && len(pe) == 0 {
		// Canonical: the bit is set only with a prefill endpoint.
		r.fail(at, ErrMalformed, "start flags announce an empty prefill endpoint")
	}
	s.PrefillEndpoint = r.intern(pe)
	s.PrefillDPRank = r.i32("prefill dp rank")
	s.PrefillCached = r.u32("prefill cached")
}

func (r *reader) outcome(o *Outcome) {
	o.ID = r.uvarint("outcome id")
	o.Endpoint = r.interned("endpoint", MaxStringLen)
	o.DPRank = r.i32("dp rank")
	o.Kind = r.byte1("outcome kind")
	o.Status = r.u16("status")
	o.TTFTMicros = r.u32("ttft")
	o.LatencyMicros = r.u32("latency")
	o.PromptTokens = r.i32("prompt tokens")
	o.CompletionTokens = r.i32("completion tokens")
	o.CachedTokens = r.i32("cached tokens")
	o.PrefixID = r.str("prefix id", MaxStringLen)
	o.Tenant = r.interned("tenant", MaxStringLen)
	o.Model = r.interned("model", MaxStringLen)
	o.Served = r.interned("served", MaxStringLen)
	o.BlockSize = r.u32("block size")
	o.ISL = r.u32("isl")
	o.Overlap = r.u32("overlap")
	o.QueuedPrefillTokens = r.uvarint("queued prefill tokens")
	o.OSL = r.byte1("osl")
}

func (r *reader) kvEvents(e *KVEvents) {
	e.Endpoint = r.interned("endpoint", MaxStringLen)
	p := r.bytes("kv-event payload", MaxPayload)
	if r.fill && len(p) > 0 {
		e.Payload = append([]byte(nil), p...)
	}
	e.Seq = r.uvarint("kv-event seq")
}
