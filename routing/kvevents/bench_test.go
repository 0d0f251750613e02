package kvevents

import (
	"encoding/binary"
	"testing"

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
