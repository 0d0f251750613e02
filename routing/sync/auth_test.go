package sync

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvbandit/kvbandit/internal/testenv/natsenv"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// TestCredentialsRequired: a Config without credentials is refused
// (ErrNoCredentials, wrapping ErrConfig) unless AllowAnonymous; any one
// credential, or an mTLS client certificate alone, is enough; two are a
// contradiction.
func TestCredentialsRequired(t *testing.T) {
	base := Config{Servers: []string{"nats://127.0.0.1:1"}, Pool: "p", Replica: "a"}
	for _, c := range []struct {
		name string
		set  func(*Config)
		err  error
	}{
		{"none", func(*Config) {}, ErrNoCredentials},
		{"anonymous allowed", func(c *Config) { c.AllowAnonymous = true }, nil},
		{"user/password", func(c *Config) { c.User, c.Password = "u", "p" }, nil},
		{"token", func(c *Config) { c.Token = "t" }, nil},
		{"nkey seed", func(c *Config) { c.NkeyFile = "/etc/nats/user.nk" }, nil},
		{"creds", func(c *Config) { c.CredsFile = "/etc/nats/user.creds" }, nil},
		{"mtls cert", func(c *Config) { c.TLS.Cert, c.TLS.Key = "c.pem", "k.pem" }, nil},
		{"tls without a client cert", func(c *Config) { c.TLS.CA = "ca.pem" }, ErrNoCredentials},
		{"token and nkey", func(c *Config) { c.Token, c.NkeyFile = "t", "f" }, ErrConfig},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := base
			c.set(&cfg)
			s, err := New(cfg, Deps{})
			switch {
			case c.err == nil && err != nil:
				t.Fatalf("New: %v", err)
			case c.err != nil && !errors.Is(err, c.err):
				t.Fatalf("New: %v, want %v", err, c.err)
			case c.err != nil && !errors.Is(err, ErrConfig):
				t.Fatalf("New: %v does not wrap ErrConfig", err)
			}
			if s != nil {
				_ = s.Close()
			}
		})
	}
}

// TestNkeySeed: replicas authenticate with an nkey seed file
// (Config.NkeyFile) to a nats-server that requires that nkey user, and
// share decisions.
func TestNkeySeed(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{Nkey: true})
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitConnected(t, a, b)
	d := a.pick(t, "", 1)
	waitFor(t, time.Second, "B applies A's decision", func() bool { return b.remoteInFlight() == 1 })
	d.Done(routing.NoUsage(routing.OutcomeCancelled))
	waitFor(t, time.Second, "B applies the End", func() bool { return b.remoteInFlight() == 0 })
	cfg := testConfig(srv, "c")
	cfg.NkeyFile = "/nonexistent/user.nk"
	s, err := New(cfg, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.Start(a.e); !errors.Is(err, ErrConfig) {
		t.Errorf("Start with a missing seed file: %v, want ErrConfig", err)
	}
}

// TestMTLSCertificateOnly: an mTLS client certificate is a credential of
// its own (nats-server verify: true, no user).
func TestMTLSCertificateOnly(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{MTLS: true})
	a := newNode(t, testConfig(srv, "a"), engine.Options{})
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitConnected(t, a, b)
}

// TestAnonymousExplicit: with AllowAnonymous, a replica connects to a
// server that lets anyone in, and says at start-up what that means.
func TestAnonymousExplicit(t *testing.T) {
	srv := natsenv.Start(t, natsenv.Options{})
	cfg := testConfig(srv, "a")
	cfg.AllowAnonymous = true
	a := newNode(t, cfg, engine.Options{})
	waitFor(t, 5*time.Second, "connected", func() bool { return !a.s.Degraded() })
	if !strings.Contains(a.log.String(), "NATS without credentials") {
		t.Errorf("no start-up warning about anonymous NATS:\n%s", a.log.String())
	}
	cfg.AllowAnonymous = false
	if _, err := New(cfg, Deps{}); !errors.Is(err, ErrNoCredentials) {
		t.Errorf("the same config without AllowAnonymous: %v, want ErrNoCredentials", err)
	}
}

// TestUnauthenticatedClientShut: on a server with credentials enforced,
// a client without them (or with wrong ones) cannot connect, so it can
// neither publish to the replicas nor read their state.
func TestUnauthenticatedClientShut(t *testing.T) {
	srv := startNATS(t)
	b := newNode(t, testConfig(srv, "b"), engine.Options{})
	waitFor(t, 5*time.Second, "b connected", func() bool { return !b.s.Degraded() })
	for name, opts := range map[string][]nats.Option{
		"none":           nil,
		"wrong password": {nats.UserInfo("kvbandit", "guess")},
		"token":          {nats.Token("test-secret")},
	} {
		nc, err := nats.Connect(srv.URL(), append(opts, nats.Timeout(5*time.Second), nats.NoReconnect())...)
		if err == nil {
			nc.Close()
			t.Fatalf("%s: connected without the credentials", name)
		}
		if !errors.Is(err, nats.ErrAuthorization) {
			t.Errorf("%s: %v, want nats.ErrAuthorization", name, err)
		}
	}
	if got := b.counter(t, "kvbandit_sync_messages_total", "direction", "received"); got != 0 {
		t.Errorf("b received %v messages", got)
	}
}
