package envoy_test

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	overridehostv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/load_balancing_policies/override_host/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"sigs.k8s.io/yaml"

	"github.com/kvbandit/kvbandit/envoy"
)

var update = flag.Bool("update", false, "rewrite sidecar.yaml and buffered.yaml from envoy.Render")

// checkedIn maps each generated file to the body mode that produces it.
var checkedIn = []struct {
	file string
	mode envoy.BodyMode
}{
	{"sidecar.yaml", envoy.FullDuplex},
	{"buffered.yaml", envoy.Buffered},
}

func TestCheckedInConfigsEqualRender(t *testing.T) {
	for _, c := range checkedIn {
		got, err := envoy.Render(envoy.ExampleOptions(c.mode))
		if err != nil {
			t.Fatalf("Render(ExampleOptions(%v)): %v", c.mode, err)
		}
		if *update {
			if err := os.WriteFile(c.file, got, 0o644); err != nil {
				t.Fatal(err)
			}
			t.Logf("wrote %s", c.file)
			continue
		}
		want, err := os.ReadFile(c.file)
		if err != nil {
			t.Fatalf("%v (run `go test ./envoy -update` to create it)", err)
		}
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs from Render(ExampleOptions(%v)) at %s; edit bootstrap.yaml.tmpl, "+
				"then run `go test ./envoy -update` and review the diff", c.file, c.mode, firstDiff(want, got))
		}
	}
}

func TestEveryCheckedInConfigValidates(t *testing.T) {
	files, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < len(checkedIn) {
		t.Fatalf("found %v, want at least the %d generated configs", files, len(checkedIn))
	}
	for _, f := range files {
		t.Run(f, func(t *testing.T) {
			t.Parallel()
			if err := envoy.Validate(readFile(t, f)); err != nil {
				t.Errorf("Validate(%s):\n%v", f, err)
			}
		})
	}
}

// edit replaces old, which must occur exactly once, with new.
type edit struct{ old, new string }

func TestValidateRejectsBrokenCopies(t *testing.T) {
	const metadataSource = `
            override_host_sources:
            - metadata:
                key: envoy.lb
                path:
                - key: x-gateway-destination-endpoint
`
	const routerFilter = `
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
              suppress_envoy_headers: true
`
	const extProcFilter = `
          - name: envoy.filters.http.ext_proc
`
	tests := []struct {
		name  string
		base  string // file the edits apply to; sidecar.yaml when empty
		edits []edit
		rule  error
		want  []string // substrings of the error
	}{
		{
			name:  "bad enum",
			edits: []edit{{"request_body_mode: FULL_DUPLEX_STREAMED", "request_body_mode: FULL_DUPLEX_STREAM"}},
			rule:  envoy.ErrDecode,
			want:  []string{`.http_filters[1].typed_config.processing_mode.request_body_mode: invalid value for enum field requestBodyMode: "FULL_DUPLEX_STREAM"`},
		},
		{
			name:  "misspelled field in an Any",
			edits: []edit{{"stat_prefix: inference", "stat_prefx: inference"}},
			rule:  envoy.ErrDecode,
			want:  []string{`static_resources.listeners[0].filter_chains[0].filters[0].typed_config.stat_prefx: unknown field "stat_prefx"`},
		},
		{
			name:  "misspelled top-level field",
			edits: []edit{{"static_resources:", "static_resource:"}},
			rule:  envoy.ErrDecode,
			want:  []string{`unknown field "static_resource"`},
		},
		{
			name:  "unregistered Any type",
			edits: []edit{{"filters.http.router.v3.Router", "filters.http.router.v3.Routr"}},
			rule:  envoy.ErrDecode,
			want:  []string{`.http_filters[2].typed_config.@type: unable to resolve`, "Routr"},
		},
		{
			name:  "not YAML",
			edits: []edit{{"admin:\n", "admin: [\n"}},
			rule:  envoy.ErrDecode,
			want:  []string{"yaml: line 24:"},
		},
		{
			// PGV through two levels of Any: listener → HCM (Any) → ext_proc (Any).
			name:  "message_timeout over 1h inside the ext_proc Any",
			edits: []edit{{"message_timeout: 35s", "message_timeout: 4000s"}},
			rule:  envoy.ErrConstraint,
			want: []string{
				"static_resources.listeners[0](inference_listener).filter_chains[0].filters[0](envoy.filters.network.http_connection_manager)" +
					".typed_config<envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager>" +
					".http_filters[1](envoy.filters.http.ext_proc).typed_config<envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor>" +
					".message_timeout: value must be inside range [0s, 1h0m0s]",
			},
		},
		{
			name:  "PGV rule outside any Any",
			edits: []edit{{"connect_timeout: 1s", "connect_timeout: -1s"}},
			rule:  envoy.ErrConstraint,
			want:  []string{"static_resources.clusters[0](kvbandit_ext_proc).connect_timeout: value must be greater than 0s"},
		},
		{
			name:  "PGV rule inside the override_host Any",
			edits: []edit{{metadataSource, "\n            override_host_sources: []\n"}},
			rule:  nil, // both ErrConstraint (min_items 1) and ErrOverrideHost (0 entries)
			want:  []string{"OverrideHost>.override_host_sources: value must contain at least 1 item(s)", "has 0 entries"},
		},
		{
			name:  "override_host with a header source",
			edits: []edit{{metadataSource, "\n            override_host_sources:\n            - header: x-gateway-destination-endpoint\n"}},
			rule:  envoy.ErrOverrideHost,
			want:  []string{`header source "x-gateway-destination-endpoint"`, "override_host_sources[0]"},
		},
		{
			// Envoy's own documented example: header and metadata together.
			name:  "override_host with a header source after the metadata",
			edits: []edit{{metadataSource, metadataSource + "            - header: x-gateway-destination-endpoint\n"}},
			rule:  envoy.ErrOverrideHost,
			want:  []string{"has 2 entries, want exactly one", `override_host_sources[1]: header source`},
		},
		{
			name: "override_host with two metadata sources",
			edits: []edit{{metadataSource, metadataSource +
				"            - metadata:\n                key: envoy.lb\n                path:\n                - key: x-other\n"}},
			rule: envoy.ErrOverrideHost,
			want: []string{"has 2 entries, want exactly one", `override_host_sources[1]: metadata source is "envoy.lb" / "x-other"`},
		},
		{
			name:  "override_host source with the header and metadata in one entry",
			edits: []edit{{"            - metadata:\n                key: envoy.lb", "            - header: x-gateway-destination-endpoint\n              metadata:\n                key: envoy.lb"}},
			rule:  envoy.ErrOverrideHost,
			want:  []string{"header source"},
		},
		{
			name:  "override_host reading the wrong metadata key",
			edits: []edit{{"                - key: x-gateway-destination-endpoint\n", "                - key: x-destination\n"}},
			rule:  envoy.ErrOverrideHost,
			want:  []string{`metadata source is "envoy.lb" / "x-destination"`},
		},
		{
			name:  "override_host without selected_host_key",
			edits: []edit{{"              - key: x-gateway-destination-endpoint-served\n", "              - key: served\n"}},
			rule:  envoy.ErrOverrideHost,
			want:  []string{"selected_host_key", "served the request"},
		},
		{
			name:  "forwarding namespaces without envoy.lb.subset_hint",
			edits: []edit{{"untyped: [envoy.lb, envoy.lb.subset_hint]", "untyped: [envoy.lb]"}},
			rule:  envoy.ErrMetadataNamespaces,
			want:  []string{"forwarding_namespaces.untyped: does not list envoy.lb.subset_hint"},
		},
		{
			name:  "forwarding namespaces without envoy.lb",
			edits: []edit{{"untyped: [envoy.lb, envoy.lb.subset_hint]", "untyped: [envoy.lb.subset_hint]"}},
			rule:  envoy.ErrMetadataNamespaces,
			want:  []string{"forwarding_namespaces.untyped: does not list envoy.lb:"},
		},
		{
			name:  "receiving namespaces without envoy.lb",
			edits: []edit{{"receiving_namespaces:\n                  untyped: [envoy.lb]", "receiving_namespaces:\n                  typed: [envoy.lb]"}},
			rule:  envoy.ErrMetadataNamespaces,
			want:  []string{"receiving_namespaces.untyped: does not list envoy.lb"},
		},
		{
			name:  "FULL_DUPLEX request body with request trailer mode SKIP",
			edits: []edit{{"request_trailer_mode: SEND", "request_trailer_mode: SKIP"}},
			rule:  envoy.ErrTrailerMode,
			want:  []string{"request_body_mode FULL_DUPLEX_STREAMED needs request_trailer_mode SEND, got SKIP"},
		},
		{
			name:  "FULL_DUPLEX response body with response trailer mode left at DEFAULT",
			base:  "buffered.yaml",
			edits: []edit{{"                response_trailer_mode: SEND\n", ""}},
			rule:  envoy.ErrTrailerMode,
			want:  []string{"response_body_mode FULL_DUPLEX_STREAMED needs response_trailer_mode SEND, got DEFAULT"},
		},
		{
			name: "ORIGINAL_DST cluster with use_http_header",
			edits: []edit{{"  clusters:\n", "  clusters:\n" +
				"  - name: original_destination_cluster\n" +
				"    type: ORIGINAL_DST\n" +
				"    lb_policy: CLUSTER_PROVIDED\n" +
				"    connect_timeout: 1s\n" +
				"    original_dst_lb_config: { use_http_header: true, http_header_name: x-gateway-destination-endpoint }\n"}},
			rule: envoy.ErrOriginalDstHeader,
			want: []string{"static_resources.clusters[0](original_destination_cluster): ", `"x-gateway-destination-endpoint" header`},
		},
		{
			name:  "route to an undefined cluster",
			edits: []edit{{"cluster: inference_pool", "cluster: inference_poll"}},
			rule:  envoy.ErrClusterRef,
			want:  []string{`cluster "inference_poll" is not defined`},
		},
		{
			name:  "ext_proc pointing at an undefined cluster",
			edits: []edit{{"cluster_name: kvbandit_ext_proc }", "cluster_name: kvbandit }"}},
			rule:  envoy.ErrClusterRef,
			want:  []string{"envoy_grpc.cluster_name", `cluster "kvbandit" is not defined`},
		},
		{
			name:  "duplicate cluster name",
			edits: []edit{{"- name: inference_pool\n", "- name: kvbandit_ext_proc\n"}, {"cluster: inference_pool", "cluster: kvbandit_ext_proc"}},
			rule:  envoy.ErrClusterRef,
			want:  []string{`duplicate cluster name "kvbandit_ext_proc"`},
		},
		{
			name:  "EDS config source pointing at an undefined cluster",
			base:  "eds.yaml",
			edits: []edit{{"envoy_grpc: { cluster_name: kvbandit_xds }", "envoy_grpc: { cluster_name: kvbandit_xdss }"}},
			rule:  envoy.ErrClusterRef,
			want:  []string{"eds_cluster_config.eds_config.api_config_source.grpc_services[0].envoy_grpc.cluster_name", `cluster "kvbandit_xdss" is not defined`},
		},
		{
			name:  "EDS config source with a bad api_type",
			base:  "eds.yaml",
			edits: []edit{{"api_type: GRPC", "api_type: GPRC"}},
			rule:  envoy.ErrDecode,
			want:  []string{`invalid value for enum field apiType: "GPRC"`},
		},
		{
			name:  "override_host with a header source in eds.yaml",
			base:  "eds.yaml",
			edits: []edit{{metadataSource, "\n            override_host_sources:\n            - header: x-gateway-destination-endpoint\n"}},
			rule:  envoy.ErrOverrideHost,
			want:  []string{`header source "x-gateway-destination-endpoint"`},
		},
		{
			name:  "router before ext_proc",
			edits: []edit{{routerFilter, "\n"}, {extProcFilter, routerFilter + extProcFilter[1:]}},
			rule:  envoy.ErrFilterOrder,
			want:  []string{"comes before ext_proc"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			base := tc.base
			if base == "" {
				base = "sidecar.yaml"
			}
			broken := string(readFile(t, base))
			for _, e := range tc.edits {
				if n := strings.Count(broken, e.old); n != 1 {
					t.Fatalf("edit target %q occurs %d times in %s, want once", e.old, n, base)
				}
				broken = strings.Replace(broken, e.old, e.new, 1)
			}
			err := envoy.Validate([]byte(broken))
			if err == nil {
				t.Fatal("Validate accepted the broken config")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error does not contain %q:\n%v", w, err)
				}
			}
			if tc.rule == nil {
				return
			}
			// Every problem reported is the rule under test: the edit breaks that rule alone,
			// and each problem is reported once.
			for _, p := range problems(err) {
				if !errors.Is(p, tc.rule) {
					t.Errorf("unexpected problem (want only %q):\n%v", tc.rule, p)
				}
			}
		})
	}
}

func TestValidateReportsEachConstraintOnce(t *testing.T) {
	broken := strings.Replace(string(readFile(t, "sidecar.yaml")), "message_timeout: 35s", "message_timeout: 4000s", 1)
	err := envoy.Validate([]byte(broken))
	if got := len(problems(err)); got != 1 {
		t.Fatalf("got %d problems, want 1:\n%v", got, err)
	}
	if n := strings.Count(err.Error(), "message_timeout"); n != 1 {
		t.Errorf("message_timeout reported %d times, want once:\n%v", n, err)
	}
}

func TestValidateIsSafeForConcurrentUse(t *testing.T) {
	config := readFile(t, "sidecar.yaml")
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if err := envoy.Validate(config); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
}

func TestRenderValidatesAndUsesTheOptions(t *testing.T) {
	tests := []struct {
		name string
		opts envoy.RenderOptions
		// Expected addresses as Envoy is given them.
		endpoints  []string
		extProc    string
		healthPort uint32
		listen     string
	}{
		{
			name:       "IPv4",
			opts:       envoy.RenderOptions{Endpoints: []string{"10.0.0.5:8000", "10.0.0.6:8000", "10.0.0.6:8001"}, ExtProcAddr: "10.0.0.2:50051", HealthPort: 50052, ListenAddr: "0.0.0.0:80"},
			endpoints:  []string{"10.0.0.5:8000", "10.0.0.6:8000", "10.0.0.6:8001"},
			extProc:    "10.0.0.2:50051",
			healthPort: 50052,
			listen:     "0.0.0.0:80",
		},
		{
			name:       "IPv6",
			opts:       envoy.RenderOptions{Endpoints: []string{"[::1]:8000", "[2001:db8::5]:8000", "[2001:0db8:0:0::6]:8000"}, ExtProcAddr: "[::1]:9002", ListenAddr: "[::]:8081"},
			endpoints:  []string{"[::1]:8000", "[2001:db8::5]:8000", "[2001:db8::6]:8000"},
			extProc:    "[::1]:9002",
			healthPort: envoy.DefaultHealthPort,
			listen:     "[::]:8081",
		},
		{
			name:       "defaults",
			opts:       envoy.RenderOptions{Endpoints: []string{"192.168.1.10:8000"}},
			endpoints:  []string{"192.168.1.10:8000"},
			extProc:    envoy.DefaultExtProcAddr,
			healthPort: envoy.DefaultHealthPort,
			listen:     envoy.DefaultListenAddr,
		},
	}
	for _, tc := range tests {
		for _, mode := range []envoy.BodyMode{envoy.FullDuplex, envoy.Buffered} {
			t.Run(fmt.Sprintf("%s/%v", tc.name, mode), func(t *testing.T) {
				t.Parallel()
				opts := tc.opts
				opts.BodyMode = mode
				out, err := envoy.Render(opts)
				if err != nil {
					t.Fatalf("Render: %v", err)
				}
				if err := envoy.Validate(out); err != nil {
					t.Fatalf("Validate(Render output):\n%v", err)
				}
				if want := "--endpoints " + strings.Join(tc.endpoints, ",") + " "; !bytes.Contains(out, []byte(want)) {
					t.Errorf("the kvbandit command line in the header does not contain %q", want)
				}

				bs := decode(t, out)
				if got := endpointsOf(t, cluster(t, bs, "inference_pool")); !slices.Equal(got, tc.endpoints) {
					t.Errorf("inference_pool endpoints = %v, want %v", got, tc.endpoints)
				}
				ext := cluster(t, bs, "kvbandit_ext_proc")
				if got := endpointsOf(t, ext); !slices.Equal(got, []string{tc.extProc}) {
					t.Errorf("kvbandit_ext_proc endpoints = %v, want %v", got, tc.extProc)
				}
				hc := ext.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints()[0].GetEndpoint().GetHealthCheckConfig()
				if got := hc.GetPortValue(); got != tc.healthPort {
					t.Errorf("health check port = %d, want %d", got, tc.healthPort)
				}
				if got := ext.GetHealthChecks()[0].GetGrpcHealthCheck().GetServiceName(); got != "envoy.service.ext_proc.v3.ExternalProcessor" {
					t.Errorf("health check service = %q", got)
				}
				listener := bs.GetStaticResources().GetListeners()[0]
				if got := addrString(listener.GetAddress()); got != tc.listen {
					t.Errorf("listener address = %s, want %s", got, tc.listen)
				}

				ep := extProc(t, bs)
				if ep.GetFailureModeAllow() {
					t.Error("failure_mode_allow is true")
				}
				pm := ep.GetProcessingMode()
				wantBody := extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED
				wantLimit := uint32(0) // unset: Envoy's 1 MiB default, not needed in full duplex
				if mode == envoy.Buffered {
					wantBody = extprocv3.ProcessingMode_BUFFERED
					wantLimit = envoy.DefaultMaxBodyBytes
				}
				if pm.GetRequestBodyMode() != wantBody {
					t.Errorf("request_body_mode = %v, want %v", pm.GetRequestBodyMode(), wantBody)
				}
				if got := listener.GetPerConnectionBufferLimitBytes().GetValue(); got != wantLimit {
					t.Errorf("per_connection_buffer_limit_bytes = %d, want %d", got, wantLimit)
				}
				if got := ep.GetMessageTimeout().AsDuration(); got != envoy.DefaultMessageTimeout {
					t.Errorf("message_timeout = %v, want %v", got, envoy.DefaultMessageTimeout)
				}

				oh := overrideHost(t, cluster(t, bs, "inference_pool"))
				if n := len(oh.GetOverrideHostSources()); n != 1 {
					t.Errorf("override_host has %d sources, want 1", n)
				}
				for _, th := range cluster(t, bs, "kvbandit_ext_proc").GetCircuitBreakers().GetThresholds() {
					if th.GetMaxRequests().GetValue() < 100000 || th.GetMaxPendingRequests().GetValue() < 100000 ||
						th.GetMaxConnections().GetValue() < 100000 {
						t.Errorf("ext_proc circuit breakers not raised: %v", th)
					}
				}
			})
		}
	}
}

func TestRenderAppliesBufferedOptions(t *testing.T) {
	out, err := envoy.Render(envoy.RenderOptions{
		Endpoints:      []string{"10.1.2.3:8000"},
		BodyMode:       envoy.Buffered,
		MaxBodyBytes:   4 << 20,
		MessageTimeout: 42500 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	bs := decode(t, out)
	if got := bs.GetStaticResources().GetListeners()[0].GetPerConnectionBufferLimitBytes().GetValue(); got != 4<<20 {
		t.Errorf("per_connection_buffer_limit_bytes = %d, want %d", got, 4<<20)
	}
	if got := extProc(t, bs).GetMessageTimeout().AsDuration(); got != 42500*time.Millisecond {
		t.Errorf("message_timeout = %v, want 42.5s", got)
	}
	if !bytes.Contains(out, []byte("--max-body-bytes 4194304")) {
		t.Error("the kvbandit command line in the header lacks --max-body-bytes 4194304")
	}
}

func TestRenderRejectsBadOptions(t *testing.T) {
	ok := []string{"127.0.0.1:8001"}
	tests := []struct {
		name string
		opts envoy.RenderOptions
	}{
		{"nil endpoint list", envoy.RenderOptions{}},
		{"empty endpoint list", envoy.RenderOptions{Endpoints: []string{}}},
		{"empty entry", envoy.RenderOptions{Endpoints: []string{"127.0.0.1:8001", ""}}},
		{"bad host name", envoy.RenderOptions{Endpoints: []string{"bad..name:8000"}}},
		{"host name with a space", envoy.RenderOptions{Endpoints: []string{"a b:8000"}}},
		{"host name label over 63", envoy.RenderOptions{Endpoints: []string{strings.Repeat("a", 64) + ":8000"}}},
		{"duplicate host name", envoy.RenderOptions{Endpoints: []string{"workers:8000", "Workers:8000"}}},
		{"DNS refresh over 1h", envoy.RenderOptions{Endpoints: []string{"workers:8000"}, DNSRefresh: 2 * time.Hour}},
		{"no port", envoy.RenderOptions{Endpoints: []string{"10.0.0.1"}}},
		{"port 0", envoy.RenderOptions{Endpoints: []string{"10.0.0.1:0"}}},
		{"port too large", envoy.RenderOptions{Endpoints: []string{"10.0.0.1:65536"}}},
		{"IPv6 without brackets", envoy.RenderOptions{Endpoints: []string{"::1:8000"}}},
		{"IPv6 with zone", envoy.RenderOptions{Endpoints: []string{"[fe80::1%eth0]:8000"}}},
		{"URL instead of ip:port", envoy.RenderOptions{Endpoints: []string{"http://10.0.0.1:8000"}}},
		{"comma list in one entry", envoy.RenderOptions{Endpoints: []string{"10.0.0.1:8000,10.0.0.2:8000"}}},
		{"spaces", envoy.RenderOptions{Endpoints: []string{" 10.0.0.1:8000"}}},
		{"duplicate", envoy.RenderOptions{Endpoints: []string{"10.0.0.1:8000", "10.0.0.1:8000"}}},
		{"duplicate IPv6 spelled differently", envoy.RenderOptions{Endpoints: []string{"[2001:db8::1]:8000", "[2001:db8:0::1]:8000"}}},
		{"bad ext_proc address", envoy.RenderOptions{Endpoints: ok, ExtProcAddr: "kvbandit:9002"}},
		{"bad listen address", envoy.RenderOptions{Endpoints: ok, ListenAddr: ":8081"}},
		{"bad admin address", envoy.RenderOptions{Endpoints: ok, AdminAddr: "127.0.0.1"}},
		{"health port out of range", envoy.RenderOptions{Endpoints: ok, HealthPort: 70000}},
		{"negative health port", envoy.RenderOptions{Endpoints: ok, HealthPort: -1}},
		{"health port equals ext_proc port", envoy.RenderOptions{Endpoints: ok, HealthPort: 9002}},
		{"body limit over uint32", envoy.RenderOptions{Endpoints: ok, BodyMode: envoy.Buffered, MaxBodyBytes: 1 << 32}},
		{"negative body limit", envoy.RenderOptions{Endpoints: ok, BodyMode: envoy.Buffered, MaxBodyBytes: -1}},
		{"message timeout over 1h", envoy.RenderOptions{Endpoints: ok, MessageTimeout: time.Hour + time.Second}},
		{"negative message timeout", envoy.RenderOptions{Endpoints: ok, MessageTimeout: -time.Second}},
		{"unknown body mode", envoy.RenderOptions{Endpoints: ok, BodyMode: 7}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			out, err := envoy.Render(tc.opts)
			if !errors.Is(err, envoy.ErrOptions) {
				t.Fatalf("Render = %d bytes, %v; want an error wrapping ErrOptions", len(out), err)
			}
			if out != nil {
				t.Errorf("Render returned output with an error")
			}
		})
	}
}

// TestRenderHostNamesMakeAStrictDNSCluster: with a worker named by DNS the
// workers cluster is STRICT_DNS (both address families, kvbandit's refresh
// rate) and still passes Validate; literal addresses alone keep it STATIC.
func TestRenderHostNamesMakeAStrictDNSCluster(t *testing.T) {
	out, err := envoy.Render(envoy.RenderOptions{Endpoints: []string{"10.0.0.1:8000", "Workers.LLM.svc:8000"}, DNSRefresh: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	c := cluster(t, decode(t, out), "inference_pool")
	if c.GetType() != clusterv3.Cluster_STRICT_DNS || c.GetDnsRefreshRate().AsDuration() != 30*time.Second || c.GetDnsLookupFamily() != clusterv3.Cluster_ALL {
		t.Fatalf("cluster type %v, refresh %v, family %v", c.GetType(), c.GetDnsRefreshRate().AsDuration(), c.GetDnsLookupFamily())
	}
	var hosts []string
	for _, lbe := range c.GetLoadAssignment().GetEndpoints()[0].GetLbEndpoints() {
		sa := lbe.GetEndpoint().GetAddress().GetSocketAddress()
		hosts = append(hosts, fmt.Sprintf("%s:%d", sa.GetAddress(), sa.GetPortValue()))
	}
	if !slices.Equal(hosts, []string{"10.0.0.1:8000", "workers.llm.svc:8000"}) {
		t.Errorf("hosts %v", hosts)
	}
	if !strings.Contains(string(out), "--endpoints 10.0.0.1:8000,workers.llm.svc:8000 ") || !strings.Contains(string(out), "--dns-refresh 30s") {
		t.Error("the serve command line in the header does not match")
	}
	out, err = envoy.Render(envoy.ExampleOptions(envoy.FullDuplex))
	if err != nil {
		t.Fatal(err)
	}
	if c := cluster(t, decode(t, out), "inference_pool"); c.GetType() != clusterv3.Cluster_STATIC {
		t.Errorf("literal addresses: cluster type %v", c.GetType())
	}
}

// problems splits an error from Validate into the problems it joins.
func problems(err error) []error {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return j.Unwrap()
	}
	return []error{err}
}

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func decode(t *testing.T, y []byte) *bootstrapv3.Bootstrap {
	t.Helper()
	j, err := yaml.YAMLToJSON(y)
	if err != nil {
		t.Fatal(err)
	}
	var bs bootstrapv3.Bootstrap
	if err := protojson.Unmarshal(j, &bs); err != nil {
		t.Fatal(err)
	}
	return &bs
}

func cluster(t *testing.T, bs *bootstrapv3.Bootstrap, name string) *clusterv3.Cluster {
	t.Helper()
	for _, c := range bs.GetStaticResources().GetClusters() {
		if c.GetName() == name {
			return c
		}
	}
	t.Fatalf("no cluster %q", name)
	return nil
}

func endpointsOf(t *testing.T, c *clusterv3.Cluster) []string {
	t.Helper()
	var out []string
	for _, le := range c.GetLoadAssignment().GetEndpoints() {
		for _, lbe := range le.GetLbEndpoints() {
			out = append(out, addrString(lbe.GetEndpoint().GetAddress()))
		}
	}
	return out
}

func addrString(a *corev3.Address) string {
	sa := a.GetSocketAddress()
	ip, err := netip.ParseAddr(sa.GetAddress())
	if err != nil {
		return "bad address " + sa.GetAddress()
	}
	return netip.AddrPortFrom(ip, uint16(sa.GetPortValue())).String()
}

func extProc(t *testing.T, bs *bootstrapv3.Bootstrap) *extprocv3.ExternalProcessor {
	t.Helper()
	var hcm hcmv3.HttpConnectionManager
	if err := bs.GetStaticResources().GetListeners()[0].GetFilterChains()[0].GetFilters()[0].GetTypedConfig().UnmarshalTo(&hcm); err != nil {
		t.Fatal(err)
	}
	for _, f := range hcm.GetHttpFilters() {
		var ep extprocv3.ExternalProcessor
		if f.GetTypedConfig().UnmarshalTo(&ep) == nil {
			return &ep
		}
	}
	t.Fatal("no ext_proc filter")
	return nil
}

func overrideHost(t *testing.T, c *clusterv3.Cluster) *overridehostv3.OverrideHost {
	t.Helper()
	var oh overridehostv3.OverrideHost
	policies := c.GetLoadBalancingPolicy().GetPolicies()
	if len(policies) != 1 {
		t.Fatalf("%d load-balancing policies, want 1", len(policies))
	}
	if err := policies[0].GetTypedExtensionConfig().GetTypedConfig().UnmarshalTo(&oh); err != nil {
		t.Fatal(err)
	}
	return &oh
}

// firstDiff names the first line where got differs from want.
func firstDiff(want, got []byte) string {
	w, g := strings.Split(string(want), "\n"), strings.Split(string(got), "\n")
	for i := range max(len(w), len(g)) {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			return fmt.Sprintf("line %d: file has %q, Render gives %q", i+1, wl, gl)
		}
	}
	return "the end of the file"
}
