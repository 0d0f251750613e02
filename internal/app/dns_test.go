package app

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/proxy"
)

// TestServeEndpointsByHostName: `serve --endpoints localhost:PORT` resolves
// the name (through /etc/hosts, as Go's resolver does) and routes with an
// IP in the destination header, over ext_proc and the standalone proxy; a
// worker listens on every address localhost has, so each endpoint serves.
func TestServeEndpointsByHostName(t *testing.T) {
	addrs, err := net.DefaultResolver.LookupNetIP(t.Context(), "ip", "localhost")
	if err != nil || len(addrs) == 0 {
		t.Fatalf("localhost does not resolve here: %v %v", addrs, err)
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	addrs = slices.Compact(addrs)
	first := startWorker(t, worker.Config{Addr: netip.AddrPortFrom(addrs[0].Unmap(), 0).String()})
	port := netip.MustParseAddrPort(first.Addr()).Port()
	want := []string{first.Addr()}
	for _, a := range addrs[1:] {
		w := startWorker(t, worker.Config{Addr: netip.AddrPortFrom(a.Unmap(), port).String()})
		want = append(want, w.Addr())
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	a := startServe(t, ctx, first, func(o *ServeOptions) {
		o.Endpoints = "localhost:" + strconv.Itoa(int(port))
		o.DNSRefresh = 100 * time.Millisecond
	})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}

	// Names resolve in the background: wait for the first set.
	var rr proxy.RouteResponse
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := c.Post(a.proxy+proxy.RoutePath, "application/json", strings.NewReader(`{"model":"test-model","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		err = json.NewDecoder(resp.Body).Decode(&rr)
		resp.Body.Close()
		if err == nil && resp.StatusCode == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no route within 10 s: %d %+v %v", resp.StatusCode, rr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !slices.Contains(want, rr.Endpoint) {
		t.Fatalf("/v1/route chose %q, want one of %v", rr.Endpoint, want)
	}

	// The proxy routes to a worker by IP.
	for range 3 {
		resp, err := c.Post(a.proxy+"/v1/chat/completions", "application/json", strings.NewReader(`{"model":"test-model","max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if ep := resp.Header.Get(proxy.HeaderEndpoint); resp.StatusCode != 200 || !slices.Contains(want, ep) {
			t.Fatalf("proxy: %d via %q, want 200 via one of %v", resp.StatusCode, ep, want)
		}
	}

	// ext_proc: the destination header and the envoy.lb metadata carry an IP.
	conn, err := grpc.NewClient("passthrough:///"+a.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	hv := func(k, v string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, RawValue: []byte(v)} }
	for _, m := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{hv(":method", "POST"), hv(":path", "/v1/chat/completions"), hv("content-type", "application/json")}},
		}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: []byte(`{"model":"test-model","messages":[{"role":"user","content":"hi"}]}`), EndOfStream: true,
		}}},
	} {
		if err := st.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var dest string
	for _, h := range resp.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == extproc.HeaderDestination {
			dest = string(h.GetHeader().GetRawValue())
		}
	}
	meta := resp.GetDynamicMetadata().GetFields()["envoy.lb"].GetStructValue().GetFields()[extproc.HeaderDestination].GetStringValue()
	if _, err := netip.ParseAddrPort(dest); err != nil || !slices.Contains(want, dest) || meta != dest {
		t.Fatalf("ext_proc destination %q (metadata %q), want an IP:port of %v; response %v", dest, meta, want, resp)
	}
	_ = st.CloseSend()

	// The lookups are counted on serve's registry.
	mresp, err := c.Get(a.metrics + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	if !strings.Contains(string(body), `kvbandit_dns_resolutions_total{result="success"}`) {
		t.Error("/metrics lacks kvbandit_dns_resolutions_total")
	}
	stopServe(t, cancel, a.done)
}

// TestServeRejectsBadHostNames: a malformed name is a usage error at
// start; config endpoints accept names.
func TestServeRejectsBadHostNames(t *testing.T) {
	for _, bad := range []string{"bad..name:8000", "-x:8000", strings.Repeat("a", 64) + ":8000", "name:0"} {
		if _, _, err := run(t, "serve", "--endpoints", bad, "--grpc-addr", "127.0.0.1:0", "--health-addr", "127.0.0.1:0", "--metrics-addr", ""); ExitCode(err) != 2 {
			t.Errorf("%q: %v", bad, err)
		}
	}
	c := DefaultFileConfig()
	if err := json.Unmarshal([]byte(`{"endpoints":[{"address":"Workers.svc:8000","models":["m"]}]}`), &c); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil || c.Endpoints[0].Key != "workers.svc:8000" {
		t.Fatalf("config with a name: %v %+v", err, c.Endpoints)
	}
}

// TestServeStartLineWhileNamesResolve: before a name has resolved, the
// start-up line says the endpoints are being discovered, not endpoints=0.
func TestServeStartLineWhileNamesResolve(t *testing.T) {
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	ready := make(chan struct{})
	ls := &Listeners{GRPC: listen(), Health: listen(), Metrics: listen(), Ready: func(_, _, _ string) { close(ready) }}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// .invalid never resolves (RFC 6761), so no set is published.
	o := ServeOptions{Endpoints: "kvbandit-test.invalid:8000", Policy: "round_robin", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second,
		DrainTimeout: 100 * time.Millisecond, StopGrace: 100 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text", DNSRefresh: time.Hour}
	logs := &syncBuffer{}
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, o, slog.New(slog.NewJSONHandler(logs, nil)), ls) }()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("serve exited: %v", err)
	}
	var ep any
	for line := range strings.Lines(logs.String()) {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) == nil && rec["msg"] == "kvbandit serving" {
			ep = rec["endpoints"]
		}
	}
	if s, ok := ep.(string); !ok || !strings.Contains(s, "being discovered") {
		t.Errorf("start-up line endpoints = %v, want that they are being discovered; logs:\n%s", ep, logs)
	}
	stopServe(t, cancel, done)
}
