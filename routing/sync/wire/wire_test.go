package wire_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"maps"
	"math"
	"reflect"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// envelope returns a message's first bytes: version 1, kind, pool "p",
// replica "r", epoch 7, seq 1.
func envelope(kind wire.Kind) []byte {
	b := []byte{wire.Version, byte(kind), 1, 'p', 1, 'r'}
	b = binary.LittleEndian.AppendUint64(b, 7)
	return binary.AppendUvarint(b, 1)
}

func blocks(n int, seed uint64) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = seed*0x9e3779b97f4a7c15 + uint64(i)*0xbf58476d1ce4e5b9
	}
	return out
}

func fullStart(id uint64, nblocks int) wire.Start {
	return wire.Start{
		ID: id, Endpoint: "10.0.0.1:8000", DPRank: -1, BlockSize: 16,
		Blocks: blocks(nblocks, id), ISL: 2048, Overlap: 3, ExpectedDecodeBlocks: 9,
		PrefixID: "session-42", Tenant: "acme", Model: "llama-3-8b", TTL: 30000,
		TotalRequests: 12, OSL: 2, OSLTokens: 700, IAT: 1, MaxTokens: 1024,
	}
}

func fullOutcome(id uint64) wire.Outcome {
	return wire.Outcome{
		ID: id, Endpoint: "10.0.0.2:8000", DPRank: 3, Kind: 1, Status: 503,
		TTFTMicros: 120000, LatencyMicros: 4_000_000, PromptTokens: 2048,
		CompletionTokens: -1, CachedTokens: -1, PrefixID: "s", Tenant: "t", Model: "m",
		Served: "10.0.0.3:8000", BlockSize: 16, ISL: 2048, Overlap: 5, QueuedPrefillTokens: 8192, OSL: 3,
	}
}

// validMessages returns one or more valid messages of every kind, with
// extreme values.
func validMessages() map[string]*wire.Message {
	extreme := wire.Start{
		ID: math.MaxUint64, Endpoint: "\xff\xfe not utf-8", DPRank: math.MinInt32,
		BlockSize: math.MaxUint32, Blocks: []uint64{0, math.MaxUint64}, ISL: math.MaxUint32,
		Overlap: math.MaxUint32, ExpectedDecodeBlocks: math.MaxUint32, PrefixID: "\x00",
		TTL: math.MaxUint32, TotalRequests: math.MaxUint32, OSL: 255, OSLTokens: math.MaxUint32, IAT: 255,
		MaxTokens: math.MaxUint32, Prefilled: true,
	}
	prefilled := fullStart(9, 4)
	prefilled.Prefilled = true
	// Disaggregated starts (flags bit 1): one prefilled, one extreme.
	disagg := fullStart(10, 6)
	disagg.PrefillEndpoint, disagg.PrefillDPRank, disagg.PrefillCached = "10.0.1.1:8000", -1, 512
	disaggDone := disagg
	disaggDone.ID, disaggDone.Prefilled, disaggDone.PrefillDPRank = 11, true, 2
	disaggExtreme := extreme
	disaggExtreme.PrefillEndpoint, disaggExtreme.PrefillDPRank, disaggExtreme.PrefillCached = "\xff", math.MinInt32, math.MaxUint32
	msgs := map[string]*wire.Message{
		"batch-pd": {
			Kind: wire.KindBatch, Pool: "default", Replica: "r-pd", Epoch: 12, Seq: 4,
			Batch: []wire.Item{wire.StartItem(disagg), wire.StartItem(fullStart(12, 2)), wire.FirstItem(10), wire.StartItem(disaggDone), wire.StartItem(disaggExtreme)},
		},
		"snapshot-pd": {Kind: wire.KindSnapshot, Pool: "default", Replica: "r-pd", Epoch: 12, Seq: 5, Snapshot: []wire.Start{disagg, fullStart(13, 1), disaggDone}},
		"batch": {
			Kind: wire.KindBatch, Pool: "default", Replica: "kvbandit-7f9c-abc", Epoch: 0xdeadbeefcafef00d, Seq: 1,
			Batch: []wire.Item{
				wire.StartItem(fullStart(1, 8)),
				wire.FirstItem(1),
				wire.StartItem(wire.Start{ID: 2, DPRank: -1}),
				wire.EndItem(1),
				wire.OutcomeItem(fullOutcome(1)),
				wire.StartItem(extreme),
				wire.OutcomeItem(wire.Outcome{ID: math.MaxUint64, DPRank: math.MaxInt32, Kind: 255, Status: math.MaxUint16,
					TTFTMicros: math.MaxUint32, LatencyMicros: math.MaxUint32, PromptTokens: math.MinInt32,
					CompletionTokens: math.MaxInt32, CachedTokens: 0, Served: "\xff", BlockSize: math.MaxUint32,
					ISL: math.MaxUint32, Overlap: math.MaxUint32, QueuedPrefillTokens: math.MaxUint64, OSL: 255}),
			},
		},
		"batch-empty": {Kind: wire.KindBatch, Pool: "p", Replica: "r", Epoch: 1, Seq: math.MaxUint64},
		"snapshot": {
			Kind: wire.KindSnapshot, Pool: "default", Replica: "kvbandit-7f9c-abc", Epoch: 3, Seq: 77,
			Snapshot: []wire.Start{fullStart(5, 3), prefilled, extreme, {}},
		},
		"snapshot-empty": {Kind: wire.KindSnapshot},
		"heartbeat":      {Kind: wire.KindHeartbeat, Pool: "default", Replica: "r1", Epoch: 5, Seq: 1000, Heartbeat: wire.Heartbeat{InFlight: 12, Interval: 500}},
		"heartbeat-max":  {Kind: wire.KindHeartbeat, Heartbeat: wire.Heartbeat{InFlight: math.MaxUint32, Interval: math.MaxUint32}},
		"kvevents": {
			Kind: wire.KindKVEvents, Pool: "default", Replica: "r2", Epoch: 9, Seq: 3,
			KVEvents: wire.KVEvents{Endpoint: "10.0.0.3:8000", Payload: []byte{0x93, 0xcb, 0x41, 0xd9, 0x00, 0x91, 0x92}, Seq: 1 << 40},
		},
		"kvevents-empty": {Kind: wire.KindKVEvents, KVEvents: wire.KVEvents{Endpoint: "e"}},
	}
	maps.Copy(msgs, validStateMessages())
	return msgs
}

func encode(t testing.TB, m *wire.Message) []byte {
	t.Helper()
	b, err := wire.Append(nil, m)
	if err != nil {
		t.Fatalf("Append: %v", err)
	}
	return b
}

func TestRoundTrip(t *testing.T) {
	var d wire.Decoder
	for name, m := range validMessages() {
		t.Run(name, func(t *testing.T) {
			b := encode(t, m)
			got, err := wire.Decode(b)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if !reflect.DeepEqual(got, m) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, m)
			}
			got, err = d.Decode(b)
			if err != nil {
				t.Fatalf("Decoder.Decode: %v", err)
			}
			if !reflect.DeepEqual(got, m) {
				t.Fatalf("round trip through a Decoder:\n got %+v\nwant %+v", got, m)
			}
			// Append appends: a prefix in dst is kept.
			b2, err := wire.Append([]byte("xyz"), m)
			if err != nil || !bytes.Equal(b2[:3], []byte("xyz")) || !bytes.Equal(b2[3:], b) {
				t.Fatalf("Append after a prefix: %q, %v", b2, err)
			}
		})
	}
}

// TestAppendIgnoresOtherBodies: only the body of m.Kind is written.
func TestAppendIgnoresOtherBodies(t *testing.T) {
	m := &wire.Message{Kind: wire.KindHeartbeat, Heartbeat: wire.Heartbeat{InFlight: 1},
		Batch: []wire.Item{wire.EndItem(1)}, Snapshot: []wire.Start{{}}, KVEvents: wire.KVEvents{Endpoint: "x"}}
	got, err := wire.Decode(encode(t, m))
	if err != nil {
		t.Fatal(err)
	}
	want := &wire.Message{Kind: wire.KindHeartbeat, Heartbeat: wire.Heartbeat{InFlight: 1}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
}

func TestItemDecisionID(t *testing.T) {
	for _, c := range []struct {
		it   wire.Item
		want uint64
	}{
		{wire.StartItem(wire.Start{ID: 1}), 1},
		{wire.FirstItem(2), 2},
		{wire.EndItem(3), 3},
		{wire.OutcomeItem(wire.Outcome{ID: 4}), 4},
	} {
		if got := c.it.DecisionID(); got != c.want {
			t.Errorf("%v item: DecisionID %d, want %d", c.it.Kind, got, c.want)
		}
	}
}

// TestDecodedOwnsMemory: a decoded message does not alias the input, and
// one Start's Blocks cannot grow into the next one's.
func TestDecodedOwnsMemory(t *testing.T) {
	m := validMessages()["snapshot"]
	b := encode(t, m)
	got, err := wire.Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	for i := range b {
		b[i] = 0xAA
	}
	_ = append(got.Snapshot[0].Blocks, 1, 2, 3)
	if !reflect.DeepEqual(got, m) {
		t.Fatalf("the decoded message changed:\n got %+v\nwant %+v", got, m)
	}
	k := validMessages()["kvevents"]
	b = encode(t, k)
	got, err = wire.Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	clear(b)
	if !reflect.DeepEqual(got, k) {
		t.Fatalf("the decoded payload aliases the input: %+v", got.KVEvents)
	}
}

// TestDecoderInterns: a Decoder returns the same string memory for an
// endpoint repeated across messages; the package-level Decode does not
// need to.
func TestDecoderInterns(t *testing.T) {
	var d wire.Decoder
	b := encode(t, validMessages()["batch"])
	m1, err := d.Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	m2, err := d.Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	s1, s2 := m1.Batch[0].Start, m2.Batch[0].Start
	for _, p := range [][2]string{{m1.Pool, m2.Pool}, {m1.Replica, m2.Replica}, {s1.Endpoint, s2.Endpoint}, {s1.Tenant, s2.Tenant}, {s1.Model, s2.Model}} {
		if unsafe.StringData(p[0]) != unsafe.StringData(p[1]) {
			t.Errorf("%q was not interned", p[0])
		}
	}
}

func TestAppendRejects(t *testing.T) {
	for _, c := range []struct {
		name string
		m    *wire.Message
		want error
	}{
		{"kind 0", &wire.Message{}, wire.ErrMalformed},
		{"kind 7", &wire.Message{Kind: 7}, wire.ErrMalformed},
		{"item kind 0", &wire.Message{Kind: wire.KindBatch, Batch: []wire.Item{{}}}, wire.ErrMalformed},
		{"item kind 5", &wire.Message{Kind: wire.KindBatch, Batch: []wire.Item{wire.EndItem(1), {Kind: 5}}}, wire.ErrMalformed},
	} {
		dst := []byte("keep")
		out, err := wire.Append(dst, c.m)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: err %v, want %v", c.name, err, c.want)
		}
		if string(out) != "keep" {
			t.Errorf("%s: dst became %q", c.name, out)
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	valid := encode(t, validMessages()["heartbeat"])
	withVersion := func(v byte) []byte { b := bytes.Clone(valid); b[0] = v; return b }
	withKind := func(k byte) []byte { b := bytes.Clone(valid); b[1] = k; return b }
	start := func(mut func(b []byte) []byte) []byte {
		// A snapshot of one minimal start, with the tail (ttl, session
		// hints, flags) given by mut.
		b := append(envelope(wire.KindSnapshot), 1)
		b = append(b, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) // id .. model
		return mut(b)
	}
	for _, c := range []struct {
		name string
		b    []byte
		want error
	}{
		{"empty", nil, wire.ErrMalformed},
		{"version 0", withVersion(0), wire.ErrVersion},
		{"version 2", withVersion(2), wire.ErrVersion},
		{"version only 2", []byte{2}, wire.ErrVersion},
		{"kind 0", withKind(0), wire.ErrMalformed},
		{"kind 7", withKind(7), wire.ErrMalformed},
		{"kind 255", withKind(255), wire.ErrMalformed},
		{"trailing byte", append(bytes.Clone(valid), 0), wire.ErrMalformed},
		{"item kind 0", append(envelope(wire.KindBatch), 1, 0, 1), wire.ErrMalformed},
		{"item kind 5", append(envelope(wire.KindBatch), 1, 5, 1), wire.ErrMalformed},
		{"overlong varint", append(envelope(wire.KindHeartbeat), 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0), wire.ErrMalformed},
		{"in-flight over uint32", binary.AppendUvarint(envelope(wire.KindHeartbeat), 1<<32), wire.ErrMalformed},
		{"ttl over uint32", start(func(b []byte) []byte { return append(binary.AppendUvarint(b, 1<<32), 0, 0, 0, 0, 0, 0) }), wire.ErrMalformed},
		{"total requests over uint32", start(func(b []byte) []byte { return append(binary.AppendUvarint(append(b, 0), 1<<32), 0, 0, 0, 0, 0) }), wire.ErrMalformed},
		{"max tokens over uint32", start(func(b []byte) []byte { return append(binary.AppendUvarint(append(b, 0, 0, 0, 0, 0), 1<<32), 0) }), wire.ErrMalformed},
		{"unknown flag", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 4) }), wire.ErrMalformed},
		{"unknown flag beside prefill", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 6, 1, 'e', 1, 0) }), wire.ErrMalformed},
		{"prefilled ok", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 1) }), nil},
		{"prefill ok", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 3, 1, 'e', 1, 0) }), nil},
		{"prefill flag, nothing after", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 2) }), wire.ErrMalformed},
		{"prefill flag, empty endpoint", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 2, 0, 1, 0) }), wire.ErrMalformed},
		{"prefill flag, empty endpoint in a long varint", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 2, 0x80, 0, 1, 0) }), wire.ErrMalformed},
		{"prefill endpoint past the end", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 2, 9, 'e', 1, 0) }), wire.ErrMalformed},
		{"prefill endpoint over the limit", start(func(b []byte) []byte {
			return append(binary.AppendUvarint(append(b, 0, 0, 0, 0, 0, 0, 2), wire.MaxStringLen+1), str(wire.MaxStringLen+1)+"\x01\x00"...)
		}), wire.ErrTooLarge},
		{"prefill rank over int32", start(func(b []byte) []byte {
			return append(binary.AppendVarint(append(b, 0, 0, 0, 0, 0, 0, 2, 1, 'e'), math.MaxInt32+1), 0)
		}), wire.ErrMalformed},
		{"prefill cached over uint32", start(func(b []byte) []byte {
			return binary.AppendUvarint(append(b, 0, 0, 0, 0, 0, 0, 2, 1, 'e', 1), 1<<32)
		}), wire.ErrMalformed},
		{"trailing byte after prefill", start(func(b []byte) []byte { return append(b, 0, 0, 0, 0, 0, 0, 2, 1, 'e', 1, 0, 0) }), wire.ErrMalformed},
		{"levels out of range decode", start(func(b []byte) []byte { return append(b, 0, 0, 255, 0, 255, 0, 0) }), nil},
		{"outcome isl over uint32", binary.AppendUvarint(append(envelope(wire.KindBatch), 1, byte(wire.ItemOutcome), 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), 1<<32), wire.ErrMalformed},
		{"dp rank over int32", binary.AppendVarint(append(envelope(wire.KindSnapshot), 1, 1, 0), math.MaxInt32+1), wire.ErrMalformed},
		{"dp rank under int32", binary.AppendVarint(append(envelope(wire.KindSnapshot), 1, 1, 0), math.MinInt32-1), wire.ErrMalformed},
		{"status over uint16", binary.AppendUvarint(append(envelope(wire.KindBatch), 1, byte(wire.ItemOutcome), 1, 0, 0, 0), 1<<16), wire.ErrMalformed},
	} {
		m, err := wire.Decode(c.b)
		if c.want == nil {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			continue
		}
		if !errors.Is(err, c.want) || m != nil {
			t.Errorf("%s: got %v, %v; want %v", c.name, m, err, c.want)
		}
	}
}

// TestTruncation: every strict prefix of every valid message is an
// ErrMalformed error (the format is prefix-free), never a panic.
func TestTruncation(t *testing.T) {
	for name, m := range validMessages() {
		b := encode(t, m)
		for i := range b {
			got, err := wire.Decode(b[:i:i])
			if i == 0 && !errors.Is(err, wire.ErrMalformed) {
				t.Fatalf("%s: empty: %v", name, err)
			}
			if !errors.Is(err, wire.ErrMalformed) || got != nil {
				t.Fatalf("%s truncated to %d of %d bytes: %v, %v", name, i, len(b), got, err)
			}
		}
	}
}

// fitStarts is how many minimal (18-byte) starts fit in a snapshot of
// MaxMessage bytes.
const fitStarts = (wire.MaxMessage - 64) / 18

// str returns s repeated to n bytes.
func str(n int) string { return strings.Repeat("s", n) }

// TestEncodeLimits: every limit holds at the limit (and the result
// decodes) and refuses one over with ErrTooLarge, leaving dst unchanged.
func TestEncodeLimits(t *testing.T) {
	startWith := func(f func(*wire.Start)) *wire.Message {
		s := wire.Start{}
		f(&s)
		return &wire.Message{Kind: wire.KindBatch, Batch: []wire.Item{wire.StartItem(s)}}
	}
	outcomeWith := func(f func(*wire.Outcome)) *wire.Message {
		o := wire.Outcome{}
		f(&o)
		return &wire.Message{Kind: wire.KindBatch, Batch: []wire.Item{wire.OutcomeItem(o)}}
	}
	snapshotWith := func(f func(*wire.Start)) *wire.Message {
		s := wire.Start{}
		f(&s)
		return &wire.Message{Kind: wire.KindSnapshot, Snapshot: []wire.Start{s}}
	}
	ends := func(n int) []wire.Item {
		out := make([]wire.Item, n)
		for i := range out {
			out[i] = wire.EndItem(uint64(i))
		}
		return out
	}
	bigStarts := func(n int) []wire.Start {
		out := make([]wire.Start, n)
		for i := range out {
			out[i].Blocks = blocks(wire.MaxBlocks, uint64(i))
		}
		return out
	}
	bigItems := func(n int) []wire.Item {
		out := make([]wire.Item, n)
		for i := range out {
			out[i] = wire.StartItem(wire.Start{Blocks: blocks(wire.MaxBlocks, uint64(i))})
		}
		return out
	}
	// payloadFor returns the payload length that makes a KV-events
	// message with this envelope exactly MaxMessage bytes.
	kvEnvelope := len(encode(t, &wire.Message{Kind: wire.KindKVEvents}))
	payloadFor := kvEnvelope + 2 // the empty payload's 1-byte length becomes 3 bytes
	kv := func(n int) *wire.Message {
		return &wire.Message{Kind: wire.KindKVEvents, KVEvents: wire.KVEvents{Payload: make([]byte, n)}}
	}
	for _, c := range []struct {
		name    string
		ok, bad *wire.Message
	}{
		{"pool", &wire.Message{Kind: wire.KindHeartbeat, Pool: str(wire.MaxIDLen)}, &wire.Message{Kind: wire.KindHeartbeat, Pool: str(wire.MaxIDLen + 1)}},
		{"replica", &wire.Message{Kind: wire.KindHeartbeat, Replica: str(wire.MaxIDLen)}, &wire.Message{Kind: wire.KindHeartbeat, Replica: str(wire.MaxIDLen + 1)}},
		{"start endpoint", startWith(func(s *wire.Start) { s.Endpoint = str(wire.MaxStringLen) }), startWith(func(s *wire.Start) { s.Endpoint = str(wire.MaxStringLen + 1) })},
		{"start prefix id", startWith(func(s *wire.Start) { s.PrefixID = str(wire.MaxStringLen) }), startWith(func(s *wire.Start) { s.PrefixID = str(wire.MaxStringLen + 1) })},
		{"start tenant", startWith(func(s *wire.Start) { s.Tenant = str(wire.MaxStringLen) }), startWith(func(s *wire.Start) { s.Tenant = str(wire.MaxStringLen + 1) })},
		{"start model", startWith(func(s *wire.Start) { s.Model = str(wire.MaxStringLen) }), startWith(func(s *wire.Start) { s.Model = str(wire.MaxStringLen + 1) })},
		{"start prefill endpoint", startWith(func(s *wire.Start) { s.PrefillEndpoint = str(wire.MaxStringLen) }), startWith(func(s *wire.Start) { s.PrefillEndpoint = str(wire.MaxStringLen + 1) })},
		{"start blocks", startWith(func(s *wire.Start) { s.Blocks = blocks(wire.MaxBlocks, 1) }), startWith(func(s *wire.Start) { s.Blocks = blocks(wire.MaxBlocks+1, 1) })},
		{"snapshot start blocks", snapshotWith(func(s *wire.Start) { s.Blocks = blocks(wire.MaxBlocks, 1) }), snapshotWith(func(s *wire.Start) { s.Blocks = blocks(wire.MaxBlocks+1, 1) })},
		{"snapshot start model", snapshotWith(func(s *wire.Start) { s.Model = str(wire.MaxStringLen) }), snapshotWith(func(s *wire.Start) { s.Model = str(wire.MaxStringLen + 1) })},
		{"outcome endpoint", outcomeWith(func(o *wire.Outcome) { o.Endpoint = str(wire.MaxStringLen) }), outcomeWith(func(o *wire.Outcome) { o.Endpoint = str(wire.MaxStringLen + 1) })},
		{"outcome prefix id", outcomeWith(func(o *wire.Outcome) { o.PrefixID = str(wire.MaxStringLen) }), outcomeWith(func(o *wire.Outcome) { o.PrefixID = str(wire.MaxStringLen + 1) })},
		{"outcome tenant", outcomeWith(func(o *wire.Outcome) { o.Tenant = str(wire.MaxStringLen) }), outcomeWith(func(o *wire.Outcome) { o.Tenant = str(wire.MaxStringLen + 1) })},
		{"outcome model", outcomeWith(func(o *wire.Outcome) { o.Model = str(wire.MaxStringLen) }), outcomeWith(func(o *wire.Outcome) { o.Model = str(wire.MaxStringLen + 1) })},
		{"outcome served", outcomeWith(func(o *wire.Outcome) { o.Served = str(wire.MaxStringLen) }), outcomeWith(func(o *wire.Outcome) { o.Served = str(wire.MaxStringLen + 1) })},
		{"kv endpoint", &wire.Message{Kind: wire.KindKVEvents, KVEvents: wire.KVEvents{Endpoint: str(wire.MaxStringLen)}}, &wire.Message{Kind: wire.KindKVEvents, KVEvents: wire.KVEvents{Endpoint: str(wire.MaxStringLen + 1)}}},
		{"batch items", &wire.Message{Kind: wire.KindBatch, Batch: ends(wire.MaxItems)}, &wire.Message{Kind: wire.KindBatch, Batch: ends(wire.MaxItems + 1)}},
		// An empty Start is 18 bytes: MaxMessage is the tighter bound.
		{"snapshot starts", &wire.Message{Kind: wire.KindSnapshot, Snapshot: make([]wire.Start, fitStarts)}, &wire.Message{Kind: wire.KindSnapshot, Snapshot: make([]wire.Start, wire.MaxSnapshotStarts+1)}},
		// 8 bytes a key: the message bound comes before the total-blocks
		// bound (MaxTotalBlocks keys cannot fit in MaxMessage bytes).
		{"message blocks (batch)", &wire.Message{Kind: wire.KindBatch, Batch: bigItems(7)}, &wire.Message{Kind: wire.KindBatch, Batch: bigItems(wire.MaxTotalBlocks/wire.MaxBlocks + 1)}},
		{"message blocks (snapshot)", &wire.Message{Kind: wire.KindSnapshot, Snapshot: bigStarts(7)}, &wire.Message{Kind: wire.KindSnapshot, Snapshot: bigStarts(9)}},
		{"message size", kv(wire.MaxMessage - payloadFor), kv(wire.MaxMessage - payloadFor + 1)},
		{"kv payload", kv(1000), kv(wire.MaxPayload + 1)},
	} {
		t.Run(c.name, func(t *testing.T) {
			b, err := wire.Append(nil, c.ok)
			if err != nil {
				t.Fatalf("at the limit: %v", err)
			}
			if len(b) > wire.MaxMessage {
				t.Fatalf("at the limit: %d bytes", len(b))
			}
			if c.name == "message size" && len(b) != wire.MaxMessage {
				t.Fatalf("the message-size case is %d bytes, not MaxMessage", len(b))
			}
			if _, err := wire.Decode(b); err != nil {
				t.Fatalf("at the limit, Decode: %v", err)
			}
			dst := []byte("keep")
			out, err := wire.Append(dst, c.bad)
			if !errors.Is(err, wire.ErrTooLarge) {
				t.Fatalf("one over: %v, want ErrTooLarge", err)
			}
			if string(out) != "keep" {
				t.Fatalf("one over: dst is %d bytes", len(out))
			}
		})
	}
}

// TestDecodeLimits: hand-made messages one over a limit, with every byte
// they declare present, are ErrTooLarge; counts and lengths within their
// limit but over the bytes present are ErrMalformed.
func TestDecodeLimits(t *testing.T) {
	// withStr: an envelope whose pool or replica has n bytes.
	withID := func(pool bool, n int) []byte {
		b := []byte{wire.Version, byte(wire.KindHeartbeat)}
		if pool {
			b = append(binary.AppendUvarint(b, uint64(n)), str(n)...)
			b = append(b, 0)
		} else {
			b = append(b, 0)
			b = append(binary.AppendUvarint(b, uint64(n)), str(n)...)
		}
		b = binary.LittleEndian.AppendUint64(b, 1)
		return append(b, 1, 0, 0)
	}
	// startStr: a snapshot of one start whose field-th string (0
	// endpoint, 1 prefix id, 2 tenant, 3 model) has n bytes.
	startStr := func(field, n int) []byte {
		b := append(envelope(wire.KindSnapshot), 1, 1)
		s := func(i int) {
			if i == field {
				b = append(binary.AppendUvarint(b, uint64(n)), str(n)...)
			} else {
				b = append(b, 0)
			}
		}
		s(0)
		b = append(b, 0, 0, 0, 0, 0, 0) // dp rank, block size, blocks, isl, overlap, decode
		s(1)
		s(2)
		s(3)
		return append(b, 0, 0, 0, 0, 0, 0, 0) // ttl, session hints, flags
	}
	// outcomeStr: a batch of one outcome whose field-th string has n bytes.
	outcomeStr := func(field, n int) []byte {
		b := append(envelope(wire.KindBatch), 1, byte(wire.ItemOutcome), 1)
		s := func(i int) {
			if i == field {
				b = append(binary.AppendUvarint(b, uint64(n)), str(n)...)
			} else {
				b = append(b, 0)
			}
		}
		s(0)
		b = append(b, 0, 0, 0, 0, 0, 0, 0, 0) // dp rank .. cached
		s(1)
		s(2)
		s(3)
		s(4)
		return append(b, 0, 0, 0, 0, 0) // block size .. osl
	}
	startBlocks := func(n int) []byte {
		b := append(envelope(wire.KindSnapshot), 1, 1, 0, 0, 0)
		b = binary.AppendUvarint(b, uint64(n))
		b = append(b, make([]byte, 8*n)...)
		return append(b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
	}
	endItems := func(n int) []byte {
		b := binary.AppendUvarint(envelope(wire.KindBatch), uint64(n))
		for range n {
			b = append(b, byte(wire.ItemEnd), 1)
		}
		return b
	}
	minStarts := func(n int) []byte {
		b := binary.AppendUvarint(envelope(wire.KindSnapshot), uint64(n))
		return append(b, make([]byte, 18*n)...)
	}
	declare := func(kind wire.Kind, prefix []byte, n uint64, have int) []byte {
		b := append(envelope(kind), prefix...)
		b = binary.AppendUvarint(b, n)
		return append(b, make([]byte, have)...)
	}
	for _, c := range []struct {
		name string
		b    []byte
		want error
	}{
		{"pool at limit", withID(true, wire.MaxIDLen), nil},
		{"pool over", withID(true, wire.MaxIDLen+1), wire.ErrTooLarge},
		{"replica at limit", withID(false, wire.MaxIDLen), nil},
		{"replica over", withID(false, wire.MaxIDLen+1), wire.ErrTooLarge},
		{"start endpoint at limit", startStr(0, wire.MaxStringLen), nil},
		{"start endpoint over", startStr(0, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"start prefix id at limit", startStr(1, wire.MaxStringLen), nil},
		{"start prefix id over", startStr(1, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"start tenant at limit", startStr(2, wire.MaxStringLen), nil},
		{"start tenant over", startStr(2, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"start model at limit", startStr(3, wire.MaxStringLen), nil},
		{"start model over", startStr(3, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"outcome endpoint at limit", outcomeStr(0, wire.MaxStringLen), nil},
		{"outcome endpoint over", outcomeStr(0, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"outcome prefix id over", outcomeStr(1, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"outcome tenant over", outcomeStr(2, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"outcome model at limit", outcomeStr(3, wire.MaxStringLen), nil},
		{"outcome model over", outcomeStr(3, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"outcome served at limit", outcomeStr(4, wire.MaxStringLen), nil},
		{"outcome served over", outcomeStr(4, wire.MaxStringLen+1), wire.ErrTooLarge},
		{"start blocks at limit", startBlocks(wire.MaxBlocks), nil},
		{"start blocks over", startBlocks(wire.MaxBlocks + 1), wire.ErrTooLarge},
		{"batch items at limit", endItems(wire.MaxItems), nil},
		{"batch items over", endItems(wire.MaxItems + 1), wire.ErrTooLarge},
		{"snapshot starts that fit", minStarts(fitStarts), nil},
		{"snapshot starts at limit (over MaxMessage)", minStarts(wire.MaxSnapshotStarts), wire.ErrTooLarge},
		{"snapshot starts over", minStarts(wire.MaxSnapshotStarts + 1), wire.ErrTooLarge},
		{"message over MaxMessage", append(envelope(wire.KindHeartbeat), make([]byte, wire.MaxMessage)...), wire.ErrTooLarge},
		{"kv payload over", declare(wire.KindKVEvents, []byte{0}, wire.MaxPayload+1, 100), wire.ErrTooLarge},
		// Within the limit, over the bytes present.
		{"items over bytes", declare(wire.KindBatch, nil, wire.MaxItems, 100), wire.ErrMalformed},
		{"starts over bytes", declare(wire.KindSnapshot, nil, wire.MaxSnapshotStarts, 100), wire.ErrMalformed},
		{"blocks over bytes", declare(wire.KindSnapshot, []byte{1, 1, 0, 0, 0}, wire.MaxBlocks, 100), wire.ErrMalformed},
		{"string over bytes", declare(wire.KindKVEvents, nil, wire.MaxStringLen, 100), wire.ErrMalformed},
		{"payload over bytes", declare(wire.KindKVEvents, []byte{0}, 1<<19, 100), wire.ErrMalformed},
		{"2^63 items", declare(wire.KindBatch, nil, 1<<63, 10), wire.ErrTooLarge},
		{"2^64-1 payload", declare(wire.KindKVEvents, []byte{0}, math.MaxUint64, 10), wire.ErrTooLarge},
	} {
		_, err := wire.Decode(c.b)
		if c.want == nil {
			if err != nil {
				t.Errorf("%s: %v", c.name, err)
			}
			continue
		}
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
}

// TestAggregatedStartKeepsItsFormat: a start without a prefill endpoint
// is the format before P/D starts, byte for byte (flags bit 1 clear,
// nothing after the flags), so replicas that predate them decode it; a
// disaggregated one is the same bytes with bit 1 set and the prefill
// endpoint, rank and cached tokens after the flags.
func TestAggregatedStartKeepsItsFormat(t *testing.T) {
	for _, prefilled := range []bool{false, true} {
		agg := fullStart(3, 2)
		agg.Prefilled = prefilled
		dis := agg
		dis.PrefillEndpoint, dis.PrefillDPRank, dis.PrefillCached = "10.0.1.1:8000", 1, 300
		a := encode(t, &wire.Message{Kind: wire.KindBatch, Batch: []wire.Item{wire.StartItem(agg)}})
		d := encode(t, &wire.Message{Kind: wire.KindBatch, Batch: []wire.Item{wire.StartItem(dis)}})
		flags := a[len(a)-1]
		if flags&^1 != 0 || (flags == 1) != prefilled {
			t.Fatalf("aggregated start's flags %#x (prefilled %v)", flags, prefilled)
		}
		tail := append([]byte{flags | 2, 13}, "10.0.1.1:8000"...)
		tail = binary.AppendUvarint(binary.AppendVarint(tail, 1), 300)
		if !bytes.Equal(d[:len(a)-1], a[:len(a)-1]) || !bytes.Equal(d[len(a)-1:], tail) {
			t.Fatalf("disaggregated start:\n% x\nwant the aggregated one's bytes then\n% x", d, tail)
		}
	}
}
