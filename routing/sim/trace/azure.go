package trace

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim"
)

// azureLayout parses the 2023 trace's timestamps, such as
// "2023-11-16 18:15:46.6805900" (the fraction is optional).
const azureLayout = "2006-01-02 15:04:05.999999999"

// ReadAzure reads an Azure LLM inference trace 2023 CSV
// (TIMESTAMP,ContextTokens,GeneratedTokens). Arrivals are relative to the
// earliest row (the first one in the published files). The trace carries
// no prefix information, so each request's tokens are its own.
func ReadAzure(r io.Reader, opt Options) ([]sim.Request, Report, error) {
	if err := opt.validate(); err != nil {
		return nil, Report{}, err
	}
	var first time.Time
	parse := func(line []byte, lineNo int) (sim.Request, error) {
		at, req, err := ParseAzureLine(line, lineNo)
		if err != nil {
			return req, err
		}
		// Arrival holds the absolute time (ns since the Unix epoch) until
		// the earliest row is known.
		req.Arrival = time.Duration(at.UnixNano())
		if first.IsZero() || at.Before(first) {
			first = at
		}
		return req, nil
	}
	reqs, rep, err := readLines(r, Options{Strict: opt.Strict}, azureHeader, parse)
	if err != nil {
		return nil, rep, err
	}
	base := time.Duration(first.UnixNano())
	for i := range reqs {
		reqs[i].Arrival -= base
	}
	finish(reqs, opt) // already sorted; spreads, scales and sets the model
	if opt.Limit > 0 && len(reqs) > opt.Limit {
		reqs = reqs[:opt.Limit:opt.Limit]
	}
	return reqs, rep, nil
}

// azureHeader checks the CSV header.
func azureHeader(line []byte) error {
	h := strings.ToLower(string(trimSpace(bytes.TrimPrefix(line, []byte("\xef\xbb\xbf")))))
	if h != "timestamp,contexttokens,generatedtokens" {
		return fmt.Errorf("header %q: want TIMESTAMP,ContextTokens,GeneratedTokens", h)
	}
	return nil
}

// ParseAzureLine parses one data row of the Azure 2023 CSV and returns its
// absolute timestamp and the request (Arrival unset); lineNo (1-based)
// seeds the request's tokens. Errors do not include the line number.
func ParseAzureLine(line []byte, lineNo int) (time.Time, sim.Request, error) {
	fields := strings.Split(string(trimSpace(line)), ",")
	if len(fields) != 3 {
		return time.Time{}, sim.Request{}, fmt.Errorf("%d fields: want 3 (TIMESTAMP,ContextTokens,GeneratedTokens)", len(fields))
	}
	at, err := time.Parse(azureLayout, strings.TrimSpace(fields[0]))
	if err != nil {
		return time.Time{}, sim.Request{}, fmt.Errorf("timestamp %q: want like 2023-11-16 18:15:46.6805900", fields[0])
	}
	if at.Year() < 1970 || at.Year() > 2200 {
		return time.Time{}, sim.Request{}, fmt.Errorf("timestamp %q: year out of range", fields[0])
	}
	in, err1 := strconv.ParseInt(strings.TrimSpace(fields[1]), 10, 64)
	out, err2 := strconv.ParseInt(strings.TrimSpace(fields[2]), 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return time.Time{}, sim.Request{}, fmt.Errorf("token counts: %w", err)
	}
	if err := checkLengths(clampInt(in), clampInt(out)); err != nil {
		return time.Time{}, sim.Request{}, err
	}
	toks := appendTokens(make([]uint32, 0, in), saltUnique, uint64(lineNo), 0, int(in))
	return at, sim.Request{Tokens: toks, OutputLen: max(int(out), 1)}, nil
}
