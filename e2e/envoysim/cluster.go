package envoysim

import (
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"

	"google.golang.org/protobuf/types/known/structpb"
)

// Metadata names of the endpoint picker protocol as the shipped Envoy
// configuration uses them.
const (
	NamespaceLB         = "envoy.lb"
	NamespaceSubsetHint = "envoy.lb.subset_hint"
	KeyDestination      = "x-gateway-destination-endpoint"
	KeyServed           = "x-gateway-destination-endpoint-served"
	KeySubset           = "x-gateway-destination-endpoint-subset"
)

// cluster is the upstream cluster with the override_host load-balancing
// policy: one metadata override source (envoy.lb / KeyDestination), a
// round-robin fallback policy and selected_host_key envoy.lb / KeyServed.
type cluster struct {
	hosts []string        // "ip:port" as Envoy prints host addresses
	index map[string]bool // the same, for lookups
	next  atomic.Uint64   // round-robin position
}

func newCluster(hosts []string) (*cluster, error) {
	c := &cluster{index: make(map[string]bool)}
	for _, h := range hosts {
		ap, err := parseHostPort(h)
		if err != nil {
			return nil, fmt.Errorf("envoysim: cluster host %q: %w", h, err)
		}
		key := ap.String()
		if c.index[key] {
			return nil, fmt.Errorf("envoysim: cluster host %q listed twice", h)
		}
		c.index[key] = true
		c.hosts = append(c.hosts, key)
	}
	return c, nil
}

// choice is the outcome of one host selection.
type choice struct {
	host        string // "" when the cluster has no host
	destination string // the override value read from metadata
	fallback    bool   // round robin chose host
	reason      string // why the override was not used
}

// choose selects the host for a request whose dynamic metadata is md, as
// OverrideHostLoadBalancer::chooseHost does, and records it under the
// selected host key.
func (c *cluster) choose(md map[string]*structpb.Struct) choice {
	var ch choice
	v := md[NamespaceLB].GetFields()[KeyDestination]
	str, isString := v.GetKind().(*structpb.Value_StringValue)
	switch {
	case v == nil:
		ch.reason = "no " + NamespaceLB + "/" + KeyDestination + " metadata"
	case !isString:
		ch.reason = "destination metadata is not a string"
	case str.StringValue == "":
		ch.reason = "destination metadata is empty"
	default:
		ch.destination = str.StringValue
		hosts, err := splitHosts(ch.destination)
		if err != nil {
			ch.reason = err.Error()
			break
		}
		for _, h := range hosts {
			if c.index[h] {
				ch.host = h
				break
			}
		}
		if ch.host == "" {
			ch.reason = fmt.Sprintf("no host of %q is in the cluster %v", ch.destination, c.hosts)
		}
	}
	if ch.host == "" && len(c.hosts) > 0 {
		ch.fallback = true
		ch.host = c.hosts[int((c.next.Add(1)-1)%uint64(len(c.hosts)))]
	}
	if ch.host != "" {
		lb := md[NamespaceLB]
		if lb == nil {
			lb = &structpb.Struct{}
			md[NamespaceLB] = lb
		}
		if lb.Fields == nil {
			lb.Fields = make(map[string]*structpb.Value)
		}
		lb.Fields[KeyServed] = structpb.NewStringValue(ch.host)
	}
	return ch
}

// splitHosts parses "ip:port[,ip:port...]" like override_host's
// extractEndpoints: split on commas, trim ASCII whitespace, every entry an
// IP address and port (IPv6 in brackets), any bad entry spoils the list.
func splitHosts(s string) ([]string, error) {
	var out []string
	for part := range strings.SplitSeq(s, ",") {
		ap, err := parseHostPort(strings.TrimSpace(part))
		if err != nil {
			return nil, fmt.Errorf("destination %q: address %q is not in host:port format", s, part)
		}
		out = append(out, ap.String())
	}
	return out, nil
}

func parseHostPort(s string) (netip.AddrPort, error) {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return netip.AddrPort{}, err
	}
	addr, err := netip.ParseAddr(host)
	if err != nil {
		return netip.AddrPort{}, err
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return netip.AddrPort{}, err
	}
	return netip.AddrPortFrom(addr.Unmap(), uint16(p)), nil
}

// SubsetList returns a subset hint in the list form of the protocol.
func SubsetList(endpoints ...string) *structpb.Value {
	vals := make([]*structpb.Value, len(endpoints))
	for i, e := range endpoints {
		vals[i] = structpb.NewStringValue(e)
	}
	return structpb.NewListValue(&structpb.ListValue{Values: vals})
}

// SubsetString returns a subset hint in the comma-string form (what
// header-to-metadata filters produce).
func SubsetString(endpoints string) *structpb.Value {
	return structpb.NewStringValue(endpoints)
}
