// Package objectives follows the Gateway API Inference Extension
// InferenceObjective resources of one InferencePool and publishes, as an
// atomic snapshot, the priority of each objective by name.
//
// # What it reads
//
// The CRD is the one the project pins (GIE v1.5.0):
// inference.networking.x-k8s.io/v1alpha2, kind InferenceObjective, in the
// pool's namespace. An objective belongs to the pool when its
// spec.poolRef.name is the pool's name, spec.poolRef.group is
// inference.networking.k8s.io and spec.poolRef.kind is InferencePool
// (group and kind default to those when empty, as the CRD defaults them).
// Its spec.priority is an integer; unset means 0, as GIE's EPP treats it.
// Objectives of other pools, and ones being deleted, are ignored.
//
// A request names its objective by metadata.name in the
// x-gateway-inference-objective header (GIE's metadata.ObjectiveKey); the
// request side (extproc/hints) asks [Watcher.Priority]. That call reads an
// immutable map through an atomic pointer: no lock, no I/O.
//
// # Bounds
//
// At most Config.MaxObjectives (default [MaxObjectives]) objectives are
// kept, the first by name; the others are skipped with reason
// "over_limit". An object whose name is longer than [MaxNameLen] bytes,
// whose spec or poolRef is not an object, or whose priority is not an
// integer is skipped with reason "malformed". Each skipped object version
// is counted once and logged once; the rest keep working.
//
// # Availability
//
// Objectives are optional. When the API server does not serve the CRD
// (not installed) or the service account may not list or watch
// inferenceobjectives, the watcher logs a warning naming the cause, keeps
// an empty snapshot (every request then has the default priority, as GIE
// does for an unknown objective) and retries every [RetryInterval]. Once the
// first list succeeds an informer keeps the snapshot current; an API
// server outage afterwards keeps the last snapshot.
//
// RBAC: get, list and watch on inferenceobjectives in the group
// inference.networking.x-k8s.io, in the pool's namespace.
package objectives
