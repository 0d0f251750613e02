package app

import (
	"context"
	"time"
)

// This file holds serve's shutdown: readiness first, so Envoy stops
// sending new streams; open streams get DrainTimeout to finish on their
// own. Then streams still waiting for a decision are answered 503 and new
// ones refused, while decided streams keep echoing their responses (an
// early close would drop chunks Envoy has in flight) until StopGrace runs
// out.

// wait serves until ctx ends or a server fails, and returns the failure.
func (s *serving) wait(ctx context.Context, errc <-chan error) error {
	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		return err
	}
}

// shutdown drains and stops the servers, in order: readiness and the
// leader lease first, then the ext_proc streams (the proxy drains
// alongside), then the gRPC servers, EDS and the admin port.
func (s *serving) shutdown() {
	s.log.Info("shutting down", "drain_timeout", s.o.DrainTimeout, "streams", s.ep.Streams())
	s.stopping.Store(true)
	s.setReady(false)
	s.hs.Shutdown()
	// Release the Lease now, so a standby takes over while this replica
	// drains.
	s.stopLeader()
	proxyDone := s.drainProxy()
	s.drainStreams()
	s.stopGRPC()
	<-proxyDone
	if s.hsrv != nil {
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		s.hsrv.Shutdown(sctx)
		cancel()
	}
	s.log.Info("stopped")
}

// drainProxy drains the standalone proxy in the background: it stops
// accepting at once, proxied requests get DrainTimeout to finish, then the
// ones left are cut (their decisions end as abandoned). The returned
// channel is closed when it is done.
func (s *serving) drainProxy() <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if s.psrv == nil {
			return
		}
		px := s.px
		pctx, cancel := context.WithTimeout(context.Background(), s.o.DrainTimeout)
		defer cancel()
		if err := s.psrv.Shutdown(pctx); err != nil {
			s.log.Warn("drain deadline reached; cutting proxied requests", "requests", px.InFlight())
			px.Stop()
			s.psrv.Close()
		}
		wctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := px.Wait(wctx); err != nil {
			s.log.Warn("proxied requests still running after stop", "requests", px.InFlight())
		}
		px.Stop()
	}()
	return done
}

// drainStreams gives the ext_proc streams DrainTimeout to finish, then
// refuses the undecided ones, and gives the decided ones StopGrace more.
func (s *serving) drainStreams() {
	ep := s.ep
	drainCtx, cancel := context.WithTimeout(context.Background(), s.o.DrainTimeout)
	if err := ep.Wait(drainCtx); err != nil {
		s.log.Warn("drain deadline reached; refusing undecided streams", "streams", ep.Streams())
	}
	cancel()
	ep.Drain()
	closeCtx, cancel := context.WithTimeout(context.Background(), s.o.StopGrace)
	if err := ep.Wait(closeCtx); err != nil {
		s.log.Warn("streams still open after the stop grace period; closing them", "streams", ep.Streams())
	}
	cancel()
	ep.Stopping()
}

// stopGRPC stops the ext_proc server (gracefully for up to a second), the
// health server and EDS.
func (s *serving) stopGRPC() {
	stopped := make(chan struct{})
	go func() { s.gs.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(time.Second):
		s.gs.Stop()
		<-stopped
	}
	s.hgs.Stop()
	if s.xgs != nil {
		// xDS streams last as long as Envoy runs: end them, then stop.
		s.edsSrv.Close()
		s.xgs.Stop()
	}
}
