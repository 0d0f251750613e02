package envoy

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	routerv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	overridehostv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/override_host/v3"
	metadatav3 "github.com/envoyproxy/go-control-plane/envoy/type/metadata/v3"
	"github.com/envoyproxy/protoc-gen-validate/validate"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/anypb"
	"sigs.k8s.io/yaml"

	// Extension protos the shipped configs pack into Any fields. protojson and Any.UnmarshalNew
	// resolve "@type" through the global registry, so each must be linked in. The ones imported
	// by name above register themselves too.
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/file/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/access_loggers/stream/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/header_mutation/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/least_request/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/round_robin/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/retry/host/previous_hosts/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
)

// Errors reported by [Validate]. Each problem is wrapped around one of them, so callers and
// tests can tell the rules apart with [errors.Is]; the message says where and why.
var (
	// ErrDecode: the YAML does not parse, or does not decode into Envoy's bootstrap proto
	// (unknown field, bad enum value, wrong type, an "@type" that is not registered).
	ErrDecode = errors.New("config does not decode")
	// ErrConstraint: a value breaks a protoc-gen-validate rule of Envoy's protos (a range, a
	// required field, a minimum length), checked inside Any fields too.
	ErrConstraint = errors.New("config breaks a proto constraint")
	// ErrOverrideHost: an override_host load-balancing policy reads from anything but the one
	// metadata source kvbandit writes (envoy.lb / x-gateway-destination-endpoint), or does not
	// report the served endpoint in envoy.lb / x-gateway-destination-endpoint-served.
	ErrOverrideHost = errors.New("unsafe or incomplete override_host policy")
	// ErrTrailerMode: an ext_proc body mode is FULL_DUPLEX_STREAMED but the trailer mode of the
	// same direction is not SEND, which Envoy rejects.
	ErrTrailerMode = errors.New("FULL_DUPLEX_STREAMED without trailer mode SEND")
	// ErrMetadataNamespaces: an ext_proc filter does not accept envoy.lb from kvbandit, or does
	// not forward envoy.lb and envoy.lb.subset_hint to it.
	ErrMetadataNamespaces = errors.New("ext_proc metadata namespaces missing")
	// ErrOriginalDstHeader: a cluster takes its destination from a request header
	// (ORIGINAL_DST with use_http_header), which lets clients route to any host and port.
	ErrOriginalDstHeader = errors.New("cluster routes by a client request header")
	// ErrClusterRef: a route or gRPC service names a cluster the config does not define, or
	// two clusters share a name.
	ErrClusterRef = errors.New("bad cluster reference")
	// ErrFilterOrder: in an HTTP connection manager with ext_proc, the router is missing, not
	// last, or before ext_proc.
	ErrFilterOrder = errors.New("bad http filter order")
)

// The endpoint-picker protocol names (Gateway API Inference Extension, 004).
const (
	lbNamespace     = "envoy.lb"
	subsetNamespace = "envoy.lb.subset_hint"
	destinationKey  = "x-gateway-destination-endpoint"
	servedKey       = "x-gateway-destination-endpoint-served"
)

// Validate checks an Envoy bootstrap configuration in YAML, the way kvbandit ships them. It
// returns nil or an error joining every problem found (see [errors.Join]); each problem wraps
// one of the Err* sentinels and starts with its path in the config, for example
//
//	static_resources.listeners[0](inference_listener).filter_chains[0].filters[0](envoy.filters.network.http_connection_manager).typed_config<envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager>.http_filters[1](envoy.filters.http.ext_proc).typed_config<envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor>.message_timeout: value must be inside range [0s, 1h0m0s]
//
// where [i](name) is a list element and its name, and <type> the message inside an Any. A
// problem found while decoding (at most one) has a shorter path, without names and types.
//
// Schema ([ErrDecode], [ErrConstraint]): the YAML must decode into
// envoy.config.bootstrap.v3.Bootstrap with no unknown field, and every message, including those
// inside Any fields at any depth, must pass its protoc-gen-validate rules.
//
// kvbandit's rules, which Envoy itself would not enforce (or only at startup):
//   - [ErrOverrideHost]: every override_host policy has exactly one override source, the
//     metadata key envoy.lb / x-gateway-destination-endpoint; a header source is never allowed
//     (override_host joins the hosts of all sources, so one would let clients feed it). Its
//     selected_host_key is envoy.lb / x-gateway-destination-endpoint-served.
//   - [ErrTrailerMode]: an ext_proc filter whose request (or response) body mode is
//     FULL_DUPLEX_STREAMED sends request (or response) trailers.
//   - [ErrMetadataNamespaces]: every ext_proc filter lists envoy.lb in
//     metadata_options.receiving_namespaces.untyped, and envoy.lb and envoy.lb.subset_hint in
//     forwarding_namespaces.untyped.
//   - [ErrOriginalDstHeader]: no cluster sets original_dst_lb_config.use_http_header.
//   - [ErrClusterRef]: cluster names are unique, and every route and Envoy gRPC service names a
//     defined cluster (skipped when clusters come from CDS).
//   - [ErrFilterOrder]: where an HTTP connection manager has an ext_proc filter, the router
//     filter comes after it and is last.
//
// Validate is safe for concurrent use.
func Validate(yamlBytes []byte) error {
	jsonBytes, err := yaml.YAMLToJSON(yamlBytes)
	if err != nil {
		return &problem{rule: ErrDecode, detail: err.Error()}
	}
	var bs bootstrapv3.Bootstrap
	if err := (protojson.UnmarshalOptions{DiscardUnknown: false}).Unmarshal(jsonBytes, &bs); err != nil {
		return decodeError(jsonBytes, err)
	}

	var w walker
	w.walk(&bs, "", false)
	errs := w.errs
	errs = append(errs, checkConstraints(w.nodes)...)
	errs = append(errs, checkPolicy(&bs, w.nodes)...)
	return errors.Join(errs...)
}

// problem is one finding of Validate: where, what, and which rule.
type problem struct {
	rule   error
	path   string
	detail string
}

func (p *problem) Error() string {
	if p.path == "" {
		return p.detail
	}
	return p.path + ": " + p.detail
}

func (p *problem) Unwrap() error { return p.rule }

func newProblem(rule error, path, format string, args ...any) error {
	return &problem{rule: rule, path: path, detail: fmt.Sprintf(format, args...)}
}

// node is one message of the config tree, Any contents included.
type node struct {
	path string
	msg  proto.Message
	// covered: the ValidateAll of an ancestor already checked this message (generated
	// ValidateAll methods recurse into embedded messages, but not into Any contents).
	covered bool
}

// walker flattens a config into nodes, depth first, in field-number order, unpacking Anys.
type walker struct {
	nodes []node
	errs  []error
}

type validatorAll interface{ ValidateAll() error }

func (w *walker) walk(m proto.Message, path string, covered bool) {
	w.nodes = append(w.nodes, node{path: path, msg: m, covered: covered})

	if a, ok := m.(*anypb.Any); ok {
		inner, err := a.UnmarshalNew()
		if err != nil {
			w.errs = append(w.errs, newProblem(ErrDecode, path, "cannot unpack %s: %v", a.GetTypeUrl(), err))
			return
		}
		// The packed message is checked on its own: nothing above it has looked inside.
		w.walk(inner, path+"<"+string(inner.ProtoReflect().Descriptor().FullName())+">", false)
		return
	}

	_, validates := m.(validatorAll)
	rm := m.ProtoReflect()
	fields := rm.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if !rm.Has(fd) {
			continue
		}
		// A child is covered when this message's ValidateAll ran (it has one) and recursed
		// into the field (no PGV "skip" rule on it).
		childCovered := validates && !pgvSkips(fd)
		fieldPath := fd.TextName()
		if path != "" {
			fieldPath = path + "." + fieldPath
		}
		v := rm.Get(fd)
		switch {
		case fd.IsMap():
			if fd.MapValue().Message() == nil {
				continue
			}
			var keys []protoreflect.MapKey
			v.Map().Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
				keys = append(keys, k)
				return true
			})
			slices.SortFunc(keys, func(a, b protoreflect.MapKey) int { return strings.Compare(a.String(), b.String()) })
			for _, k := range keys {
				w.walk(v.Map().Get(k).Message().Interface(), fieldPath+"["+strconv.Quote(k.String())+"]", childCovered)
			}
		case fd.IsList():
			if fd.Message() == nil {
				continue
			}
			list := v.List()
			for j := range list.Len() {
				el := list.Get(j).Message().Interface()
				w.walk(el, fieldPath+"["+strconv.Itoa(j)+"]"+nameSuffix(el), childCovered)
			}
		case fd.Message() != nil:
			w.walk(v.Message().Interface(), fieldPath, childCovered)
		}
	}
}

// nameSuffix returns "(name)" for list elements that have a non-empty string field "name"
// (clusters, listeners, filters), so paths stay readable.
func nameSuffix(m proto.Message) string {
	rm := m.ProtoReflect()
	fd := rm.Descriptor().Fields().ByName("name")
	if fd == nil || fd.Kind() != protoreflect.StringKind || fd.IsList() || !rm.Has(fd) {
		return ""
	}
	return "(" + rm.Get(fd).String() + ")"
}

// pgvSkips reports whether the field carries the protoc-gen-validate rule message.skip, in
// which case the generated ValidateAll does not recurse into it.
func pgvSkips(fd protoreflect.FieldDescriptor) bool {
	rules, ok := proto.GetExtension(fd.Options(), validate.E_Rules).(*validate.FieldRules)
	return ok && rules.GetMessage().GetSkip()
}

// checkConstraints runs the protoc-gen-validate rules once over every message: ValidateAll on
// each message that no ancestor's ValidateAll already covered (the root, the contents of each
// Any, and whatever sits below a message without generated validation).
func checkConstraints(nodes []node) []error {
	var errs []error
	for _, n := range nodes {
		if n.covered {
			continue
		}
		v, ok := n.msg.(validatorAll)
		if !ok {
			continue
		}
		if err := v.ValidateAll(); err != nil {
			errs = append(errs, constraintErrors(err, n.msg.ProtoReflect(), n.path)...)
		}
	}
	return errs
}

// checkPolicy applies kvbandit's rules (see Validate) to the decoded config.
func checkPolicy(bs *bootstrapv3.Bootstrap, nodes []node) []error {
	var errs []error
	clusters := map[string]bool{}
	type ref struct{ path, cluster string }
	var refs []ref

	for _, n := range nodes {
		switch m := n.msg.(type) {
		case *overridehostv3.OverrideHost:
			errs = append(errs, checkOverrideHost(n.path, m)...)
		case *extprocv3.ExternalProcessor:
			errs = append(errs, checkExtProc(n.path, m)...)
		case *hcmv3.HttpConnectionManager:
			errs = append(errs, checkFilterOrder(n.path, m)...)
		case *clusterv3.Cluster:
			if m.GetOriginalDstLbConfig().GetUseHttpHeader() {
				header := m.GetOriginalDstLbConfig().GetHttpHeaderName()
				if header == "" {
					header = "x-envoy-original-dst-host"
				}
				errs = append(errs, newProblem(ErrOriginalDstHeader, n.path,
					"original_dst_lb_config.use_http_header sends each request to the address in its %q header, "+
						"which any client can set (Envoy: \"allows HTTP clients to route traffic to arbitrary hosts and/or ports\"); "+
						"use a STATIC or EDS cluster with the override_host policy reading envoy.lb metadata", header))
			}
			if clusters[m.GetName()] {
				errs = append(errs, newProblem(ErrClusterRef, n.path, "duplicate cluster name %q", m.GetName()))
			}
			clusters[m.GetName()] = true
		case *routev3.RouteAction:
			if c := m.GetCluster(); c != "" {
				refs = append(refs, ref{n.path + ".cluster", c})
			}
			for i, wc := range m.GetWeightedClusters().GetClusters() {
				if wc.GetName() != "" {
					refs = append(refs, ref{fmt.Sprintf("%s.weighted_clusters.clusters[%d]", n.path, i), wc.GetName()})
				}
			}
		case *corev3.GrpcService_EnvoyGrpc:
			refs = append(refs, ref{n.path + ".cluster_name", m.GetClusterName()})
		}
	}

	dyn := bs.GetDynamicResources()
	if dyn.GetCdsConfig() == nil && dyn.GetCdsResourcesLocator() == "" {
		for _, r := range refs {
			if !clusters[r.cluster] {
				errs = append(errs, newProblem(ErrClusterRef, r.path, "cluster %q is not defined in static_resources.clusters", r.cluster))
			}
		}
	}
	return errs
}

func checkOverrideHost(path string, m *overridehostv3.OverrideHost) []error {
	var errs []error
	want := lbNamespace + " / " + destinationKey
	sources := m.GetOverrideHostSources()
	if len(sources) != 1 {
		errs = append(errs, newProblem(ErrOverrideHost, path,
			"override_host_sources has %d entries, want exactly one (metadata %s): override_host joins the hosts of every source, "+
				"so any other source can put hosts ahead of kvbandit's pick", len(sources), want))
	}
	for i, s := range sources {
		sp := fmt.Sprintf("%s.override_host_sources[%d]", path, i)
		if h := s.GetHeader(); h != "" {
			errs = append(errs, newProblem(ErrOverrideHost, sp,
				"header source %q: clients can send that header and pin their requests to any worker (even while kvbandit is skipped); "+
					"read only the metadata %s", h, want))
		} else if md := s.GetMetadata(); !isMetadataKey(md, lbNamespace, destinationKey) {
			errs = append(errs, newProblem(ErrOverrideHost, sp,
				"metadata source is %s, want %s (where kvbandit writes its pick)", describeKey(md), want))
		}
	}
	if k := m.GetSelectedHostKey(); !isMetadataKey(k, lbNamespace, servedKey) {
		errs = append(errs, newProblem(ErrOverrideHost, path+".selected_host_key",
			"is %s, want %s / %s: without it kvbandit never learns which endpoint served the request",
			describeKey(k), lbNamespace, servedKey))
	}
	return errs
}

func isMetadataKey(k *metadatav3.MetadataKey, namespace, key string) bool {
	p := k.GetPath()
	return k.GetKey() == namespace && len(p) == 1 && p[0].GetKey() == key
}

func describeKey(k *metadatav3.MetadataKey) string {
	if k == nil {
		return "unset"
	}
	segs := make([]string, 0, len(k.GetPath()))
	for _, s := range k.GetPath() {
		segs = append(segs, s.GetKey())
	}
	return fmt.Sprintf("%q / %q", k.GetKey(), strings.Join(segs, "."))
}

func checkExtProc(path string, m *extprocv3.ExternalProcessor) []error {
	var errs []error
	pm := m.GetProcessingMode()
	full := extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED
	send := extprocv3.ProcessingMode_SEND
	if pm.GetRequestBodyMode() == full && pm.GetRequestTrailerMode() != send {
		errs = append(errs, newProblem(ErrTrailerMode, path+".processing_mode",
			"request_body_mode FULL_DUPLEX_STREAMED needs request_trailer_mode SEND, got %v", pm.GetRequestTrailerMode()))
	}
	if pm.GetResponseBodyMode() == full && pm.GetResponseTrailerMode() != send {
		errs = append(errs, newProblem(ErrTrailerMode, path+".processing_mode",
			"response_body_mode FULL_DUPLEX_STREAMED needs response_trailer_mode SEND, got %v", pm.GetResponseTrailerMode()))
	}

	mo := m.GetMetadataOptions()
	if !slices.Contains(mo.GetReceivingNamespaces().GetUntyped(), lbNamespace) {
		errs = append(errs, newProblem(ErrMetadataNamespaces, path+".metadata_options.receiving_namespaces.untyped",
			"does not list %s: Envoy would drop the destination metadata kvbandit sends, leaving override_host nothing to read", lbNamespace))
	}
	fwd := mo.GetForwardingNamespaces().GetUntyped()
	if !slices.Contains(fwd, lbNamespace) {
		errs = append(errs, newProblem(ErrMetadataNamespaces, path+".metadata_options.forwarding_namespaces.untyped",
			"does not list %s: kvbandit would never see %s, the endpoint that really served the request", lbNamespace, servedKey))
	}
	if !slices.Contains(fwd, subsetNamespace) {
		errs = append(errs, newProblem(ErrMetadataNamespaces, path+".metadata_options.forwarding_namespaces.untyped",
			"does not list %s: kvbandit would never see a gateway's endpoint subset hint", subsetNamespace))
	}
	return errs
}

func checkFilterOrder(path string, m *hcmv3.HttpConnectionManager) []error {
	filters := m.GetHttpFilters()
	extProc, router := -1, -1
	for i, f := range filters {
		tc := f.GetTypedConfig()
		switch {
		case tc.MessageIs((*extprocv3.ExternalProcessor)(nil)):
			if extProc < 0 {
				extProc = i
			}
		case tc.MessageIs((*routerv3.Router)(nil)):
			router = i
		}
	}
	switch {
	case extProc < 0:
		return nil
	case router < 0:
		return []error{newProblem(ErrFilterOrder, path+".http_filters", "has an ext_proc filter but no router filter")}
	case router < extProc:
		return []error{newProblem(ErrFilterOrder, path+".http_filters",
			"the router (index %d) comes before ext_proc (index %d), so ext_proc would never run", router, extProc)}
	case router != len(filters)-1:
		return []error{newProblem(ErrFilterOrder, path+".http_filters",
			"the router (index %d) must be the last of %d filters", router, len(filters))}
	}
	return nil
}
