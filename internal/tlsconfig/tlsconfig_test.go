package tlsconfig

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// ca is a test certificate authority.
type ca struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
}

var serials atomic.Int64

func newCA(t *testing.T) *ca {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serials.Add(1)), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return &ca{cert: c, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})}
}

func (c *ca) pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(c.cert)
	return p
}

// leaf issues a certificate for localhost/127.0.0.1 and returns its serial
// and the PEM certificate and key.
func (c *ca) leaf(t *testing.T, client bool) (int64, []byte, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	serial := serials.Add(1)
	usage := x509.ExtKeyUsageServerAuth
	if client {
		usage = x509.ExtKeyUsageClientAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "localhost"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.cert, &key.PublicKey, c.key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return serial, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb})
}

func (c *ca) clientCert(t *testing.T) tls.Certificate {
	t.Helper()
	_, cp, kp := c.leaf(t, true)
	cert, err := tls.X509KeyPair(cp, kp)
	if err != nil {
		t.Fatal(err)
	}
	return cert
}

func write(t *testing.T, path string, b []byte) {
	t.Helper()
	// Write then rename, as a secret volume update does.
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// clock is a settable clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// serveHealth serves the gRPC health service with TLS from src on loopback.
func serveHealth(t *testing.T, src *Source) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(src.ServerConfig("h2"))))
	healthpb.RegisterHealthServer(gs, health.NewServer())
	go gs.Serve(l)
	t.Cleanup(gs.Stop)
	return l.Addr().String()
}

// check opens a new connection with creds, makes one health call and
// returns the server certificate's serial.
func check(t *testing.T, addr string, creds credentials.TransportCredentials) (int64, error) {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	var p peer.Peer
	if _, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p)); err != nil {
		return 0, err
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		t.Fatalf("peer auth info %T, want TLS", p.AuthInfo)
	}
	return info.State.PeerCertificates[0].SerialNumber.Int64(), nil
}

func tlsClient(pool *x509.CertPool, certs ...tls.Certificate) credentials.TransportCredentials {
	return credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "localhost", Certificates: certs})
}

// files writes a CA-signed server pair into a temp dir.
func files(t *testing.T, c *ca) (certPath, keyPath string, serial int64) {
	t.Helper()
	dir := t.TempDir()
	certPath, keyPath = filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	serial, cp, kp := c.leaf(t, false)
	write(t, certPath, cp)
	write(t, keyPath, kp)
	return certPath, keyPath, serial
}

func TestHandshakeServesCertificate(t *testing.T) {
	c := newCA(t)
	certPath, keyPath, serial := files(t, c)
	src, err := New(Options{CertFile: certPath, KeyFile: keyPath}, Deps{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	addr := serveHealth(t, src)
	got, err := check(t, addr, tlsClient(c.pool()))
	if err != nil {
		t.Fatal(err)
	}
	if got != serial {
		t.Fatalf("served serial %d, want %d", got, serial)
	}
}

func TestRotation(t *testing.T) {
	c := newCA(t)
	certPath, keyPath, first := files(t, c)
	clk := &clock{t: time.Unix(1000, 0)}
	logs := &syncBuffer{}
	src, err := New(Options{CertFile: certPath, KeyFile: keyPath}, Deps{Logger: slog.New(slog.NewTextHandler(logs, nil)), Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	addr := serveHealth(t, src)
	if got, err := check(t, addr, tlsClient(c.pool())); err != nil || got != first {
		t.Fatalf("before rotation: serial %d err %v, want %d", got, err, first)
	}

	second, cp, kp := c.leaf(t, false)
	write(t, certPath, cp)
	write(t, keyPath, kp)
	// Within the check interval the cached certificate is served.
	if got, err := check(t, addr, tlsClient(c.pool())); err != nil || got != first {
		t.Fatalf("within the check interval: serial %d err %v, want %d", got, err, first)
	}
	clk.Add(CheckInterval)
	if got, err := check(t, addr, tlsClient(c.pool())); err != nil || got != second {
		t.Fatalf("after rotation: serial %d err %v, want %d", got, err, second)
	}
	if !strings.Contains(logs.String(), "reloaded the certificate") {
		t.Errorf("no reload logged:\n%s", logs)
	}
}

func TestBadRotationKeepsOld(t *testing.T) {
	c := newCA(t)
	certPath, keyPath, first := files(t, c)
	clk := &clock{t: time.Unix(1000, 0)}
	logs := &syncBuffer{}
	src, err := New(Options{CertFile: certPath, KeyFile: keyPath}, Deps{Logger: slog.New(slog.NewTextHandler(logs, nil)), Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	addr := serveHealth(t, src)

	// A new certificate with the old key: the pair does not match.
	_, cp, _ := c.leaf(t, false)
	write(t, certPath, cp)
	clk.Add(CheckInterval)
	if got, err := check(t, addr, tlsClient(c.pool())); err != nil || got != first {
		t.Fatalf("after a mismatched pair: serial %d err %v, want the old %d", got, err, first)
	}
	// Garbage.
	write(t, keyPath, []byte("not a key"))
	clk.Add(CheckInterval)
	if got, err := check(t, addr, tlsClient(c.pool())); err != nil || got != first {
		t.Fatalf("after a garbage key: serial %d err %v, want the old %d", got, err, first)
	}
	if n := strings.Count(logs.String(), "reloading failed"); n != 2 {
		t.Errorf("%d failed reloads logged, want 2:\n%s", n, logs)
	}
	// The fixed pair lands: it is picked up.
	third, cp, kp := c.leaf(t, false)
	write(t, certPath, cp)
	write(t, keyPath, kp)
	clk.Add(CheckInterval)
	if got, err := check(t, addr, tlsClient(c.pool())); err != nil || got != third {
		t.Fatalf("after a good pair: serial %d err %v, want %d", got, err, third)
	}
}

func TestSelfSignedInsecureClient(t *testing.T) {
	src, err := New(Options{SelfSigned: true, Hosts: DefaultHosts}, Deps{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	addr := serveHealth(t, src)
	if _, err := check(t, addr, credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})); err != nil {
		t.Fatalf("insecure client: %v", err)
	}
	// It also verifies as itself for the hosts it names.
	leaf := src.Certificate().Leaf
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	if _, err := check(t, addr, credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})); err != nil {
		t.Fatalf("verifying client with the self-signed cert as root: %v", err)
	}
	if _, err := check(t, addr, credentials.NewTLS(&tls.Config{RootCAs: x509.NewCertPool(), ServerName: "localhost"})); err == nil {
		t.Fatal("a verifying client without the root accepted the self-signed certificate")
	}
}

func TestMTLS(t *testing.T) {
	c := newCA(t)
	clients := newCA(t)
	certPath, keyPath, _ := files(t, c)
	caPath := filepath.Join(t.TempDir(), "ca.crt")
	write(t, caPath, clients.pem)
	clk := &clock{t: time.Unix(1000, 0)}
	src, err := New(Options{CertFile: certPath, KeyFile: keyPath, ClientCAFile: caPath}, Deps{Logger: slog.New(slog.DiscardHandler), Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	addr := serveHealth(t, src)

	if _, err := check(t, addr, tlsClient(c.pool())); err == nil {
		t.Fatal("a client without a certificate was accepted")
	}
	other := newCA(t)
	if _, err := check(t, addr, tlsClient(c.pool(), other.clientCert(t))); err == nil {
		t.Fatal("a client with a certificate from another CA was accepted")
	}
	if _, err := check(t, addr, tlsClient(c.pool(), clients.clientCert(t))); err != nil {
		t.Fatalf("a client signed by the CA: %v", err)
	}

	// The CA file is reloaded: trust the other CA instead.
	write(t, caPath, other.pem)
	clk.Add(CheckInterval)
	if _, err := check(t, addr, tlsClient(c.pool(), other.clientCert(t))); err != nil {
		t.Fatalf("after the CA rotation, a client of the new CA: %v", err)
	}
	if _, err := check(t, addr, tlsClient(c.pool(), clients.clientCert(t))); err == nil {
		t.Fatal("after the CA rotation, a client of the old CA was accepted")
	}
}

func TestPlaintextClientFails(t *testing.T) {
	src, err := New(Options{SelfSigned: true, Hosts: DefaultHosts}, Deps{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	addr := serveHealth(t, src)
	start := time.Now()
	_, err = check(t, addr, insecure.NewCredentials())
	if err == nil {
		t.Fatal("a plaintext client talked to the TLS server")
	}
	if code := status.Code(err); code != codes.Unavailable {
		t.Errorf("plaintext client: code %v (%v), want Unavailable", code, err)
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("plaintext client failed after %v; want a prompt failure", d)
	}
	t.Logf("plaintext client error: %v", err)
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{CertFile: "a"}, "go together"},
		{Options{KeyFile: "a"}, "go together"},
		{Options{SelfSigned: true, CertFile: "a", KeyFile: "b", Hosts: "x"}, "not both"},
		{Options{SelfSigned: true, Hosts: " , "}, "at least one host"},
		{Options{ClientCAFile: "ca"}, "needs TLS"},
	} {
		err := tc.o.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.o, err, tc.want)
		}
	}
	if err := (Options{Hosts: DefaultHosts}).Validate(); err != nil {
		t.Errorf("TLS off: %v", err)
	}
	if _, err := New(Options{CertFile: "/nonexistent", KeyFile: "/nonexistent"}, Deps{}); err == nil {
		t.Error("missing files: no start-up error")
	}
}
