package wire_test

import (
	"encoding/binary"
	"errors"
	"runtime"
	"testing"

	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// hostile returns 64-byte messages, each declaring a huge count or
// length (2^31, or the limit itself) that its bytes do not hold.
func hostile() [][]byte {
	const huge = 1 << 31
	declare := func(kind wire.Kind, prefix []byte, n uint64) []byte {
		b := append(envelope(kind), prefix...)
		b = binary.AppendUvarint(b, n)
		for len(b) < 64 {
			b = append(b, 0xff)
		}
		return b[:64]
	}
	// One valid start, then a second one declaring n keys.
	twoStarts := func(n uint64) []byte {
		return declare(wire.KindBatch, []byte{2, byte(wire.ItemStart), 1, 0, 1, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, byte(wire.ItemStart), 2, 0, 1, 16}, n)
	}
	var out [][]byte
	for _, n := range []uint64{huge, wire.MaxItems} {
		out = append(out, declare(wire.KindBatch, nil, n))
	}
	for _, n := range []uint64{huge, wire.MaxSnapshotStarts} {
		out = append(out, declare(wire.KindSnapshot, nil, n))
	}
	for _, n := range []uint64{huge, wire.MaxBlocks} {
		out = append(out, declare(wire.KindSnapshot, []byte{1, 1, 0, 0, 16}, n))
		out = append(out, declare(wire.KindBatch, []byte{1, byte(wire.ItemStart), 1, 0, 0, 16}, n))
		out = append(out, twoStarts(n))
	}
	for _, n := range []uint64{huge, wire.MaxPayload} {
		out = append(out, declare(wire.KindKVEvents, []byte{0}, n))
	}
	for _, n := range []uint64{huge, wire.MaxStringLen} {
		out = append(out, declare(wire.KindKVEvents, nil, n))                                                  // endpoint
		out = append(out, declare(wire.KindBatch, []byte{1, byte(wire.ItemOutcome), 1}, n))                    // outcome endpoint
		out = append(out, declare(wire.KindSnapshot, []byte{1, 1, 0, 0, 0, 0, 0, 0, 0}, n))                    // prefix id
		out = append(out, declare(wire.KindBatch, []byte{1, byte(wire.ItemStart), 1, 0, 0, 0, 0, 0, 0, 0}, n)) // prefix id
	}
	// Envelope strings.
	for _, n := range []uint64{huge, wire.MaxIDLen} {
		b := binary.AppendUvarint([]byte{wire.Version, byte(wire.KindBatch)}, n)
		for len(b) < 64 {
			b = append(b, 0xff)
		}
		out = append(out, b)
	}
	return append(out, hostileState()...)
}

// TestHostileMemoryBudget decodes 1,000 hostile 64-byte messages, each
// declaring 2^31 (or the limit of) items, starts, block keys or string
// bytes: every one is refused and the heap, after GC, grows less than
// 8 MiB, counting every byte allocated on the way (TotalAlloc).
func TestHostileMemoryBudget(t *testing.T) {
	msgs := hostile()
	var d wire.Decoder
	errs := make([]error, 0, 1000)
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for i := range 1000 {
		b := msgs[i%len(msgs)]
		if len(b) != 64 {
			t.Fatalf("hostile message %d is %d bytes", i%len(msgs), len(b))
		}
		dec := wire.Decode
		if i%2 == 1 {
			dec = d.Decode
		}
		m, err := dec(b)
		if err == nil || m != nil {
			t.Fatalf("hostile message %d (% x) decoded: %+v", i%len(msgs), b, m)
		}
		if !errors.Is(err, wire.ErrMalformed) && !errors.Is(err, wire.ErrTooLarge) {
			t.Fatalf("hostile message %d: %v", i%len(msgs), err)
		}
		errs = append(errs, err)
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	const budget = 8 << 20
	if grew := int64(after.HeapAlloc) - int64(before.HeapAlloc); grew > budget {
		t.Errorf("the heap grew %d bytes after 1000 hostile messages, budget %d", grew, budget)
	}
	if total := after.TotalAlloc - before.TotalAlloc; total > budget {
		t.Errorf("decoding 1000 hostile messages allocated %d bytes, budget %d", total, budget)
	}
	runtime.KeepAlive(errs)
}

// TestRejectAllocatesOnlyTheError: a large valid batch cut short by its
// last byte is refused by the checking pass, before any of its items or
// keys are allocated (about 80 KiB if they were): only the error's few
// hundred bytes.
func TestRejectAllocatesOnlyTheError(t *testing.T) {
	b := encode(t, benchBatch())
	b = b[:len(b)-1]
	if _, err := wire.Decode(b); !errors.Is(err, wire.ErrMalformed) {
		t.Fatalf("truncated batch: %v", err)
	}
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const runs = 100
	for range runs {
		if _, err := wire.Decode(b); err == nil {
			t.Fatal("decoded")
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / runs; per > 2048 {
		t.Errorf("a refused batch allocated %d bytes", per)
	}
}
