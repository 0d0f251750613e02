package app

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/discovery/dns"
	"github.com/kvbandit/kvbandit/routing/discovery/eds"
	"github.com/kvbandit/kvbandit/routing/discovery/etcd"
	"github.com/kvbandit/kvbandit/routing/discovery/kube"
	"github.com/kvbandit/kvbandit/routing/discovery/kube/objectives"
)

// discoverySources returns the static set (published synchronously at
// start, so a bad one is a start-up error) or the dynamic sources the
// flags and the config file select, and, when the source is an
// InferencePool, the watcher of the pool's InferenceObjectives.
func discoverySources(o ServeOptions, c *FileConfig, log *slog.Logger) (static *routing.EndpointSet, sources []discovery.Source, obj *objectives.Watcher, err error) {
	if len(c.Endpoints) > 0 {
		static = &routing.EndpointSet{Source: "config", Endpoints: c.Endpoints}
	}
	if o.Endpoints != "" {
		if static != nil {
			return nil, nil, nil, errors.New("give endpoints in --endpoints or in the config file, not both")
		}
		s, err := discovery.ParseEndpointList(o.Endpoints)
		if err != nil {
			return nil, nil, nil, err
		}
		static = &s
	}
	if o.EndpointsFile != "" {
		sources = append(sources, discovery.File{Path: o.EndpointsFile})
	}
	if f := c.Discovery.File; f != nil {
		sources = append(sources, discovery.File{Path: f.Path, Interval: secs(f.IntervalSecs)})
	}
	ec := c.Discovery.Etcd
	if o.EtcdEndpoints != "" {
		if ec == nil {
			ec = &etcd.Config{}
		}
		ec.Endpoints = splitList(o.EtcdEndpoints)
	}
	if ec != nil {
		if _, ok := o.set["etcd-pool"]; ok || ec.Pool == "" {
			ec.Pool = o.EtcdPool
		}
		if _, ok := o.set["etcd-prefix"]; ok || ec.Prefix == "" {
			ec.Prefix = o.EtcdPrefix
		}
		ec.Defaults()
		src, err := etcd.New(*ec, etcd.Deps{Logger: log})
		if err != nil {
			return nil, nil, nil, err
		}
		sources = append(sources, src)
	}
	src, obj, err := kubeSource(o, c, log)
	if err != nil {
		return nil, nil, nil, err
	}
	if src != nil {
		sources = append(sources, src)
	}
	if static != nil && !allowLinkLocal(o, c) {
		for _, ep := range static.Endpoints {
			if discovery.IsLinkLocal(ep.Key) {
				return nil, nil, nil, fmt.Errorf("%w: endpoint %q is link-local (169.254.0.0/16, fe80::/10, where clouds serve instance metadata): give the worker's routable address, or allow it with --discovery-allow-link-local (config discovery.allow_link_local)", routing.ErrInvalidEndpointSet, ep.Key)
			}
		}
	}
	n := len(sources)
	if static != nil {
		n++
	}
	switch {
	case n == 0:
		return nil, nil, nil, errors.New("no workers: give --endpoints, --endpoints-file, --pool-name, --kube-selector, or a config file with endpoints or a discovery source")
	case n > 1:
		return nil, nil, nil, errors.New("give one source of endpoints: --endpoints, --endpoints-file, the config's endpoints, or one discovery source")
	}
	if static != nil && discovery.HasNames(static.Endpoints) {
		// Names are resolved in the background (withDNS), like the
		// records of the dynamic sources.
		sources, static = []discovery.Source{discovery.Static{Set: *static}}, nil
	}
	return static, sources, obj, nil
}

// allowLinkLocal reports whether link-local endpoints are allowed
// (--discovery-allow-link-local or discovery.allow_link_local).
func allowLinkLocal(o ServeOptions, c *FileConfig) bool {
	return o.DiscoveryAllowLinkLocal || c.Discovery.AllowLinkLocal
}

// withDNS wraps every source so that records naming their host by DNS
// name become one endpoint per address (routing/discovery/dns), re-resolved
// every --dns-refresh (else the config's discovery.dns.refresh_secs).
func withDNS(o ServeOptions, c *FileConfig, log *slog.Logger, reg prometheus.Registerer, sources []discovery.Source) error {
	if len(sources) == 0 {
		return nil
	}
	cfg := dns.Config{Refresh: o.DNSRefresh}
	if d := c.Discovery.DNS; d != nil {
		if _, ok := o.set["dns-refresh"]; !ok && d.RefreshSecs > 0 {
			cfg.Refresh = secs(d.RefreshSecs)
		}
		cfg.Timeout, cfg.MaxAddrs = secs(d.TimeoutSecs), d.MaxAddresses
	}
	x, err := dns.New(cfg, dns.Deps{Logger: log, Registry: reg})
	if err != nil {
		return err
	}
	for i, s := range sources {
		sources[i] = x.Wrap(s)
	}
	return nil
}

// kubeSource is the Kubernetes source of --pool-name/--kube-selector and
// the config's discovery.kube (flags win), or nil; in pool mode also the
// watcher of the pool's InferenceObjectives.
func kubeSource(o ServeOptions, c *FileConfig, log *slog.Logger) (discovery.Source, *objectives.Watcher, error) {
	kc := c.Discovery.Kube
	if o.PoolName != "" || o.KubeSelector != "" {
		if kc == nil {
			kc = &KubeDiscoveryConfig{}
		}
		if o.PoolName != "" {
			kc.Pool = o.PoolName
		}
		if o.KubeSelector != "" {
			sel, err := parseSelector(o.KubeSelector)
			if err != nil {
				return nil, nil, err
			}
			kc.Selector = sel
		}
	}
	if kc == nil {
		if o.PoolNamespace != "" || o.KubeTargetPorts != "" {
			return nil, nil, errors.New("--pool-namespace and --kube-target-ports need --pool-name or --kube-selector")
		}
		return nil, nil, nil
	}
	if o.PoolNamespace != "" {
		kc.Namespace = o.PoolNamespace
	}
	if o.KubeTargetPorts != "" {
		kc.TargetPorts = nil
		for _, f := range splitList(o.KubeTargetPorts) {
			p, err := strconv.Atoi(f)
			if err != nil {
				return nil, nil, fmt.Errorf("--kube-target-ports: %q is not a port", f)
			}
			kc.TargetPorts = append(kc.TargetPorts, p)
		}
	}
	rc, err := kubeRESTConfig(cmp.Or(o.Kubeconfig, kc.Kubeconfig))
	if err != nil {
		return nil, nil, fmt.Errorf("kube discovery: API server configuration: %w", err)
	}
	ns := cmp.Or(kc.Namespace, os.Getenv("POD_NAMESPACE"), "default")
	src, err := kube.New(kube.Config{Namespace: ns, Pool: kc.Pool, Selector: kc.Selector, TargetPorts: kc.TargetPorts},
		kube.Deps{Config: rc, Logger: log})
	if err != nil {
		return nil, nil, err
	}
	if kc.Pool == "" {
		return src, nil, nil
	}
	obj, err := objectives.New(objectives.Config{Namespace: ns, Pool: kc.Pool}, objectives.Deps{Config: rc, Logger: log})
	if err != nil {
		return nil, nil, err
	}
	return src, obj, nil
}

// parseSelector parses "k=v,k=v".
func parseSelector(s string) (map[string]string, error) {
	sel := map[string]string{}
	for _, f := range splitList(s) {
		k, v, ok := strings.Cut(f, "=")
		if !ok || strings.TrimSpace(k) == "" {
			return nil, fmt.Errorf("--kube-selector: %q is not key=value", f)
		}
		sel[strings.TrimSpace(k)] = strings.TrimSpace(v)
	}
	return sel, nil
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// hubCollector exports discovery's state.
type hubCollector struct{ h *discovery.Hub }

var (
	discDegradedDesc  = prometheus.NewDesc("kvbandit_discovery_degraded", "1 while a discovery source serves its last known endpoint set because its backend fails (readiness is not affected).", []string{"source"}, nil)
	discEndpointsDesc = prometheus.NewDesc("kvbandit_discovery_endpoints", "Endpoints by state: desired (discovered), pickable (given to the engine), lingering (left, decisions still in flight).", []string{"state"}, nil)
	discSetsDesc      = prometheus.NewDesc("kvbandit_discovery_sets_total", "Endpoint sets by result: published to the engine, or rejected by validation.", []string{"result"}, nil)
	discSkippedDesc   = prometheus.NewDesc("kvbandit_discovery_skipped_records_total", "Discovery records skipped, by source and reason (malformed, unknown_engine, invalid, duplicate).", []string{"source", "reason"}, nil)
)

func (hubCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- discDegradedDesc
	ch <- discEndpointsDesc
	ch <- discSetsDesc
	ch <- discSkippedDesc
}

func (c hubCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.h.Stats()
	for src := range st.Degraded {
		ch <- prometheus.MustNewConstMetric(discDegradedDesc, prometheus.GaugeValue, 1, src)
	}
	if st.Source != "" {
		if _, ok := st.Degraded[st.Source]; !ok {
			ch <- prometheus.MustNewConstMetric(discDegradedDesc, prometheus.GaugeValue, 0, st.Source)
		}
	}
	ch <- prometheus.MustNewConstMetric(discEndpointsDesc, prometheus.GaugeValue, float64(st.Endpoints), "desired")
	ch <- prometheus.MustNewConstMetric(discEndpointsDesc, prometheus.GaugeValue, float64(st.Pickable), "pickable")
	ch <- prometheus.MustNewConstMetric(discEndpointsDesc, prometheus.GaugeValue, float64(st.Lingering), "lingering")
	ch <- prometheus.MustNewConstMetric(discSetsDesc, prometheus.CounterValue, float64(st.Published), "published")
	ch <- prometheus.MustNewConstMetric(discSetsDesc, prometheus.CounterValue, float64(st.Rejected), "rejected")
	for k, n := range st.Skipped {
		ch <- prometheus.MustNewConstMetric(discSkippedDesc, prometheus.CounterValue, float64(n), k[0], k[1])
	}
}

// edsCollector exports the EDS server's state.
type edsCollector struct{ s *eds.Server }

var (
	edsStreamsDesc = prometheus.NewDesc("kvbandit_eds_streams", "Connected xDS streams (Envoys) subscribed to the workers cluster.", nil, nil)
	edsAcksDesc    = prometheus.NewDesc("kvbandit_eds_responses_total", "EDS responses acknowledged (ack) or rejected (nack) by Envoy.", []string{"result"}, nil)
	edsVersionDesc = prometheus.NewDesc("kvbandit_eds_endpoints", "Endpoints in the current ClusterLoadAssignment (desired plus lingering).", nil, nil)
)

func (edsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- edsStreamsDesc
	ch <- edsAcksDesc
	ch <- edsVersionDesc
}

func (c edsCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.Stats()
	ch <- prometheus.MustNewConstMetric(edsStreamsDesc, prometheus.GaugeValue, float64(len(st.Streams)))
	ch <- prometheus.MustNewConstMetric(edsAcksDesc, prometheus.CounterValue, float64(st.ACKs), "ack")
	ch <- prometheus.MustNewConstMetric(edsAcksDesc, prometheus.CounterValue, float64(st.NACKs), "nack")
	ch <- prometheus.MustNewConstMetric(edsVersionDesc, prometheus.GaugeValue, float64(st.Endpoints))
}

// objectivesCollector exports the InferenceObjective watcher's state.
type objectivesCollector struct{ w *objectives.Watcher }

var (
	objKnownDesc     = prometheus.NewDesc("kvbandit_inference_objectives", "InferenceObjectives of the pool known by name (their priorities apply to requests naming them in x-gateway-inference-objective).", nil, nil)
	objAvailableDesc = prometheus.NewDesc("kvbandit_inference_objectives_available", "1 once the pool's InferenceObjectives could be listed and watched; 0 while the CRD is not served or RBAC forbids it (requests get the default priority).", nil, nil)
	objSkippedDesc   = prometheus.NewDesc("kvbandit_inference_objectives_skipped_total", "InferenceObjective versions skipped, by reason (malformed, over_limit).", []string{"reason"}, nil)
)

func (objectivesCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- objKnownDesc
	ch <- objAvailableDesc
	ch <- objSkippedDesc
}

func (c objectivesCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.w.Stats()
	avail := 0.0
	if st.Available {
		avail = 1
	}
	ch <- prometheus.MustNewConstMetric(objKnownDesc, prometheus.GaugeValue, float64(st.Known))
	ch <- prometheus.MustNewConstMetric(objAvailableDesc, prometheus.GaugeValue, avail)
	for _, r := range []string{objectives.ReasonMalformed, objectives.ReasonOverLimit} {
		ch <- prometheus.MustNewConstMetric(objSkippedDesc, prometheus.CounterValue, float64(st.Skipped[r]), r)
	}
}
