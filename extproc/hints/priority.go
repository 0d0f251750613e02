package hints

import (
	"errors"
	"fmt"
	"strings"

	"github.com/kvbandit/kvbandit/routing"
)

// ClientPriority says what kvbandit does with the priority a client gives
// itself (x-request-priority, nvext.agent_hints.priority and
// nvext.agent_hints.latency_sensitivity).
type ClientPriority string

// Client priority modes (serve --client-priority, config
// router.client_priority).
const (
	// ClientPriorityCap, the default (also ""): a client may lower its
	// priority freely but never raise it above a ceiling: the priority
	// of the request's InferenceObjective when one applies, else
	// PriorityPolicy.Max.
	ClientPriorityCap ClientPriority = "cap"
	// ClientPriorityAllow: a client's own priority wins over its
	// InferenceObjective's (kvbandit before this switch).
	ClientPriorityAllow ClientPriority = "allow"
	// ClientPriorityIgnore: client priorities are dropped; only an
	// InferenceObjective gives a request a priority.
	ClientPriorityIgnore ClientPriority = "ignore"
)

// ErrClientPriority: an invalid client priority mode or ceiling.
var ErrClientPriority = errors.New("invalid client priority policy")

// PriorityPolicy is the operator's rule for client priorities. The zero
// value is cap mode with a ceiling of [MaxPriority] when no objective
// applies.
type PriorityPolicy struct {
	// Mode: "" means [ClientPriorityCap].
	Mode ClientPriority
	// Max is, in cap mode, the highest priority (and latency sensitivity,
	// in seconds: the same queue head start) a client may give itself
	// when no InferenceObjective applies, in [0, MaxPriority]; used only
	// when HasMax is set (else MaxPriority).
	Max    int
	HasMax bool
}

// ParseClientPriority checks a mode name ("" is cap).
func ParseClientPriority(s string) (ClientPriority, error) {
	switch m := ClientPriority(strings.TrimSpace(s)); m {
	case "", ClientPriorityCap:
		return ClientPriorityCap, nil
	case ClientPriorityAllow, ClientPriorityIgnore:
		return m, nil
	}
	return "", fmt.Errorf("%w: want allow, cap or ignore, got %q", ErrClientPriority, s)
}

// Validate checks the mode and the ceiling.
func (p PriorityPolicy) Validate() error {
	if _, err := ParseClientPriority(string(p.Mode)); err != nil {
		return err
	}
	if p.HasMax && (p.Max < 0 || p.Max > MaxPriority) {
		return fmt.Errorf("%w: the ceiling must be in [0, %d], got %d", ErrClientPriority, MaxPriority, p.Max)
	}
	return nil
}

// ceiling is the cap-mode ceiling without an objective.
func (p PriorityPolicy) ceiling() int {
	if p.HasMax {
		return min(max(p.Max, 0), MaxPriority)
	}
	return MaxPriority
}

// What [ResolvePriority] did with the client's own priority.
const (
	// ClientKept: no client priority, or it was kept as given.
	ClientKept = ""
	// ClientCapped: the client's priority (or latency sensitivity) was
	// lowered to the ceiling.
	ClientCapped = "capped"
	// ClientIgnored: the client's priority was dropped (ignore mode).
	ClientIgnored = "ignored"
)

// ResolvePriority settles a request's priority from the client's hints (h,
// as [Parse] left them), the request's InferenceObjective (named by
// [HeaderInferenceObjective], looked up in p) and the operator's policy:
//
//   - allow: the client's priority wins; the objective's applies when the
//     client gave none (the objective is not looked up otherwise).
//   - cap (default): the objective's priority applies when the client gave
//     none; a client's own priority is kept when it is at most the ceiling
//     (the objective's priority when the request names a known objective,
//     else pol's Max) and lowered to it otherwise. latency_sensitivity,
//     a head start in seconds, is bounded by the same ceiling.
//   - ignore: the client's priority and latency sensitivity are dropped;
//     the objective's priority applies when there is one.
//
// An invalid pol.Mode (Validate rejects it) counts as cap. objective is one
// of the Objective* results, client one of the Client*.
// The objective's priority is clamped to ±[MaxPriority], as a hinted one.
func ResolvePriority(g Getter, p Priorities, pol PriorityPolicy, h *routing.Hints) (objective, client string) {
	mode, err := ParseClientPriority(string(pol.Mode))
	if err != nil {
		mode = ClientPriorityCap
	}
	if mode == ClientPriorityAllow && h.HasPriority {
		return ObjectiveNone, ClientKept
	}
	objective, prio := lookupObjective(g, p)
	switch mode {
	case ClientPriorityIgnore:
		if h.HasPriority || h.LatencySensitivity > 0 {
			client = ClientIgnored
		}
		h.Priority, h.HasPriority, h.LatencySensitivity = 0, false, 0
	case ClientPriorityCap:
		ceil := pol.ceiling()
		if objective == ObjectiveFound {
			ceil = prio
		}
		if h.HasPriority && h.Priority > ceil {
			h.Priority, client = ceil, ClientCapped
		}
		if !h.HasPriority && objective != ObjectiveFound && h.LatencySensitivity > float64(max(ceil, 0)) {
			h.LatencySensitivity, client = float64(max(ceil, 0)), ClientCapped
		}
		if h.HasPriority {
			return objective, client
		}
	}
	if objective == ObjectiveFound {
		h.Priority, h.HasPriority = prio, true
	}
	return objective, client
}

// lookupObjective finds the request's InferenceObjective priority, clamped
// to ±MaxPriority.
func lookupObjective(g Getter, p Priorities) (result string, priority int) {
	if g == nil || p == nil {
		return ObjectiveNone, 0
	}
	name, ok := g(HeaderInferenceObjective)
	if !ok {
		return ObjectiveNone, 0
	}
	name = strings.TrimSpace(name)
	if name == "" {
		return ObjectiveNone, 0
	}
	if len(name) > MaxObjectiveNameLen {
		return ObjectiveUnknown, 0
	}
	prio, ok := p.Priority(name)
	if !ok {
		return ObjectiveUnknown, 0
	}
	return ObjectiveFound, min(max(prio, -MaxPriority), MaxPriority)
}
