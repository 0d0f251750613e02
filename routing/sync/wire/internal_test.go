package wire

import (
	"encoding/binary"
	"errors"
	"strconv"
	"testing"
)

// TestTotalBlocksLimit: MaxMessage keeps a real message under
// MaxTotalBlocks, so this test starts the reader as if the message had
// already carried MaxTotalBlocks-1 keys: a start of 2 more is refused.
func TestTotalBlocksLimit(t *testing.T) {
	b := []byte{1, 0, 0, 0, 2} // id, endpoint, dp rank, block size, 2 keys
	b = append(b, make([]byte, 16)...)
	b = append(b, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0) // isl .. flags
	for _, c := range []struct {
		already int
		want    error
	}{{MaxTotalBlocks - 2, nil}, {MaxTotalBlocks - 1, ErrTooLarge}} {
		r := reader{b: b, blocks: c.already}
		var s Start
		r.start(&s)
		if !errors.Is(r.err, c.want) {
			t.Errorf("after %d keys: %v, want %v", c.already, r.err, c.want)
		}
	}
}

// TestInternBounded: a Decoder keeps at most maxInterned strings however
// many distinct endpoints it sees.
func TestInternBounded(t *testing.T) {
	var d Decoder
	for i := range 3 * maxInterned {
		ep := "10.0.0.1:" + strconv.Itoa(i)
		b := []byte{Version, byte(KindKVEvents), 0, 0}
		b = binary.LittleEndian.AppendUint64(b, 0)
		b = append(b, 0)
		b = append(binary.AppendUvarint(b, uint64(len(ep))), ep...)
		b = append(b, 0, 0)
		m, err := d.Decode(b)
		if err != nil {
			t.Fatal(err)
		}
		if m.KVEvents.Endpoint != ep {
			t.Fatalf("endpoint %q, want %q", m.KVEvents.Endpoint, ep)
		}
		if len(d.strs) > maxInterned {
			t.Fatalf("%d interned strings, limit %d", len(d.strs), maxInterned)
		}
	}
}
