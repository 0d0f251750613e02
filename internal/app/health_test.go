package app

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvbandit/kvbandit/e2e/worker"
)

type healthReply struct {
	code   int
	status string
	reason string
	allow  string
}

func getHealth(t *testing.T, c *http.Client, method, url string) healthReply {
	t.Helper()
	req, _ := http.NewRequestWithContext(t.Context(), method, url, nil)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
	var body struct{ Status, Reason string }
	if method != http.MethodHead {
		if err := json.Unmarshal(b, &body); err != nil || !strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
			t.Fatalf("%s %s: %d %q %v", method, url, resp.StatusCode, b, resp.Header)
		}
	}
	return healthReply{resp.StatusCode, body.Status, body.Reason, resp.Header.Get("Allow")}
}

// grpcReadiness asks the gRPC health port for the readiness service.
func grpcReadiness(t *testing.T, addr string) healthpb.HealthCheckResponse_ServingStatus {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: healthReadiness})
	if err != nil {
		t.Fatal(err)
	}
	return r.GetStatus()
}

// TestServeHTTPHealth: /healthz and /readyz answer on the admin port and
// on the proxy port, agree with the gRPC health service, are never
// forwarded to a worker, take GET and HEAD only, and /readyz turns 503
// shutting_down (and /healthz 503) once the drain starts, while a stream
// is still finishing.
func TestServeHTTPHealth(t *testing.T) {
	w := startWorker(t, worker.Config{TokenDelay: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	a := startServe(t, ctx, w, func(o *ServeOptions) { o.DrainTimeout = 10 * time.Second })
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	for _, base := range []string{a.metrics, a.proxy} {
		for _, p := range []string{healthzPath, readyzPath} {
			if r := getHealth(t, c, http.MethodGet, base+p); r.code != 200 || r.status != "serving" {
				t.Errorf("GET %s%s: %+v", base, p, r)
			}
			if r := getHealth(t, c, http.MethodHead, base+p); r.code != 200 {
				t.Errorf("HEAD %s%s: %+v", base, p, r)
			}
			if r := getHealth(t, c, http.MethodPost, base+p); r.code != 405 || r.allow != "GET, HEAD" {
				t.Errorf("POST %s%s: %+v", base, p, r)
			}
		}
	}
	if st := grpcReadiness(t, a.health); st != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("gRPC readiness %v while /readyz is 200", st)
	}
	for _, r := range w.Requests() {
		t.Errorf("the worker saw %s %s", r.Method, r.Path)
	}

	// A stream keeps the drain going; readiness goes first.
	resp := streamRequest(t, c, a.proxy, 100)
	defer resp.Body.Close()
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for {
		r := getHealth(t, c, http.MethodGet, a.metrics+readyzPath)
		if r.code == 503 {
			if r.status != "not_serving" || r.reason != "shutting_down" {
				t.Errorf("/readyz while draining: %+v", r)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz still %+v after shutdown began", r)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if r := getHealth(t, c, http.MethodGet, a.metrics+healthzPath); r.code != 503 || r.reason != "shutting_down" {
		t.Errorf("/healthz while draining: %+v (the gRPC liveness service is NOT_SERVING then too)", r)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	select {
	case err := <-a.done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("serve did not stop")
	}
}

// TestServeHTTPReadyzNoEndpoints: before discovery publishes a set (here
// an etcd that is not there) /readyz answers 503 no_endpoint_set, as the
// gRPC readiness is NOT_SERVING, while /healthz is 200.
func TestServeHTTPReadyzNoEndpoints(t *testing.T) {
	w := startWorker(t, worker.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	a := startServe(t, ctx, w, func(o *ServeOptions) { o.Endpoints, o.EtcdEndpoints = "", freeAddr(t) })
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	for _, base := range []string{a.metrics, a.proxy} {
		if r := getHealth(t, c, http.MethodGet, base+readyzPath); r.code != 503 || r.status != "not_serving" || r.reason != "no_endpoint_set" {
			t.Errorf("%s/readyz: %+v", base, r)
		}
		if r := getHealth(t, c, http.MethodGet, base+healthzPath); r.code != 200 {
			t.Errorf("%s/healthz: %+v", base, r)
		}
	}
	if st := grpcReadiness(t, a.health); st != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("gRPC readiness %v while /readyz is 503", st)
	}
	stopServe(t, cancel, a.done)
}
