package kvevents

import (
	"encoding/binary"
	"errors"
	"runtime"
	"runtime/metrics"
	"strings"
	"testing"
	"time"
)

// heapAllocs is the process's cumulative heap allocation in bytes. Small
// objects are counted a span at a time, so differences are exact to
// within a few hundred KiB; large objects are counted when allocated.
func heapAllocs() uint64 {
	s := []metrics.Sample{{Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

// allocBound is what Decode may allocate for a payload: its decoded form
// is at most a few times the payload (4-byte tokens from 1-byte fixints,
// 32-byte blocks from 1-byte hashes), plus slack for span granularity.
func allocBound(payload []byte) uint64 { return 64*uint64(len(payload)) + 4<<20 }

// mp builds raw msgpack by hand, so hostile headers can be written.
type mp []byte

func (m mp) arr(n int) mp {
	if n < 16 {
		return append(m, 0x90|byte(n))
	}
	return binary.BigEndian.AppendUint32(append(m, 0xdd), uint32(n))
}
func (m mp) fixmap(n int) mp { return append(m, 0x80|byte(n)) }
func (m mp) str(s string) mp {
	if len(s) < 256 {
		return append(append(m, 0xd9, byte(len(s))), s...)
	}
	return append(binary.BigEndian.AppendUint16(append(m, 0xda), uint16(len(s))), s...)
}
func (m mp) f64() mp          { return append(m, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0) }
func (m mp) raw(b ...byte) mp { return append(m, b...) }

// hugeHeader is a 32-bit length header of 0xffffffff for format c.
func hugeHeader(c byte) []byte { return []byte{c, 0xff, 0xff, 0xff, 0xff} }

// hostilePayloads are short messages whose headers declare ~4 GiB.
func hostilePayloads() map[string][]byte {
	stored := func() mp { return mp{}.arr(2).f64().arr(1).arr(8).str("BlockStored") }
	return map[string][]byte{
		// The 31-byte message of issue 11: a bin32 block hash of 4 GiB.
		"bin32 block hash": mp{}.arr(2).f64().arr(1).arr(2).raw(0xab).raw([]byte("BlockStored")...).arr(1).raw(hugeHeader(0xc6)...).raw(0),
		"str32 block hash": stored().arr(1).raw(hugeHeader(0xdb)...),
		"str32 parent":     stored().arr(0).raw(hugeHeader(0xdb)...),
		"str32 event tag":  mp{}.arr(2).f64().arr(1).arr(1).raw(hugeHeader(0xdb)...),
		"str32 map key":    mp{}.fixmap(1).raw(hugeHeader(0xdb)...).raw(0),
		"str32 medium":     stored().arr(0).raw(0xc0).arr(0).raw(1, 0xc0).raw(hugeHeader(0xdb)...),
		"str32 lora_name":  stored().arr(0).raw(0xc0).arr(0).raw(1, 0xc0, 0xc0).raw(hugeHeader(0xdb)...),
		"ext32 extra field": mp{}.arr(4).f64().arr(0).raw(0).
			raw(hugeHeader(0xc9)...).raw(1, 2, 3),
		"bin32 extra batch key": mp{}.fixmap(2).str("events").arr(0).str("x").raw(hugeHeader(0xc6)...),
		"str32 extra event field": mp{}.arr(2).f64().arr(1).fixmap(2).str("type").str("BlockStored").
			str("future").raw(hugeHeader(0xdb)...),
		"array32 of tokens": stored().arr(0).raw(0xc0).raw(hugeHeader(0xdd)...).raw(1, 2, 3),
		"map32 event":       mp{}.arr(2).f64().arr(1).raw(hugeHeader(0xdf)...),
		"array32 of events": mp{}.arr(2).f64().raw(hugeHeader(0xdd)...),
	}
}

// TestDecodeHugeDeclaredLengths: a message of a few dozen bytes whose
// str/bin/ext/array header declares 4 GiB is rejected at once and costs
// next to nothing. (github.com/vmihailenco/msgpack allocated the declared
// length before reading: 4 GiB per 31-byte message.)
func TestDecodeHugeDeclaredLengths(t *testing.T) {
	payloads := hostilePayloads()
	names := []string{"bin32 block hash"} // the reported one first
	for name := range payloads {
		if name != names[0] {
			names = append(names, name)
		}
	}
	if n := len(payloads["bin32 block hash"]); n != 31 {
		t.Fatalf("the reported message is %d bytes, want 31", n)
	}
	for _, name := range names {
		p := payloads[name]
		start, before := time.Now(), heapAllocs()
		_, err := Decode([][]byte{[]byte("kv"), seqFrame(1), p})
		alloc, took := heapAllocs()-before, time.Since(start)
		// Fatal, not Error: an unbounded decoder would allocate 4 GiB per
		// case.
		if alloc > allocBound(p) {
			t.Fatalf("%s (%d bytes): Decode allocated %d bytes (bound %d), err %v", name, len(p), alloc, allocBound(p), err)
		}
		if !errors.Is(err, ErrMalformed) {
			t.Fatalf("%s: err = %v, want ErrMalformed", name, err)
		}
		if took > time.Second {
			t.Errorf("%s: Decode took %v", name, took)
		}
	}
}

// TestDecodeLimits: batches over the documented limits are rejected, and
// batches at the limits decode.
func TestDecodeLimits(t *testing.T) {
	t.Parallel()
	fixints := func(m mp, n int) mp {
		for i := range n {
			m = append(m, byte(i&0x7f))
		}
		return m
	}
	// stored is one array_like BlockStored of blocks hashes and tokens
	// token ids in block size bs, in a batch.
	stored := func(blocks, tokens, bs int) []byte {
		m := mp{}.arr(2).f64().arr(1).arr(7).str("BlockStored").arr(blocks)
		for i := range blocks {
			m = binary.BigEndian.AppendUint64(append(m, 0xcf), uint64(i)+1)
		}
		m = fixints(m.raw(0xc0).arr(tokens), tokens)
		return m.raw(0xce).raw(binary.BigEndian.AppendUint32(nil, uint32(bs))...).raw(0xc0).str("GPU")
	}
	removed := func(events, hashes int) []byte {
		m := mp{}.arr(2).f64().arr(events)
		for range events {
			m = fixints(m.arr(3).str("BlockRemoved").arr(hashes), hashes).str("GPU")
		}
		return m
	}
	cleared := func(events int) []byte {
		m := mp{}.arr(2).f64().arr(events)
		for range events {
			m = m.arr(1).str("AllBlocksCleared")
		}
		return m
	}
	withString := func(field string, n int) []byte {
		return mp{}.arr(2).f64().arr(1).fixmap(2).str("type").str("BlockRemoved").
			str(field).raw(0xda, byte(n>>8), byte(n)).raw([]byte(strings.Repeat("x", n))...)
	}
	hashBytes := func(n int) []byte {
		return mp{}.arr(2).f64().arr(1).arr(2).str("BlockRemoved").arr(1).raw(0xc4, byte(n)).raw(make([]byte, n)...)
	}
	for _, tc := range []struct {
		name    string
		payload []byte
		ok      bool
	}{
		{"tokens per event at the limit", stored(MaxTokensPerEvent/16, MaxTokensPerEvent, 16), true},
		{"tokens per event over", stored(1, MaxTokensPerEvent+1, MaxTokensPerEvent+1), false},
		{"blocks per event at the limit", stored(MaxBlocksPerEvent, MaxBlocksPerEvent, 1), true},
		{"blocks per event over", removed(1, MaxBlocksPerEvent+1), false},
		{"blocks per batch at the limit", removed(MaxBlocksPerBatch/1024, 1024), true},
		{"blocks per batch over", removed(MaxBlocksPerBatch/1024+1, 1024), false},
		{"tokens per batch over", func() []byte {
			m := mp{}.arr(2).f64().arr(3)
			for range 3 {
				m = fixints(m.arr(4).str("BlockStored").arr(0).raw(0xc0).arr(MaxTokensPerEvent), MaxTokensPerEvent)
			}
			return m
		}(), false},
		{"events at the limit", cleared(MaxEventsPerBatch), true},
		{"events over", cleared(MaxEventsPerBatch + 1), false},
		{"lora_name at the limit", withString("lora_name", MaxStringBytes), true},
		{"lora_name over", withString("lora_name", MaxStringBytes+1), false},
		{"medium over", withString("medium", MaxStringBytes+1), false},
		{"kind over", withString("kv_cache_spec_kind", MaxStringBytes+1), false},
		{"map key over", withString(strings.Repeat("k", MaxStringBytes+1), 1), false},
		{"hash bytes at the limit", hashBytes(MaxHashBytes), true},
		{"hash bytes over", hashBytes(MaxHashBytes + 1), false},
	} {
		_, err := Decode([][]byte{[]byte("kv"), seqFrame(1), tc.payload})
		if tc.ok && err != nil {
			t.Errorf("%s: %v", tc.name, err)
		}
		if !tc.ok && !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", tc.name, err)
		}
	}
}

// TestDecodeMemoryBudget sends 1,000 hostile messages through Decode:
// headers declaring 4 GiB, batches of one event more than allowed, batches
// of as many tiny events as allowed, and valid batches of the largest
// accepted size. No message
// may allocate more than 64× its size (plus 4 MiB of slack), and the heap
// in use after a GC stays within 64 MiB of where it started.
func TestDecodeMemoryBudget(t *testing.T) {
	var msgs [][]byte
	for _, p := range hostilePayloads() {
		msgs = append(msgs, p)
	}
	many := mp{}.arr(2).f64().arr(MaxEventsPerBatch)
	for range MaxEventsPerBatch {
		many = many.arr(1).str("AllBlocksCleared")
	}
	head := len(mp{}.arr(2).f64().arr(MaxEventsPerBatch))
	tooMany := append(mp{}.arr(2).f64().arr(MaxEventsPerBatch+1), many[head:]...).arr(1).str("AllBlocksCleared")
	big := mp{}.arr(2).f64().arr(1).arr(5).str("BlockStored").arr(MaxTokensPerEvent / 16)
	for i := range MaxTokensPerEvent / 16 {
		big = binary.BigEndian.AppendUint64(append(big, 0xcf), uint64(i)+1)
	}
	big = big.raw(0xc0).arr(MaxTokensPerEvent)
	for i := range MaxTokensPerEvent {
		big = append(big, byte(i&0x7f))
	}
	big = big.raw(16)

	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse
	for i := range 1000 {
		var p []byte
		wantErr := true
		switch {
		// Valid batches of the largest sizes are slow to build under
		// -race: five of each.
		case i%200 == 17:
			p, wantErr = big, false
		case i%200 == 18:
			p, wantErr = many, false
		case i%20 == 19:
			p = tooMany
		default:
			p = msgs[i%len(msgs)]
		}
		before := heapAllocs()
		b, err := Decode([][]byte{[]byte("kv"), seqFrame(uint64(i)), p})
		if alloc := heapAllocs() - before; alloc > allocBound(p) {
			t.Fatalf("message %d (%d bytes): Decode allocated %d bytes, bound %d", i, len(p), alloc, allocBound(p))
		}
		if (err != nil) != wantErr || (err != nil && !errors.Is(err, ErrMalformed)) {
			t.Fatalf("message %d: err = %v, want error %v", i, err, wantErr)
		}
		if !wantErr && len(b.Events) == 0 {
			t.Fatalf("message %d: no events", i)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&ms)
	if grew := int64(ms.HeapInuse) - int64(base); grew > 64<<20 {
		t.Errorf("heap in use grew by %d MiB, bound 64 MiB", grew>>20)
	}
	t.Logf("heap in use %+d KiB", (int64(ms.HeapInuse)-int64(base))>>10)
}
