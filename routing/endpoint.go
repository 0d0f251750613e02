package routing

import (
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
)

// EndpointKey identifies an endpoint by its "ip:port" address (IPv6 in
// brackets), exactly as it travels in x-gateway-destination-endpoint.
type EndpointKey string

// ModelName is a model (or LoRA adapter) name as clients send it.
type ModelName string

// Endpoint describes one worker as discovery reports it. Its fields are
// immutable once the endpoint is part of a published [EndpointSet].
type Endpoint struct {
	// Key is the endpoint's "ip:port" address.
	Key EndpointKey `json:"address"`
	// Models lists the models this endpoint serves; empty means every model.
	Models []ModelName `json:"models,omitempty"`
	// Adapters lists LoRA adapters the endpoint serves.
	Adapters []ModelName `json:"adapters,omitempty"`
	// Engine is "vllm", "sglang" or empty when unknown.
	Engine string `json:"engine,omitempty"`
	// BlockSize is the KV block size in tokens; 0 means the router default.
	BlockSize int `json:"block_size,omitempty"`
	// MaxBatchedTokens is the prefill capacity per step; 0 means the default.
	MaxBatchedTokens int `json:"max_num_batched_tokens,omitempty"`
	// DataParallelSize is the number of data-parallel ranks; 0 or 1 means one.
	DataParallelSize int `json:"data_parallel_size,omitempty"`
	// Weight scales the endpoint's share for weighted policies; 0 means 1.
	Weight float64 `json:"weight,omitempty"`
	// Labels are free-form discovery labels.
	Labels map[string]string `json:"labels,omitempty"`
	// KVEvents is the worker's KV-events ZMQ address (tcp://host:port);
	// empty keeps the endpoint on the approximate index.
	KVEvents string `json:"kv_events,omitempty"`
	// KVEventsBind makes kvbandit bind that address and the worker connect
	// (llm-d-inference-sim); vLLM binds its publisher, so kvbandit connects.
	KVEventsBind bool `json:"kv_events_bind,omitempty"`
	// KVEventsReplay is the worker's replay address (vLLM's
	// replay_endpoint), used to fill sequence gaps.
	KVEventsReplay string `json:"kv_events_replay,omitempty"`
	// KVEventsFirstSeq is the sequence number of the worker's first KV
	// event message: 0 for vLLM (the default), 1 for llm-d-inference-sim.
	KVEventsFirstSeq uint64 `json:"kv_events_first_seq,omitempty"`
	// MetricsURL is the worker's Prometheus endpoint; empty means
	// http://<address>/metrics.
	MetricsURL string `json:"metrics_url,omitempty"`
	// Role is the endpoint's prefill/decode role (record field "role":
	// prefill, decode, both or prefill-decode; absent means both).
	Role Role `json:"role,omitempty"`

	// addr is the parsed Key, filled by Validate.
	addr netip.AddrPort
}

// Engines lists the worker engines an endpoint may declare ("" = unknown).
var Engines = []string{"", "vllm", "sglang"}

// Equal reports whether e and o describe the same endpoint with the same
// metadata.
func (e *Endpoint) Equal(o *Endpoint) bool {
	return e.Key == o.Key && slices.Equal(e.Models, o.Models) && slices.Equal(e.Adapters, o.Adapters) &&
		e.Engine == o.Engine && e.BlockSize == o.BlockSize && e.MaxBatchedTokens == o.MaxBatchedTokens &&
		e.DataParallelSize == o.DataParallelSize && e.Weight == o.Weight && maps.Equal(e.Labels, o.Labels) &&
		e.KVEvents == o.KVEvents && e.KVEventsBind == o.KVEventsBind && e.KVEventsReplay == o.KVEventsReplay && e.KVEventsFirstSeq == o.KVEventsFirstSeq &&
		e.MetricsURL == o.MetricsURL && e.Role == o.Role
}

// Addr returns the parsed address (valid after [EndpointSet.Validate]).
func (e *Endpoint) Addr() netip.AddrPort { return e.addr }

// Serves reports whether the endpoint serves model (as a base model or a
// LoRA adapter). An endpoint that declares no models serves every model.
func (e *Endpoint) Serves(model ModelName) bool {
	if len(e.Models) == 0 {
		return true
	}
	return slices.Contains(e.Models, model) || slices.Contains(e.Adapters, model)
}

// EndpointSet is one version of the endpoint list. Sources build a new set
// and hand it to [Engine.Update]; a published set is never modified.
type EndpointSet struct {
	// Source names the discovery source ("static", "file", "etcd", ...).
	Source string
	// Endpoints is the list, in discovery order.
	Endpoints []Endpoint
}

// ErrInvalidEndpointSet is wrapped by every [EndpointSet.Validate] error.
var ErrInvalidEndpointSet = errors.New("invalid endpoint set")

// Limits of an endpoint set. Discovery records come from files, etcd and
// Pod annotations that someone other than the operator may write: every
// count and length that turns into memory is bounded, well above what a
// real fleet declares.
const (
	// MaxEndpoints is the largest set (all sources, after expansion).
	MaxEndpoints = 16384
	// MaxDataParallelSize bounds data_parallel_size (state is kept per rank).
	MaxDataParallelSize = 1024
	// MaxBlockSize bounds block_size in tokens.
	MaxBlockSize = 1 << 16
	// MaxModels bounds an endpoint's models and, separately, its adapters.
	MaxModels = 4096
	// MaxNameBytes bounds one model or adapter name.
	MaxNameBytes = 512
	// MaxLabels bounds an endpoint's labels.
	MaxLabels = 256
	// MaxLabelBytes bounds one label's key and its value.
	MaxLabelBytes = 1024
	// MaxURLBytes bounds kv_events, kv_events_replay and metrics_url.
	MaxURLBytes = 2048
)

// Validate checks the set before it is published: every key is a literal
// "ip:port" with a non-zero port and an address that can be a worker's
// (not unspecified, 0.0.0.0 or ::, and not multicast), keys are unique and canonical, numeric
// fields are not negative, and counts and lengths are within the limits
// above. It fills each endpoint's parsed address.
func (s *EndpointSet) Validate() error {
	if len(s.Endpoints) > MaxEndpoints {
		return fmt.Errorf("%w: %d endpoints (at most %d)", ErrInvalidEndpointSet, len(s.Endpoints), MaxEndpoints)
	}
	seen := make(map[EndpointKey]struct{}, len(s.Endpoints))
	for i := range s.Endpoints {
		e := &s.Endpoints[i]
		if err := e.checkLimits(); err != nil {
			return fmt.Errorf("%w: endpoint %d: %w", ErrInvalidEndpointSet, i, err)
		}
		ap, err := ParseAddrPort(string(e.Key))
		if err != nil {
			return fmt.Errorf("%w: endpoint %d: %w", ErrInvalidEndpointSet, i, err)
		}
		if a := ap.Addr(); a.IsUnspecified() || a.IsMulticast() {
			return fmt.Errorf("%w: endpoint %d: %q is an unspecified or multicast address, not a worker's (give the address the worker is reached at)", ErrInvalidEndpointSet, i, e.Key)
		}
		if canon := EndpointKey(ap.String()); canon != e.Key {
			return fmt.Errorf("%w: endpoint %d: %q is not canonical (want %q)", ErrInvalidEndpointSet, i, e.Key, canon)
		}
		if _, dup := seen[e.Key]; dup {
			return fmt.Errorf("%w: duplicate endpoint %q", ErrInvalidEndpointSet, e.Key)
		}
		seen[e.Key] = struct{}{}
		switch {
		case e.BlockSize < 0:
			return fmt.Errorf("%w: endpoint %q: negative block_size", ErrInvalidEndpointSet, e.Key)
		case e.MaxBatchedTokens < 0:
			return fmt.Errorf("%w: endpoint %q: negative max_num_batched_tokens", ErrInvalidEndpointSet, e.Key)
		case e.DataParallelSize < 0:
			return fmt.Errorf("%w: endpoint %q: negative data_parallel_size", ErrInvalidEndpointSet, e.Key)
		case e.Weight < 0 || e.Weight != e.Weight:
			return fmt.Errorf("%w: endpoint %q: weight must be a non-negative number", ErrInvalidEndpointSet, e.Key)
		case e.Role > RoleDecode:
			return fmt.Errorf("%w: endpoint %q: role %d out of range", ErrInvalidEndpointSet, e.Key, e.Role)
		case !slices.Contains(Engines, e.Engine):
			return fmt.Errorf("%w: endpoint %q: unknown engine %q (want vllm or sglang)", ErrInvalidEndpointSet, e.Key, e.Engine)
		}
		e.addr = ap
	}
	return nil
}

// checkLimits checks the endpoint's counts and lengths against the set's
// limits (before anything is derived from them).
func (e *Endpoint) checkLimits() error {
	switch {
	case len(e.Key) > MaxURLBytes:
		return fmt.Errorf("address of %d bytes", len(e.Key))
	case e.DataParallelSize > MaxDataParallelSize:
		return fmt.Errorf("data_parallel_size %d (at most %d)", e.DataParallelSize, MaxDataParallelSize)
	case e.BlockSize > MaxBlockSize:
		return fmt.Errorf("block_size %d (at most %d)", e.BlockSize, MaxBlockSize)
	case len(e.Models) > MaxModels || len(e.Adapters) > MaxModels:
		return fmt.Errorf("%d models and %d adapters (at most %d each)", len(e.Models), len(e.Adapters), MaxModels)
	case len(e.Labels) > MaxLabels:
		return fmt.Errorf("%d labels (at most %d)", len(e.Labels), MaxLabels)
	case len(e.KVEvents) > MaxURLBytes || len(e.KVEventsReplay) > MaxURLBytes || len(e.MetricsURL) > MaxURLBytes:
		return fmt.Errorf("an address or URL over %d bytes", MaxURLBytes)
	}
	for _, names := range [][]ModelName{e.Models, e.Adapters} {
		for _, n := range names {
			if len(n) > MaxNameBytes {
				return fmt.Errorf("a model or adapter name of %d bytes (at most %d)", len(n), MaxNameBytes)
			}
		}
	}
	for k, v := range e.Labels {
		if len(k) > MaxLabelBytes || len(v) > MaxLabelBytes {
			return fmt.Errorf("a label over %d bytes", MaxLabelBytes)
		}
	}
	return nil
}

// ParseAddrPort parses a literal "ip:port" (IPv6 as "[ip]:port") with a
// port in 1..65535. Host names are refused: Envoy's override_host needs the
// address of a host in the cluster.
func ParseAddrPort(s string) (netip.AddrPort, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q: %w", s, err)
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("address %q: host must be an IP literal", s)
	}
	if ip.Zone() != "" {
		return netip.AddrPort{}, fmt.Errorf("address %q: zones are not supported", s)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || p == 0 {
		return netip.AddrPort{}, fmt.Errorf("address %q: port must be 1..65535", s)
	}
	return netip.AddrPortFrom(ip.Unmap(), uint16(p)), nil
}

// ParseEndpointList parses a static "host:port[,host:port...]" list into a
// validated set. Spaces around entries are ignored; an empty list is an
// error.
func ParseEndpointList(list string) (EndpointSet, error) {
	set := EndpointSet{Source: "static"}
	for _, f := range strings.Split(list, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		ap, err := ParseAddrPort(f)
		if err != nil {
			return EndpointSet{}, fmt.Errorf("%w: %w", ErrInvalidEndpointSet, err)
		}
		set.Endpoints = append(set.Endpoints, Endpoint{Key: EndpointKey(ap.String())})
	}
	if len(set.Endpoints) == 0 {
		return EndpointSet{}, fmt.Errorf("%w: no endpoints in %q", ErrInvalidEndpointSet, list)
	}
	return set, set.Validate()
}
