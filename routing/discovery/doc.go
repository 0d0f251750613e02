// Package discovery finds the workers. Sources (static, file, etcd, and the
// Kubernetes InferencePool in gateway-api/) each publish whole endpoint sets
// to a [Hub]; the hub validates a set, swaps it into the routing engine, and
// tells its followers (KV-event subscribers, the EDS server).
//
// A source that loses its backend (etcd unreachable) keeps its last set
// published and reports itself degraded through [Sink.SetDegraded]: the
// picker keeps serving the last known fleet, readiness does not change, and
// a metric and the logs say "degraded" until the source recovers.
//
// With a [Gate] (the EDS server), a new endpoint becomes pickable only once
// the data plane has acknowledged a version that contains it, and an
// endpoint that left stays offered to the data plane until the decisions
// in flight to it have ended.
package discovery
