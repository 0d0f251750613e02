package decisionlog

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// Format is the log's file format.
type Format uint8

// Formats.
const (
	// CSV: a header line, then one row per record.
	CSV Format = iota + 1
	// JSONL: one JSON object per line (JSON Lines).
	JSONL
)

// String returns "csv" or "jsonl".
func (f Format) String() string {
	switch f {
	case CSV:
		return "csv"
	case JSONL:
		return "jsonl"
	}
	return fmt.Sprintf("Format(%d)", uint8(f))
}

// ParseFormat parses "csv" or "jsonl" (case-insensitive; "json" and
// "ndjson" are accepted for JSONL).
func ParseFormat(s string) (Format, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "csv":
		return CSV, nil
	case "jsonl", "json", "ndjson":
		return JSONL, nil
	}
	return 0, fmt.Errorf("decisionlog: unknown format %q (want csv or jsonl)", s)
}

// Score is one endpoint's score in a decision.
type Score struct {
	// Endpoint is the endpoint's "ip:port"; for data-parallel ranks the
	// caller may append the rank (for example "10.0.0.1:8000/1"), since a
	// JSON object cannot hold one key twice.
	Endpoint string
	// Score is the policy's score; NaN is allowed.
	Score float64
}

// Record is one routing decision. The first eleven fields are the
// reference router's CSV columns, in order.
type Record struct {
	// Time is the decision time (ts_epoch_ms, milliseconds since the
	// epoch). The zero value means the time the writer wrote the record.
	Time time.Time
	// TokensLen is the prompt length in tokens (tokens_len).
	TokensLen int
	// PrefixID is the prefix (session) id (prefix_id), bounded by
	// [Log.Record].
	PrefixID string
	// ReuseAfter is the prefix's remaining reuse budget after this request
	// (reuse_after).
	ReuseAfter int
	// ChosenWorker is the chosen endpoint's "ip:port" (chosen_worker).
	ChosenWorker string
	// OverlapChosen is the KV overlap on the chosen endpoint
	// (overlap_chosen): the reference router logs the cached fraction of
	// the prompt in [0, 1].
	OverlapChosen float64
	// DecodeCost and PrefillCost are the policy's cost estimates for the
	// chosen endpoint (decode_cost, prefill_cost).
	DecodeCost  float64
	PrefillCost float64
	// IATLevel is the inter-arrival hint level: LOW, MEDIUM, HIGH or empty
	// (iat_level).
	IATLevel string
	// Stickiness is 1 when the previous endpoint of the prefix was chosen
	// again, else 0 (stickiness).
	Stickiness float64
	// LoadMod is the load modifier applied to the chosen endpoint's score
	// (load_mod).
	LoadMod float64

	// DecisionID identifies the decision (decision_id).
	DecisionID string
	// Policy is the deciding policy's name (policy).
	Policy string
	// Tenant is the request's tenant (tenant), bounded by [Log.Record].
	Tenant string
	// DPRank is the chosen data-parallel rank, -1 for a single-rank
	// endpoint (dp_rank).
	DPRank int
	// EstimatedTokens is set when TokensLen is a byte-based estimate rather
	// than the tokenizer's count (estimated_tokens).
	EstimatedTokens bool
	// Scores are the per-endpoint scores (scores). [Log.Record] takes
	// ownership of the slice: the caller must not modify it afterwards.
	Scores []Score
}

// Columns returns the CSV header's column names, in order. The JSONL keys
// are the same names.
func Columns() []string {
	return []string{
		"ts_epoch_ms", "tokens_len", "prefix_id", "reuse_after", "chosen_worker",
		"overlap_chosen", "decode_cost", "prefill_cost", "iat_level", "stickiness", "load_mod",
		"decision_id", "policy", "tenant", "dp_rank", "estimated_tokens", "scores",
	}
}

func csvHeader() []byte { return []byte(strings.Join(Columns(), ",") + "\n") }

// appendCSV appends r as one CSV row (RFC 4180 quoting) with a trailing
// newline.
func appendCSV(b []byte, r *Record) []byte {
	b = strconv.AppendInt(b, r.Time.UnixMilli(), 10)
	b = append(b, ',')
	b = strconv.AppendInt(b, int64(r.TokensLen), 10)
	b = append(b, ',')
	b = appendCSVString(b, r.PrefixID)
	b = append(b, ',')
	b = strconv.AppendInt(b, int64(r.ReuseAfter), 10)
	b = append(b, ',')
	b = appendCSVString(b, r.ChosenWorker)
	b = append(b, ',')
	b = appendCSVFloat(b, r.OverlapChosen)
	b = append(b, ',')
	b = appendCSVFloat(b, r.DecodeCost)
	b = append(b, ',')
	b = appendCSVFloat(b, r.PrefillCost)
	b = append(b, ',')
	b = appendCSVString(b, r.IATLevel)
	b = append(b, ',')
	b = appendCSVFloat(b, r.Stickiness)
	b = append(b, ',')
	b = appendCSVFloat(b, r.LoadMod)
	b = append(b, ',')
	b = appendCSVString(b, r.DecisionID)
	b = append(b, ',')
	b = appendCSVString(b, r.Policy)
	b = append(b, ',')
	b = appendCSVString(b, r.Tenant)
	b = append(b, ',')
	b = strconv.AppendInt(b, int64(r.DPRank), 10)
	b = append(b, ',')
	b = strconv.AppendBool(b, r.EstimatedTokens)
	b = append(b, ',')
	// scores: "ep=score;ep=score", quoted as a whole if needed.
	start := len(b)
	for i, s := range r.Scores {
		if i > 0 {
			b = append(b, ';')
		}
		b = append(b, s.Endpoint...)
		b = append(b, '=')
		b = appendCSVFloat(b, s.Score)
	}
	if scores := b[start:]; needsCSVQuote(scores) {
		b = appendCSVString(b[:start], string(scores)) // rare: copies
	}
	return append(b, '\n')
}

// appendCSVFloat writes the shortest representation that round-trips;
// NaN, +Inf and -Inf are written as such.
func appendCSVFloat(b []byte, f float64) []byte {
	return strconv.AppendFloat(b, f, 'g', -1, 64)
}

// needsCSVQuote reports whether a field must be quoted: it holds a comma,
// quote or line break, or starts with a space (which some readers trim).
func needsCSVQuote[T string | []byte](s T) bool {
	for i := range len(s) {
		switch s[i] {
		case ',', '"', '\r', '\n':
			return true
		case ' ', '\t':
			if i == 0 {
				return true
			}
		}
	}
	return false
}

func appendCSVString(b []byte, s string) []byte {
	if !needsCSVQuote(s) {
		return append(b, s...)
	}
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		if s[i] == '"' {
			b = append(b, '"')
		}
		b = append(b, s[i])
	}
	return append(b, '"')
}

// appendJSON appends r as one JSON object with a trailing newline.
func appendJSON(b []byte, r *Record) []byte {
	b = append(b, `{"ts_epoch_ms":`...)
	b = strconv.AppendInt(b, r.Time.UnixMilli(), 10)
	b = append(b, `,"tokens_len":`...)
	b = strconv.AppendInt(b, int64(r.TokensLen), 10)
	b = append(b, `,"prefix_id":`...)
	b = appendJSONString(b, r.PrefixID)
	b = append(b, `,"reuse_after":`...)
	b = strconv.AppendInt(b, int64(r.ReuseAfter), 10)
	b = append(b, `,"chosen_worker":`...)
	b = appendJSONString(b, r.ChosenWorker)
	b = append(b, `,"overlap_chosen":`...)
	b = appendJSONFloat(b, r.OverlapChosen)
	b = append(b, `,"decode_cost":`...)
	b = appendJSONFloat(b, r.DecodeCost)
	b = append(b, `,"prefill_cost":`...)
	b = appendJSONFloat(b, r.PrefillCost)
	b = append(b, `,"iat_level":`...)
	b = appendJSONString(b, r.IATLevel)
	b = append(b, `,"stickiness":`...)
	b = appendJSONFloat(b, r.Stickiness)
	b = append(b, `,"load_mod":`...)
	b = appendJSONFloat(b, r.LoadMod)
	b = append(b, `,"decision_id":`...)
	b = appendJSONString(b, r.DecisionID)
	b = append(b, `,"policy":`...)
	b = appendJSONString(b, r.Policy)
	b = append(b, `,"tenant":`...)
	b = appendJSONString(b, r.Tenant)
	b = append(b, `,"dp_rank":`...)
	b = strconv.AppendInt(b, int64(r.DPRank), 10)
	b = append(b, `,"estimated_tokens":`...)
	b = strconv.AppendBool(b, r.EstimatedTokens)
	b = append(b, `,"scores":{`...)
	for i, s := range r.Scores {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendJSONString(b, s.Endpoint)
		b = append(b, ':')
		b = appendJSONFloat(b, s.Score)
	}
	return append(b, "}}\n"...)
}

// appendJSONFloat writes f like encoding/json (shortest round-trip form,
// exponent form outside [1e-6, 1e21)) and null for NaN and ±Inf, which
// JSON cannot represent.
func appendJSONFloat(b []byte, f float64) []byte {
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return append(b, "null"...)
	}
	if abs := math.Abs(f); abs != 0 && (abs < 1e-6 || abs >= 1e21) {
		return strconv.AppendFloat(b, f, 'e', -1, 64)
	}
	return strconv.AppendFloat(b, f, 'f', -1, 64)
}

const hexDigits = "0123456789abcdef"

// appendJSONString appends s as a JSON string; invalid UTF-8 becomes
// U+FFFD, as encoding/json does.
func appendJSONString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		// U+2028 and U+2029 are valid JSON but break JavaScript parsers.
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}
