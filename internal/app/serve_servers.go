package app

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	"github.com/kvbandit/kvbandit/extproc/proxy"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/discovery"
	"github.com/kvbandit/kvbandit/routing/scrape"
)

// This file holds serve's servers: the ext_proc and health gRPC servers,
// the admin and proxy HTTP servers, EDS, their listeners, and the
// background goroutines started with them.

// ext_proc server keepalive: how long a connection may be quiet before
// the server pings it, and how long it waits for the ack.
const (
	grpcKeepaliveTime    = time.Minute
	grpcKeepaliveTimeout = 20 * time.Second
)

// Health service names (GIE endpoint picker protocol).
const (
	healthLiveness  = "liveness"
	healthReadiness = "readiness"
	healthExtProc   = "envoy.service.ext_proc.v3.ExternalProcessor"
)

// buildServers makes the ext_proc and health gRPC servers, with TLS and
// leader election; readiness starts NOT_SERVING.
func (s *serving) buildServers() error {
	// BUFFERED mode sends the whole body in one message: the receive limit
	// must hold the largest body plus the message framing.
	maxMsg := int(min(s.o.MaxBodyBytes, 1<<30)) + 64<<10
	var err error
	if s.tlsSrc, err = newTLSSource(s.o.TLS, s.log); err != nil {
		return err
	}
	s.gate = &readyGate{}
	if s.le, err = newLeaderElection(s.o, s.log, s.reg, s.gate); err != nil {
		return err
	}
	s.gs = grpc.NewServer(
		grpcTLS(s.tlsSrc),
		grpc.MaxRecvMsgSize(maxMsg),
		grpc.MaxConcurrentStreams(uint32(min(s.o.MaxInflight*2, 1<<20))),
		// Envoy's connection_keepalive pings (every 30 s in envoy/*.yaml)
		// are allowed down to one per 10 s; faster ones end the
		// connection with GOAWAY too_many_pings.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		// Ping a connection that has been quiet for a minute and close it
		// when the ack does not come within 20 s: a dead peer (host gone,
		// partition) then ends its streams, which release their decisions,
		// instead of holding them until the idle timeout. Envoy answers
		// pings as any HTTP/2 peer must, and a quiet connection is pinged
		// at most once a minute.
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: grpcKeepaliveTime, Timeout: grpcKeepaliveTimeout}),
	)
	extprocv3.RegisterExternalProcessorServer(s.gs, s.ep)
	reflection.Register(s.gs)

	s.hs = health.NewServer()
	s.hgs = grpc.NewServer(healthServerOptions(s.o.Admin, s.tlsSrc)...)
	healthpb.RegisterHealthServer(s.hgs, s.hs)
	reflection.Register(s.hgs)
	s.hs.SetServingStatus(healthLiveness, healthpb.HealthCheckResponse_SERVING)
	s.setReady(false)
	s.hh = &httpHealth{hs: s.hs, gate: s.gate} // /healthz, /readyz on the admin and proxy ports
	return nil
}

// setReady sets the readiness services' status.
func (s *serving) setReady(ready bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ready {
		st = healthpb.HealthCheckResponse_SERVING
	}
	s.hs.SetServingStatus(healthReadiness, st)
	s.hs.SetServingStatus(healthExtProc, st)
	s.hs.SetServingStatus("", st)
}

// listenOn returns l, or when it is nil a listener bound to addr.
func listenOn(l net.Listener, addr string) (net.Listener, error) {
	if l != nil {
		return l, nil
	}
	return net.Listen("tcp", addr)
}

// closeListeners closes the listeners bound so far, after a later one
// failed.
func (s *serving) closeListeners() {
	for _, l := range []net.Listener{s.gl, s.hl, s.ml, s.pl} {
		if l != nil {
			l.Close()
		}
	}
}

// listen binds the ext_proc, health, admin and proxy listeners (or takes
// the caller's), and makes the admin and proxy HTTP servers.
func (s *serving) listen() error {
	o, ls := s.o, s.ls
	var err error
	if s.gl, err = listenOn(ls.GRPC, o.GRPCAddr); err != nil {
		return fmt.Errorf("--grpc-addr: %w", err)
	}
	if s.hl, err = listenOn(ls.Health, o.HealthAddr); err != nil {
		s.closeListeners()
		return fmt.Errorf("--health-addr: %w", err)
	}
	if ls.Metrics != nil || o.MetricsAddr != "" {
		if s.ml, err = listenOn(ls.Metrics, o.MetricsAddr); err != nil {
			s.closeListeners()
			return fmt.Errorf("--metrics-addr: %w", err)
		}
		if o.Admin.TLS {
			s.ml = httpTLS(s.ml, s.tlsSrc)
		}
		s.hsrv = newAdminServer(o.Admin, adminState{reg: s.reg, engine: s.parts.engine, hub: s.hub, policy: s.parts.policy.Name(), ep: s.ep, sync: s.parts.sync, warm: s.warm, health: s.hh})
	}
	if s.px != nil {
		if s.pl, err = listenOn(ls.HTTP, o.HTTPAddr); err != nil {
			s.closeListeners()
			return fmt.Errorf("--http-addr: %w", err)
		}
		s.pl = httpTLS(s.pl, s.tlsSrc)
		// No whole-request read or write timeout: a long SSE generation
		// must not be cut. The proxy bounds the body read itself (the
		// decision deadline), and headers by time and size.
		s.psrv = &http.Server{Handler: withHealth(s.px, s.hh), ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: proxy.MaxHeaderBytes,
			ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)}
	}
	return nil
}

// startScraper scrapes the workers' /metrics for load in the background
// (off with --scrape-interval 0).
func (s *serving) startScraper() {
	if s.o.ScrapeInterval <= 0 {
		return
	}
	engine, log := s.parts.engine, s.log
	publish := scrape.EnginePublish(engine)
	if f := s.fleet; f != nil {
		// A worker's GPU cache size lets its KV view regain trust as the
		// cache turns over (routing/kvevents warm.go).
		inner := publish
		publish = func(t scrape.Target, smp scrape.Sample) {
			inner(t, smp)
			f.setCacheBlocks(routing.EndpointKey(t.Key), smp.NumGPUBlocks)
		}
	}
	sc := scrape.New(scrape.Config{Interval: s.o.ScrapeInterval, Timeout: s.o.ScrapeTimeout}, scrape.Deps{
		Logger: log, Targets: scrape.EngineTargets(engine), Publish: publish,
		OnError: scrape.EngineFailure(engine, func(t scrape.Target, err error) { log.Debug("scrape failed", "endpoint", t.Key, "err", err) }),
	})
	s.reg.MustRegister(scrapeCollector{sc})
	s.bg.Add(1)
	go func() { defer s.bg.Done(); _ = sc.Run(s.bgCtx) }()
}

// startEDS serves the endpoint set to Envoy over xDS EDS, when asked.
func (s *serving) startEDS() error {
	if s.edsSrv == nil {
		return nil
	}
	xl, err := listenOn(s.ls.EDS, s.edsCfg.Addr)
	if err != nil {
		s.closeListeners()
		return fmt.Errorf("--eds-addr: %w", err)
	}
	s.xgs = grpc.NewServer(grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}))
	s.edsSrv.Register(s.xgs)
	reflection.Register(s.xgs)
	go func() {
		if err := serveGRPC(s.xgs, xl, "eds"); err != nil {
			s.log.Error("EDS server stopped", "err", err)
		}
	}()
	s.log.Info("EDS serving", "addr", xl.Addr().String())
	return nil
}

// start runs discovery and the servers in the background; the returned
// channel receives the error of one that fails.
func (s *serving) start() <-chan error {
	errc := make(chan error, 5)
	s.bg.Add(2)
	go func() { defer s.bg.Done(); s.hub.Run(s.bgCtx, 0) }()
	go func() {
		defer s.bg.Done()
		if err := discovery.RunSources(s.bgCtx, s.hub, s.sources...); err != nil {
			errc <- fmt.Errorf("discovery: %w", err)
		}
	}()
	go func() { errc <- serveGRPC(s.gs, s.gl, "ext_proc") }()
	go func() { errc <- serveGRPC(s.hgs, s.hl, "health") }()
	serveHTTP(s.hsrv, s.ml, "metrics", errc)
	serveHTTP(s.psrv, s.pl, "http proxy", errc)
	return errc
}

// serveHTTP serves srv on l in the background, when srv is not nil.
func serveHTTP(srv *http.Server, l net.Listener, name string, errc chan<- error) {
	if srv == nil {
		return
	}
	go func() {
		if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("%s: %w", name, err)
		}
	}()
}

// becomeReady lets readiness follow discovery and leadership, and says
// that serve is serving.
func (s *serving) becomeReady() {
	s.warm.waitReady() // bounded: sync.warm_start.ready_wait_ms
	// Ready once discovery has published a set, and from then on through
	// discovery outages (the last known set keeps serving).
	// Under --leader-elect, also only while leading (leader.go).
	s.gate.bind(s.setReady, &s.stopping)
	s.hub.Follow(func(routing.EndpointSet) { s.gate.setSynced() })
	s.stopLeader = s.le.start()
	s.onExit(s.stopLeader)
	paddr, maddr := "", ""
	if s.psrv != nil {
		paddr = s.pl.Addr().String()
	}
	if s.ml != nil {
		maddr = s.ml.Addr().String()
	}
	b, gaddr, haddr := s.build, s.gl.Addr().String(), s.hl.Addr().String()
	s.log.Info("kvbandit serving", "version", b.Version, "commit", b.Commit, "built", b.Date, "grpc", gaddr, "health", haddr, "metrics", maddr, "http", paddr, "policy", s.parts.policy.Name(), s.endpointsAttr())
	if s.ls.Ready != nil {
		s.ls.Ready(gaddr, haddr, maddr)
	}
}

// endpointsAttr is the start-up line's endpoint count, or, while dynamic
// sources (or host names) have not published a set yet, that they are
// being discovered: the hub logs "first endpoint set" when one comes.
func (s *serving) endpointsAttr() slog.Attr {
	n := len(s.parts.engine.Endpoints())
	if n == 0 && len(s.sources) > 0 && s.hub.Stats().Source == "" {
		return slog.String("endpoints", "being discovered (logged as \"first endpoint set\")")
	}
	return slog.Int("endpoints", n)
}

func serveGRPC(s *grpc.Server, l net.Listener, name string) error {
	if err := s.Serve(l); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// scrapeCollector exports the load scraper's results.
type scrapeCollector struct{ s *scrape.Scraper }

var scrapeDesc = prometheus.NewDesc("kvbandit_scrapes_total", "Worker /metrics scrapes, by result.", []string{"result"}, nil)

func (scrapeCollector) Describe(ch chan<- *prometheus.Desc) { ch <- scrapeDesc }
func (c scrapeCollector) Collect(ch chan<- prometheus.Metric) {
	for reason, n := range c.s.Stats().ByReason() {
		ch <- prometheus.MustNewConstMetric(scrapeDesc, prometheus.CounterValue, float64(n), reason)
	}
}
