package hints

import (
	"strings"

	"github.com/kvbandit/kvbandit/routing"
)

// HeaderInferenceObjective names the request's InferenceObjective (the
// Gateway API Inference Extension's header, its metadata.ObjectiveKey): the
// value is the objective's metadata.name in the pool's namespace.
const HeaderInferenceObjective = "x-gateway-inference-objective"

// MaxObjectiveNameLen is the longest objective name looked up (a
// Kubernetes object name's bound); a longer value is unknown.
const MaxObjectiveNameLen = 253

// Priorities gives the priority of an InferenceObjective by name (the
// Kubernetes watcher, routing/discovery/kube/objectives). It must not block.
type Priorities interface {
	Priority(name string) (priority int, ok bool)
}

// Results of [ApplyObjective].
const (
	// ObjectiveNone: no objective header, no lookup configured, or the
	// request already gave its own priority.
	ObjectiveNone = ""
	// ObjectiveFound: the objective's priority was applied.
	ObjectiveFound = "found"
	// ObjectiveUnknown: the header named no known objective of the pool.
	ObjectiveUnknown = "unknown"
)

// ApplyObjective fills h.Priority from the request's InferenceObjective
// when the request gave no priority of its own (x-request-priority or
// nvext.agent_hints.priority win over it). The priority is clamped to
// ±[MaxPriority], as a hinted one.
//
// A request without the header, or naming an objective the pool does not
// have, keeps no priority: GIE v1.5.0's EPP gives such a request the
// default priority 0, which is what kvbandit does with a request without a
// priority (not sheddable, no queue head start beyond its
// latency_sensitivity).
func ApplyObjective(g Getter, p Priorities, h *routing.Hints) string {
	if g == nil || p == nil || h.HasPriority {
		return ObjectiveNone
	}
	name, ok := g(HeaderInferenceObjective)
	if !ok {
		return ObjectiveNone
	}
	name = strings.TrimSpace(name)
	if name == "" {
		return ObjectiveNone
	}
	if len(name) > MaxObjectiveNameLen {
		return ObjectiveUnknown
	}
	prio, ok := p.Priority(name)
	if !ok {
		return ObjectiveUnknown
	}
	h.Priority, h.HasPriority = min(max(prio, -MaxPriority), MaxPriority), true
	return ObjectiveFound
}
