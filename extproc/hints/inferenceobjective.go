package hints

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

// Results of [ResolvePriority] for the request's InferenceObjective. A
// request without the header, or naming an objective the pool does not
// have, keeps no priority of the objective's: GIE v1.5.0's EPP gives such a
// request the default priority 0, which is what kvbandit does with a
// request without a priority (not sheddable, no queue head start beyond its
// latency_sensitivity).
const (
	// ObjectiveNone: no objective header, no lookup configured, or (allow
	// mode) the request gave its own priority, which wins.
	ObjectiveNone = ""
	// ObjectiveFound: the objective's priority was applied, as the
	// request's priority or (cap mode) as the ceiling of the client's.
	ObjectiveFound = "found"
	// ObjectiveUnknown: the header named no known objective of the pool.
	ObjectiveUnknown = "unknown"
)
