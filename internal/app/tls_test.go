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
	} {
		err := runServe(t.Context(), args, io.Discard, io.Discard)
		if ExitCode(err) != 2 {
			t.Errorf("%q: %v, want a usage error", args, err)
		}
	}
}
