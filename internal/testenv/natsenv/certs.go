package natsenv

import (
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"net"
	"os"
	"path/filepath"

	"github.com/kvbandit/kvbandit/internal/testenv"
)

// TLSFiles are the PEM files of a TLS server's material, for clients that
// take file paths (kvbandit's own --sync-nats flags). They live in the
// test's temporary directory and are kept across Restart.
type TLSFiles struct {
	CA         string // the CA certificate that signed the server and client certificates
	ClientCert string // the client certificate (mTLS servers only; empty otherwise)
	ClientKey  string // its private key (mTLS servers only; empty otherwise)
}

// pki is a throwaway CA with a server certificate for 127.0.0.1 and a
// client certificate.
type pki struct {
	pool   *x509.CertPool
	client tls.Certificate
	files  TLSFiles
	server struct{ cert, key string } // file paths
}

// newPKI generates a CA ([testenv.NewCA]), a server certificate (IP SAN
// 127.0.0.1) and a client certificate signed by it, and writes them as PEM
// files into dir.
func newPKI(dir string) (*pki, error) {
	ca, err := testenv.NewCA("natsenv CA")
	if err != nil {
		return nil, err
	}
	p := &pki{pool: ca.Pool()}
	p.files.CA = filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(p.files.CA, ca.PEM, 0o600); err != nil {
		return nil, err
	}
	leaf := func(name string, tmpl *x509.Certificate) (certFile, keyFile string, c tls.Certificate, err error) {
		tmpl.Subject = pkix.Name{CommonName: "natsenv " + name}
		cert, err := ca.Issue(tmpl)
		if err != nil {
			return "", "", c, err
		}
		certFile = filepath.Join(dir, name+"-cert.pem")
		keyFile = filepath.Join(dir, name+"-key.pem")
		if err := os.WriteFile(certFile, cert.CertPEM, 0o600); err != nil {
			return "", "", c, err
		}
		if err := os.WriteFile(keyFile, cert.KeyPEM, 0o600); err != nil {
			return "", "", c, err
		}
		return certFile, keyFile, cert.TLS, nil
	}
	server := &x509.Certificate{
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP(testenv.Loopback)},
	}
	if p.server.cert, p.server.key, _, err = leaf("server", server); err != nil {
		return nil, err
	}
	client := &x509.Certificate{ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	if p.files.ClientCert, p.files.ClientKey, p.client, err = leaf("client", client); err != nil {
		return nil, err
	}
	return p, nil
}
