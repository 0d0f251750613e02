// Package kube discovers workers in Kubernetes: a [discovery.Source] that
// follows one Gateway API Inference Extension InferencePool
// (inference.networking.k8s.io/v1) and the Pods it selects, or, in
// standalone mode, a fixed Pod label selector and target ports for
// clusters without the InferencePool CRD.
//
// # What it watches
//
// In pool mode, an informer watches the one InferencePool (a field
// selector on its name) and a second one the Pods of the pool's namespace
// that match the pool's spec.selector.matchLabels; when the selector is
// edited the Pod informer is replaced. The target ports come from the
// pool's spec.targetPorts. In standalone mode (Config.Pool empty), the
// selector and ports come from [Config]. Both modes need only namespaced
// RBAC: get, list and watch on pods (and, in pool mode, inferencepools in
// the group inference.networking.k8s.io) in the one namespace. The source
// never makes a cluster-scoped call.
//
// # The endpoint set
//
// Every Pod that is Ready (condition Ready=True), not terminating (no
// deletionTimestamp) and has a status.podIP becomes one endpoint per target
// port, "podIP:port". Pods without an IP are left out silently (they are
// still starting). The set is sorted by address and published as a whole
// (Source "kube") only once both informers have made their first full
// list, so the hub (and serve's readiness) stay not-ready until then; after
// that, changes are coalesced into at most one publish per 50 ms, and no
// change waits longer than that.
//
// A deleted pool publishes an empty set (the picker answers 503; readiness
// stays up) and a re-created one is followed. When the API server cannot
// be reached the source reports itself degraded and the last set keeps
// serving; once a probe List succeeds it clears the degraded state and
// restarts its informers, which re-list at once. RBAC denied at start (a
// forbidden preflight List) is returned by Run as an error naming the
// permissions needed, instead of being retried forever.
//
// # Pod labels and annotations
//
// Endpoint metadata comes from the Pod. Annotations:
//
//	kvbandit.io/models                  comma list of model names; default:
//	                                    the label llm-d.ai/model, else none
//	                                    (the endpoint serves every model)
//	kvbandit.io/adapters                comma list of LoRA adapters (none)
//	kvbandit.io/engine                  vllm or sglang (unknown)
//	kvbandit.io/block-size              KV block size in tokens, > 0
//	                                    (the router default)
//	kvbandit.io/max-num-batched-tokens  prefill tokens per step, > 0 (default)
//	kvbandit.io/data-parallel-size      data-parallel ranks, > 0 (one)
//	kvbandit.io/metrics-port            metrics at http://podIP:port/metrics
//	                                    (default: the target port)
//	kvbandit.io/kv-events-port          KV events at tcp://podIP:port,
//	                                    kvbandit connects (none: the
//	                                    approximate prefix index)
//	kvbandit.io/kv-events-replay-port   KV-events replay at tcp://podIP:port
//	kvbandit.io/role                    prefill, decode, both or
//	                                    prefill-decode; default: llm-d's
//	                                    label llm-d.ai/role, else both
//
// With several target ports (data-parallel ranks, one port each), the i-th
// target port (in spec order) gets kv-events-port+i and
// kv-events-replay-port+i, as vLLM offsets its publisher per rank. Each
// endpoint's labels are the Pod's labels plus "kvbandit.io/pod"
// (namespace/name).
//
// A Pod with a malformed value (engine "tgi", role "encode", block size "abc", a port out
// of range) is left out with a warning log and counted once per Pod
// version through [discovery.Sink.Skipped] with the reasons of
// [discovery.CheckRecord]; the other Pods keep working. Two Pods with the
// same address keep the first by name (the other is counted as a
// duplicate).
package kube
