package hints

import (
	"errors"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

// TestResolvePriority: the operator's client-priority policy against the
// request's InferenceObjective. By default (cap) a client's +1000 no longer
// overrides its objective's priority; it may still lower it.
func TestResolvePriority(t *testing.T) {
	lookup := prios{"gold": 10, "batch": -5}
	obj := func(v string) Getter {
		return func(name string) (string, bool) {
			if name == HeaderInferenceObjective && v != "" {
				return v, true
			}
			return "", false
		}
	}
	client := func(p int) routing.Hints { return routing.Hints{Priority: p, HasPriority: true} }
	capAt := func(m int) PriorityPolicy { return PriorityPolicy{Mode: ClientPriorityCap, Max: m, HasMax: true} }
	allow, ignore := PriorityPolicy{Mode: ClientPriorityAllow}, PriorityPolicy{Mode: ClientPriorityIgnore}
	for _, tc := range []struct {
		name      string
		objective string
		pol       PriorityPolicy
		in        routing.Hints
		obj, cli  string
		prio      int
		has       bool
		ls        float64
	}{
		{"default: +1000 capped at the objective", "gold", PriorityPolicy{}, client(MaxPriority), ObjectiveFound, ClientCapped, 10, true, 0},
		{"default: lower kept", "gold", PriorityPolicy{}, client(-1), ObjectiveFound, ClientKept, -1, true, 0},
		{"default: equal kept", "gold", PriorityPolicy{}, client(10), ObjectiveFound, ClientKept, 10, true, 0},
		{"default: sheddable objective caps", "batch", PriorityPolicy{}, client(3), ObjectiveFound, ClientCapped, -5, true, 0},
		{"default: no objective, no ceiling", "", PriorityPolicy{}, client(MaxPriority), ObjectiveNone, ClientKept, MaxPriority, true, 0},
		{"default: unknown objective, no ceiling", "nope", PriorityPolicy{}, client(7), ObjectiveUnknown, ClientKept, 7, true, 0},
		{"cap 0: no objective", "", capAt(0), client(MaxPriority), ObjectiveNone, ClientCapped, 0, true, 0},
		{"cap 0: lower kept", "", capAt(0), client(-3), ObjectiveNone, ClientKept, -3, true, 0},
		{"cap 5: latency sensitivity", "", capAt(5), routing.Hints{LatencySensitivity: 1000}, ObjectiveNone, ClientCapped, 0, false, 5},
		{"cap 5: objective is the ceiling", "gold", capAt(5), client(MaxPriority), ObjectiveFound, ClientCapped, 10, true, 0},
		{"cap: objective without client", "gold", capAt(0), routing.Hints{}, ObjectiveFound, ClientKept, 10, true, 0},
		{"allow: client wins", "gold", allow, client(MaxPriority), ObjectiveNone, ClientKept, MaxPriority, true, 0},
		{"allow: objective without client", "gold", allow, routing.Hints{}, ObjectiveFound, ClientKept, 10, true, 0},
		{"ignore: objective wins", "gold", ignore, client(MaxPriority), ObjectiveFound, ClientIgnored, 10, true, 0},
		{"ignore: lower dropped too", "gold", ignore, client(-1), ObjectiveFound, ClientIgnored, 10, true, 0},
		{"ignore: no objective", "", ignore, routing.Hints{Priority: 9, HasPriority: true, LatencySensitivity: 50}, ObjectiveNone, ClientIgnored, 0, false, 0},
		{"ignore: nothing given", "", ignore, routing.Hints{}, ObjectiveNone, ClientKept, 0, false, 0},
	} {
		h := tc.in
		o, c := ResolvePriority(obj(tc.objective), lookup, tc.pol, &h)
		if o != tc.obj || c != tc.cli || h.Priority != tc.prio || h.HasPriority != tc.has || h.LatencySensitivity != tc.ls {
			t.Errorf("%s: (%q, %q) priority %d (%v) ls %v; want (%q, %q) %d (%v) ls %v", tc.name, o, c, h.Priority, h.HasPriority, h.LatencySensitivity,
				tc.obj, tc.cli, tc.prio, tc.has, tc.ls)
		}
	}
}

func TestPriorityPolicyValidate(t *testing.T) {
	for _, ok := range []PriorityPolicy{{}, {Mode: "cap", Max: 0, HasMax: true}, {Mode: "allow"}, {Mode: "ignore"}, {Max: MaxPriority, HasMax: true}} {
		if err := ok.Validate(); err != nil {
			t.Errorf("%+v: %v", ok, err)
		}
	}
	for _, bad := range []PriorityPolicy{{Mode: "deny"}, {Mode: "CAP"}, {Max: -1, HasMax: true}, {Max: MaxPriority + 1, HasMax: true}} {
		if err := bad.Validate(); !errors.Is(err, ErrClientPriority) {
			t.Errorf("%+v: %v, want ErrClientPriority", bad, err)
		}
	}
}
