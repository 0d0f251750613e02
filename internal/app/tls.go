package app

import (
	"crypto/tls"
	"log/slog"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kvbandit/kvbandit/internal/tlsconfig"
)

// newTLSSource loads the --tls-* certificate (nil when TLS is off). A
// missing or bad file is a start-up error; later changes are reloaded.
func newTLSSource(o tlsconfig.Options, log *slog.Logger) (*tlsconfig.Source, error) {
	if !o.Enabled() {
		return nil, nil
	}
	return tlsconfig.New(o, tlsconfig.Deps{Logger: log})
}

// grpcTLS is the ext_proc server's transport credentials option.
func grpcTLS(src *tlsconfig.Source) grpc.ServerOption {
	if src == nil {
		return grpc.EmptyServerOption{}
	}
	return grpc.Creds(credentials.NewTLS(src.ServerConfig("h2")))
}

// httpTLS wraps the standalone proxy's listener in the same TLS (HTTP/1.1
// over TLS; the proxy has no HTTP/2).
func httpTLS(l net.Listener, src *tlsconfig.Source) net.Listener {
	if src == nil || l == nil {
		return l
	}
	return tls.NewListener(l, src.ServerConfig("http/1.1"))
}
