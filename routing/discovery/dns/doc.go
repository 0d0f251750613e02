// Package dns lets endpoint records name their worker by DNS host name
// ("vllm-headless.llm.svc.cluster.local:8000") as well as by IP, the way
// Envoy's STRICT_DNS clusters do: a [Source] wraps another
// [discovery.Source] (static list, file, etcd), resolves every name in the
// sets it publishes, and publishes instead one endpoint per A/AAAA address
// — so a Kubernetes headless Service or a Compose service with replicas
// becomes one endpoint per replica. Names are re-resolved every
// [Config.Refresh].
//
// # Resolution
//
// Each endpoint a name yields is a copy of its record (models, engine,
// labels, ...) with the address replaced by "ip:port" ("[ip]:port" for
// IPv6); kv_events, kv_events_replay and metrics_url that name the same
// host are rewritten to the same IP, so every replica is scraped and
// subscribed on its own. Addresses are sorted, so a DNS server that
// rotates its answers does not change the set. An address two records
// yield is kept once (the first record wins). Literal IP records pass
// through untouched, and a set without names is published as it is.
//
// # Failures
//
// A lookup that fails (timeout, SERVFAIL, NXDOMAIN, an answer without a
// usable address) keeps the name's last good addresses: the set is never
// emptied by DNS trouble. Every lookup is counted in
// kvbandit_dns_resolutions_total{result}, failures are logged, and while
// any name is failing the source reports itself degraded as "dns"
// (kvbandit_discovery_degraded{source="dns"}). A name that has never
// resolved yields nothing; when no endpoint at all is known yet, nothing is
// published, so readiness waits for the first answer (as an Envoy cluster
// warms).
//
// # Bounds
//
// Records come from files and etcd that others may write, so the work is
// bounded: names are checked by [discovery.ParseName] (at most 253 bytes,
// labels of 1..63), each lookup has a timeout, at most [Config.MaxAddrs]
// addresses are kept per name, at most [Config.MaxNames] distinct names
// per set are resolved (further records are skipped and counted), and at
// most [Config.Parallel] lookups run at once.
package dns
