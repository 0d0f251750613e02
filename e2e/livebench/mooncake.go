package livebench

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim/trace"
)

// maxTraceLine bounds one trace line, as routing/sim/trace does.
const maxTraceLine = 4 << 20

// ReadMooncake reads a Mooncake JSONL trace with routing/sim/trace's
// reader (the same validation, the same tokens per hash id: a hash id's
// 512-token block renders as the same 512 words wherever it appears, the
// last block cut to input_length) and turns it into a workload. The
// conversation trace's timestamps sit on a 3 s grid, which is detected
// and spread unless opt.Grid says otherwise.
//
// With opt.Window, lines whose timestamp is past the window are dropped
// before the reader synthesizes their tokens (an hour of the
// conversation trace holds about 150 M tokens).
func ReadMooncake(r io.Reader, opt Options) (Workload, trace.Report, error) {
	if err := opt.validate(); err != nil {
		return Workload{}, trace.Report{}, err
	}
	if opt.Window > 0 {
		kept, err := windowLines(r, opt.Window)
		if err != nil {
			return Workload{}, trace.Report{}, err
		}
		r = kept
	}
	reqs, rep, err := trace.ReadMooncake(r, trace.Options{Strict: opt.Strict})
	if err != nil {
		return Workload{}, rep, err
	}
	w, err := FromTrace(reqs, opt)
	return w, rep, err
}

// windowLines copies r, blanking the lines whose timestamp is at least
// window past the smallest timestamp seen before them (those are past
// the window whatever comes later). Blank lines keep the reader's line
// numbers right; lines that do not parse are kept for it to report.
func windowLines(r io.Reader, window time.Duration) (io.Reader, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxTraceLine)
	var out bytes.Buffer
	minTS := math.Inf(1)
	limit := float64(window) / float64(time.Millisecond)
	for sc.Scan() {
		var m struct {
			Timestamp *float64 `json:"timestamp"`
		}
		line := sc.Bytes()
		if json.Unmarshal(line, &m) == nil && m.Timestamp != nil && *m.Timestamp >= 0 {
			ts := *m.Timestamp
			if ts >= minTS+limit {
				out.WriteByte('\n')
				continue
			}
			minTS = min(minTS, ts)
		}
		out.Write(line)
		out.WriteByte('\n')
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading trace: %w", err)
	}
	return &out, nil
}
