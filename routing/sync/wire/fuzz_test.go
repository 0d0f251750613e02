package wire_test

import (
	"errors"
	"reflect"
	"sort"
	"testing"

	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// FuzzDecode: decoding never panics, every error wraps one of the three
// sentinels, a Decoder agrees with Decode, and whatever decodes encodes
// again (to at most MaxMessage bytes) and decodes to an equal message.
// Seeds: one valid message per kind here, hostile ones in
// testdata/fuzz/FuzzDecode.
func FuzzDecode(f *testing.F) {
	msgs := validMessages()
	names := make([]string, 0, len(msgs))
	for name := range msgs {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		f.Add(encode(f, msgs[name]))
	}
	var d wire.Decoder
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := wire.Decode(b)
		m2, err2 := d.Decode(b)
		if (err == nil) != (err2 == nil) || !reflect.DeepEqual(m, m2) {
			t.Fatalf("Decode: %+v, %v; Decoder.Decode: %+v, %v", m, err, m2, err2)
		}
		if err != nil {
			if m != nil {
				t.Fatalf("a message with an error: %+v", m)
			}
			if !errors.Is(err, wire.ErrMalformed) && !errors.Is(err, wire.ErrTooLarge) && !errors.Is(err, wire.ErrVersion) {
				t.Fatalf("error wraps no sentinel: %v", err)
			}
			return
		}
		enc, err := wire.Append(nil, m)
		if err != nil {
			t.Fatalf("a decoded message does not encode: %v\n%+v", err, m)
		}
		if len(enc) > len(b) {
			t.Fatalf("re-encoded to %d bytes from %d (encoding is minimal)", len(enc), len(b))
		}
		again, err := wire.Decode(enc)
		if err != nil {
			t.Fatalf("re-encoded message does not decode: %v", err)
		}
		if !reflect.DeepEqual(again, m) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", again, m)
		}
	})
}
