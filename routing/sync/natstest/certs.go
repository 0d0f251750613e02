package natstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// TLSFiles are the PEM files of a TLS server's material, for clients that
// take file paths (kvbandit's own --sync-nats flags). They live in the
// test's temporary directory and are kept across Restart.
type TLSFiles struct {
	CA         string // the CA certificate that signed the server and client certificates
	ClientCert string // the client certificate (mTLS servers only; empty otherwise)
	ClientKey  string // its private key (mTLS servers only; empty otherwise)
}

// certValidity bounds the generated certificates: long enough for any test,
// short enough to be useless afterwards.
const certValidity = 6 * time.Hour

// pki is a throwaway CA with a server certificate for 127.0.0.1 and a
// client certificate.
type pki struct {
	pool   *x509.CertPool
	client tls.Certificate
	files  TLSFiles
	server struct{ cert, key string } // file paths
}

// newPKI generates an ECDSA P-256 CA, a server certificate (IP SAN
// 127.0.0.1) and a client certificate signed by it, and writes them as PEM
// files into dir.
func newPKI(dir string, now time.Time) (*pki, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	caTmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: "natstest CA"},
		NotBefore:             now.Add(-time.Minute),
		NotAfter:              now.Add(certValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	caDER, caCert, err := sign(caTmpl, nil, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("CA: %w", err)
	}
	p := &pki{pool: x509.NewCertPool()}
	p.pool.AddCert(caCert)
	p.files.CA = filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(p.files.CA, pemBlock("CERTIFICATE", caDER), 0o600); err != nil {
		return nil, err
	}

	leaf := func(name string, usage x509.ExtKeyUsage) (certFile, keyFile string, c tls.Certificate, err error) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return "", "", c, err
		}
		tmpl := &x509.Certificate{
			Subject:     pkix.Name{CommonName: "natstest " + name},
			NotBefore:   now.Add(-time.Minute),
			NotAfter:    now.Add(certValidity),
			KeyUsage:    x509.KeyUsageDigitalSignature,
			ExtKeyUsage: []x509.ExtKeyUsage{usage},
		}
		if usage == x509.ExtKeyUsageServerAuth {
			tmpl.IPAddresses = []net.IP{net.IPv4(127, 0, 0, 1)}
		}
		der, cert, err := sign(tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			return "", "", c, fmt.Errorf("%s certificate: %w", name, err)
		}
		keyDER, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			return "", "", c, err
		}
		certFile = filepath.Join(dir, name+"-cert.pem")
		keyFile = filepath.Join(dir, name+"-key.pem")
		if err := os.WriteFile(certFile, pemBlock("CERTIFICATE", der), 0o600); err != nil {
			return "", "", c, err
		}
		if err := os.WriteFile(keyFile, pemBlock("EC PRIVATE KEY", keyDER), 0o600); err != nil {
			return "", "", c, err
		}
		return certFile, keyFile, tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: cert}, nil
	}
	if p.server.cert, p.server.key, _, err = leaf("server", x509.ExtKeyUsageServerAuth); err != nil {
		return nil, err
	}
	if p.files.ClientCert, p.files.ClientKey, p.client, err = leaf("client", x509.ExtKeyUsageClientAuth); err != nil {
		return nil, err
	}
	return p, nil
}

// sign creates a certificate from tmpl with a random serial, signed by
// parent (tmpl itself when nil), and parses it back.
func sign(tmpl, parent *x509.Certificate, pub *ecdsa.PublicKey, signer *ecdsa.PrivateKey) ([]byte, *x509.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return nil, nil, err
	}
	tmpl.SerialNumber = serial
	if parent == nil {
		parent = tmpl
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, pub, signer)
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	return der, cert, nil
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}
