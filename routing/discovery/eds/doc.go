// Package eds is kvbandit's EDS server: it keeps Envoy's worker cluster in
// step with kvbandit's endpoint set, and it is the [discovery.Gate] that
// holds a new endpoint back until every Envoy has it.
//
// # Overview
//
// Envoy's worker cluster uses the override_host load-balancing policy, and
// override_host only sends a request to a host that exists in the cluster.
// With dynamic discovery (etcd, Kubernetes) that cluster is of type EDS and
// its ClusterLoadAssignment comes from this server (envoy/eds.yaml).
//
// [Server.Offer] (called by the [discovery.Hub] on every set change) builds
// one ClusterLoadAssignment for [Config.Cluster] holding the desired
// endpoints and the lingering ones (endpoints that left but still have
// decisions in flight; override_host must still reach them, so they stay
// HEALTHY, not DRAINING). Each endpoint is a socket address ip:port (IPv6
// too); nothing else about it (models, data-parallel ranks) goes to Envoy.
// The version, a decimal counter, is bumped only when the set of addresses
// changes, and the new assignment is pushed to every connected stream.
//
// # Protocol
//
// The server speaks state-of-the-world xDS for type ClusterLoadAssignment
// over both envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints
// and envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources
// (ADS streams ignore other types). Delta xDS and FetchEndpoints answer
// Unimplemented. It answers requests that name Config.Cluster, or that are
// wildcard (no names, or "*", before any explicit name); an empty name
// list after explicit names unsubscribes, as the xDS protocol says.
//
// It is written on the generated gRPC stubs, not on go-control-plane's
// pkg/server and pkg/cache: there is one resource of one type, and owning
// the stream loop makes the ACK bookkeeping direct (each response's nonce
// maps to the assignment it carried) instead of being reconstructed from
// server callbacks.
//
// # ACKs and pickability
//
// A request whose response_nonce is the nonce of a response this stream
// sent, without error_detail, ACKs that response's version. With
// error_detail it is a NACK: it is counted and logged, the stream keeps the
// version it ACKed before, and the rejected version is not sent again (the
// next change is). Nonces the stream never received are ignored.
//
// [Server.Pickable] (the Gate) is true for every key while no stream
// counts: no Envoy is connected, or none has been sent an assignment yet
// (Envoy does not use an EDS cluster before its first EDS response, so
// nothing can be routed through it wrongly). A subscribed stream counts from
// its first response on. Envoy applies a version before it ACKs it, so a
// stream may hold any version it has ACKed or been sent since: the key must
// be in the version it last ACKed, in every version sent to it that it has
// not answered yet (when more than 16 are unanswered, the keys common to
// the forgotten ones stand in for them), and in the current version, which
// it will be sent. A stream that disconnects, or unsubscribes from the
// cluster, leaves the calculation; a stream that NACKed every version it
// was sent holds nothing and does not count.
//
// Offer can only narrow the gate, by keys the new version lacks; the hub
// has already taken those out of the engine. Everything that can widen it
// (an ACK or NACK, a stream's end or unsubscription, a response that
// replaced a version never sent) calls [Deps.OnChange] (the hub's Refresh),
// outside the server's locks, so the gate never takes a key out from under
// the engine and the engine learns of every key released.
//
// A reconnecting Envoy that already holds an older assignment counts from
// the version it is sent on the new stream (the version it reports on its
// first request is not trusted: versions restart with kvbandit).
//
// # Concurrency
//
// All methods are safe for concurrent use. Pickable is lock-free: it reads
// an immutable gate (the keys every counted stream may hold) swapped with
// an atomic pointer when an Offer, a response, an ACK or a stream end
// changes it. Offer never blocks
// on a stream: it wakes each stream's goroutine, which sends. Offer and
// Pickable may be called under the hub's lock; the server never calls the
// hub while holding its own lock.
//
// # Lifecycle
//
// [Server.Register] adds the services to a caller-owned gRPC server. Each
// stream runs in its gRPC handler goroutine plus one receiving goroutine,
// both ending with the stream. xDS streams last as long as Envoy runs, so
// grpc.Server.GracefulStop waits for them: call [Server.Close] first, which
// ends every stream (code Unavailable, Envoy reconnects elsewhere or later)
// and refuses new ones.
package eds
