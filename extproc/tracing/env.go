package tracing

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
)

// ErrConfig wraps every invalid OTEL_* setting, so serve reports it as a
// usage error at start-up.
var ErrConfig = errors.New("tracing configuration")

// Protocols of the OTLP trace exporter.
const (
	ProtocolGRPC         = "grpc"
	ProtocolHTTPProtobuf = "http/protobuf"
)

// Samplers (OTEL_TRACES_SAMPLER values).
const (
	SamplerAlwaysOn                = "always_on"
	SamplerAlwaysOff               = "always_off"
	SamplerTraceIDRatio            = "traceidratio"
	SamplerParentBasedAlwaysOn     = "parentbased_always_on"
	SamplerParentBasedAlwaysOff    = "parentbased_always_off"
	SamplerParentBasedTraceIDRatio = "parentbased_traceidratio"
)

// DefaultServiceName is the service.name resource attribute when
// OTEL_SERVICE_NAME (or service.name in OTEL_RESOURCE_ATTRIBUTES) is unset.
const DefaultServiceName = "kvbandit"

// Bounds on what the environment may hold.
const (
	maxEnvBytes = 4096
)

// Config is the tracing set-up read from the standard OTEL_* variables.
type Config struct {
	// Enabled: spans are exported. False leaves a nil *Tracer: no spans,
	// no header changes, no cost on the request path.
	Enabled bool
	// Protocol is ProtocolGRPC or ProtocolHTTPProtobuf.
	Protocol string
	// Endpoint is the exporter's URL: for OTLP/HTTP the full traces URL
	// (…/v1/traces), for gRPC scheme://host:port (http: plain text, https:
	// TLS).
	Endpoint string
	// Sampler is one of the Sampler* names; Ratio is its argument for the
	// ratio samplers, in [0, 1].
	Sampler string
	Ratio   float64
	// ServiceName is OTEL_SERVICE_NAME, or DefaultServiceName.
	ServiceName string
}

// FromEnv reads the tracing configuration through getenv (os.Getenv in
// serve). Tracing is off unless OTEL_TRACES_EXPORTER is "otlp", or is
// unset while an OTLP endpoint variable is set; OTEL_SDK_DISABLED=true
// turns it off whatever else is set. Every value that is set is checked,
// and a bad one is an error wrapping [ErrConfig] that names the variable.
func FromEnv(getenv func(string) string) (Config, error) {
	get := func(k string) (string, error) {
		v := strings.TrimSpace(getenv(k))
		if len(v) > maxEnvBytes {
			return "", fmt.Errorf("%w: %s: longer than %d bytes", ErrConfig, k, maxEnvBytes)
		}
		return v, nil
	}
	var c Config
	var errs []error
	val := func(k string) string {
		v, err := get(k)
		if err != nil {
			errs = append(errs, err)
		}
		return v
	}

	disabled := false
	switch v := strings.ToLower(val("OTEL_SDK_DISABLED")); v {
	case "", "false":
	case "true":
		disabled = true
	default:
		errs = append(errs, fmt.Errorf("%w: OTEL_SDK_DISABLED: want true or false, got %q", ErrConfig, v))
	}

	tracesEndpoint, baseEndpoint := val("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), val("OTEL_EXPORTER_OTLP_ENDPOINT")
	switch v := strings.ToLower(val("OTEL_TRACES_EXPORTER")); v {
	case "":
		c.Enabled = tracesEndpoint != "" || baseEndpoint != ""
	case "otlp":
		c.Enabled = true
	case "none":
	default:
		errs = append(errs, fmt.Errorf("%w: OTEL_TRACES_EXPORTER: want otlp or none, got %q", ErrConfig, v))
	}

	c.Protocol = ProtocolHTTPProtobuf
	proto, protoVar := val("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	if proto == "" {
		proto, protoVar = val("OTEL_EXPORTER_OTLP_PROTOCOL"), "OTEL_EXPORTER_OTLP_PROTOCOL"
	}
	switch proto {
	case "":
	case ProtocolGRPC, ProtocolHTTPProtobuf:
		c.Protocol = proto
	default:
		errs = append(errs, fmt.Errorf("%w: %s: want grpc or http/protobuf, got %q", ErrConfig, protoVar, proto))
	}

	endpoint, err := exporterURL(c.Protocol, tracesEndpoint, baseEndpoint)
	if err != nil {
		errs = append(errs, err)
	}
	c.Endpoint = endpoint

	c.Sampler, c.Ratio = SamplerParentBasedAlwaysOn, 1
	if s := strings.ToLower(val("OTEL_TRACES_SAMPLER")); s != "" {
		switch s {
		case SamplerAlwaysOn, SamplerAlwaysOff, SamplerTraceIDRatio, SamplerParentBasedAlwaysOn, SamplerParentBasedAlwaysOff, SamplerParentBasedTraceIDRatio:
			c.Sampler = s
		default:
			errs = append(errs, fmt.Errorf("%w: OTEL_TRACES_SAMPLER: want one of always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off, parentbased_traceidratio, got %q", ErrConfig, s))
		}
	}
	if a := val("OTEL_TRACES_SAMPLER_ARG"); a != "" && (c.Sampler == SamplerTraceIDRatio || c.Sampler == SamplerParentBasedTraceIDRatio) {
		r, err := strconv.ParseFloat(a, 64)
		if err != nil || r < 0 || r > 1 || r != r {
			errs = append(errs, fmt.Errorf("%w: OTEL_TRACES_SAMPLER_ARG: want a ratio in [0, 1], got %q", ErrConfig, a))
		} else {
			c.Ratio = r
		}
	}

	c.ServiceName = val("OTEL_SERVICE_NAME")
	if c.ServiceName == "" {
		c.ServiceName = DefaultServiceName
	}
	if err := errors.Join(errs...); err != nil {
		return Config{}, err
	}
	if disabled {
		c.Enabled = false
	}
	return c, nil
}

// exporterURL resolves the exporter's URL as the OTLP exporter
// specification says: the per-signal variable is used as is, the generic
// one gets /v1/traces appended for OTLP/HTTP; the defaults are
// http://localhost:4318/v1/traces and http://localhost:4317.
func exporterURL(protocol, traces, base string) (string, error) {
	name, raw := "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", traces
	if raw == "" {
		name, raw = "OTEL_EXPORTER_OTLP_ENDPOINT", base
	}
	if raw == "" {
		if protocol == ProtocolGRPC {
			return "http://localhost:4317", nil
		}
		return "http://localhost:4318/v1/traces", nil
	}
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil {
		return "", fmt.Errorf("%w: %s: want an http:// or https:// URL with a host, got %q", ErrConfig, name, raw)
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return "", fmt.Errorf("%w: %s: bad port in %q", ErrConfig, name, raw)
		}
	}
	if protocol == ProtocolHTTPProtobuf && traces == "" {
		u.Path = strings.TrimSuffix(u.Path, "/") + "/v1/traces"
	}
	return u.String(), nil
}
