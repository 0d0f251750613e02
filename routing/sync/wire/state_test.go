package wire_test

import (
	"encoding/binary"
	"errors"
	"math"
	"reflect"
	"runtime"
	"testing"

	"github.com/kvbandit/kvbandit/routing/sync/wire"
	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// fullState is a snapshot with every kind of record.
func fullState(blocks int) warmstate.Snapshot {
	var s warmstate.Snapshot
	s.Streams = []warmstate.Stream{{Endpoint: "10.0.0.1:8000", Started: true, Trusted: true, Seq: math.MaxUint64}, {Endpoint: "10.0.0.2:8000"}}
	run := warmstate.Blocks{Endpoint: "10.0.0.1:8000", Rank: 1, Medium: warmstate.MediumGPU, BlockSize: 16, Factor: 1}
	for i := range blocks {
		run.Blocks = append(run.Blocks, warmstate.Block{Hash: uint64(i) * 0x9e3779b97f4a7c15, Key: ^uint64(i)})
	}
	s.Blocks = []warmstate.Blocks{run, {Endpoint: "10.0.0.1:8000", Medium: warmstate.MediumDisk, BlockSize: warmstate.MaxBlockSize, Factor: warmstate.MaxFactor,
		Blocks: []warmstate.Block{{Hash: 1, Key: 2}}}}
	l := &warmstate.Latency{Observations: 1 << 40, TTFT: warmstate.Fit{S: make([]float64, 25), XY: make([]float64, 5)},
		Decode: warmstate.Fit{S: make([]float64, 4), XY: make([]float64, 2)}}
	for i := range l.Coefficients {
		l.Coefficients[i] = float64(i) - 2.5
	}
	l.TTFT.S[24], l.Decode.XY[1] = math.MaxFloat64, -math.SmallestNonzeroFloat64
	s.Latency = l
	s.Speeds = []warmstate.Speed{{Endpoint: "10.0.0.2:8000", Rank: -1, Mean: -0.3, Precision: 44.4, Running: 3, Observations: math.MaxUint32, AgeMillis: 1500}}
	arm := warmstate.Arm{Endpoint: "10.0.0.2:8000", Rank: warmstate.MaxRank, Updates: 7}
	for i := range arm.A {
		arm.A[i] = float64(i)
	}
	arm.B[8] = -1
	s.Arms = []warmstate.Arm{arm}
	beta := warmstate.Beta{Endpoint: "10.0.0.2:8000", Alpha: 3, Beta: 2, Rewards: 4, LastReward: 0.5}
	beta.Buckets[17], beta.Overall[1] = warmstate.EMA{V: 12, OK: true}, warmstate.EMA{V: 9, OK: true}
	s.Betas = []warmstate.Beta{beta}
	s.Baselines = &warmstate.Baselines{Global: [2]warmstate.EMA{{V: 1, OK: true}, {}}}
	s.Sessions = []warmstate.Session{
		{Tenant: "acme", PrefixID: "wf-1", Total: math.MaxInt32, Processed: 3, Pinned: true, Endpoint: "10.0.0.1:8000", Rank: -1,
			DecodeCost: 1, PrefillCost: 0.25, IATFactor: 1.5, PinAgeMillis: 10, IdleMillis: math.MaxUint32},
		{PrefixID: "wf-2", Total: 2},
	}
	return s
}

// validStateMessages returns valid messages of the state kinds, for
// TestRoundTrip and FuzzDecode's seeds (validMessages).
func validStateMessages() map[string]*wire.Message {
	return map[string]*wire.Message{
		"state-request":     {Kind: wire.KindStateRequest, Pool: "default", Replica: "r1", Epoch: 4, StateRequest: wire.StateRequest{Transfer: 99, From: 12, MaxBytes: wire.MaxStateBytes}},
		"state-chunk":       {Kind: wire.KindStateChunk, Pool: "default", Replica: "r2", Epoch: 5, StateChunk: wire.StateChunk{Transfer: 99, Index: 3, Total: wire.MaxStateChunks, State: fullState(40)}},
		"state-chunk-empty": {Kind: wire.KindStateChunk, StateChunk: wire.StateChunk{Transfer: 1, Total: 1}},
		"state-refused":     {Kind: wire.KindStateChunk, StateChunk: wire.StateChunk{Transfer: 1, Refused: true}},
	}
}

// TestStateLimits: values over a limit or out of range are refused by
// Append (so that what it writes decodes) and by the decoder.
func TestStateLimits(t *testing.T) {
	msg := func(mut func(*wire.StateChunk)) *wire.Message {
		m := &wire.Message{Kind: wire.KindStateChunk, StateChunk: wire.StateChunk{Total: 1, State: fullState(2)}}
		mut(&m.StateChunk)
		return m
	}
	for name, m := range map[string]*wire.Message{
		"too many chunks": msg(func(c *wire.StateChunk) { c.Total = wire.MaxStateChunks + 1 }),
		"rank":            msg(func(c *wire.StateChunk) { c.State.Blocks[0].Rank = -1 }),
		"medium":          msg(func(c *wire.StateChunk) { c.State.Blocks[0].Medium = 3 }),
		"block size":      msg(func(c *wire.StateChunk) { c.State.Blocks[0].BlockSize = 0 }),
		"factor":          msg(func(c *wire.StateChunk) { c.State.Blocks[0].Factor = warmstate.MaxFactor + 1 }),
		"nan":             msg(func(c *wire.StateChunk) { c.State.Speeds[0].Mean = math.NaN() }),
		"inf":             msg(func(c *wire.StateChunk) { c.State.Arms[0].A[3] = math.Inf(1) }),
		"fit size":        msg(func(c *wire.StateChunk) { c.State.Latency.TTFT.S = nil }),
		"speed rank":      msg(func(c *wire.StateChunk) { c.State.Speeds[0].Rank = -2 }),
		"session total":   msg(func(c *wire.StateChunk) { c.State.Sessions[0].Total = -1 }),
		"endpoint":        msg(func(c *wire.StateChunk) { c.State.Streams[0].Endpoint = string(make([]byte, wire.MaxStringLen+1)) }),
		"request":         {Kind: wire.KindStateRequest, StateRequest: wire.StateRequest{MaxBytes: wire.MaxStateBytes + 1}},
	} {
		if _, err := wire.Append(nil, m); !errors.Is(err, wire.ErrTooLarge) && !errors.Is(err, wire.ErrMalformed) {
			t.Errorf("%s: Append: %v", name, err)
		}
	}
	// The decoder refuses the same values, written by hand.
	good := encode(t, validStateMessages()["state-chunk-empty"])
	body := len(envelope(wire.KindStateChunk))
	for name, patch := range map[string]func([]byte) []byte{
		"flags": func(b []byte) []byte { b[body+8+1+1] = 2; return b },
		"total": func(b []byte) []byte {
			return append(append(b[:body+8+1], binary.AppendUvarint(nil, wire.MaxStateChunks+1)...), b[body+8+2:]...)
		},
		"latency presence": func(b []byte) []byte {
			b[body+8+3+2] = 2
			return b
		},
		"trailing": func(b []byte) []byte { return append(b, 0) },
	} {
		b := patch(append([]byte(nil), good...))
		if _, err := wire.Decode(b); err == nil {
			t.Errorf("%s: decoded % x", name, b)
		}
	}
}

// TestSplitState: a snapshot cut in chunks of at most a message each
// (every chunk encodes within MaxMessage with the longest ids) comes back
// whole with Append, its long block run cut in runs; a budget below one
// record is an error.
func TestSplitState(t *testing.T) {
	s := fullState(150_000) // 2.4 MB of blocks
	for i := range 2000 {
		s.Sessions = append(s.Sessions, warmstate.Session{PrefixID: string(rune(0x4e00 + i)), Total: 3})
	}
	pieces, err := wire.SplitState(&s, wire.ChunkBudget)
	if err != nil {
		t.Fatal(err)
	}
	if len(pieces) < 3 {
		t.Fatalf("%d pieces for 2.4 MB", len(pieces))
	}
	var back warmstate.Snapshot
	long := string(make([]byte, wire.MaxIDLen))
	for i := range pieces {
		m := &wire.Message{Kind: wire.KindStateChunk, Pool: long, Replica: long, Epoch: math.MaxUint64, Seq: math.MaxUint64,
			StateChunk: wire.StateChunk{Transfer: math.MaxUint64, Index: uint32(i), Total: uint32(len(pieces)), State: pieces[i]}}
		b, err := wire.Append(nil, m)
		if err != nil {
			t.Fatalf("piece %d: %v", i, err)
		}
		got, err := wire.Decode(b)
		if err != nil {
			t.Fatalf("piece %d: %v", i, err)
		}
		back.Append(&got.StateChunk.State)
	}
	if back.BlockCount() != s.BlockCount() || len(back.Sessions) != len(s.Sessions) || !reflect.DeepEqual(back.Latency, s.Latency) ||
		!reflect.DeepEqual(back.Streams, s.Streams) || !reflect.DeepEqual(back.Arms, s.Arms) {
		t.Fatalf("reassembled: %d blocks, %d sessions; want %d, %d", back.BlockCount(), len(back.Sessions), s.BlockCount(), len(s.Sessions))
	}
	var keys []warmstate.Block
	for _, r := range back.RunsOf("10.0.0.1:8000") {
		if r.Medium == warmstate.MediumGPU {
			keys = append(keys, r.Blocks...)
		}
	}
	if !reflect.DeepEqual(keys, s.Blocks[0].Blocks) {
		t.Fatal("the long run's blocks changed in the split")
	}
	if one, err := wire.SplitState(&warmstate.Snapshot{}, wire.ChunkBudget); err != nil || len(one) != 1 || !one[0].Empty() {
		t.Errorf("empty snapshot: %d pieces, %v", len(one), err)
	}
	if _, err := wire.SplitState(&s, 100); !errors.Is(err, wire.ErrTooLarge) {
		t.Errorf("budget below an arm: %v", err)
	}
}

// TestStateChunkRejectAllocates: a full chunk cut short by its last byte
// is refused by the checking pass before its records are allocated.
func TestStateChunkRejectAllocates(t *testing.T) {
	b := encode(t, &wire.Message{Kind: wire.KindStateChunk, StateChunk: wire.StateChunk{Total: 1, State: fullState(5000)}})
	b = b[:len(b)-1]
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const runs = 50
	for range runs {
		if _, err := wire.Decode(b); err == nil {
			t.Fatal("decoded")
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / runs; per > 4096 {
		t.Errorf("a refused state chunk allocated %d bytes (80 KiB of blocks if it were decoded)", per)
	}
}

// hostileState returns 64-byte state chunks each declaring a huge count
// (2^31, or the limit itself) that its bytes do not hold: streams, block
// runs, a run's blocks, sessions, a session's prefix id (for
// TestHostileMemoryBudget through hostile).
func hostileState() [][]byte {
	const huge = 1 << 31
	head := append(make([]byte, 8), 0, 1, 0) // transfer 0, index 0, total 1, flags 0
	declare := func(prefix []byte, n uint64) []byte {
		b := append(append(envelope(wire.KindStateChunk), head...), prefix...)
		b = binary.AppendUvarint(b, n)
		for len(b) < 64 {
			b = append(b, 0xff)
		}
		return b[:64]
	}
	var out [][]byte
	for _, n := range []uint64{huge, wire.MaxRecords} {
		out = append(out, declare(nil, n))                                  // streams
		out = append(out, declare([]byte{0}, n))                            // block runs
		out = append(out, declare([]byte{0, 0, 0, 0, 0, 0}, n))             // sessions (no latency, speeds, arms, betas, baselines)
		out = append(out, declare([]byte{0, 1, 0, 0, 0, 16, 1}, n))         // a run's blocks
		out = append(out, declare([]byte{0, 0, 0, 0, 0, 0, 0, 1, 0}, n))    // a session's prefix id
		out = append(out, declare([]byte{0, 0, 0, 0, 0, 0, 0, 1, 0, 0}, n)) // (the same, one byte on)
	}
	return out
}

// BenchmarkStateChunk encodes and decodes one full chunk (a 65,000-block
// run, about 1 MiB): the warm start's cost per chunk on each side.
func BenchmarkStateChunk(b *testing.B) {
	s := fullState(0)
	s.Blocks = s.Blocks[:1]
	for i := range 65_000 {
		s.Blocks[0].Blocks = append(s.Blocks[0].Blocks, warmstate.Block{Hash: uint64(i), Key: ^uint64(i)})
	}
	m := &wire.Message{Kind: wire.KindStateChunk, Pool: "p", Replica: "r", StateChunk: wire.StateChunk{Total: 1, State: s}}
	enc, err := wire.Append(nil, m)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("encode", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(enc)))
		buf := make([]byte, 0, len(enc))
		for b.Loop() {
			if _, err := wire.Append(buf[:0], m); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(enc)))
		for b.Loop() {
			if _, err := wire.Decode(enc); err != nil {
				b.Fatal(err)
			}
		}
	})
}
