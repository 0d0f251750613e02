package hints

import (
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

type prios map[string]int

func (m prios) Priority(name string) (int, bool) { p, ok := m[name]; return p, ok }

func TestResolvePriorityObjective(t *testing.T) {
	lookup := prios{"gold": 10, "batch": -5, "min": -1 << 40, strings.Repeat("a", MaxObjectiveNameLen): 7}
	hdr := func(v string) Getter {
		return func(name string) (string, bool) {
			if name == HeaderInferenceObjective && v != "\x00" {
				return v, true
			}
			return "", false
		}
	}
	for _, tc := range []struct {
		name   string
		g      Getter
		p      Priorities
		in     routing.Hints
		result string
		prio   int
		has    bool
	}{
		{"found", hdr("gold"), lookup, routing.Hints{}, ObjectiveFound, 10, true},
		{"trimmed", hdr("  batch\t"), lookup, routing.Hints{}, ObjectiveFound, -5, true},
		{"clamped", hdr("min"), lookup, routing.Hints{}, ObjectiveFound, -MaxPriority, true},
		{"longest name", hdr(strings.Repeat("a", MaxObjectiveNameLen)), lookup, routing.Hints{}, ObjectiveFound, 7, true},
		{"too long", hdr(strings.Repeat("a", MaxObjectiveNameLen+1)), lookup, routing.Hints{}, ObjectiveUnknown, 0, false},
		{"unknown", hdr("silver"), lookup, routing.Hints{}, ObjectiveUnknown, 0, false},
		{"blank", hdr("  "), lookup, routing.Hints{}, ObjectiveNone, 0, false},
		{"absent", hdr("\x00"), lookup, routing.Hints{}, ObjectiveNone, 0, false},
		{"own lower priority", hdr("gold"), lookup, routing.Hints{Priority: 2, HasPriority: true}, ObjectiveFound, 2, true},
		{"own higher priority capped", hdr("gold"), lookup, routing.Hints{Priority: MaxPriority, HasPriority: true}, ObjectiveFound, 10, true},
		{"no lookup", hdr("gold"), nil, routing.Hints{}, ObjectiveNone, 0, false},
		{"no headers", nil, lookup, routing.Hints{}, ObjectiveNone, 0, false},
	} {
		h := tc.in
		if r, _ := ResolvePriority(tc.g, tc.p, PriorityPolicy{}, &h); r != tc.result || h.Priority != tc.prio || h.HasPriority != tc.has {
			t.Errorf("%s: %q, priority %d (%v); want %q, %d (%v)", tc.name, r, h.Priority, h.HasPriority, tc.result, tc.prio, tc.has)
		}
	}
	// A negative objective priority makes the request sheddable.
	h := routing.Hints{}
	ResolvePriority(hdr("batch"), lookup, PriorityPolicy{}, &h)
	if !h.Sheddable() {
		t.Error("a negative objective priority is not sheddable")
	}
}
