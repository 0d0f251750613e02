package wire_test

import (
	"testing"

	"github.com/kvbandit/kvbandit/routing/sync/wire"
)

// benchBatch is a batch of 64 Starts of 128 block keys each, spread over
// 8 endpoints.
func benchBatch() *wire.Message {
	m := &wire.Message{Kind: wire.KindBatch, Pool: "default", Replica: "kvbandit-7f9c-abc", Epoch: 0xdeadbeefcafef00d, Seq: 1234}
	for i := range 64 {
		s := fullStart(uint64(1000+i), 128)
		s.Endpoint = "10.0.0." + string(rune('1'+i%8)) + ":8000"
		s.PrefixID = "session-" + string(rune('a'+i%26))
		m.Batch = append(m.Batch, wire.StartItem(s))
	}
	return m
}

func benchHeartbeat() *wire.Message {
	return &wire.Message{Kind: wire.KindHeartbeat, Pool: "default", Replica: "kvbandit-7f9c-abc", Epoch: 0xdeadbeefcafef00d, Seq: 1234,
		Heartbeat: wire.Heartbeat{InFlight: 37, Interval: 500}}
}

func benchAppend(b *testing.B, m *wire.Message) {
	buf, err := wire.Append(nil, m)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	for b.Loop() {
		if buf, err = wire.Append(buf[:0], m); err != nil {
			b.Fatal(err)
		}
	}
}

func benchDecode(b *testing.B, m *wire.Message, withDecoder bool) {
	buf, err := wire.Append(nil, m)
	if err != nil {
		b.Fatal(err)
	}
	var d wire.Decoder
	dec := wire.Decode
	if withDecoder {
		dec = d.Decode
	}
	b.SetBytes(int64(len(buf)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := dec(buf); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAppendBatch64x128(b *testing.B)        { benchAppend(b, benchBatch()) }
func BenchmarkDecodeBatch64x128(b *testing.B)        { benchDecode(b, benchBatch(), false) }
func BenchmarkDecoderDecodeBatch64x128(b *testing.B) { benchDecode(b, benchBatch(), true) }
func BenchmarkAppendHeartbeat(b *testing.B)          { benchAppend(b, benchHeartbeat()) }
func BenchmarkDecodeHeartbeat(b *testing.B)          { benchDecode(b, benchHeartbeat(), false) }
func BenchmarkDecoderDecodeHeartbeat(b *testing.B)   { benchDecode(b, benchHeartbeat(), true) }
