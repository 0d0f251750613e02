package kvevents

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/zeebo/xxh3"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// The helpers below build payloads the way vLLM's msgspec encoder does:
// array_like events are ["Tag", field...] in declaration order, map events
// are {"type": "Tag", field: value...}.

func pack(t testing.TB, v any) []byte {
	t.Helper()
	b, err := msgpack.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func seqFrame(seq uint64) []byte { return binary.BigEndian.AppendUint64(nil, seq) }

func frames(t testing.TB, seq uint64, batch any) [][]byte {
	return [][]byte{[]byte("kv@127.0.0.1:8000@m"), seqFrame(seq), pack(t, batch)}
}

func toks(n, start int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(start + i)
	}
	return out
}

func anyInts(ts []uint32) []any {
	out := make([]any, len(ts))
	for i, v := range ts {
		out[i] = v
	}
	return out
}

// storedArray is vLLM's array_like BlockStored.
func storedArray(hashes []any, parent any, tokens []uint32, bs int, extra ...any) []any {
	ev := []any{"BlockStored", hashes, parent, anyInts(tokens), bs, nil, "GPU", nil}
	return append(ev, extra...)
}

func TestDecodeArrayIntHashes(t *testing.T) {
	t.Parallel()
	tk := toks(8, 100)
	batch := []any{1.5, []any{
		storedArray([]any{uint64(1 << 63), int64(-2)}, nil, tk, 4),
		[]any{"BlockStored", []any{3}, int64(-2), anyInts(toks(4, 7)), 4, nil, "GPU", "my-lora", nil, 0, "full_attention", nil},
		[]any{"BlockRemoved", []any{1}, "GPU"},
		[]any{"AllBlocksCleared"},
	}, 2}
	b, err := Decode(frames(t, 7, batch))
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{
		Topic: "kv@127.0.0.1:8000@m", Seq: 7, TS: 1.5, Rank: 2, Blocks: 3,
		Events: []kvindex.Event{
			{Kind: kvindex.Stored, BlockSize: 4, Blocks: []kvindex.StoredBlock{
				{EngineHash: 1 << 63, Tokens: tk[:4]}, {EngineHash: ^uint64(1), Tokens: tk[4:]}}},
			{Kind: kvindex.Stored, BlockSize: 4, HasParent: true, Parent: ^uint64(1), LoRA: "my-lora",
				Blocks: []kvindex.StoredBlock{{EngineHash: 3, Tokens: toks(4, 7)}}},
			{Kind: kvindex.Removed, RemovedHashes: []uint64{1}},
			{Kind: kvindex.Cleared},
		},
	}
	if diff := cmp.Diff(want, b); diff != "" {
		t.Errorf("Decode (-want +got):\n%s", diff)
	}
}

func TestDecodeMapBytesHashes(t *testing.T) {
	t.Parallel()
	h1 := make([]byte, 32)
	h2 := make([]byte, 32)
	h1[0], h2[0] = 1, 2
	tk := toks(32, 1000) // big enough to need non-fixint encodings
	batch := map[string]any{
		"ts": 2.0,
		"events": []any{
			map[string]any{"type": "BlockStored", "block_hashes": []any{h1, h2}, "parent_block_hash": nil,
				"token_ids": anyInts(tk), "block_size": 16, "lora_id": 3, "medium": "GPU",
				"extra_keys": []any{nil, nil}, "future_field": map[string]any{"x": 1}},
			map[string]any{"type": "BlockRemoved", "block_hashes": []any{h2}, "medium": "GPU", "group_idx": 0},
			map[string]any{"type": "SomethingNew", "x": 1},
		},
		"data_parallel_rank": nil,
	}
	b, err := Decode(frames(t, 0, batch))
	if err != nil {
		t.Fatal(err)
	}
	want := Batch{
		Topic: "kv@127.0.0.1:8000@m", TS: 2, Blocks: 2, Ignored: 1,
		Events: []kvindex.Event{
			{Kind: kvindex.Stored, BlockSize: 16, LoRA: "3", Blocks: []kvindex.StoredBlock{
				{EngineHash: xxh3.Hash(h1), Tokens: tk[:16]}, {EngineHash: xxh3.Hash(h2), Tokens: tk[16:]}}},
			{Kind: kvindex.Removed, RemovedHashes: []uint64{xxh3.Hash(h2)}},
		},
	}
	if diff := cmp.Diff(want, b); diff != "" {
		t.Errorf("Decode (-want +got):\n%s", diff)
	}
}

// Old vLLM: BlockStored without medium and the fields after it, and a batch
// without data_parallel_rank.
func TestDecodeShortArrays(t *testing.T) {
	t.Parallel()
	batch := []any{1.0, []any{[]any{"BlockStored", []any{5}, nil, anyInts(toks(2, 0)), 2, nil}}}
	b, err := Decode(frames(t, 1, batch))
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 1 || b.Rank != 0 || len(b.Events[0].Blocks) != 1 {
		t.Fatalf("got %+v", b)
	}
}

func TestDecodeIgnoresOtherGroupsAndMedia(t *testing.T) {
	t.Parallel()
	tk := toks(4, 0)
	batch := []any{1.0, []any{
		[]any{"BlockStored", []any{1}, nil, anyInts(tk), 4, nil, "GPU", nil, nil, 1, "full_attention"},
		[]any{"BlockStored", []any{1}, nil, anyInts(tk), 4, nil, "GPU", nil, nil, 0, "sliding_window", 128},
		[]any{"BlockStored", []any{1}, nil, anyInts(tk), 4, nil, "EXTERNAL"},
		[]any{"BlockRemoved", []any{1}, "GPU", 2},
		[]any{"BlockStored", []any{1}, nil, anyInts(tk), 4, nil, "GPU", nil, nil, 0, "mla_attention"},
	}, 0}
	b, err := Decode(frames(t, 1, batch))
	if err != nil {
		t.Fatal(err)
	}
	if b.Ignored != 4 || len(b.Events) != 1 {
		t.Fatalf("ignored %d, events %d; want 4, 1", b.Ignored, len(b.Events))
	}
}

func TestDecodeTokenCountMismatch(t *testing.T) {
	t.Parallel()
	batch := []any{1.0, []any{storedArray([]any{1, 2}, nil, toks(7, 0), 4)}, 0}
	_, err := Decode(frames(t, 1, batch))
	if !errors.Is(err, ErrTokenCount) || !errors.Is(err, kvindex.ErrBlockSize) || !errors.Is(err, ErrMalformed) {
		t.Fatalf("err = %v, want ErrTokenCount, kvindex.ErrBlockSize and ErrMalformed", err)
	}
}

func TestDecodeMalformed(t *testing.T) {
	t.Parallel()
	good := frames(t, 1, []any{1.0, []any{}, 0})
	cases := map[string][][]byte{
		"two frames":     good[:2],
		"short seq":      {good[0], []byte{1, 2}, good[2]},
		"empty payload":  {good[0], good[1], nil},
		"not msgpack":    {good[0], good[1], []byte{0xc1}},
		"string batch":   {good[0], good[1], pack(t, "x")},
		"trailing bytes": {good[0], good[1], append(append([]byte{}, good[2]...), 0)},
		"huge array":     {good[0], good[1], {0xdd, 0xff, 0xff, 0xff, 0xff}},
		"event is int":   frames(t, 1, []any{1.0, []any{1}}),
		"zero block size": frames(t, 1, []any{1.0, []any{
			storedArray([]any{1}, nil, nil, 0)}}),
		"negative token": frames(t, 1, []any{1.0, []any{
			storedArray([]any{1}, nil, nil, 1)[:3], // truncated: no token_ids
			[]any{"BlockStored", []any{1}, nil, []any{-1}, 1}}}),
		"nil hash in list":   frames(t, 1, []any{1.0, []any{[]any{"BlockRemoved", []any{nil}}}}),
		"map without events": frames(t, 1, map[string]any{"ts": 1.0}),
	}
	for name, f := range cases {
		if _, err := Decode(f); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", name, err)
		}
	}
}

func FuzzDecode(f *testing.F) {
	tk := toks(8, 120)
	f.Add(frames(f, 3, []any{1.0, []any{storedArray([]any{1, 2}, 9, tk, 4), []any{"BlockRemoved", []any{1}, "GPU"}, []any{"AllBlocksCleared"}}, 1})[2])
	f.Add(frames(f, 3, map[string]any{"ts": 1.0, "events": []any{map[string]any{"type": "BlockStored", "block_hashes": []any{[]byte("0123456789abcdef0123456789abcdef")}, "token_ids": anyInts(tk[:4]), "block_size": 4}}})[2])
	// Media: vLLM offloading (CPU, no tokens), HiCache/KVBM tiers, an
	// unscored medium, and a medium string at the length limit.
	f.Add(frames(f, 4, []any{1.0, []any{
		[]any{"BlockStored", []any{[]byte("0123456789abcdef0123456789abcdef")}, nil, []any{}, 0, nil, "CPU", nil, nil, 0, nil, nil},
		[]any{"BlockStored", []any{3, 4}, nil, []any{}, 48, nil, "CPU", nil},
		[]any{"BlockRemoved", []any{3}, "CPU"},
		storedArray([]any{5}, nil, tk[:4], 4)[:6:6],
	}, 0})[2])
	f.Add(frames(f, 5, map[string]any{"ts": 1.0, "events": []any{
		map[string]any{"type": "BlockStored", "block_hashes": []any{7}, "token_ids": anyInts(tk[:4]), "block_size": 4, "medium": "CPU_TIER1"},
		map[string]any{"type": "BlockStored", "block_hashes": []any{8}, "parent_block_hash": 7, "token_ids": anyInts(tk[4:]), "block_size": 4, "medium": "CPU_TIER2"},
		map[string]any{"type": "BlockRemoved", "block_hashes": []any{8}, "medium": "disk"},
		map[string]any{"type": "BlockRemoved", "block_hashes": []any{7}, "medium": "REMOTE"},
		map[string]any{"type": "BlockStored", "block_hashes": []any{9}, "token_ids": []any{}, "block_size": 70000, "medium": string(make([]byte, MaxStringBytes))},
	}})[2])
	f.Fuzz(func(t *testing.T, payload []byte) {
		before := heapAllocs()
		b, err := Decode([][]byte{[]byte("kv"), seqFrame(1), payload})
		if alloc := heapAllocs() - before; alloc > allocBound(payload) {
			t.Fatalf("Decode of %d bytes allocated %d bytes, bound %d", len(payload), alloc, allocBound(payload))
		}
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("unexpected error kind: %v", err)
			}
			return
		}
		for _, ev := range b.Events {
			if ev.Medium > kvindex.MediumDisk || ev.BlockSize < 0 || ev.BlockSize > maxBlockSize {
				t.Fatalf("medium %v, block size %d", ev.Medium, ev.BlockSize)
			}
			for _, blk := range ev.Blocks {
				if ev.Medium != kvindex.MediumGPU && blk.Tokens == nil {
					continue // location only
				}
				if len(blk.Tokens) != ev.BlockSize {
					t.Fatalf("block of %d tokens, block size %d", len(blk.Tokens), ev.BlockSize)
				}
			}
		}
	})
}

func TestDecodeDeepNestingInIgnoredField(t *testing.T) {
	t.Parallel()
	// {"ts":1.0,"events":[],"x":[[[[...]]]]} nested a million deep.
	head := pack(t, map[string]any{"ts": 1.0, "events": []any{}})
	head[0] = 0x83 // three entries
	p := append(head, pack(t, "x")...)
	for range 1 << 20 {
		p = append(p, 0x91)
	}
	p = append(p, 0xc0)
	b, err := Decode([][]byte{nil, seqFrame(0), p})
	if err != nil || len(b.Events) != 0 {
		t.Fatalf("Decode = %+v, %v", b, err)
	}
}

// llm-d-inference-sim's array encoding sends parent 0 for a first block
// (vLLM sends nil): 0 means no parent, any other value is one.
func TestDecodeZeroParentIsNoParent(t *testing.T) {
	t.Parallel()
	tk := toks(4, 0)
	batch := []any{1.0, []any{storedArray([]any{7}, 0, tk, 4), storedArray([]any{8}, 7, tk, 4)}}
	b, err := Decode(frames(t, 1, batch))
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Events) != 2 || b.Events[0].HasParent || !b.Events[1].HasParent || b.Events[1].Parent != 7 {
		t.Fatalf("got %+v", b.Events)
	}
}

// The media publishers send: vLLM's OffloadingConnector (array_like, no
// tokens, no parent, block size 0 in newer vLLM or the offloaded block size,
// sha256 byte hashes), SGLang HiCache / Dynamo KVBM (CPU_TIER1 and CPU_TIER2
// with tokens, map encoding), llm-d's lower case, and a medium nobody
// scores.
func TestDecodeMedia(t *testing.T) {
	t.Parallel()
	tk := toks(4, 0)
	h := make([]byte, 32)
	h[31] = 9
	batch := []any{1.0, []any{
		[]any{"BlockStored", []any{h}, nil, []any{}, 0, nil, "CPU", nil, nil, 0, nil, nil},
		[]any{"BlockStored", []any{5, 6}, nil, []any{}, 48, nil, "CPU", nil},
		[]any{"BlockRemoved", []any{5}, "CPU"},
		map[string]any{"type": "BlockStored", "block_hashes": []any{7}, "parent_block_hash": nil, "token_ids": anyInts(tk), "block_size": 4, "medium": "CPU_TIER1"},
		map[string]any{"type": "BlockStored", "block_hashes": []any{8}, "parent_block_hash": 7, "token_ids": anyInts(tk), "block_size": 4, "medium": "CPU_TIER2"},
		map[string]any{"type": "BlockRemoved", "block_hashes": []any{8}, "medium": "cpu_tier2"},
		[]any{"BlockStored", []any{1}, nil, anyInts(tk), 4, nil, "gpu", nil},
		[]any{"BlockRemoved", []any{1}, "REMOTE"},
	}, 0}
	b, err := Decode(frames(t, 1, batch))
	if err != nil {
		t.Fatal(err)
	}
	if b.Ignored != 1 {
		t.Errorf("ignored %d, want 1 (the REMOTE removal)", b.Ignored)
	}
	type got struct {
		kind   kvindex.EventKind
		medium kvindex.Medium
		bs     int
		blocks int
		tokens int
	}
	var gs []got
	for _, ev := range b.Events {
		g := got{kind: ev.Kind, medium: ev.Medium, bs: ev.BlockSize, blocks: len(ev.Blocks) + len(ev.RemovedHashes)}
		for _, bl := range ev.Blocks {
			g.tokens += len(bl.Tokens)
		}
		gs = append(gs, g)
	}
	want := []got{
		{kvindex.Stored, kvindex.MediumCPU, 0, 1, 0},
		{kvindex.Stored, kvindex.MediumCPU, 48, 2, 0},
		{kvindex.Removed, kvindex.MediumCPU, 0, 1, 0},
		{kvindex.Stored, kvindex.MediumCPU, 4, 1, 4},
		{kvindex.Stored, kvindex.MediumDisk, 4, 1, 4},
		{kvindex.Removed, kvindex.MediumDisk, 0, 1, 0},
		{kvindex.Stored, kvindex.MediumGPU, 4, 1, 4},
	}
	if d := cmp.Diff(want, gs, cmp.AllowUnexported(got{})); d != "" {
		t.Errorf("events (-want +got):\n%s", d)
	}
	// The sha256 hash becomes the xxh3-64 of its bytes, as on the GPU.
	if b.Events[0].Blocks[0].EngineHash != xxh3.Hash(h) {
		t.Errorf("byte hash %x, want xxh3 of the digest", b.Events[0].Blocks[0].EngineHash)
	}
	// A GPU event still needs its tokens, and a lower-tier block size is
	// still bounded.
	for name, ev := range map[string][]any{
		"gpu without tokens":    {"BlockStored", []any{1}, nil, []any{}, 4, nil, "GPU", nil},
		"negative cpu bs":       {"BlockStored", []any{1}, nil, []any{}, -1, nil, "CPU", nil},
		"cpu tokens mismatched": {"BlockStored", []any{1}, nil, anyInts(toks(3, 0)), 4, nil, "CPU", nil},
	} {
		if _, err := Decode(frames(t, 1, []any{1.0, []any{ev}, 0})); !errors.Is(err, ErrMalformed) {
			t.Errorf("%s: err = %v, want ErrMalformed", name, err)
		}
	}
}
