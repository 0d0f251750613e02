package wire

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/kvbandit/kvbandit/routing/warmstate"
)

// This file holds the warm start's messages (issue 22): a starting
// replica's request for a peer's state and the chunks of the answer. The
// state's values are routing/warmstate's; the format is in doc.go.

// Limits of the state messages.
const (
	// MaxStateChunks bounds a transfer's chunks (StateChunk.Total): 4,096
	// chunks of at most MaxMessage bytes are 4 GiB, beyond any
	// configured transfer bound.
	MaxStateChunks = 4096
	// MaxStateBytes bounds what a requester may ask for in all
	// (StateRequest.MaxBytes).
	MaxStateBytes = 1 << 32
	// MaxRecords bounds each record list of one chunk (streams, block
	// runs, speeds, arms, betas, sessions); the message bound is tighter.
	MaxRecords = 1 << 20
	// MaxStateBlocks bounds the blocks of one chunk (16 bytes each: the
	// message bound is tighter).
	MaxStateBlocks = MaxMessage / 16
)

// StateRequest asks a peer for its state, or for the next chunks of a
// transfer it started.
type StateRequest struct {
	// Transfer is the requester's number for the transfer (not 0): the
	// peer's chunks carry it back.
	Transfer uint64
	// From is the first chunk wanted: 0 starts a transfer, a later one
	// asks for the next window of chunks.
	From uint32
	// MaxBytes is the most the requester takes in all (≤ MaxStateBytes).
	MaxBytes uint64
}

// StateChunk is one chunk of a peer's state.
type StateChunk struct {
	// Transfer is the request's number.
	Transfer uint64
	// Index numbers the chunk in the transfer, from 0; Total is the
	// transfer's chunks (1 to MaxStateChunks; 0 when Refused).
	Index, Total uint32
	// Refused says the peer does not answer (busy, over its rate, no
	// state): ask another.
	Refused bool
	// State is the chunk's records.
	State warmstate.Snapshot
}

// Minimal encoded sizes of the state records, to check declared counts
// against the bytes left.
const (
	minStream  = 3
	minRun     = 6
	minSpeed   = 1 + 1 + 3*8 + 1 + 1
	minArm     = 1 + 1 + 1 + 8*(warmstate.ArmDim*warmstate.ArmDim+warmstate.ArmDim)
	minBeta    = 1 + 2*8 + 1 + 8 + 20*9
	minSession = 6
	minEMA     = 9
)

const (
	flagStarted   = 1
	flagTrusted   = 2
	flagRefused   = 1
	flagPinned    = 1
	latencyFloats = 7 + warmstate.FitDimTTFT*(warmstate.FitDimTTFT+1) + warmstate.FitDimDecode*(warmstate.FitDimDecode+1)
)

// ---- encoding ----

func appendStateRequest(b []byte, q *StateRequest) ([]byte, error) {
	if q.MaxBytes > MaxStateBytes {
		return b, fmt.Errorf("%w: state request of %d bytes, limit %d", ErrTooLarge, q.MaxBytes, uint64(MaxStateBytes))
	}
	b = binary.LittleEndian.AppendUint64(b, q.Transfer)
	b = binary.AppendUvarint(b, uint64(q.From))
	return binary.AppendUvarint(b, q.MaxBytes), nil
}

func appendStateChunk(b []byte, c *StateChunk, start int) ([]byte, error) {
	if c.Total > MaxStateChunks {
		return b, fmt.Errorf("%w: %d state chunks, limit %d", ErrTooLarge, c.Total, MaxStateChunks)
	}
	b = binary.LittleEndian.AppendUint64(b, c.Transfer)
	b = binary.AppendUvarint(b, uint64(c.Index))
	b = binary.AppendUvarint(b, uint64(c.Total))
	var flags byte
	if c.Refused {
		flags |= flagRefused
	}
	b = append(b, flags)
	b, err := appendState(b, &c.State)
	if err == nil {
		err = checkSize(b, start)
	}
	return b, err
}

// appendState appends a snapshot's records, section by section.
func appendState(b []byte, s *warmstate.Snapshot) ([]byte, error) {
	if err := checkState(s); err != nil {
		return b, err
	}
	b = binary.AppendUvarint(b, uint64(len(s.Streams)))
	for i := range s.Streams {
		b = appendStream(b, &s.Streams[i])
	}
	b = binary.AppendUvarint(b, uint64(len(s.Blocks)))
	for i := range s.Blocks {
		b = appendRun(b, &s.Blocks[i])
	}
	b = appendLatency(b, s.Latency)
	b = binary.AppendUvarint(b, uint64(len(s.Speeds)))
	for i := range s.Speeds {
		b = appendSpeed(b, &s.Speeds[i])
	}
	b = binary.AppendUvarint(b, uint64(len(s.Arms)))
	for i := range s.Arms {
		b = appendArm(b, &s.Arms[i])
	}
	b = binary.AppendUvarint(b, uint64(len(s.Betas)))
	for i := range s.Betas {
		b = appendBeta(b, &s.Betas[i])
	}
	if s.Baselines == nil {
		b = append(b, 0)
	} else {
		b = append(b, 1)
		b = appendEMA(appendEMA(b, s.Baselines.Global[0]), s.Baselines.Global[1])
	}
	b = binary.AppendUvarint(b, uint64(len(s.Sessions)))
	for i := range s.Sessions {
		b = appendSession(b, &s.Sessions[i])
	}
	return b, nil
}

// checkState refuses what the decoder would refuse, so that what Append
// writes always decodes.
func checkState(s *warmstate.Snapshot) error {
	for _, n := range []int{len(s.Streams), len(s.Blocks), len(s.Speeds), len(s.Arms), len(s.Betas), len(s.Sessions)} {
		if err := checkLen("state records", n, MaxRecords); err != nil {
			return err
		}
	}
	if n := s.BlockCount(); n > MaxStateBlocks {
		return fmt.Errorf("%w: %d blocks in a state chunk, limit %d", ErrTooLarge, n, MaxStateBlocks)
	}
	bad := func(what string, args ...any) error {
		return fmt.Errorf("%w: state: %s", ErrMalformed, fmt.Sprintf(what, args...))
	}
	for i := range s.Streams {
		if len(s.Streams[i].Endpoint) > MaxStringLen {
			return checkLen("endpoint", len(s.Streams[i].Endpoint), MaxStringLen)
		}
	}
	for i := range s.Blocks {
		r := &s.Blocks[i]
		switch {
		case len(r.Endpoint) > MaxStringLen:
			return checkLen("endpoint", len(r.Endpoint), MaxStringLen)
		case r.Rank < 0 || r.Rank > warmstate.MaxRank || r.Medium > warmstate.MediumDisk ||
			r.BlockSize == 0 || r.BlockSize > warmstate.MaxBlockSize || r.Factor == 0 || r.Factor > warmstate.MaxFactor:
			return bad("block run %d: rank %d, medium %d, block size %d, factor %d", i, r.Rank, r.Medium, r.BlockSize, r.Factor)
		}
	}
	if l := s.Latency; l != nil {
		if len(l.TTFT.S) != warmstate.FitDimTTFT*warmstate.FitDimTTFT || len(l.TTFT.XY) != warmstate.FitDimTTFT ||
			len(l.Decode.S) != warmstate.FitDimDecode*warmstate.FitDimDecode || len(l.Decode.XY) != warmstate.FitDimDecode {
			return bad("latency fit of the wrong size")
		}
		if !finiteAll(l.Coefficients[:]) || !finiteAll(l.TTFT.S) || !finiteAll(l.TTFT.XY) || !finiteAll(l.Decode.S) || !finiteAll(l.Decode.XY) {
			return bad("latency fit not finite")
		}
	}
	for i := range s.Speeds {
		sp := &s.Speeds[i]
		if len(sp.Endpoint) > MaxStringLen || !rankOK(sp.Rank) || !finiteAll([]float64{sp.Mean, sp.Precision, sp.Running}) {
			return bad("speed %d", i)
		}
	}
	for i := range s.Arms {
		a := &s.Arms[i]
		if len(a.Endpoint) > MaxStringLen || !rankOK(a.Rank) || !finiteAll(a.A[:]) || !finiteAll(a.B[:]) {
			return bad("arm %d", i)
		}
	}
	for i := range s.Betas {
		bt := &s.Betas[i]
		if len(bt.Endpoint) > MaxStringLen || !finiteAll([]float64{bt.Alpha, bt.Beta, bt.LastReward}) || !emasOK(bt.Buckets[:]) || !emasOK(bt.Overall[:]) {
			return bad("beta %d", i)
		}
	}
	if s.Baselines != nil && !emasOK(s.Baselines.Global[:]) {
		return bad("baselines")
	}
	for i := range s.Sessions {
		ss := &s.Sessions[i]
		if len(ss.Tenant) > MaxStringLen || len(ss.PrefixID) > MaxStringLen || len(ss.Endpoint) > MaxStringLen ||
			ss.Total < 0 || ss.Processed < 0 || (ss.Pinned && (!rankOK(ss.Rank) || !finiteAll([]float64{ss.DecodeCost, ss.PrefillCost, ss.IATFactor}))) {
			return bad("session %d", i)
		}
	}
	return nil
}

func rankOK(r int32) bool { return r >= -1 && r <= warmstate.MaxRank }

func finiteAll(vs []float64) bool {
	for _, v := range vs {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return false
		}
	}
	return true
}

func emasOK(es []warmstate.EMA) bool {
	for _, e := range es {
		if !finiteAll([]float64{e.V}) {
			return false
		}
	}
	return true
}

func appendF64(b []byte, v float64) []byte {
	return binary.LittleEndian.AppendUint64(b, math.Float64bits(v))
}

func appendF64s(b []byte, vs []float64) []byte {
	for _, v := range vs {
		b = appendF64(b, v)
	}
	return b
}

func appendStream(b []byte, st *warmstate.Stream) []byte {
	b = appendString(b, st.Endpoint)
	var flags byte
	if st.Started {
		flags |= flagStarted
	}
	if st.Trusted {
		flags |= flagTrusted
	}
	b = append(b, flags)
	return binary.AppendUvarint(b, st.Seq)
}

func appendRun(b []byte, r *warmstate.Blocks) []byte {
	b = appendString(b, r.Endpoint)
	b = binary.AppendUvarint(b, uint64(r.Rank))
	b = append(b, r.Medium)
	b = binary.AppendUvarint(b, uint64(r.BlockSize))
	b = binary.AppendUvarint(b, uint64(r.Factor))
	b = binary.AppendUvarint(b, uint64(len(r.Blocks)))
	for _, k := range r.Blocks {
		b = binary.LittleEndian.AppendUint64(b, k.Hash)
		b = binary.LittleEndian.AppendUint64(b, k.Key)
	}
	return b
}

func appendLatency(b []byte, l *warmstate.Latency) []byte {
	if l == nil {
		return append(b, 0)
	}
	b = append(b, 1)
	b = appendF64s(b, l.Coefficients[:])
	b = binary.AppendUvarint(b, l.Observations)
	b = appendF64s(b, l.TTFT.S)
	b = appendF64s(b, l.TTFT.XY)
	b = appendF64s(b, l.Decode.S)
	return appendF64s(b, l.Decode.XY)
}

func appendSpeed(b []byte, sp *warmstate.Speed) []byte {
	b = appendString(b, sp.Endpoint)
	b = binary.AppendVarint(b, int64(sp.Rank))
	b = appendF64s(b, []float64{sp.Mean, sp.Precision, sp.Running})
	b = binary.AppendUvarint(b, uint64(sp.Observations))
	return binary.AppendUvarint(b, uint64(sp.AgeMillis))
}

func appendArm(b []byte, a *warmstate.Arm) []byte {
	b = appendString(b, a.Endpoint)
	b = binary.AppendVarint(b, int64(a.Rank))
	b = binary.AppendUvarint(b, a.Updates)
	b = appendF64s(b, a.A[:])
	return appendF64s(b, a.B[:])
}

func appendEMA(b []byte, e warmstate.EMA) []byte {
	ok := byte(0)
	if e.OK {
		ok = 1
	}
	return appendF64(append(b, ok), e.V)
}

func appendBeta(b []byte, bt *warmstate.Beta) []byte {
	b = appendString(b, bt.Endpoint)
	b = appendF64(appendF64(b, bt.Alpha), bt.Beta)
	b = binary.AppendUvarint(b, bt.Rewards)
	b = appendF64(b, bt.LastReward)
	for _, e := range bt.Buckets {
		b = appendEMA(b, e)
	}
	return appendEMA(appendEMA(b, bt.Overall[0]), bt.Overall[1])
}

func appendSession(b []byte, ss *warmstate.Session) []byte {
	b = appendString(b, ss.Tenant)
	b = appendString(b, ss.PrefixID)
	b = binary.AppendUvarint(b, uint64(ss.Total))
	b = binary.AppendUvarint(b, uint64(ss.Processed))
	if !ss.Pinned {
		b = append(b, 0)
	} else {
		b = append(b, flagPinned)
		b = appendString(b, ss.Endpoint)
		b = binary.AppendVarint(b, int64(ss.Rank))
		b = appendF64s(b, []float64{ss.DecodeCost, ss.PrefillCost, ss.IATFactor})
		b = binary.AppendUvarint(b, uint64(ss.PinAgeMillis))
	}
	return binary.AppendUvarint(b, uint64(ss.IdleMillis))
}

// ---- decoding ----

func (r *reader) stateRequest(q *StateRequest) {
	q.Transfer = r.u64le("state transfer")
	q.From = r.u32("state from")
	at := r.off
	q.MaxBytes = r.uvarint("state max bytes")
	if r.err == nil && q.MaxBytes > MaxStateBytes {
		r.fail(at, ErrTooLarge, "state request of %d bytes, limit %d", q.MaxBytes, uint64(MaxStateBytes))
	}
}

func (r *reader) stateChunk(c *StateChunk) {
	c.Transfer = r.u64le("state transfer")
	c.Index = r.u32("state chunk index")
	at := r.off
	c.Total = r.u32("state chunks")
	if r.err == nil && c.Total > MaxStateChunks {
		r.fail(at, ErrTooLarge, "%d state chunks, limit %d", c.Total, MaxStateChunks)
	}
	at = r.off
	flags := r.byte1("state chunk flags")
	if flags&^flagRefused != 0 {
		r.fail(at, ErrMalformed, "unknown state chunk flags %#x", flags)
	}
	c.Refused = flags&flagRefused != 0
	r.state(&c.State)
}

// records reads a record count and allocates the list on the filling
// pass; each is then read by one into the i-th element (a scratch value
// on the checking pass).
func records[T any](r *reader, what string, minEach int, list *[]T, one func(*T)) {
	n := r.count(what, MaxRecords, minEach)
	if n == 0 || r.err != nil {
		return
	}
	if r.fill {
		*list = make([]T, n)
	}
	var scratch T
	for i := 0; i < n && r.err == nil; i++ {
		v := &scratch
		if r.fill {
			v = &(*list)[i]
		}
		one(v)
	}
}

func (r *reader) state(s *warmstate.Snapshot) {
	records(r, "state streams", minStream, &s.Streams, r.stream)
	records(r, "state block runs", minRun, &s.Blocks, r.run)
	if r.present("latency") {
		l := &warmstate.Latency{}
		r.latency(l)
		if r.fill {
			s.Latency = l
		}
	}
	records(r, "state speeds", minSpeed, &s.Speeds, r.speed)
	records(r, "state arms", minArm, &s.Arms, r.arm)
	records(r, "state betas", minBeta, &s.Betas, r.beta)
	if r.present("baselines") {
		g := &warmstate.Baselines{Global: [2]warmstate.EMA{r.ema(), r.ema()}}
		if r.fill {
			s.Baselines = g
		}
	}
	records(r, "state sessions", minSession, &s.Sessions, r.session)
}

// present reads a 0/1 byte saying whether an optional section follows.
func (r *reader) present(what string) bool {
	at := r.off
	v := r.byte1(what)
	if v > 1 {
		r.fail(at, ErrMalformed, "%s presence byte %d", what, v)
	}
	return v == 1 && r.err == nil
}

func (r *reader) f64(what string) float64 {
	at := r.off
	v := math.Float64frombits(r.u64le(what))
	if math.IsNaN(v) || math.IsInf(v, 0) {
		r.fail(at, ErrMalformed, "%s is not finite", what)
		return 0
	}
	return v
}

func (r *reader) f64s(what string, dst []float64) {
	for i := range dst {
		dst[i] = r.f64(what)
	}
}

func (r *reader) rank(what string) int32 {
	at := r.off
	v := r.i32(what)
	if r.err == nil && !rankOK(v) {
		r.fail(at, ErrMalformed, "%s %d out of range", what, v)
	}
	return v
}

func (r *reader) stream(st *warmstate.Stream) {
	st.Endpoint = r.interned("endpoint", MaxStringLen)
	at := r.off
	flags := r.byte1("stream flags")
	if flags&^(flagStarted|flagTrusted) != 0 {
		r.fail(at, ErrMalformed, "unknown stream flags %#x", flags)
	}
	st.Started, st.Trusted = flags&flagStarted != 0, flags&flagTrusted != 0
	st.Seq = r.uvarint("stream seq")
}

func (r *reader) run(b *warmstate.Blocks) {
	b.Endpoint = r.interned("endpoint", MaxStringLen)
	at := r.off
	rank := r.uvarint("run rank")
	if r.err == nil && rank > warmstate.MaxRank {
		r.fail(at, ErrMalformed, "run rank %d out of range", rank)
	}
	b.Rank = int32(rank)
	at = r.off
	b.Medium = r.byte1("run medium")
	if r.err == nil && b.Medium > warmstate.MediumDisk {
		r.fail(at, ErrMalformed, "run medium %d", b.Medium)
	}
	at = r.off
	b.BlockSize = r.u32("run block size")
	if r.err == nil && (b.BlockSize == 0 || b.BlockSize > warmstate.MaxBlockSize) {
		r.fail(at, ErrMalformed, "run block size %d", b.BlockSize)
	}
	at = r.off
	b.Factor = r.u32("run factor")
	if r.err == nil && (b.Factor == 0 || b.Factor > warmstate.MaxFactor) {
		r.fail(at, ErrMalformed, "run factor %d", b.Factor)
	}
	at = r.off
	n := r.count("run blocks", MaxStateBlocks, 16)
	if r.err == nil && r.stateBlocks+n > MaxStateBlocks {
		r.fail(at, ErrTooLarge, "blocks in the state chunk: over %d", MaxStateBlocks)
	}
	if r.err != nil || n == 0 {
		return
	}
	if r.fill {
		blocks := r.stateArena[r.stateBlocks : r.stateBlocks+n : r.stateBlocks+n]
		for j := range blocks {
			blocks[j] = warmstate.Block{Hash: binary.LittleEndian.Uint64(r.b[r.off+16*j:]), Key: binary.LittleEndian.Uint64(r.b[r.off+16*j+8:])}
		}
		b.Blocks = blocks
	}
	r.stateBlocks += n
	r.off += 16 * n
}

func (r *reader) latency(l *warmstate.Latency) {
	if r.left() < latencyFloats*8+1 {
		r.fail(r.off, ErrMalformed, "truncated latency fit")
		return
	}
	r.f64s("latency coefficient", l.Coefficients[:])
	l.Observations = r.uvarint("latency observations")
	var scratch [warmstate.FitDimTTFT * (warmstate.FitDimTTFT + 1)]float64
	fit := func(f *warmstate.Fit, n int) {
		s, xy := scratch[:n*n], scratch[n*n:n*n+n]
		if r.fill {
			s, xy = make([]float64, n*n), make([]float64, n)
			f.S, f.XY = s, xy
		}
		r.f64s("latency fit", s)
		r.f64s("latency fit", xy)
	}
	fit(&l.TTFT, warmstate.FitDimTTFT)
	fit(&l.Decode, warmstate.FitDimDecode)
}

func (r *reader) speed(sp *warmstate.Speed) {
	sp.Endpoint = r.interned("endpoint", MaxStringLen)
	sp.Rank = r.rank("speed rank")
	sp.Mean = r.f64("speed mean")
	sp.Precision = r.f64("speed precision")
	sp.Running = r.f64("speed running")
	sp.Observations = r.u32("speed observations")
	sp.AgeMillis = r.u32("speed age")
}

func (r *reader) arm(a *warmstate.Arm) {
	a.Endpoint = r.interned("endpoint", MaxStringLen)
	a.Rank = r.rank("arm rank")
	a.Updates = r.uvarint("arm updates")
	r.f64s("arm A", a.A[:])
	r.f64s("arm b", a.B[:])
}

func (r *reader) ema() warmstate.EMA {
	at := r.off
	ok := r.byte1("ema flag")
	if ok > 1 {
		r.fail(at, ErrMalformed, "ema flag %d", ok)
	}
	return warmstate.EMA{OK: ok == 1, V: r.f64("ema")}
}

func (r *reader) beta(bt *warmstate.Beta) {
	bt.Endpoint = r.interned("endpoint", MaxStringLen)
	bt.Alpha = r.f64("beta alpha")
	bt.Beta = r.f64("beta beta")
	bt.Rewards = r.uvarint("beta rewards")
	bt.LastReward = r.f64("beta last reward")
	for i := range bt.Buckets {
		bt.Buckets[i] = r.ema()
	}
	bt.Overall = [2]warmstate.EMA{r.ema(), r.ema()}
}

func (r *reader) session(ss *warmstate.Session) {
	ss.Tenant = r.interned("tenant", MaxStringLen)
	ss.PrefixID = r.str("prefix id", MaxStringLen)
	ss.Total = r.nonNeg32("session total")
	ss.Processed = r.nonNeg32("session processed")
	ss.Pinned = r.present("session pin")
	if ss.Pinned {
		ss.Endpoint = r.interned("endpoint", MaxStringLen)
		ss.Rank = r.rank("session rank")
		ss.DecodeCost = r.f64("session decode cost")
		ss.PrefillCost = r.f64("session prefill cost")
		ss.IATFactor = r.f64("session iat factor")
		ss.PinAgeMillis = r.u32("session pin age")
	}
	ss.IdleMillis = r.u32("session idle")
}

func (r *reader) nonNeg32(what string) int32 {
	at := r.off
	v := r.uvarint(what)
	if r.err == nil && v > math.MaxInt32 {
		r.fail(at, ErrMalformed, "%s %d out of range", what, v)
	}
	return int32(v)
}

// ---- splitting ----

// SplitState cuts s into pieces whose records each encode in at most
// budget bytes (a chunk's body; see ChunkBudget), in order, splitting
// long block runs; Snapshot.Append of the pieces gives s back (a run cut
// in several runs of the same endpoint, rank and space). It never returns
// an empty list: an empty s is one empty piece. A record that cannot fit
// (budget below a record's fixed size) is an error wrapping ErrTooLarge.
func SplitState(s *warmstate.Snapshot, budget int) ([]warmstate.Snapshot, error) {
	sp := splitter{budget: budget}
	var scratch []byte
	size := func(f func([]byte) []byte) int { scratch = f(scratch[:0]); return len(scratch) }
	for i := range s.Streams {
		if err := sp.add(size(func(b []byte) []byte { return appendStream(b, &s.Streams[i]) }), func(p *warmstate.Snapshot) { p.Streams = append(p.Streams, s.Streams[i]) }); err != nil {
			return nil, err
		}
	}
	for i := range s.Blocks {
		if err := sp.run(&s.Blocks[i]); err != nil {
			return nil, err
		}
	}
	if l := s.Latency; l != nil {
		if err := sp.add(size(func(b []byte) []byte { return appendLatency(b, l) }), func(p *warmstate.Snapshot) { p.Latency = l }); err != nil {
			return nil, err
		}
	}
	for i := range s.Speeds {
		if err := sp.add(size(func(b []byte) []byte { return appendSpeed(b, &s.Speeds[i]) }), func(p *warmstate.Snapshot) { p.Speeds = append(p.Speeds, s.Speeds[i]) }); err != nil {
			return nil, err
		}
	}
	for i := range s.Arms {
		if err := sp.add(size(func(b []byte) []byte { return appendArm(b, &s.Arms[i]) }), func(p *warmstate.Snapshot) { p.Arms = append(p.Arms, s.Arms[i]) }); err != nil {
			return nil, err
		}
	}
	for i := range s.Betas {
		if err := sp.add(size(func(b []byte) []byte { return appendBeta(b, &s.Betas[i]) }), func(p *warmstate.Snapshot) { p.Betas = append(p.Betas, s.Betas[i]) }); err != nil {
			return nil, err
		}
	}
	if g := s.Baselines; g != nil {
		if err := sp.add(2*minEMA, func(p *warmstate.Snapshot) { p.Baselines = g }); err != nil {
			return nil, err
		}
	}
	for i := range s.Sessions {
		if err := sp.add(size(func(b []byte) []byte { return appendSession(b, &s.Sessions[i]) }), func(p *warmstate.Snapshot) { p.Sessions = append(p.Sessions, s.Sessions[i]) }); err != nil {
			return nil, err
		}
	}
	return sp.done(), nil
}

// ChunkBudget is the body budget for SplitState's pieces: what a
// StateChunk with the longest pool and replica ids leaves of MaxMessage
// besides its records' lists (their counts and presence bytes).
const ChunkBudget = MaxMessage - chunkOverhead

// chunkOverhead bounds a StateChunk's bytes besides its records.
const chunkOverhead = 2 + 2*(2+MaxIDLen) + 8 + 10 + 8 + 3*5 + 1 + 8*5 + 2 + 64

type splitter struct {
	budget int
	pieces []warmstate.Snapshot
	cur    warmstate.Snapshot
	used   int
	blocks int
}

func (sp *splitter) flush() {
	sp.pieces = append(sp.pieces, sp.cur)
	sp.cur, sp.used, sp.blocks = warmstate.Snapshot{}, 0, 0
}

// add puts one record of n bytes in the current piece, or in a new one.
func (sp *splitter) add(n int, put func(*warmstate.Snapshot)) error {
	if n > sp.budget {
		return fmt.Errorf("%w: a state record of %d bytes, chunk budget %d", ErrTooLarge, n, sp.budget)
	}
	if sp.used+n > sp.budget {
		sp.flush()
	}
	put(&sp.cur)
	sp.used += n
	return nil
}

// run puts a block run in as many pieces as it takes.
func (sp *splitter) run(r *warmstate.Blocks) error {
	head := len(appendRun(nil, &warmstate.Blocks{Endpoint: r.Endpoint, Rank: r.Rank, Medium: r.Medium, BlockSize: r.BlockSize, Factor: r.Factor})) + 4
	if head+16 > sp.budget {
		return fmt.Errorf("%w: a block run's header of %d bytes, chunk budget %d", ErrTooLarge, head, sp.budget)
	}
	rest := r.Blocks
	for {
		room := min((sp.budget-sp.used-head)/16, MaxStateBlocks-sp.blocks)
		if room <= 0 || (room < len(rest) && room < 64 && sp.used > 0) {
			sp.flush()
			continue
		}
		n := min(room, len(rest))
		part := *r
		part.Blocks = rest[:n:n]
		sp.cur.Blocks = append(sp.cur.Blocks, part)
		sp.used += head + 16*n
		sp.blocks += n
		rest = rest[n:]
		if len(rest) == 0 {
			return nil
		}
	}
}

func (sp *splitter) done() []warmstate.Snapshot {
	if sp.used > 0 || !sp.cur.Empty() || len(sp.pieces) == 0 {
		sp.flush()
	}
	return sp.pieces
}
