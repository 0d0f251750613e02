package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim"
)

// MooncakeBlock is the block size of Mooncake's hash_ids, in tokens.
const MooncakeBlock = 512

// mooncakeLine is one JSONL record. Pointers tell a missing field from a
// zero.
type mooncakeLine struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLength  *int64   `json:"input_length"`
	OutputLength *int64   `json:"output_length"`
	HashIDs      []int64  `json:"hash_ids"`
}

// ReadMooncake reads a Mooncake JSONL trace. Each hash id stands for 512
// tokens that are the same wherever the id appears. Both conventions for
// the number of hash ids are accepted: ceil(input_length/512), where the
// last block is partial (its first tokens are used), and
// floor(input_length/512), where the tail after the last full block is
// unhashed and gets tokens unique to the request.
func ReadMooncake(r io.Reader, opt Options) ([]sim.Request, Report, error) {
	return readLines(r, opt, nil, ParseMooncakeLine)
}

// ParseMooncakeLine parses one Mooncake JSONL line; lineNo (1-based) seeds
// the tokens of an unhashed tail. Errors do not include the line number.
func ParseMooncakeLine(line []byte, lineNo int) (sim.Request, error) {
	var m mooncakeLine
	dec := json.NewDecoder(bytes.NewReader(line))
	if err := dec.Decode(&m); err != nil {
		return sim.Request{}, fmt.Errorf("invalid JSON: %w", err)
	}
	if dec.More() {
		return sim.Request{}, errors.New("trailing data after the JSON object")
	}
	switch {
	case m.Timestamp == nil:
		return sim.Request{}, errors.New("missing timestamp")
	case m.InputLength == nil:
		return sim.Request{}, errors.New("missing input_length")
	case m.OutputLength == nil:
		return sim.Request{}, errors.New("missing output_length")
	}
	ts := *m.Timestamp
	if ts < 0 || math.IsNaN(ts) || ts > float64(math.MaxInt64/int64(time.Millisecond)) {
		return sim.Request{}, fmt.Errorf("timestamp %v: must be >= 0 ms and finite", ts)
	}
	if *m.InputLength > MaxTokens || *m.OutputLength > MaxTokens || *m.InputLength < math.MinInt32 || *m.OutputLength < math.MinInt32 {
		return sim.Request{}, checkLengths(clampInt(*m.InputLength), clampInt(*m.OutputLength))
	}
	in, out := int(*m.InputLength), int(*m.OutputLength)
	if err := checkLengths(in, out); err != nil {
		return sim.Request{}, err
	}
	n := len(m.HashIDs)
	full := in / MooncakeBlock
	ceil := (in + MooncakeBlock - 1) / MooncakeBlock
	if n != full && n != ceil {
		return sim.Request{}, fmt.Errorf("%d hash_ids for input_length %d: want %d (ceil) or %d (floor) blocks of %d", n, in, ceil, full, MooncakeBlock)
	}
	for i, id := range m.HashIDs {
		if id < 0 {
			return sim.Request{}, fmt.Errorf("hash_ids[%d] = %d: must be >= 0", i, id)
		}
	}
	toks := make([]uint32, 0, in)
	for _, id := range m.HashIDs {
		k := min(MooncakeBlock, in-len(toks))
		toks = appendTokens(toks, saltBlock, uint64(id), 0, k)
	}
	if tail := in - len(toks); tail > 0 { // floor convention
		toks = appendTokens(toks, saltUnique, uint64(lineNo), 0, tail)
	}
	return sim.Request{
		Arrival:   time.Duration(ts * float64(time.Millisecond)),
		Tokens:    toks,
		OutputLen: max(out, 1), // a request generates at least one token
	}, nil
}

func clampInt(v int64) int {
	return int(max(min(v, math.MaxInt32), math.MinInt32))
}
