// Package hints turns a request's routing hints into [routing.Hints].
//
// Hints come in three forms (architecture.md, "Routing hints"): request
// headers (x-prefix-id, x-prefix-total-requests, x-prefix-osl, x-prefix-iat,
// x-request-priority), the structured nvext.agent_hints object, and
// "key:value" strings in nvext.annotations (prefix_id, total_requests, osl,
// iat). For each hint the first valid value in this order wins:
//
//  1. the header,
//  2. nvext.agent_hints,
//  3. nvext.annotations (the first entry with that key).
//
// A value that is present but invalid is skipped, counted in [Problems], and
// the next form is tried. Hints never fail a request: garbage only loses the
// hint. Defaults: no prefix id (a one-shot request), total requests 0
// (unknown), OSL and IAT [routing.LevelMedium], no priority.
//
// Values:
//
//   - prefix id: any string, trimmed of spaces; it must be valid UTF-8 of
//     printable characters (unicode.IsPrint) or it is ignored. It is then
//     bounded by [prefixstate.BoundID], the one rule for stored client ids:
//     an id longer than [MaxPrefixIDLen] bytes, or one starting with
//     "sha256:", is replaced by "sha256:" and the hex SHA-256 of the id, so
//     distinct ids stay distinct and the id stays short. In agent_hints it
//     must be a JSON string.
//   - total requests: an integer >= 0 (a JSON number or a string holding
//     one, "12", "12.0" and "1.2e1" alike), clamped to [MaxTotalRequests].
//   - OSL (tokens) and IAT (milliseconds): LOW, MEDIUM or HIGH in any case,
//     or a finite number >= 0 that maps to a level (OSL < 256 LOW, < 1024
//     MEDIUM, else HIGH; IAT < 100 ms LOW, < 500 ms MEDIUM, else HIGH) and
//     fills OSLTokens or IATMillis (truncated, clamped to 2^31-1).
//   - priority: an integer clamped to ±[MaxPriority]; HasPriority is set
//     only for a valid one. [ResolvePriority] then settles it against the
//     request's InferenceObjective under the operator's [PriorityPolicy]
//     (by default a client may not raise itself above its objective).
//   - latency sensitivity (agent_hints only): a finite number of seconds
//     >= 0, clamped to [MaxLatencySensitivity].
//
// Numbers are decimal (sign, digits, point, exponent; at most 64
// characters): hex, NaN, Inf and digit separators are invalid. A number too
// large for float64 counts as infinite and is clamped.
package hints

import (
	"errors"
	"math"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/tidwall/gjson"

	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// Getter returns a request header value by lower-case name; ok is false
// when the header is absent. A nil Getter means no headers.
type Getter func(name string) (string, bool)

// Hint header names.
const (
	HeaderPrefixID      = "x-prefix-id"
	HeaderTotalRequests = "x-prefix-total-requests"
	HeaderOSL           = "x-prefix-osl"
	HeaderIAT           = "x-prefix-iat"
	HeaderPriority      = "x-request-priority"
)

// Limits applied to hint values.
const (
	// MaxPrefixIDLen is the longest prefix id kept as is, in bytes.
	MaxPrefixIDLen = prefixstate.MaxIDLen
	// MaxTotalRequests caps total requests.
	MaxTotalRequests = 1 << 20
	// MaxPriority caps the priority's magnitude.
	MaxPriority = 1000
	// MaxLatencySensitivity caps latency sensitivity, in seconds (the
	// same head start as MaxPriority).
	MaxLatencySensitivity = 1000.0
	// maxRaw caps OSLTokens and IATMillis.
	maxRaw = math.MaxInt32
	// maxNumberLen is the longest text read as a number.
	maxNumberLen = 64
)

// Level thresholds, as in the reference router.
const (
	oslLowBelow, oslMediumBelow = 256, 1024 // tokens
	iatLowBelow, iatMediumBelow = 100, 500  // milliseconds
)

// Parse reads the hints of one request from its headers and nvext. It never
// fails; Problems describes the values it ignored, including the nvext
// values that openai.Parse skipped (openai.NVExt.Ignored).
func Parse(h Getter, nv openai.NVExt) (routing.Hints, Problems) {
	p := parser{h: h}
	for _, name := range nv.Ignored {
		p.problems.add(name)
	}
	p.annotations(nv.Annotations)
	out := routing.Hints{OSL: routing.LevelMedium, IAT: routing.LevelMedium}
	ah := &nv.AgentHints
	p.first(HeaderPrefixID, ah.PrefixID, "prefix_id", annPrefixID, func(v value) (ok bool) {
		out.PrefixID, ok = prefixID(v)
		return ok
	})
	p.first(HeaderTotalRequests, ah.TotalRequests, "total_requests", annTotalRequests, func(v value) (ok bool) {
		out.TotalRequests, ok = integer(v, 0, MaxTotalRequests)
		return ok
	})
	p.first(HeaderOSL, ah.OSL, "osl", annOSL, func(v value) (ok bool) {
		out.OSL, out.OSLTokens, ok = level(v, oslLowBelow, oslMediumBelow)
		return ok
	})
	p.first(HeaderIAT, ah.IAT, "iat", annIAT, func(v value) (ok bool) {
		out.IAT, out.IATMillis, ok = level(v, iatLowBelow, iatMediumBelow)
		return ok
	})
	p.first(HeaderPriority, ah.Priority, "priority", -1, func(v value) (ok bool) {
		out.Priority, ok = integer(v, -MaxPriority, MaxPriority)
		out.HasPriority = ok
		return ok
	})
	p.first("", ah.LatencySensitivity, "latency_sensitivity", -1, func(v value) bool {
		f, ok := number(v)
		if !ok || f < 0 {
			return false
		}
		out.LatencySensitivity = min(f, MaxLatencySensitivity)
		return true
	})
	if out.OSL == routing.LevelUnset {
		out.OSL = routing.LevelMedium
	}
	if out.IAT == routing.LevelUnset {
		out.IAT = routing.LevelMedium
	}
	return out, p.problems
}

// Annotation keys, as indexes into parser.ann.
const (
	annPrefixID = iota
	annTotalRequests
	annOSL
	annIAT
	annCount
)

// annKey returns the annotation key of index i.
func annKey(i int) string {
	switch i {
	case annPrefixID:
		return "prefix_id"
	case annTotalRequests:
		return "total_requests"
	case annOSL:
		return "osl"
	}
	return "iat"
}

type parser struct {
	h        Getter
	ann      [annCount]string
	hasAnn   [annCount]bool
	problems Problems
}

// annotations indexes the first annotation of each hint key.
func (p *parser) annotations(list []string) {
	for _, a := range list {
		k, v, ok := strings.Cut(a, ":")
		if !ok {
			continue
		}
		k = strings.TrimSpace(k)
		for i := range annCount {
			if !p.hasAnn[i] && k == annKey(i) {
				p.ann[i], p.hasAnn[i] = v, true
			}
		}
	}
}

// Where a hint value came from.
const (
	fromHeader = iota
	fromAgentHints
	fromAnnotation
)

// value is one form of a hint that is present.
type value struct {
	from     int
	key      string // header name, agent_hints field or annotation key
	text     string // the value as text
	isNumber bool   // a JSON number (agent_hints)
	badType  bool   // a JSON value that is neither string nor number
}

// name names the value in Problems.
func (v value) name() string {
	switch v.from {
	case fromAgentHints:
		return "nvext.agent_hints." + v.key
	case fromAnnotation:
		return "nvext.annotations:" + v.key
	}
	return v.key
}

// first offers the present forms of one hint to try, in precedence order,
// until try accepts one; each form it rejects is a problem.
func (p *parser) first(header, agentRaw, agentField string, ann int, try func(value) bool) {
	vs, n := p.sources(header, agentRaw, agentField, ann)
	for _, v := range vs[:n] {
		if try(v) {
			return
		}
		p.problems.add(v.name())
	}
}

// sources returns the present forms of one hint in precedence order: the
// header (if named), the agent_hints field (raw JSON) and the annotation (if
// ann >= 0). Empty and all-space values count as absent.
func (p *parser) sources(header, agentRaw, agentField string, ann int) ([3]value, int) {
	var out [3]value
	n := 0
	if header != "" && p.h != nil {
		if s, ok := p.h(header); ok && strings.TrimSpace(s) != "" {
			out[n] = value{from: fromHeader, key: header, text: s}
			n++
		}
	}
	if agentRaw != "" {
		v := value{from: fromAgentHints, key: agentField}
		present := true
		switch r := gjson.Parse(agentRaw); r.Type {
		case gjson.Null:
			present = false
		case gjson.String:
			v.text = r.Str
			present = strings.TrimSpace(v.text) != ""
		case gjson.Number:
			v.text, v.isNumber = r.Raw, true
		default:
			v.badType = true
		}
		if present {
			out[n] = v
			n++
		}
	}
	if ann >= 0 && p.hasAnn[ann] && strings.TrimSpace(p.ann[ann]) != "" {
		out[n] = value{from: fromAnnotation, key: annKey(ann), text: p.ann[ann]}
		n++
	}
	return out, n
}

// prefixID validates and normalizes a prefix id.
func prefixID(v value) (string, bool) {
	if v.isNumber || v.badType {
		return "", false
	}
	s := strings.TrimSpace(v.text)
	if s == "" || !utf8.ValidString(s) {
		return "", false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) {
			return "", false
		}
	}
	return prefixstate.BoundID(s), true
}

// number reads a finite decimal number; a syntactically valid number beyond
// float64's range is returned as ±Inf, for clamping.
func number(v value) (float64, bool) {
	if v.badType {
		return 0, false
	}
	s := strings.TrimSpace(v.text)
	if s == "" || len(s) > maxNumberLen {
		return 0, false
	}
	digits := false
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c >= '0' && c <= '9':
			digits = true
		case c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-':
		default:
			return 0, false
		}
	}
	if !digits {
		return 0, false
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil && !errors.Is(err, strconv.ErrRange) {
		return 0, false
	}
	if math.IsNaN(f) {
		return 0, false
	}
	return f, true
}

// integer reads an integral number and clamps it to [lo, hi]; a number
// below lo is invalid when lo is 0 (counts), clamped otherwise.
func integer(v value, lo, hi int) (int, bool) {
	f, ok := number(v)
	if !ok || (!math.IsInf(f, 0) && f != math.Trunc(f)) {
		return 0, false
	}
	switch {
	case f < 0 && lo == 0:
		return 0, false
	case f <= float64(lo):
		return lo, true
	case f >= float64(hi):
		return hi, true
	}
	return int(f), true
}

// level reads LOW/MEDIUM/HIGH or a number >= 0, which maps to a level with
// the two thresholds and is returned truncated as raw.
func level(v value, lowBelow, mediumBelow float64) (l routing.Level, raw int, ok bool) {
	if v.badType {
		return routing.LevelUnset, 0, false
	}
	t := strings.TrimSpace(v.text)
	switch {
	case strings.EqualFold(t, "low"):
		return routing.LevelLow, 0, true
	case strings.EqualFold(t, "medium"):
		return routing.LevelMedium, 0, true
	case strings.EqualFold(t, "high"):
		return routing.LevelHigh, 0, true
	}
	f, ok := number(v)
	if !ok || f < 0 {
		return routing.LevelUnset, 0, false
	}
	switch {
	case f < lowBelow:
		l = routing.LevelLow
	case f < mediumBelow:
		l = routing.LevelMedium
	default:
		l = routing.LevelHigh
	}
	return l, int(min(f, maxRaw)), true
}
