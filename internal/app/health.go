package app

import (
	"encoding/json"
	"net/http"

	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// HTTP health paths, served on the admin port and on the proxy port.
const (
	// healthzPath mirrors the gRPC health service "liveness": 200 from
	// start until shutdown begins.
	healthzPath = "/healthz"
	// readyzPath mirrors the gRPC health service "readiness" (and the
	// ext_proc service's status): 200 while SERVING, else 503.
	readyzPath = "/readyz"
)

// httpHealth answers /healthz and /readyz from the gRPC health server's
// own status, so the HTTP and gRPC answers never disagree; a 503 says why
// in a small JSON body: {"status":"not_serving","reason":...}.
type httpHealth struct {
	hs   *health.Server
	gate *readyGate
}

type healthBody struct {
	Status string `json:"status"`
	Reason string `json:"reason,omitempty"`
}

// ServeHTTP implements [http.Handler].
func (h *httpHealth) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	svc := healthReadiness
	if r.URL.Path == healthzPath {
		svc = healthLiveness
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		w.WriteHeader(http.StatusMethodNotAllowed)
		_ = json.NewEncoder(w).Encode(healthBody{Status: "error", Reason: "method_not_allowed"})
		return
	}
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if resp, err := h.hs.Check(r.Context(), &healthpb.HealthCheckRequest{Service: svc}); err == nil {
		st = resp.GetStatus()
	}
	body, code := healthBody{Status: "serving"}, http.StatusOK
	if st != healthpb.HealthCheckResponse_SERVING {
		body, code = healthBody{Status: "not_serving", Reason: h.gate.reason()}, http.StatusServiceUnavailable
	}
	w.WriteHeader(code)
	if r.Method != http.MethodHead {
		_ = json.NewEncoder(w).Encode(body)
	}
}

// withHealth serves /healthz and /readyz with h and every other path with
// next (the proxy: these paths are never forwarded to a worker).
func withHealth(next, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == healthzPath || r.URL.Path == readyzPath {
			h.ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// reason says why serve is not ready: shutting_down (drain started),
// no_endpoint_set (discovery has not published a set yet), not_leader
// (--leader-elect and another replica holds the Lease), else starting.
func (g *readyGate) reason() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.stopping != nil && g.stopping.Load():
		return "shutting_down"
	case g.set == nil:
		return "starting"
	case !g.synced:
		return "no_endpoint_set"
	case g.needLeader && !g.leading:
		return "not_leader"
	}
	return "starting"
}
