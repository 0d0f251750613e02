// Package tlsconfig provides the server-side TLS configuration of
// `kvbandit serve`: a certificate and key read from files and reloaded when
// they change, or a self-signed certificate generated at start, and optional
// client-certificate verification (mTLS) against a CA file that is reloaded
// the same way.
//
// # Reloading
//
// Handshakes read a cached certificate. At most once per [CheckInterval] a
// handshake also stats the files; when a file's modification time, size or
// inode changed (a Kubernetes Secret volume swaps a symlink, which changes
// the inode; an in-place rewrite within the same filesystem timestamp tick
// and of the same size goes unseen until the next change), the pair (or the CA bundle) is read and parsed again. A new pair
// that fails to load — a key that does not match, a half-written file —
// keeps the previous one in use and is logged; it is retried when the files
// change again. Nothing runs in the background.
package tlsconfig

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// CheckInterval is how often, at most, the files are checked for changes.
const CheckInterval = time.Second

// DefaultHosts are the names and addresses a self-signed certificate covers
// when --tls-hosts is not given.
const DefaultHosts = "localhost,127.0.0.1"

// Options are the --tls-* flags.
type Options struct {
	CertFile     string
	KeyFile      string
	SelfSigned   bool
	Hosts        string // comma list of DNS names and IPs for SelfSigned
	ClientCAFile string
}

// AddFlags registers the options on fs.
func (o *Options) AddFlags(fs *flag.FlagSet) {
	fs.StringVar(&o.CertFile, "tls-cert", "", "serve TLS with this PEM certificate (chain) file, reloaded on change; needs --tls-key")
	fs.StringVar(&o.KeyFile, "tls-key", "", "PEM private key for --tls-cert, reloaded on change")
	fs.BoolVar(&o.SelfSigned, "tls-self-signed", false, "serve TLS with an ECDSA certificate generated at start for --tls-hosts (for gateways that connect with TLS without verifying)")
	fs.StringVar(&o.Hosts, "tls-hosts", DefaultHosts, "--tls-self-signed: comma list of DNS names and IPs the certificate covers")
	fs.StringVar(&o.ClientCAFile, "tls-client-ca", "", "mTLS: require client certificates signed by a CA in this PEM file (reloaded on change); needs --tls-cert/--tls-key or --tls-self-signed")
}

// Enabled reports whether the options ask for TLS.
func (o Options) Enabled() bool { return o.SelfSigned || o.CertFile != "" || o.KeyFile != "" }

// Validate checks the combination of options.
func (o Options) Validate() error {
	var errs []error
	if (o.CertFile == "") != (o.KeyFile == "") {
		errs = append(errs, errors.New("--tls-cert and --tls-key go together"))
	}
	if o.SelfSigned && o.CertFile != "" {
		errs = append(errs, errors.New("give --tls-self-signed or --tls-cert/--tls-key, not both"))
	}
	if o.SelfSigned && len(splitHosts(o.Hosts)) == 0 {
		errs = append(errs, errors.New("--tls-hosts must name at least one host for --tls-self-signed"))
	}
	if o.ClientCAFile != "" && !o.Enabled() {
		errs = append(errs, errors.New("--tls-client-ca needs TLS: give --tls-cert/--tls-key or --tls-self-signed"))
	}
	return errors.Join(errs...)
}

func splitHosts(s string) []string {
	var hs []string
	for _, h := range strings.Split(s, ",") {
		if h = strings.TrimSpace(h); h != "" {
			hs = append(hs, h)
		}
	}
	return hs
}

// Deps are the injected dependencies; nil fields get defaults.
type Deps struct {
	Logger *slog.Logger     // nil: slog.Default()
	Now    func() time.Time // nil: time.Now
}

// Source serves the current certificate and client CA pool to handshakes.
// It is safe for concurrent use.
type Source struct {
	log   *slog.Logger
	now   func() time.Time
	cert  *watched[tls.Certificate]
	cas   *watched[x509.CertPool] // nil without --tls-client-ca
	fixed *tls.Certificate        // self-signed
}

// New loads the certificate (or generates the self-signed one) and the
// client CA; a failure here is a start-up error.
func New(o Options, d Deps) (*Source, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	if !o.Enabled() {
		return nil, errors.New("tlsconfig: TLS is not enabled")
	}
	s := &Source{log: d.Logger, now: d.Now}
	if s.log == nil {
		s.log = slog.Default()
	}
	if s.now == nil {
		s.now = time.Now
	}
	if o.SelfSigned {
		c, err := SelfSigned(splitHosts(o.Hosts), s.now())
		if err != nil {
			return nil, err
		}
		s.fixed = &c
		sum := sha256.Sum256(c.Certificate[0])
		s.log.Info("TLS: generated a self-signed certificate", "hosts", o.Hosts, "sha256", hex.EncodeToString(sum[:]))
	} else {
		w, err := newWatched(s, "certificate", []string{o.CertFile, o.KeyFile}, func() (*tls.Certificate, error) {
			c, err := tls.LoadX509KeyPair(o.CertFile, o.KeyFile)
			if err != nil {
				return nil, err
			}
			return &c, nil
		})
		if err != nil {
			return nil, fmt.Errorf("--tls-cert/--tls-key: %w", err)
		}
		s.cert = w
	}
	if o.ClientCAFile != "" {
		w, err := newWatched(s, "client CA", []string{o.ClientCAFile}, func() (*x509.CertPool, error) {
			return loadPool(o.ClientCAFile)
		})
		if err != nil {
			return nil, fmt.Errorf("--tls-client-ca: %w", err)
		}
		s.cas = w
	}
	return s, nil
}

func loadPool(path string) (*x509.CertPool, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("%s: no PEM certificates", path)
	}
	return p, nil
}

// Certificate returns the certificate handshakes currently use.
func (s *Source) Certificate() *tls.Certificate {
	if s.fixed != nil {
		return s.fixed
	}
	return s.cert.get()
}

// ServerConfig returns a server tls.Config that reads the current
// certificate (and client CA pool) on every handshake. nextProtos are the
// ALPN protocols offered ("h2" for gRPC).
func (s *Source) ServerConfig(nextProtos ...string) *tls.Config {
	get := func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return s.Certificate(), nil }
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, GetCertificate: get, NextProtos: nextProtos}
	if s.cas != nil {
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
		cfg.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return &tls.Config{
				MinVersion:     tls.VersionTLS12,
				GetCertificate: get,
				NextProtos:     nextProtos,
				ClientAuth:     tls.RequireAndVerifyClientCert,
				ClientCAs:      s.cas.get(),
			}, nil
		}
	}
	return cfg
}

// stamp identifies a version of a set of files.
type stamp struct {
	mod  time.Time
	size int64
	id   uint64 // inode, where available
}

// watched caches a value loaded from files and reloads it when they change.
type watched[T any] struct {
	s     *Source
	what  string
	paths []string
	load  func() (*T, error)

	cur       atomic.Pointer[T]
	mu        sync.Mutex // held by the one handshake that checks the files
	nextCheck time.Time
	seen      []stamp // the stamps last loaded or last rejected
}

func newWatched[T any](s *Source, what string, paths []string, load func() (*T, error)) (*watched[T], error) {
	w := &watched[T]{s: s, what: what, paths: paths, load: load}
	st, err := w.stamps()
	if err != nil {
		return nil, err
	}
	v, err := load()
	if err != nil {
		return nil, err
	}
	w.cur.Store(v)
	w.seen = st
	w.nextCheck = s.now().Add(CheckInterval)
	return w, nil
}

func (w *watched[T]) stamps() ([]stamp, error) {
	st := make([]stamp, len(w.paths))
	for i, p := range w.paths {
		fi, err := os.Stat(p)
		if err != nil {
			return nil, err
		}
		st[i] = stamp{fi.ModTime(), fi.Size(), fileID(fi)}
	}
	return st, nil
}

// get returns the cached value, first reloading it if a check is due and
// the files changed. A handshake never waits for another one's check.
func (w *watched[T]) get() *T {
	if w.mu.TryLock() {
		w.check()
		w.mu.Unlock()
	}
	return w.cur.Load()
}

func (w *watched[T]) check() {
	now := w.s.now()
	if now.Before(w.nextCheck) {
		return
	}
	w.nextCheck = now.Add(CheckInterval)
	st, err := w.stamps()
	if err != nil {
		w.s.log.Warn("TLS: cannot stat files; keeping the current "+w.what, "files", w.paths, "err", err)
		return
	}
	if equalStamps(st, w.seen) {
		return
	}
	w.seen = st
	v, err := w.load()
	if err != nil {
		w.s.log.Error("TLS: reloading failed; keeping the current "+w.what, "files", w.paths, "err", err)
		return
	}
	w.cur.Store(v)
	w.s.log.Info("TLS: reloaded the "+w.what, "files", w.paths)
}

func equalStamps(a, b []stamp) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !a[i].mod.Equal(b[i].mod) || a[i].size != b[i].size || a[i].id != b[i].id {
			return false
		}
	}
	return true
}

// SelfSigned generates an ECDSA P-256 certificate valid for a year from now
// for hosts (DNS names and IP addresses), usable as a server and a client
// certificate.
func SelfSigned(hosts []string, now time.Time) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "kvbandit", Organization: []string{"kvbandit self-signed"}},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}
