package kube

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

// Pod annotations and labels read for endpoint metadata (see the package
// documentation).
const (
	AnnotationModels           = "kvbandit.io/models"
	AnnotationAdapters         = "kvbandit.io/adapters"
	AnnotationEngine           = "kvbandit.io/engine"
	AnnotationBlockSize        = "kvbandit.io/block-size"
	AnnotationMaxBatchedTokens = "kvbandit.io/max-num-batched-tokens"
	AnnotationDataParallelSize = "kvbandit.io/data-parallel-size"
	AnnotationMetricsPort      = "kvbandit.io/metrics-port"
	AnnotationKVEventsPort     = "kvbandit.io/kv-events-port"
	AnnotationKVEventsReplay   = "kvbandit.io/kv-events-replay-port"
	// AnnotationRole is the endpoint's prefill/decode role; it wins over
	// LabelRole.
	AnnotationRole = "kvbandit.io/role"
	// LabelRole is llm-d's role label (prefill, decode, both or
	// prefill-decode), used when AnnotationRole is absent.
	LabelRole = "llm-d.ai/role"
	// LabelModel is llm-d's model label, used when AnnotationModels is
	// absent.
	LabelModel = "llm-d.ai/model"
	// LabelPod is added to every endpoint's labels: the Pod's
	// namespace/name.
	LabelPod = "kvbandit.io/pod"
)

// podReady reports whether the pod can take traffic: Ready=True, not
// terminating.
func podReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// podEndpoints returns the pod's endpoints, one per target port. The pod
// must be ready and have an IP. Errors are *discovery.RecordError.
func podEndpoints(p *corev1.Pod, ports []int) ([]routing.Endpoint, error) {
	ip, err := netip.ParseAddr(p.Status.PodIP)
	if err != nil {
		return nil, &discovery.RecordError{Reason: discovery.ReasonInvalid, Err: fmt.Errorf("status.podIP %q", p.Status.PodIP)}
	}
	ip = ip.Unmap()
	ann := p.Annotations
	var base routing.Endpoint
	if v, ok := ann[AnnotationModels]; ok {
		base.Models = names(v)
	} else if v := p.Labels[LabelModel]; v != "" {
		base.Models = []routing.ModelName{routing.ModelName(v)}
	}
	base.Adapters = names(ann[AnnotationAdapters])
	if v, ok := ann[AnnotationEngine]; ok {
		base.Engine = strings.ToLower(strings.TrimSpace(v))
		if base.Engine == "" || !slices.Contains(routing.Engines, base.Engine) {
			return nil, &discovery.RecordError{Reason: discovery.ReasonUnknownEngine,
				Err: fmt.Errorf("annotation %s=%q (want vllm or sglang)", AnnotationEngine, v)}
		}
	}
	if base.Role, err = podRole(p); err != nil {
		return nil, err
	}
	for _, f := range []struct {
		key string
		dst *int
		max int
	}{
		{AnnotationBlockSize, &base.BlockSize, routing.MaxBlockSize},
		{AnnotationMaxBatchedTokens, &base.MaxBatchedTokens, 1 << 30},
		{AnnotationDataParallelSize, &base.DataParallelSize, routing.MaxDataParallelSize},
	} {
		if *f.dst, err = positive(ann, f.key, f.max); err != nil {
			return nil, err
		}
	}
	metricsPort, err := positive(ann, AnnotationMetricsPort, 65535)
	if err != nil {
		return nil, err
	}
	kvPort, err := positive(ann, AnnotationKVEventsPort, 65535)
	if err != nil {
		return nil, err
	}
	replayPort, err := positive(ann, AnnotationKVEventsReplay, 65535)
	if err != nil {
		return nil, err
	}
	base.Labels = make(map[string]string, len(p.Labels)+1)
	maps.Copy(base.Labels, p.Labels)
	base.Labels[LabelPod] = p.Namespace + "/" + p.Name

	eps := make([]routing.Endpoint, 0, len(ports))
	for i, port := range ports {
		ep := base
		ep.Key = routing.EndpointKey(netip.AddrPortFrom(ip, uint16(port)).String())
		if metricsPort > 0 {
			ep.MetricsURL = "http://" + netip.AddrPortFrom(ip, uint16(metricsPort)).String() + "/metrics"
		}
		if kvPort > 0 {
			if kvPort+i > 65535 {
				return nil, &discovery.RecordError{Reason: discovery.ReasonInvalid,
					Err: fmt.Errorf("annotation %s=%d: rank %d's port is out of range", AnnotationKVEventsPort, kvPort, i)}
			}
			ep.KVEvents = "tcp://" + netip.AddrPortFrom(ip, uint16(kvPort+i)).String()
		}
		if replayPort > 0 {
			if replayPort+i > 65535 {
				return nil, &discovery.RecordError{Reason: discovery.ReasonInvalid,
					Err: fmt.Errorf("annotation %s=%d: rank %d's port is out of range", AnnotationKVEventsReplay, replayPort, i)}
			}
			ep.KVEventsReplay = "tcp://" + netip.AddrPortFrom(ip, uint16(replayPort+i)).String()
		}
		if err := discovery.CheckRecord(&ep); err != nil {
			return nil, err
		}
		eps = append(eps, ep)
	}
	return eps, nil
}

// podRole is the Pod's role: the annotation kvbandit.io/role, else llm-d's
// label llm-d.ai/role, else both. An unknown value is a
// *discovery.RecordError with reason unknown_role.
func podRole(p *corev1.Pod) (routing.Role, error) {
	key, v, ok := AnnotationRole, "", false
	if v, ok = p.Annotations[AnnotationRole]; !ok {
		key, v = LabelRole, p.Labels[LabelRole]
	}
	r, err := routing.ParseRole(v)
	if err != nil {
		return r, &discovery.RecordError{Reason: discovery.ReasonUnknownRole, Err: fmt.Errorf("%s: %w", key, err)}
	}
	return r, nil
}

// positive parses an optional annotation holding an integer in 1..max
// (0 when absent).
func positive(ann map[string]string, key string, max int) (int, error) {
	v, ok := ann[key]
	if !ok {
		return 0, nil
	}
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil {
		return 0, &discovery.RecordError{Reason: discovery.ReasonMalformed, Err: fmt.Errorf("annotation %s=%q: not an integer", key, v)}
	}
	if n < 1 || n > max {
		return 0, &discovery.RecordError{Reason: discovery.ReasonInvalid, Err: fmt.Errorf("annotation %s=%d: want 1..%d", key, n, max)}
	}
	return n, nil
}

// names splits a comma list, dropping empty entries (nil when none).
func names(v string) []routing.ModelName {
	var out []routing.ModelName
	for f := range strings.SplitSeq(v, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, routing.ModelName(f))
		}
	}
	return out
}

// errNoPorts is why a pool without usable target ports selects nothing.
var errNoPorts = errors.New("no target ports")
