package kvevents

import (
	"context"
	"encoding/binary"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

const (
	benchBlocks    = 32 // blocks per BlockStored
	benchBlockSize = 16
	benchChains    = 16
	benchDepth     = 8 // messages per chain, each continuing the previous
)

// benchFrames records benchChains × benchDepth messages of one BlockStored
// of benchBlocks × benchBlockSize tokens each, as vLLM would publish them.
func benchFrames(b *testing.B, mapEnc, bytesHash bool) [][][]byte {
	hash := func(chain, pos int) any {
		v := uint64(chain)<<32 | uint64(pos) | 1<<63
		if bytesHash {
			h := make([]byte, 32)
			binary.BigEndian.PutUint64(h, v)
			return h
		}
		return v
	}
	var out [][][]byte
	seq := uint64(0)
	for c := range benchChains {
		for d := range benchDepth {
			hashes := make([]any, benchBlocks)
			for i := range hashes {
				hashes[i] = hash(c, d*benchBlocks+i)
			}
			var parent any
			if d > 0 {
				parent = hash(c, d*benchBlocks-1)
			}
			tokens := make([]any, benchBlocks*benchBlockSize)
			for i := range tokens {
				tokens[i] = uint32(1000 + (c*7919+d*104729+i*31)%150000)
			}
			var ev any
			if mapEnc {
				ev = map[string]any{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
					"token_ids": tokens, "block_size": benchBlockSize, "lora_id": nil, "medium": "GPU", "lora_name": nil}
				out = append(out, frames(b, seq, map[string]any{"ts": 1.0, "events": []any{ev}, "data_parallel_rank": 0}))
			} else {
				ev = []any{"BlockStored", hashes, parent, tokens, benchBlockSize, nil, "GPU", nil}
				out = append(out, frames(b, seq, []any{1.0, []any{ev}, 0}))
			}
			seq++
		}
	}
	return out
}

// BenchmarkDecode decodes recorded vLLM messages (one BlockStored of
// benchBlocks × benchBlockSize tokens each) without applying them.
//
//	go test -run '^$' -bench 'Decode$' -benchmem ./routing/kvevents
func BenchmarkDecode(b *testing.B) {
	for _, bc := range []struct {
		name             string
		mapEnc, bytesKey bool
	}{
		{"array-int", false, false},
		{"map-bytes", true, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			msgs := benchFrames(b, bc.mapEnc, bc.bytesKey)
			b.SetBytes(int64(len(msgs[0][2])))
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				if _, err := Decode(msgs[i%len(msgs)]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkDecodeApply decodes recorded vLLM messages and applies them to a
// real kvindex.Index; the goal is ≥ 500k blocks/s on one core.
//
//	go test -run '^$' -bench DecodeApply -benchmem -cpu 1 ./routing/kvevents
func BenchmarkDecodeApply(b *testing.B) {
	for _, bc := range []struct {
		name             string
		mapEnc, bytesKey bool
	}{
		{"array-int", false, false},
		{"map-bytes", true, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			msgs := benchFrames(b, bc.mapEnc, bc.bytesKey)
			ix, err := kvindex.New(kvindex.Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer ix.Close()
			w := ix.Worker("10.0.0.1:8000", 0)
			b.ReportAllocs()
			b.ResetTimer()
			blocks := 0
			for i := range b.N {
				batch, err := Decode(msgs[i%len(msgs)])
				if err != nil {
					b.Fatal(err)
				}
				for _, ev := range batch.Events {
					if err := ix.Apply(w, ev); err != nil {
						b.Fatal(err)
					}
				}
				blocks += batch.Blocks
			}
			b.ReportMetric(float64(blocks)/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// BenchmarkSubscribeApply is the whole ingestion path: recorded vLLM
// messages published by a real ZMQ PUB on loopback, received by a
// Subscribe'd SUB, decoded and applied to a real kvindex.Index. The goal
// is ≥ 500k blocks/s; drops (the bounded queue overflowing) are reported.
//
//	go test -run '^$' -bench SubscribeApply -benchmem ./routing/kvevents
func BenchmarkSubscribeApply(b *testing.B) {
	msgs := benchFrames(b, false, false)
	ix, err := kvindex.New(kvindex.Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer ix.Close()
	w := ix.Worker("10.0.0.1:8000", 0)
	pub := zmq4.NewPub(context.Background())
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		b.Fatal(err)
	}
	var blocks atomic.Int64
	s, err := Subscribe(context.Background(), Config{Endpoint: "w", Address: "tcp://" + pub.Addr().String(), QueueSize: 1 << 16},
		Deps{Apply: func(_ string, _ int, ev kvindex.Event) error {
			blocks.Add(int64(len(ev.Blocks)))
			return ix.Apply(w, ev)
		}})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	// Join: PUB drops what it sends before the subscription arrives.
	deadline := time.Now().Add(5 * time.Second)
	for s.Stats().Messages == 0 {
		if time.Now().After(deadline) {
			b.Fatal("subscriber never joined")
		}
		_ = pub.Send(zmq4.NewMsgFrom(msgs[0]...))
		time.Sleep(5 * time.Millisecond)
	}
	base := s.Stats()
	start := blocks.Load()
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		m := msgs[i%len(msgs)]
		f := [][]byte{m[0], binary.BigEndian.AppendUint64(nil, base.Messages+base.Duplicates+uint64(i)), m[2]}
		if err := pub.Send(zmq4.NewMsgFrom(f...)); err != nil {
			b.Fatal(err)
		}
	}
	for {
		st := s.Stats()
		if st.Messages+st.Dropped-base.Messages-base.Dropped >= uint64(b.N) {
			break
		}
		if time.Since(deadline) > 60*time.Second {
			b.Fatalf("only %d of %d messages arrived", st.Messages-base.Messages, b.N)
		}
		time.Sleep(100 * time.Microsecond)
	}
	b.StopTimer()
	st := s.Stats()
	b.ReportMetric(float64(blocks.Load()-start)/b.Elapsed().Seconds(), "blocks/s")
	b.ReportMetric(float64(st.Dropped-base.Dropped), "dropped")
}
