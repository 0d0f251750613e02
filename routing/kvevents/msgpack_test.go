package kvevents

import (
	"bytes"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// FuzzMsgpack checks the bounded reader's skip against
// github.com/vmihailenco/msgpack's: whenever ours accepts a value, theirs
// must accept it too and consume exactly as many bytes. (Theirs runs only
// after ours has checked every length against the bytes present, so it
// cannot be made to allocate what the input only declares.)
func FuzzMsgpack(f *testing.F) {
	for _, p := range hostilePayloads() {
		f.Add(p)
	}
	f.Add(pack(f, map[string]any{"a": []any{1, -1, 1.5, float32(2), "s", []byte{1}, nil, true, uint64(1 << 63)}}))
	f.Add([]byte{0xd4, 1, 2, 0xc7, 1, 5, 9, 0xd8, 0, 0})
	f.Fuzz(func(t *testing.T, p []byte) {
		if len(p) > 64<<10 {
			return
		}
		r := mpReader{b: p}
		if err := r.skip(1); err != nil {
			return
		}
		if r.off < 1 || r.off > len(p) {
			t.Fatalf("skip consumed %d of %d bytes", r.off, len(p))
		}
		br := bytes.NewReader(p)
		if err := msgpack.NewDecoder(br).Skip(); err != nil {
			t.Fatalf("ours skipped %d bytes, vmihailenco failed: %v", r.off, err)
		}
		if theirs := len(p) - br.Len(); theirs != r.off {
			t.Fatalf("ours skipped %d bytes, vmihailenco %d", r.off, theirs)
		}
	})
}
