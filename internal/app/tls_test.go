package app

import (
	"context"
	"crypto/tls"
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/internal/tlsconfig"
)

// TestServeTLSSelfSigned: --tls-self-signed puts TLS on the ext_proc port
// (ALPN h2) and on the standalone proxy.
func TestServeTLSSelfSigned(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	ready := make(chan struct{})
	ls := &Listeners{GRPC: listen(), Health: listen(), HTTP: listen(), Ready: func(string, string, string) { close(ready) }}
	grpcAddr, httpAddr := ls.GRPC.Addr().String(), ls.HTTP.Addr().String()
	o := ServeOptions{Endpoints: "127.0.0.1:1", Policy: "kv", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second,
		StopGrace: 100 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text",
		TLS: tlsconfig.Options{SelfSigned: true, Hosts: tlsconfig.DefaultHosts}}
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)), ls) }()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("serve exited: %v", err)
	}

	c, err := tls.Dial("tcp", grpcAddr, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatalf("TLS handshake on the ext_proc port: %v", err)
	}
	if p := c.ConnectionState().NegotiatedProtocol; p != "h2" {
		t.Errorf("ext_proc ALPN %q, want h2", p)
	}
	c.Close()

	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	defer hc.CloseIdleConnections()
	resp, err := hc.Get("https://" + httpAddr + "/v1/nothing")
	if err != nil {
		t.Fatalf("HTTPS to the proxy: %v", err)
	}
	resp.Body.Close()
	if resp.TLS == nil {
		t.Error("proxy answered without TLS")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestServeTLSFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--endpoints", "127.0.0.1:1", "--tls-cert", "x"},
		{"--endpoints", "127.0.0.1:1", "--tls-client-ca", "x"},
		{"--endpoints", "127.0.0.1:1", "--tls-self-signed", "--tls-cert", "a", "--tls-key", "b"},
		{"--endpoints", "127.0.0.1:1", "--admin-tls"},
		{"--endpoints", "127.0.0.1:1", "--health-tls"},
	} {
		err := runServe(t.Context(), args, io.Discard, io.Discard)
		if ExitCode(err) != 2 {
			t.Errorf("%q: %v, want a usage error", args, err)
		}
	}
}

// TestServeAdminTLS: --admin-tls and --health-tls put the admin and health
// ports on the same certificate (plaintext is refused), and --pprof mounts
// the profiler.
func TestServeAdminTLS(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	ready := make(chan struct{})
	ls := &Listeners{GRPC: listen(), Health: listen(), Metrics: listen(), Ready: func(string, string, string) { close(ready) }}
	healthAddr, adminAddr := ls.Health.Addr().String(), ls.Metrics.Addr().String()
	o := ServeOptions{Endpoints: "127.0.0.1:1", Policy: "kv", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second,
		StopGrace: 100 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text", MetricsAddr: "x",
		TLS:   tlsconfig.Options{SelfSigned: true, Hosts: tlsconfig.DefaultHosts},
		Admin: AdminOptions{TLS: true, HealthTLS: true, Pprof: true}}
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, o, slog.New(slog.NewTextHandler(io.Discard, nil)), ls) }()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("serve exited: %v", err)
	}

	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, Timeout: 5 * time.Second}
	defer hc.CloseIdleConnections()
	for _, path := range []string{"/metrics", "/debug/endpoints", "/debug/pprof/heap?debug=1"} {
		resp, err := hc.Get("https://" + adminAddr + path)
		if err != nil {
			t.Fatalf("HTTPS %s: %v", path, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.TLS == nil {
			t.Errorf("%s: status %d, TLS %v", path, resp.StatusCode, resp.TLS != nil)
		}
	}
	plain := &http.Client{Timeout: 5 * time.Second}
	if resp, err := plain.Get("http://" + adminAddr + "/metrics"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Error("the admin port served /metrics in plaintext under --admin-tls")
		}
	}

	c, err := tls.Dial("tcp", healthAddr, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatalf("TLS handshake on the health port: %v", err)
	}
	if p := c.ConnectionState().NegotiatedProtocol; p != "h2" {
		t.Errorf("health ALPN %q, want h2", p)
	}
	c.Close()
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}
