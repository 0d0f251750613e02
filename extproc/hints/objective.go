package hints

import (
	"math"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/extproc/openai"
)

// Objective headers. x-slo-ttft-ms is the name llm-d's EPP used before it
// moved to x-llm-d-slo-ttft-ms; both are read, the first one present wins.
const (
	HeaderSLOTTFT      = "x-slo-ttft-ms"
	HeaderLLMDSLOTTFT  = "x-llm-d-slo-ttft-ms"
	agentFieldSLOTTFT  = "ttft_slo_ms"
	objectiveReasonFmt = "must be a number of milliseconds in [1, 600000]"
)

// Bounds of a TTFT objective.
const (
	MinObjective = time.Millisecond
	MaxObjective = 10 * time.Minute
)

// Objective reads the request's time-to-first-token objective: the
// x-slo-ttft-ms header, else x-llm-d-slo-ttft-ms, else
// nvext.agent_hints.ttft_slo_ms, in milliseconds (a decimal number,
// fractions allowed, within [MinObjective, MaxObjective]). 0 means none.
//
// Unlike the other hints, a present but invalid objective is an error (an
// [openai.FieldError] wrapping [openai.ErrInvalidField], HTTP 400): a
// client that states a latency contract must learn that it was not
// understood rather than be routed as if it had none. An invalid
// higher-precedence form is not skipped for a lower one.
//
// nvext.agent_hints.latency_sensitivity is not an objective: it keeps
// Dynamo's meaning, a queue head start in seconds (see [Parse]).
func Objective(h Getter, nv openai.NVExt) (time.Duration, error) {
	if h != nil {
		for _, name := range [...]string{HeaderSLOTTFT, HeaderLLMDSLOTTFT} {
			if s, ok := h(name); ok && strings.TrimSpace(s) != "" {
				return objective(value{from: fromHeader, key: name, text: s})
			}
		}
	}
	raw := nv.AgentHints.TTFTSLOMillis
	if raw == "" {
		return 0, nil
	}
	v, n := (&parser{}).sources("", raw, agentFieldSLOTTFT, -1)
	if n == 0 {
		return 0, nil // null or blank
	}
	return objective(v[0])
}

func objective(v value) (time.Duration, error) {
	f, ok := number(v)
	d := time.Duration(f * float64(time.Millisecond))
	if !ok || math.IsInf(f, 0) || f > float64(MaxObjective/time.Millisecond) || d < MinObjective {
		return 0, &openai.FieldError{Field: v.name(), Reason: objectiveReasonFmt, Err: openai.ErrInvalidField}
	}
	return d, nil
}
