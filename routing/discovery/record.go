package discovery

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/kvbandit/kvbandit/routing"
)

// Skip reasons (metric labels) for records a source cannot use.
const (
	ReasonMalformed     = "malformed"      // not a JSON object of the record schema
	ReasonUnknownEngine = "unknown_engine" // engine other than vllm or sglang
	ReasonUnknownRole   = "unknown_role"   // role other than prefill, decode, both, prefill-decode
	ReasonInvalid       = "invalid"        // address or numbers out of range
	ReasonDuplicate     = "duplicate"      // a second record for the same address
	ReasonLinkLocal     = "link_local"     // a link-local address the operator has not allowed
)

// MaxRecordBytes bounds one encoded record (an etcd value, a file entry):
// a record within routing's per-endpoint limits is far smaller.
const MaxRecordBytes = 1 << 20

// RecordError is why one record was skipped.
type RecordError struct {
	Reason string
	Err    error
}

func (e *RecordError) Error() string { return e.Reason + ": " + e.Err.Error() }
func (e *RecordError) Unwrap() error { return e.Err }

// DecodeRecord parses one endpoint record: a JSON object with the fields of
// [routing.Endpoint] (address, models, adapters, engine, block_size,
// max_num_batched_tokens, data_parallel_size, weight, labels, metrics_url,
// kv_events, kv_events_bind, kv_events_replay, role). Unknown fields are ignored
// so that newer writers do not break older readers. The address is
// canonicalised. Errors are *RecordError.
func DecodeRecord(data []byte) (routing.Endpoint, error) {
	if len(data) > MaxRecordBytes {
		return routing.Endpoint{}, &RecordError{ReasonInvalid, fmt.Errorf("record of %d bytes (at most %d)", len(data), MaxRecordBytes)}
	}
	var ep routing.Endpoint
	if err := json.Unmarshal(data, &ep); err != nil {
		if errors.Is(err, routing.ErrUnknownRole) {
			return routing.Endpoint{}, &RecordError{ReasonUnknownRole, err}
		}
		return routing.Endpoint{}, &RecordError{ReasonMalformed, err}
	}
	return ep, CheckRecord(&ep)
}

// CheckRecord validates one endpoint on its own and canonicalises its
// address. The address is a literal "ip:port" (IPv6 in brackets) or
// "name:port" with a DNS host name (see [ParseName]), either of them
// optionally written as a worker URL "http://host:port" ([TrimWorkerURL]
// keeps host:port); a name is
// lower-cased, and it never reaches the routing engine: the dns package
// (routing/discovery/dns) replaces such a record by one endpoint per
// address the name resolves to. Errors are *RecordError.
func CheckRecord(ep *routing.Endpoint) error {
	if ep.Key == "" {
		return &RecordError{ReasonMalformed, errors.New("no address")}
	}
	if !slices.Contains(routing.Engines, ep.Engine) {
		return &RecordError{ReasonUnknownEngine, fmt.Errorf("engine %q (want vllm or sglang)", ep.Engine)}
	}
	addr, err := TrimWorkerURL(string(ep.Key))
	if err != nil {
		return &RecordError{ReasonInvalid, err}
	}
	ep.Key = routing.EndpointKey(addr)
	if ap, err := routing.ParseAddrPort(string(ep.Key)); err == nil {
		ep.Key = routing.EndpointKey(ap.String())
	}
	check := *ep
	name, port, err := ParseName(string(ep.Key))
	switch {
	case err != nil:
		return &RecordError{ReasonInvalid, err}
	case name != "":
		ep.Key = routing.EndpointKey(net.JoinHostPort(name, strconv.Itoa(int(port))))
		// Everything but the address is checked as routing will check
		// each resolved endpoint (192.0.2.1 is TEST-NET-1, a stand-in).
		check.Key = routing.EndpointKey(netip.AddrPortFrom(netip.AddrFrom4([4]byte{192, 0, 2, 1}), port).String())
	}
	one := routing.EndpointSet{Endpoints: []routing.Endpoint{check}}
	if err := one.Validate(); err != nil {
		return &RecordError{ReasonInvalid, err}
	}
	return nil
}

// CheckSet checks a static list (--endpoints, the config file's
// endpoints) record by record, canonicalising addresses in place, and
// refuses duplicates.
func CheckSet(eps []routing.Endpoint) error {
	if len(eps) > routing.MaxEndpoints {
		return fmt.Errorf("%w: %d endpoints (at most %d)", routing.ErrInvalidEndpointSet, len(eps), routing.MaxEndpoints)
	}
	seen := make(map[routing.EndpointKey]bool, len(eps))
	for i := range eps {
		if err := CheckRecord(&eps[i]); err != nil {
			return fmt.Errorf("%w: endpoint %d: %w", routing.ErrInvalidEndpointSet, i, err)
		}
		if seen[eps[i].Key] {
			return fmt.Errorf("%w: duplicate endpoint %q", routing.ErrInvalidEndpointSet, eps[i].Key)
		}
		seen[eps[i].Key] = true
	}
	return nil
}

// TrimWorkerURL turns a worker URL, as SGLang's router and vLLM's
// production-stack take them ("http://10.0.0.1:8000", "http://vllm-0:8000/"),
// into the "host:port" kvbandit routes to; an address without "://" is
// returned unchanged. The scheme must be http (kvbandit's proxy, metrics
// scrapes and health checks talk plain HTTP to workers; TLS to them is the
// data plane's cluster transport socket), the port defaults to 80, and a
// path other than "/", a query, a fragment or user information is an error
// naming the fix: kvbandit adds the API paths itself.
func TrimWorkerURL(addr string) (string, error) {
	if !strings.Contains(addr, "://") {
		return addr, nil
	}
	if len(addr) > routing.MaxURLBytes {
		return "", fmt.Errorf("worker URL of %d bytes (at most %d)", len(addr), routing.MaxURLBytes)
	}
	u, err := url.Parse(addr)
	if err != nil {
		return "", fmt.Errorf("worker URL %q: %w", addr, err)
	}
	fix := "write host:port or http://host:port"
	switch strings.ToLower(u.Scheme) {
	case "http":
	case "https":
		return "", fmt.Errorf("worker URL %q: https is not supported: kvbandit talks plain HTTP to workers (put TLS in the data plane's cluster transport_socket); %s", addr, fix)
	default:
		return "", fmt.Errorf("worker URL %q: scheme %q is not supported; %s", addr, u.Scheme, fix)
	}
	switch {
	case u.Path != "" && u.Path != "/":
		return "", fmt.Errorf("worker URL %q: path %q is not supported (kvbandit adds /v1/... itself); %s", addr, u.Path, fix)
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return "", fmt.Errorf("worker URL %q: a query or fragment is not supported; %s", addr, fix)
	case u.User != nil:
		return "", fmt.Errorf("worker URL %q: user information is not supported; %s", addr, fix)
	case u.Hostname() == "":
		return "", fmt.Errorf("worker URL %q: no host; %s", addr, fix)
	}
	port := u.Port()
	if port == "" {
		if strings.HasSuffix(u.Host, ":") {
			return "", fmt.Errorf("worker URL %q: empty port; %s", addr, fix)
		}
		port = "80"
	}
	return net.JoinHostPort(u.Hostname(), port), nil
}

// HasNames reports whether any endpoint's address is a host name.
func HasNames(eps []routing.Endpoint) bool {
	return slices.ContainsFunc(eps, func(e routing.Endpoint) bool {
		name, _, err := ParseName(string(e.Key))
		return err == nil && name != ""
	})
}

// MaxNameBytes bounds a host name (RFC 1035: 253 characters in text form,
// 63 per label).
const (
	MaxNameBytes  = 253
	maxLabelBytes = 63
)

// ErrHostName is wrapped by the errors [ParseName] returns for an address
// whose host is neither an IP literal nor a valid host name.
var ErrHostName = errors.New("invalid host name")

// ParseName splits a record address "host:port". When host is a DNS name
// it returns the name, lower-cased (a trailing dot, meaning "no search
// domains", is kept), and the port; when host is an IP literal it returns
// "" and the port. A name is 1..253 bytes of labels of 1..63 letters,
// digits, '-' or '_' (Docker and Compose service names may hold '_'),
// a label neither starting nor ending with '-', and a last label that is
// not all digits (so "10.0.0" is not taken for a name). The port is
// 1..65535.
func ParseName(addr string) (name string, port uint16, err error) {
	host, ps, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, fmt.Errorf("address %q: %w", addr, err)
	}
	p, err := strconv.ParseUint(ps, 10, 16)
	if err != nil || p == 0 {
		return "", 0, fmt.Errorf("address %q: port must be 1..65535", addr)
	}
	if _, err := netip.ParseAddr(host); err == nil {
		if _, err := routing.ParseAddrPort(addr); err != nil {
			return "", 0, err
		}
		return "", uint16(p), nil
	}
	if err := checkHostName(host); err != nil {
		return "", 0, fmt.Errorf("address %q: %w", addr, err)
	}
	return strings.ToLower(host), uint16(p), nil
}

func checkHostName(host string) error {
	n := strings.TrimSuffix(host, ".")
	if n == "" || len(n) > MaxNameBytes {
		return fmt.Errorf("%w: %d bytes (1..%d)", ErrHostName, len(n), MaxNameBytes)
	}
	labels := strings.Split(n, ".")
	for _, l := range labels {
		if l == "" || len(l) > maxLabelBytes {
			return fmt.Errorf("%w: a label of %d bytes (1..%d)", ErrHostName, len(l), maxLabelBytes)
		}
		if l[0] == '-' || l[len(l)-1] == '-' {
			return fmt.Errorf("%w: label %q starts or ends with '-'", ErrHostName, l)
		}
		for i := 0; i < len(l); i++ {
			c := l[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return fmt.Errorf("%w: %q holds %q (want letters, digits, '-', '_')", ErrHostName, l, c)
			}
		}
	}
	if strings.Trim(labels[len(labels)-1], "0123456789") == "" {
		return fmt.Errorf("%w: %q is neither an IP address nor a name (last label all digits)", ErrHostName, host)
	}
	return nil
}

// SkipReason returns the metric label for err (ReasonInvalid when err is
// not a *RecordError).
func SkipReason(err error) string {
	if re, ok := errors.AsType[*RecordError](err); ok {
		return re.Reason
	}
	return ReasonInvalid
}
