package app

import (
	"context"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/kvbandit/kvbandit/envoy"
	"github.com/kvbandit/kvbandit/internal/cmdline"
	"github.com/kvbandit/kvbandit/routing/discovery"
)

// runEnvoyConfig prints an Envoy bootstrap for the given workers, validated
// against Envoy's protos before it is printed.
func runEnvoyConfig(_ context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("envoy-config", flag.ContinueOnError)
	fs.SetOutput(stderr)
	endpoints := fs.String("endpoints", "", "workers \"host:port[,host:port...]\" (or http://host:port): the cluster's hosts, the same list as serve --endpoints (required); with any DNS name the cluster is STRICT_DNS (every A/AAAA address a host)")
	dnsRefresh := fs.Duration("dns-refresh", envoy.DefaultDNSRefresh, "STRICT_DNS dns_refresh_rate when an endpoint is a name (keep = serve --dns-refresh)")
	extProc := fs.String("ext-proc-addr", envoy.DefaultExtProcAddr, "kvbandit's ext_proc address as Envoy reaches it")
	healthPort := fs.Int("health-port", envoy.DefaultHealthPort, "kvbandit's gRPC health port")
	listen := fs.String("listen-addr", envoy.DefaultListenAddr, "Envoy's client-facing listener")
	admin := fs.String("admin-addr", envoy.DefaultAdminAddr, "Envoy's admin listener")
	mode := fs.String("body-mode", "full-duplex", "request body mode: full-duplex | buffered")
	maxBody := fs.Int64("max-body-bytes", envoy.DefaultMaxBodyBytes, "buffer limit for buffered mode (keep = serve --max-body-bytes)")
	msgTimeout := fs.Duration("message-timeout", envoy.DefaultMessageTimeout, "ext_proc message_timeout (keep > serve --decision-timeout)")
	if err := cmdline.ParseFlags(fs, args); err != nil {
		return err
	}
	if *endpoints == "" {
		return fmt.Errorf("%w: --endpoints is required", ErrUsage)
	}
	opts := envoy.RenderOptions{
		ExtProcAddr: *extProc, HealthPort: *healthPort, ListenAddr: *listen, AdminAddr: *admin,
		MaxBodyBytes: *maxBody, MessageTimeout: *msgTimeout, DNSRefresh: *dnsRefresh,
	}
	// The same parser as serve --endpoints: worker URLs become host:port,
	// unspecified addresses are refused.
	set, err := discovery.ParseEndpointList(*endpoints)
	if err != nil {
		return fmt.Errorf("%w: --endpoints: %w", ErrUsage, err)
	}
	for _, e := range set.Endpoints {
		opts.Endpoints = append(opts.Endpoints, string(e.Key))
	}
	switch *mode {
	case "full-duplex":
		opts.BodyMode = envoy.FullDuplex
	case "buffered":
		opts.BodyMode = envoy.Buffered
	default:
		return fmt.Errorf("%w: --body-mode %q: want full-duplex or buffered", ErrUsage, *mode)
	}
	if *msgTimeout <= 0 || *msgTimeout > time.Hour {
		return fmt.Errorf("%w: --message-timeout must be in (0, 1h]", ErrUsage)
	}
	out, err := envoy.Render(opts)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUsage, err)
	}
	_, err = stdout.Write(out)
	return err
}
