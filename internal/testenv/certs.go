package testenv

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
	"time"
)

// certValidity bounds the certificates NewCA and Issue make: long enough
// for any test, short enough to be useless afterwards.
const certValidity = 24 * time.Hour

// CA is a throwaway ECDSA P-256 certificate authority for a test server.
type CA struct {
	Cert *x509.Certificate
	PEM  []byte // Cert, PEM-encoded
	key  *ecdsa.PrivateKey
}

// Cert is a certificate issued by a CA, with its new private key.
type Cert struct {
	TLS     tls.Certificate // with Leaf set
	CertPEM []byte
	KeyPEM  []byte // "EC PRIVATE KEY"
}

// NewCA generates a self-signed CA named commonName.
func NewCA(commonName string) (*CA, error) {
	key, _, err := newKey()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: commonName},
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, cert, err := sign(tmpl, nil, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("testenv: CA %s: %w", commonName, err)
	}
	return &CA{Cert: cert, PEM: pemBlock("CERTIFICATE", der), key: key}, nil
}

// Pool is a certificate pool that holds only the CA.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Issue signs a certificate for a new P-256 key. tmpl says what it is for
// (Subject, ExtKeyUsage, DNSNames, IPAddresses); Issue sets its serial
// number, validity and KeyUsage (digital signature).
func (ca *CA) Issue(tmpl *x509.Certificate) (*Cert, error) {
	key, keyPEM, err := newKey()
	if err != nil {
		return nil, err
	}
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, cert, err := sign(tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, fmt.Errorf("testenv: certificate %s: %w", tmpl.Subject.CommonName, err)
	}
	return &Cert{
		TLS:     tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: cert},
		CertPEM: pemBlock("CERTIFICATE", der),
		KeyPEM:  keyPEM,
	}, nil
}

// NewKeyPEM generates a P-256 private key and returns it PEM-encoded
// ("EC PRIVATE KEY"), e.g. for a service-account signing key.
func NewKeyPEM() ([]byte, error) {
	_, p, err := newKey()
	return p, err
}

func newKey() (*ecdsa.PrivateKey, []byte, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return key, pemBlock("EC PRIVATE KEY", der), nil
}

// sign creates a certificate from tmpl with a random serial and the
// validity window, signed by parent (tmpl itself when nil), and parses it
// back.
func sign(tmpl, parent *x509.Certificate, pub *ecdsa.PublicKey, signer *ecdsa.PrivateKey) ([]byte, *x509.Certificate, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl.SerialNumber = serial
	tmpl.NotBefore, tmpl.NotAfter = now.Add(-time.Hour), now.Add(certValidity)
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
