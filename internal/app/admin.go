package app

import (
	"encoding/json"
	"errors"
	"flag"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/internal/tlsconfig"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/engine"
	rsync "github.com/kvbandit/kvbandit/routing/sync"
)

// AdminOptions are the flags of the admin (--metrics-addr) and health
// (--health-addr) ports.
type AdminOptions struct {
	// TLS serves the admin port over the --tls-* certificate (and requires
	// client certificates when --tls-client-ca is set).
	TLS bool
	// HealthTLS serves the gRPC health port over the --tls-* certificate.
	// Off by default: the kubelet's gRPC probes cannot speak TLS.
	HealthTLS bool
	// Pprof mounts Go's profiler under /debug/pprof/ on the admin port.
	Pprof bool
}

// AddFlags registers the options on fs.
func (o *AdminOptions) AddFlags(fs *flag.FlagSet) {
	fs.BoolVar(&o.TLS, "admin-tls", false, "serve the admin port (--metrics-addr: /metrics, /debug/*) with the --tls-* certificate; with --tls-client-ca, scrapers must present a client certificate")
	fs.BoolVar(&o.HealthTLS, "health-tls", false, "serve the gRPC health port (--health-addr) with the --tls-* certificate (the kubelet's gRPC probes cannot use TLS: leave it off for them)")
	fs.BoolVar(&o.Pprof, "pprof", false, "mount Go's profiler under /debug/pprof/ on the admin port (it exposes heap contents and can cost CPU: keep the port private)")
}

// Validate checks that TLS is configured when a port asks for it.
func (o AdminOptions) Validate(t tlsconfig.Options) []error {
	var errs []error
	if o.TLS && !t.Enabled() {
		errs = append(errs, errors.New("--admin-tls needs TLS: give --tls-cert/--tls-key or --tls-self-signed"))
	}
	if o.HealthTLS && !t.Enabled() {
		errs = append(errs, errors.New("--health-tls needs TLS: give --tls-cert/--tls-key or --tls-self-signed"))
	}
	return errs
}

// Admin-port HTTP limits: requests are small GETs; /debug/pprof/profile
// and /debug/pprof/trace stream for up to their ?seconds= (30 s default).
const (
	adminReadHeaderTimeout = 5 * time.Second
	adminWriteTimeout      = 2 * time.Minute
	adminIdleTimeout       = time.Minute
	adminMaxHeaderBytes    = 16 << 10
)

// adminState is what the admin pages read.
type adminState struct {
	reg    *prometheus.Registry
	engine *engine.Engine
	hub    *discovery.Hub
	policy string
	ep     *extproc.Server
	sync   *rsync.Syncer // nil without --sync-nats
	warm   *warmStart    // nil without --sync-nats (warm.go)
	// health answers /healthz and /readyz (health.go).
	health http.Handler
}

// newAdminServer returns the admin HTTP server: /metrics, /healthz,
// /readyz, /debug/endpoints, /debug/replicas and, with --pprof,
// /debug/pprof/.
func newAdminServer(o AdminOptions, st adminState) *http.Server {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(st.reg, promhttp.HandlerOpts{Registry: st.reg}))
	mux.Handle(healthzPath, st.health)
	mux.Handle(readyzPath, st.health)
	if o.Pprof {
		// go tool pprof http://ADDR/debug/pprof/profile
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	mux.HandleFunc("/debug/endpoints", st.endpoints)
	mux.HandleFunc("/debug/replicas", st.replicas)
	return &http.Server{Handler: mux, ReadHeaderTimeout: adminReadHeaderTimeout, WriteTimeout: adminWriteTimeout,
		IdleTimeout: adminIdleTimeout, MaxHeaderBytes: adminMaxHeaderBytes}
}

// endpoints serves /debug/endpoints: the endpoint set with in-flight
// requests, decisions and health per worker, and the discovery state.
func (st adminState) endpoints(w http.ResponseWriter, _ *http.Request) {
	type row struct {
		routing.Endpoint
		// Role is always shown (the record omits "both").
		Role string `json:"role"`
		// InFlight is this replica's decisions, RemoteInFlight its
		// peers' (--sync-nats), FleetInFlight their sum.
		InFlight       int64               `json:"inflight"`
		RemoteInFlight int64               `json:"remote_inflight"`
		FleetInFlight  int64               `json:"fleet_inflight"`
		Decisions      int64               `json:"decisions"`
		Health         engine.Health       `json:"health"`
		Scraped        []routing.ModelName `json:"scraped_adapters,omitempty"`
		// KVBlocks is what the KV index holds for it, per medium.
		KVBlocks engine.TierBlocks `json:"kv_blocks"`
	}
	var rows []row
	now := st.engine.Clock().Now()
	for _, e := range st.engine.Endpoints() {
		local, remote := e.InFlight.Load(), e.RemoteInFlight.Load()
		rows = append(rows, row{e.Endpoint, e.Role.String(), local, remote, local + remote, e.Decisions.Load(), st.engine.Health(e.Key, now), st.engine.ScrapedAdapters(e.Key), st.engine.TierBlocks(e)})
	}
	w.Header().Set("content-type", "application/json")
	ds := st.hub.Stats()
	_ = json.NewEncoder(w).Encode(map[string]any{"policy": st.policy, "endpoints": rows, "streams": st.ep.Streams(),
		"discovery": map[string]any{"source": ds.Source, "desired": ds.Endpoints, "pickable": ds.Pickable, "lingering": ds.Lingering, "degraded": ds.Degraded}})
}

// replicas serves /debug/replicas: this replica's sync state and its
// peers (last heard, last heartbeat, in-flight reported and applied, lag).
func (st adminState) replicas(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("content-type", "application/json")
	if st.sync == nil {
		_ = json.NewEncoder(w).Encode(map[string]any{"enabled": false, "peers": []any{}})
		return
	}
	b := st.engine.BurstStats()
	var warm *WarmReport
	if st.warm != nil {
		r := st.warm.Report()
		warm = &r
	}
	_ = json.NewEncoder(w).Encode(struct {
		Enabled bool `json:"enabled"`
		rsync.Status
		Turns turnsStatus `json:"turns"`
		// WarmStart is what this replica took from a peer at start.
		WarmStart *WarmReport `json:"warm_start,omitempty"`
	}{true, st.sync.Status(), turnsStatus{Rank: b.Rank, Replicas: b.Replicas, Simultaneous: b.Simultaneous, Blind: b.Blind, Held: b.Held, HeldSeconds: b.HeldSeconds}, warm})
}

// turnsStatus is /debug/replicas' view of routing/burst: this replica's
// turn, how bursty its traffic looks and what the turns did.
type turnsStatus struct {
	Rank         int     `json:"rank"`
	Replicas     int     `json:"replicas"`
	Simultaneous float64 `json:"simultaneous"`
	Blind        float64 `json:"blind_decisions"`
	Held         int64   `json:"held"`
	HeldSeconds  float64 `json:"held_seconds"`
}

// healthServerOptions are the gRPC health server's options: TLS with
// --health-tls.
func healthServerOptions(o AdminOptions, src *tlsconfig.Source) []grpc.ServerOption {
	if !o.HealthTLS {
		return nil
	}
	return []grpc.ServerOption{grpcTLS(src)}
}
