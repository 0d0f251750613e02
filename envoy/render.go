package envoy

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"text/template"
	"time"
)

//go:embed bootstrap.yaml.tmpl
var bootstrapTemplate string

// ErrOptions is wrapped by the errors [Render] returns for bad [RenderOptions].
var ErrOptions = errors.New("invalid render options")

// BodyMode selects how Envoy sends the request body to kvbandit.
type BodyMode int

const (
	// FullDuplex streams the request body to kvbandit (ext_proc FULL_DUPLEX_STREAMED); kvbandit
	// buffers it, decides and streams it back. The primary mode; sidecar.yaml.
	FullDuplex BodyMode = iota
	// Buffered makes Envoy buffer the whole request body (ext_proc BUFFERED) within the listener's
	// buffer limit, RenderOptions.MaxBodyBytes; buffered.yaml.
	Buffered
)

// String returns the ext_proc name of the request body mode.
func (m BodyMode) String() string {
	switch m {
	case FullDuplex:
		return "FULL_DUPLEX_STREAMED"
	case Buffered:
		return "BUFFERED"
	default:
		return "BodyMode(" + strconv.Itoa(int(m)) + ")"
	}
}

// Defaults that [Render] applies to zero-valued [RenderOptions] fields. They match kvbandit's
// own defaults (--grpc-addr :9002, --health-addr :9003, --max-body-bytes 16 MiB,
// --decision-timeout 30 s) on loopback.
const (
	DefaultExtProcAddr    = "127.0.0.1:9002"
	DefaultHealthPort     = 9003
	DefaultListenAddr     = "127.0.0.1:8081"
	DefaultAdminAddr      = "127.0.0.1:9901"
	DefaultMaxBodyBytes   = 16 << 20
	DefaultMessageTimeout = 35 * time.Second
	DefaultDNSRefresh     = 5 * time.Second
)

// maxMessageTimeout is the protoc-gen-validate bound of ExternalProcessor.message_timeout.
const maxMessageTimeout = time.Hour

// RenderOptions describe one deployment. Only Endpoints is required.
type RenderOptions struct {
	// Endpoints are the inference workers, in the order given to kvbandit's --endpoints. They
	// become the load_assignment of cluster inference_pool; override_host only routes to hosts
	// listed there. Must be non-empty, without duplicates. Each is a literal "ip:port" (IPv6 in
	// brackets, "[::1]:8000") or "name:port" with a DNS host name. With only literals the
	// cluster is STATIC; with any name it is STRICT_DNS: Envoy resolves each name as kvbandit
	// does (every A/AAAA address a host, both families, re-resolved every DNSRefresh), so the
	// IPs kvbandit picks are hosts of the cluster.
	Endpoints []string
	// DNSRefresh is the STRICT_DNS cluster's dns_refresh_rate; keep it equal to kvbandit's
	// --dns-refresh. Default DefaultDNSRefresh (Envoy's own default); at most one hour.
	DNSRefresh time.Duration
	// ExtProcAddr is where Envoy reaches kvbandit's ext_proc server (--grpc-addr).
	// Default DefaultExtProcAddr.
	ExtProcAddr string
	// HealthPort is the port of kvbandit's gRPC health server (--health-addr) on the ExtProcAddr
	// host. Default DefaultHealthPort.
	HealthPort int
	// ListenAddr is where Envoy accepts client connections. Default DefaultListenAddr; use
	// 0.0.0.0 or [::] for a front proxy.
	ListenAddr string
	// AdminAddr is Envoy's admin interface. Default DefaultAdminAddr; keep it on loopback.
	AdminAddr string
	// BodyMode picks the variant. Default FullDuplex.
	BodyMode BodyMode
	// MaxBodyBytes is the listener's per_connection_buffer_limit_bytes in Buffered mode, the
	// largest request body Envoy accepts (413 above it). Ignored in FullDuplex mode. Default
	// DefaultMaxBodyBytes; at most 4 GiB - 1.
	MaxBodyBytes int64
	// MessageTimeout is the ext_proc message_timeout. In Buffered mode it must exceed kvbandit's
	// --decision-timeout. Default DefaultMessageTimeout; at most one hour.
	MessageTimeout time.Duration
}

// ExampleOptions returns the options that produce the checked-in envoy/sidecar.yaml
// (FullDuplex) or envoy/buffered.yaml (Buffered): workers 127.0.0.1:8001 and 127.0.0.1:8002,
// everything else at its default.
func ExampleOptions(mode BodyMode) RenderOptions {
	return RenderOptions{Endpoints: []string{"127.0.0.1:8001", "127.0.0.1:8002"}, BodyMode: mode}
}

// hostPort is an address as the template writes it: socket_address.address and port_value,
// and as a flag value ("ip:port", IPv6 in brackets).
type hostPort struct {
	IP   string
	Port uint16
	Addr string
}

type templateData struct {
	Buffered       bool
	StrictDNS      bool   // some endpoint is a host name
	DNSRefresh     string // dns_refresh_rate
	DNSRefreshFlag string // the --dns-refresh value
	Endpoints      []hostPort
	EndpointList   string // the --endpoints value
	ExtProc        hostPort
	ExtProcHealth  string // the --health-addr value
	HealthPort     uint16
	Listen         hostPort
	Admin          hostPort
	MaxBodyBytes   int64
	MessageTimeout string
}

// Render returns an Envoy bootstrap in YAML, with comments, that runs kvbandit as the endpoint
// picker for the given workers: sidecar.yaml's layout for FullDuplex, buffered.yaml's for
// Buffered. Invalid options give an error wrapping [ErrOptions]. The output passes [Validate]
// (Render checks it before returning). Render is safe for concurrent use.
func Render(opts RenderOptions) ([]byte, error) {
	data, err := opts.templateData()
	if err != nil {
		return nil, err
	}
	tmpl, err := template.New("bootstrap.yaml.tmpl").
		Funcs(template.FuncMap{"q": yamlQuote}).
		Option("missingkey=error").
		Parse(bootstrapTemplate)
	if err != nil {
		return nil, fmt.Errorf("envoy: parse template: %w", err)
	}
	var buf bytes.Buffer
	if err := tmpl.Execute(&buf, data); err != nil {
		return nil, fmt.Errorf("envoy: render template: %w", err)
	}
	out := buf.Bytes()
	if err := Validate(out); err != nil {
		// The options were checked above, so this is a bug in the template.
		return nil, fmt.Errorf("envoy: rendered config is invalid: %w", err)
	}
	return out, nil
}

func (o RenderOptions) templateData() (templateData, error) {
	d := templateData{Buffered: o.BodyMode == Buffered}
	if o.BodyMode != FullDuplex && o.BodyMode != Buffered {
		return d, fmt.Errorf("%w: unknown body mode %v", ErrOptions, o.BodyMode)
	}

	if len(o.Endpoints) == 0 {
		return d, fmt.Errorf("%w: no endpoints: list the workers (the same as kvbandit's --endpoints)", ErrOptions)
	}
	seen := map[string]bool{}
	list := make([]string, 0, len(o.Endpoints))
	for i, e := range o.Endpoints {
		hp, err := parseEndpoint(e)
		if err != nil {
			return d, fmt.Errorf("%w: endpoint %d: %v", ErrOptions, i, err)
		}
		if seen[hp.Addr] {
			return d, fmt.Errorf("%w: endpoint %d: duplicate %s", ErrOptions, i, hp.Addr)
		}
		seen[hp.Addr] = true
		if _, err := netip.ParseAddr(hp.IP); err != nil {
			d.StrictDNS = true
		}
		d.Endpoints = append(d.Endpoints, hp)
		list = append(list, hp.Addr)
	}
	d.EndpointList = strings.Join(list, ",")
	refresh := o.DNSRefresh
	if refresh == 0 {
		refresh = DefaultDNSRefresh
	}
	if refresh < time.Millisecond || refresh > time.Hour {
		return d, fmt.Errorf("%w: DNSRefresh %v is outside 1ms..1h", ErrOptions, o.DNSRefresh)
	}
	d.DNSRefresh = strconv.FormatFloat(refresh.Seconds(), 'f', -1, 64) + "s"
	d.DNSRefreshFlag = refresh.String()

	extProc, err := addrOption("ExtProcAddr", o.ExtProcAddr, DefaultExtProcAddr)
	if err != nil {
		return d, err
	}
	d.ExtProc = toHostPort(extProc)
	listen, err := addrOption("ListenAddr", o.ListenAddr, DefaultListenAddr)
	if err != nil {
		return d, err
	}
	d.Listen = toHostPort(listen)
	admin, err := addrOption("AdminAddr", o.AdminAddr, DefaultAdminAddr)
	if err != nil {
		return d, err
	}
	d.Admin = toHostPort(admin)

	health := o.HealthPort
	if health == 0 {
		health = DefaultHealthPort
	}
	if health < 1 || health > 65535 {
		return d, fmt.Errorf("%w: HealthPort %d is not a port", ErrOptions, o.HealthPort)
	}
	d.HealthPort = uint16(health)
	d.ExtProcHealth = toHostPort(netip.AddrPortFrom(extProc.Addr(), d.HealthPort)).Addr
	if d.HealthPort == d.ExtProc.Port {
		return d, fmt.Errorf("%w: HealthPort %d equals the ext_proc port: kvbandit serves health on its own --health-addr",
			ErrOptions, health)
	}

	d.MaxBodyBytes = o.MaxBodyBytes
	if d.MaxBodyBytes == 0 {
		d.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if d.MaxBodyBytes < 1 || d.MaxBodyBytes > 1<<32-1 {
		return d, fmt.Errorf("%w: MaxBodyBytes %d is outside 1..%d (per_connection_buffer_limit_bytes is a uint32)",
			ErrOptions, o.MaxBodyBytes, int64(1<<32-1))
	}

	timeout := o.MessageTimeout
	if timeout == 0 {
		timeout = DefaultMessageTimeout
	}
	if timeout < time.Millisecond || timeout > maxMessageTimeout {
		return d, fmt.Errorf("%w: MessageTimeout %v is outside 1ms..%v", ErrOptions, o.MessageTimeout, maxMessageTimeout)
	}
	d.MessageTimeout = strconv.FormatFloat(timeout.Seconds(), 'f', -1, 64) + "s"
	return d, nil
}

func addrOption(name, value, def string) (netip.AddrPort, error) {
	if value == "" {
		value = def
	}
	ap, err := parseAddrPort(value)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%w: %s: %v", ErrOptions, name, err)
	}
	return ap, nil
}

// parseAddrPort accepts a literal "ip:port" with a non-zero port: IPv6 in brackets, no zone, no
// host name (a STATIC cluster needs addresses, and override_host matches "ip:port" strings).
func parseAddrPort(s string) (netip.AddrPort, error) {
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("%q is not ip:port (IPv6 as [addr]:port, no host names): %v", s, err)
	}
	if ap.Addr().Zone() != "" {
		return netip.AddrPort{}, fmt.Errorf("%q: IPv6 zones are not supported", s)
	}
	if ap.Port() == 0 {
		return netip.AddrPort{}, fmt.Errorf("%q: port 0", s)
	}
	return ap, nil
}

// parseEndpoint accepts a worker address: a literal as parseAddrPort does, or "name:port" with a
// DNS host name of at most 253 bytes, labels of 1..63 letters, digits, '-' or '_' (lower-cased).
func parseEndpoint(s string) (hostPort, error) {
	if ap, err := parseAddrPort(s); err == nil {
		return toHostPort(ap), nil
	} else if _, perr := netip.ParseAddrPort(s); perr == nil {
		return hostPort{}, err // a literal with a zone or port 0
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return hostPort{}, fmt.Errorf("%q is not ip:port or name:port: %v", s, err)
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil || p == 0 {
		return hostPort{}, fmt.Errorf("%q: port must be 1..65535", s)
	}
	name := strings.ToLower(strings.TrimSuffix(host, "."))
	labels := strings.Split(name, ".")
	valid := name != "" && len(name) <= 253 && strings.Trim(labels[len(labels)-1], "0123456789") != ""
	for _, l := range labels {
		valid = valid && l != "" && len(l) <= 63 && l[0] != '-' && l[len(l)-1] != '-' &&
			strings.Trim(l, "abcdefghijklmnopqrstuvwxyz0123456789-_") == ""
	}
	if !valid {
		return hostPort{}, fmt.Errorf("%q: host is neither an IP literal nor a valid DNS name", s)
	}
	return hostPort{IP: name, Port: uint16(p), Addr: net.JoinHostPort(name, port)}, nil
}

func toHostPort(ap netip.AddrPort) hostPort {
	return hostPort{IP: ap.Addr().String(), Port: ap.Port(), Addr: ap.String()}
}

// yamlQuote writes s as a double-quoted YAML scalar (JSON strings are valid YAML), so that
// IPv6 addresses such as "::1" are never read as something else.
func yamlQuote(s string) (string, error) {
	b, err := json.Marshal(s)
	return string(b), err
}
