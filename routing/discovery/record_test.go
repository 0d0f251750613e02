package discovery_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

func TestParseName(t *testing.T) {
	label63 := strings.Repeat("a", 63)
	name253 := strings.Repeat(label63+".", 3) + strings.Repeat("b", 61) // 3*64 + 61 = 253
	for _, c := range []struct {
		addr, name string
		port       uint16
		bad        bool
	}{
		{addr: "10.0.0.1:8000", port: 8000},
		{addr: "[fd00::1]:8000", port: 8000},
		{addr: "vLLM-0.Workers.svc.cluster.local:8000", name: "vllm-0.workers.svc.cluster.local", port: 8000},
		{addr: "localhost:1", name: "localhost", port: 1},
		{addr: "my_service:80", name: "my_service", port: 80},
		{addr: "fqdn.example.:80", name: "fqdn.example.", port: 80},
		{addr: label63 + ":1", name: label63, port: 1},
		{addr: name253 + ":1", name: name253, port: 1},
		{addr: name253 + "b:1", bad: true},                // 254 bytes
		{addr: strings.Repeat("a", 64) + ":1", bad: true}, // label of 64
		{addr: "a..b:1", bad: true},
		{addr: "-a:1", bad: true},
		{addr: "a-:1", bad: true},
		{addr: "a b:1", bad: true},
		{addr: "a/b:1", bad: true},
		{addr: "10.0.0:1", bad: true}, // all-digit last label
		{addr: "host:0", bad: true},
		{addr: "host:65536", bad: true},
		{addr: "host", bad: true},
		{addr: ":80", bad: true},
		{addr: "[fe80::1%eth0]:80", bad: true},
	} {
		name, port, err := discovery.ParseName(c.addr)
		if c.bad {
			if err == nil {
				t.Errorf("%q: accepted as %q %d", c.addr, name, port)
			}
			continue
		}
		if err != nil || name != c.name || port != c.port {
			t.Errorf("%q: got %q %d %v, want %q %d", c.addr, name, port, err, c.name, c.port)
		}
	}
	if _, _, err := discovery.ParseName("a..b:1"); !errors.Is(err, discovery.ErrHostName) {
		t.Errorf("bad name: %v does not wrap ErrHostName", err)
	}
}

func TestRecordsAcceptHostNames(t *testing.T) {
	ep, err := discovery.DecodeRecord([]byte(`{"address":"Workers.LLM.svc:8000","models":["m"],"engine":"vllm","kv_events":"tcp://workers.llm.svc:5557"}`))
	if err != nil {
		t.Fatal(err)
	}
	if ep.Key != "workers.llm.svc:8000" || ep.Models[0] != "m" {
		t.Fatalf("record: %+v", ep)
	}
	// The rest of a named record is checked as routing checks endpoints.
	for _, bad := range []string{
		`{"address":"workers:8000","block_size":-1}`,
		`{"address":"workers:0"}`,
		`{"address":"wor kers:8000"}`,
		`{"address":"` + strings.Repeat("a", 300) + `:8000"}`,
	} {
		if _, err := discovery.DecodeRecord([]byte(bad)); discovery.SkipReason(err) != discovery.ReasonInvalid {
			t.Errorf("%s: err = %v", bad, err)
		}
	}
	set, err := discovery.ParseEndpointList(" 10.0.0.1:8000, Workers:8000 ")
	if err != nil || len(set.Endpoints) != 2 || set.Endpoints[1].Key != "workers:8000" {
		t.Fatalf("list: %+v %v", set, err)
	}
	if !discovery.HasNames(set.Endpoints) || discovery.HasNames(set.Endpoints[:1]) {
		t.Error("HasNames")
	}
	for _, bad := range []string{"", " , ", "workers:8000,WORKERS:8000", "10.0.0.1:8000,10.0.0.1:8000", "a..b:1"} {
		if _, err := discovery.ParseEndpointList(bad); !errors.Is(err, routing.ErrInvalidEndpointSet) {
			t.Errorf("%q: err = %v", bad, err)
		}
	}
	// A set that still holds a name is refused by routing: nothing
	// downstream of discovery ever sees one.
	if err := set.Validate(); !errors.Is(err, routing.ErrInvalidEndpointSet) {
		t.Errorf("routing accepted a host name: %v", err)
	}
}

func TestRecordRole(t *testing.T) {
	for rec, want := range map[string]routing.Role{
		`{"address":"10.0.0.1:8000"}`:                         routing.RoleBoth,
		`{"address":"10.0.0.1:8000","role":"prefill"}`:        routing.RolePrefill,
		`{"address":"10.0.0.1:8000","role":"DECODE"}`:         routing.RoleDecode,
		`{"address":"10.0.0.1:8000","role":"prefill-decode"}`: routing.RoleBoth,
		`{"address":"10.0.0.1:8000","role":"both"}`:           routing.RoleBoth,
	} {
		ep, err := discovery.DecodeRecord([]byte(rec))
		if err != nil || ep.Role != want {
			t.Errorf("%s: role %v, err %v; want %v", rec, ep.Role, err, want)
		}
	}
	for _, rec := range []string{`{"address":"10.0.0.1:8000","role":"encode"}`, `{"address":"10.0.0.1:8000","role":1}`} {
		_, err := discovery.DecodeRecord([]byte(rec))
		if err == nil {
			t.Errorf("%s: accepted", rec)
		}
	}
	_, err := discovery.DecodeRecord([]byte(`{"address":"10.0.0.1:8000","role":"encode"}`))
	if discovery.SkipReason(err) != discovery.ReasonUnknownRole || !errors.Is(err, routing.ErrUnknownRole) {
		t.Errorf("unknown role: reason %q, err %v", discovery.SkipReason(err), err)
	}
}

func TestWorkerURLs(t *testing.T) {
	for _, c := range []struct{ in, want, bad string }{
		{in: "http://127.0.0.1:8000", want: "127.0.0.1:8000"},
		{in: "HTTP://127.0.0.1:8000/", want: "127.0.0.1:8000"},
		{in: "http://[fd00::1]:8000", want: "[fd00::1]:8000"},
		{in: "http://vllm-0.workers:8000/", want: "vllm-0.workers:8000"},
		{in: "http://10.0.0.1", want: "10.0.0.1:80"},
		{in: "10.0.0.1:8000", want: "10.0.0.1:8000"},
		{in: "https://10.0.0.1:8443", bad: "https is not supported"},
		{in: "grpc://10.0.0.1:8000", bad: `scheme "grpc"`},
		{in: "http://10.0.0.1:8000/v1", bad: `path "/v1"`},
		{in: "http://10.0.0.1:8000/?a=b", bad: "query"},
		{in: "http://u:p@10.0.0.1:8000", bad: "user information"},
		{in: "http://:8000", bad: "no host"},
		{in: "http://10.0.0.1:", bad: "empty port"},
		{in: "http://" + strings.Repeat("a", routing.MaxURLBytes), bad: "bytes"},
	} {
		got, err := discovery.TrimWorkerURL(c.in)
		if c.bad != "" {
			if err == nil || !strings.Contains(err.Error(), c.bad) || !strings.Contains(err.Error(), "host:port") && !strings.Contains(err.Error(), "bytes") {
				t.Errorf("%q: got %q, %v; want an error about %q naming the fix", c.in, got, err, c.bad)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%q: got %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	// The same parser serves --endpoints, the config file's endpoints and
	// every record (file, etcd, kube, register).
	s, err := discovery.ParseEndpointList("http://127.0.0.1:8000, http://[::1]:8001/")
	if err != nil || len(s.Endpoints) != 2 || s.Endpoints[0].Key != "127.0.0.1:8000" || s.Endpoints[1].Key != "[::1]:8001" {
		t.Fatalf("ParseEndpointList(URLs) = %+v, %v", s, err)
	}
	if _, err := discovery.ParseEndpointList("http://127.0.0.1:8000,127.0.0.1:8000"); err == nil {
		t.Error("a URL and its host:port: no duplicate error")
	}
	ep, err := discovery.DecodeRecord([]byte(`{"address":"http://10.0.0.7:8000/"}`))
	if err != nil || ep.Key != "10.0.0.7:8000" {
		t.Errorf("record with a URL: %q, %v", ep.Key, err)
	}
	if _, err := discovery.DecodeRecord([]byte(`{"address":"https://10.0.0.7:8000"}`)); err == nil {
		t.Error("record with an https URL: accepted")
	}
}

func TestUnspecifiedAddressesAreNotEndpoints(t *testing.T) {
	for _, a := range []string{"0.0.0.0:8000", "[::]:8000", "[::ffff:0.0.0.0]:8000", "http://0.0.0.0:8000", "224.0.0.1:8000"} {
		if _, err := discovery.ParseEndpointList(a); !errors.Is(err, routing.ErrInvalidEndpointSet) {
			t.Errorf("--endpoints %s: err = %v", a, err)
		}
		if _, err := discovery.DecodeRecord([]byte(`{"address":"` + a + `"}`)); err == nil {
			t.Errorf("record %s: accepted", a)
		}
	}
	// The engine's own check (every source's sets, and EDS's) refuses them too.
	set := routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "0.0.0.0:8000"}}}
	if err := set.Validate(); !errors.Is(err, routing.ErrInvalidEndpointSet) {
		t.Errorf("Validate(0.0.0.0:8000) = %v", err)
	}
}
