package trace

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim"
)

// MaxTokens is the largest input or output length accepted, in tokens.
const MaxTokens = 1_000_000

// maxLine bounds one trace line (a Mooncake line of 2,000 hash ids is
// about 16 KB).
const maxLine = 4 << 20

// Errors returned by the readers; line errors wrap ErrBadLine.
var (
	// ErrEmpty: the trace holds no request.
	ErrEmpty = errors.New("empty trace")
	// ErrBadLine: a line could not be parsed or holds impossible values.
	ErrBadLine = errors.New("bad trace line")
)

// Options tune a reader.
type Options struct {
	// Strict makes the first bad line fatal; otherwise bad lines are
	// skipped and counted in the Report.
	Strict bool
	// RateScale compresses arrivals: arrival / RateScale. 0 means 1.
	RateScale float64
	// Limit keeps only the first Limit requests (after sorting by
	// arrival); 0 keeps all.
	Limit int
	// Model is copied into every request.
	Model string
	// Jitter spreads arrivals: each request's arrival (in trace time,
	// before RateScale) moves later by a uniform draw in [0, Jitter),
	// seeded by JitterSeed, and the trace is sorted again. A trace whose
	// timestamps sit on a coarse grid (the Mooncake trace's 3 s) then
	// arrives spread within each step of the grid instead of in bursts at
	// one instant. 0 keeps the arrivals as stamped.
	Jitter     time.Duration
	JitterSeed uint64
}

// Report says what a reader did with its input.
type Report struct {
	// Lines is the number of data lines read (headers and blank lines
	// excluded).
	Lines int
	// Skipped is the number of bad lines skipped.
	Skipped int
	// Errors holds the first ten line errors.
	Errors []error
}

// maxReportErrors is how many line errors a Report keeps.
const maxReportErrors = 10

// LineError is a problem with one line of a trace.
type LineError struct {
	Line int // 1-based
	Err  error
}

func (e *LineError) Error() string { return fmt.Sprintf("line %d: %v", e.Line, e.Err) }

// Unwrap returns ErrBadLine and the cause.
func (e *LineError) Unwrap() []error { return []error{ErrBadLine, e.Err} }

// validate checks Options.
func (o Options) validate() error {
	if o.RateScale < 0 || o.RateScale != o.RateScale {
		return fmt.Errorf("rate scale %v: must be > 0", o.RateScale)
	}
	if o.Limit < 0 {
		return fmt.Errorf("limit %d: must be >= 0", o.Limit)
	}
	if o.Jitter < 0 {
		return fmt.Errorf("jitter %v: must be >= 0", o.Jitter)
	}
	return nil
}

// parseFunc parses one data line (lineNo is 1-based in the file).
type parseFunc func(line []byte, lineNo int) (sim.Request, error)

// readLines runs parse over every non-blank line after skip header lines,
// then sorts by arrival, applies Limit, RateScale and Model.
func readLines(r io.Reader, opt Options, header func([]byte) error, parse parseFunc) ([]sim.Request, Report, error) {
	var rep Report
	if err := opt.validate(); err != nil {
		return nil, rep, err
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxLine)
	var reqs []sim.Request
	lineNo := 0
	sawHeader := header == nil
	for sc.Scan() {
		lineNo++
		line := sc.Bytes()
		if len(trimSpace(line)) == 0 {
			continue
		}
		if !sawHeader {
			sawHeader = true
			if err := header(line); err != nil {
				return nil, rep, &LineError{Line: lineNo, Err: err}
			}
			continue
		}
		rep.Lines++
		req, err := parse(line, lineNo)
		if err != nil {
			le := &LineError{Line: lineNo, Err: err}
			if opt.Strict {
				return nil, rep, le
			}
			rep.Skipped++
			if len(rep.Errors) < maxReportErrors {
				rep.Errors = append(rep.Errors, le)
			}
			continue
		}
		reqs = append(reqs, req)
	}
	if err := sc.Err(); err != nil {
		return nil, rep, fmt.Errorf("line %d: %w", lineNo+1, err)
	}
	if len(reqs) == 0 {
		if rep.Skipped > 0 {
			return nil, rep, fmt.Errorf("%w: all %d lines bad (first: %w)", ErrEmpty, rep.Skipped, rep.Errors[0])
		}
		return nil, rep, ErrEmpty
	}
	finish(reqs, opt)
	if opt.Limit > 0 && len(reqs) > opt.Limit {
		reqs = reqs[:opt.Limit:opt.Limit]
	}
	return reqs, rep, nil
}

// finish sorts by arrival (stable: ties keep file order), spreads
// arrivals by Jitter (then sorts again), then scales arrivals and sets the
// model.
func finish(reqs []sim.Request, opt Options) {
	byArrival := func(a, b sim.Request) int {
		switch {
		case a.Arrival < b.Arrival:
			return -1
		case a.Arrival > b.Arrival:
			return 1
		}
		return 0
	}
	slices.SortStableFunc(reqs, byArrival)
	if opt.Jitter > 0 {
		rng := rand.New(rand.NewPCG(opt.JitterSeed, 0x6a09e667f3bcc909))
		for i := range reqs {
			reqs[i].Arrival += time.Duration(rng.Int64N(int64(opt.Jitter)))
		}
		slices.SortStableFunc(reqs, byArrival)
	}
	scale := opt.RateScale
	if scale == 0 {
		scale = 1
	}
	for i := range reqs {
		if scale != 1 {
			reqs[i].Arrival = time.Duration(float64(reqs[i].Arrival) / scale)
		}
		if opt.Model != "" {
			reqs[i].Model = opt.Model
		}
	}
}

func trimSpace(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t' || b[0] == '\r') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t' || b[len(b)-1] == '\r') {
		b = b[:len(b)-1]
	}
	return b
}

// checkLengths rejects negative and absurd lengths. An output length of 0
// is accepted and read as 1: the simulator, like vLLM, generates at least
// one token.
func checkLengths(in, out int) error {
	switch {
	case in <= 0:
		return fmt.Errorf("input length %d: must be > 0", in)
	case in > MaxTokens:
		return fmt.Errorf("input length %d: more than %d tokens", in, MaxTokens)
	case out < 0:
		return fmt.Errorf("output length %d: must be >= 0", out)
	case out > MaxTokens:
		return fmt.Errorf("output length %d: more than %d tokens", out, MaxTokens)
	}
	return nil
}
