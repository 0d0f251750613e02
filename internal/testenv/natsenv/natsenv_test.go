package natsenv

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// connect dials s with the credentials it requires plus extra options; the
// connection is closed when the test ends.
func connect(t *testing.T, s *Server, extra ...nats.Option) *nats.Conn {
	t.Helper()
	opts := append([]nats.Option{nats.Timeout(5 * time.Second), nats.NoReconnect()}, credentials(s)...)
	nc, err := nats.Connect(s.URL(), append(opts, extra...)...)
	if err != nil {
		t.Fatalf("connect %s: %v", s.URL(), err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// credentials are the options that authenticate to s.
func credentials(s *Server) []nats.Option { return s.ClientOptions() }

// roundTrip publishes on subject through pub and waits for it on sub.
func roundTrip(t *testing.T, pub *nats.Conn, sub *nats.Subscription, subject string) {
	t.Helper()
	want := []byte("hello " + subject)
	if err := pub.Publish(subject, want); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if err := pub.FlushTimeout(5 * time.Second); err != nil {
		t.Fatalf("flush: %v", err)
	}
	m, err := sub.NextMsg(5 * time.Second)
	if err != nil {
		t.Fatalf("receive on %s: %v", subject, err)
	}
	if string(m.Data) != string(want) {
		t.Fatalf("received %q, want %q", m.Data, want)
	}
}

var modes = []struct {
	name   string
	opts   Options
	scheme string
}{
	{"plain", Options{}, "nats"},
	{"userpass", Options{User: "kv", Password: "s3cret"}, "nats"},
	{"userpass-quoted", Options{User: `k v"\`, Password: `p{a}ss "w\ord" $x #y é`}, "nats"},
	{"token", Options{Token: "tok-123"}, "nats"},
	{"tls", Options{TLS: true}, "tls"},
	{"mtls", Options{MTLS: true}, "tls"},
	{"tls-userpass", Options{TLS: true, User: "kv", Password: "s3cret"}, "tls"},
	{"mtls-token", Options{MTLS: true, Token: "tok-123"}, "tls"},
	{"nkey", Options{Nkey: true}, "nats"},
	{"tls-nkey", Options{TLS: true, Nkey: true}, "tls"},
}

// TestRoundTrip connects with nats.go in every mode and passes a message
// from one connection to another.
func TestRoundTrip(t *testing.T) {
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			s := Start(t, m.opts)
			if got := s.URL(); !strings.HasPrefix(got, m.scheme+"://127.0.0.1:") {
				t.Fatalf("URL %q, want %s://127.0.0.1:port", got, m.scheme)
			}
			a, b := connect(t, s), connect(t, s)
			if m.opts.TLS || m.opts.MTLS {
				if _, err := a.TLSConnectionState(); err != nil {
					t.Fatalf("connection is not TLS: %v", err)
				}
			}
			sub, err := b.SubscribeSync("natstest." + m.name)
			if err != nil {
				t.Fatal(err)
			}
			if err := b.Flush(); err != nil {
				t.Fatal(err)
			}
			roundTrip(t, a, sub, "natstest."+m.name)
			if got := a.MaxPayload(); got != 1<<20 {
				t.Errorf("max_payload %d, want 1 MiB", got)
			}
		})
	}
}

// TestTLSFiles checks that the PEM files verify the server the way a
// client configured by paths would (nats.RootCAs, nats.ClientCert).
func TestTLSFiles(t *testing.T) {
	s := Start(t, Options{MTLS: true})
	f := s.TLSFiles()
	if f.CA == "" || f.ClientCert == "" || f.ClientKey == "" {
		t.Fatalf("TLSFiles %+v: missing a path", f)
	}
	nc, err := nats.Connect(s.URL(), nats.RootCAs(f.CA), nats.ClientCert(f.ClientCert, f.ClientKey), nats.Timeout(5*time.Second), nats.NoReconnect())
	if err != nil {
		t.Fatalf("connect with files: %v", err)
	}
	defer nc.Close()
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if tf := Start(t, Options{TLS: true}).TLSFiles(); tf.CA == "" || tf.ClientCert != "" || tf.ClientKey != "" {
		t.Fatalf("TLS (not mTLS) TLSFiles %+v: want the CA only", tf)
	}
	if (Start(t, Options{}).TLSFiles() != TLSFiles{}) {
		t.Fatal("plain server has TLS files")
	}
}

// TestAuthFailures checks that wrong or missing credentials are refused
// with nats.go's authorization error, and that a TLS server refuses
// clients that do not trust it or (mTLS) bring no certificate.
func TestAuthFailures(t *testing.T) {
	up := Start(t, Options{User: "kv", Password: "s3cret"})
	tok := Start(t, Options{Token: "tok-123"})
	nk := Start(t, Options{Nkey: true})
	other := Start(t, Options{Nkey: true}) // another nkey user
	otherSeed, err := nats.NkeyOptionFromSeed(other.NkeySeedFile())
	if err != nil {
		t.Fatal(err)
	}
	base := []nats.Option{nats.Timeout(5 * time.Second), nats.NoReconnect()}
	for _, c := range []struct {
		name string
		url  string
		opts []nats.Option
	}{
		{"wrong password", up.URL(), []nats.Option{nats.UserInfo("kv", "wrong")}},
		{"wrong user", up.URL(), []nats.Option{nats.UserInfo("nobody", "s3cret")}},
		{"no credentials", up.URL(), nil},
		{"wrong token", tok.URL(), []nats.Option{nats.Token("tok-124")}},
		{"no token", tok.URL(), nil},
		{"no nkey", nk.URL(), nil},
		{"another nkey", nk.URL(), []nats.Option{otherSeed}},
	} {
		t.Run(c.name, func(t *testing.T) {
			nc, err := nats.Connect(c.url, append(c.opts, base...)...)
			if err == nil {
				nc.Close()
				t.Fatal("connected, want an authorization error")
			}
			if !errors.Is(err, nats.ErrAuthorization) {
				t.Fatalf("error %v (%T), want nats.ErrAuthorization", err, err)
			}
		})
	}

	ts := Start(t, Options{TLS: true})
	t.Run("untrusted server certificate", func(t *testing.T) {
		nc, err := nats.Connect(ts.URL(), append([]nats.Option{nats.Secure(&tls.Config{MinVersion: tls.VersionTLS12})}, base...)...)
		if err == nil {
			nc.Close()
			t.Fatal("connected to a server signed by an unknown CA")
		}
		var unknown x509.UnknownAuthorityError
		if !errors.As(err, &unknown) {
			t.Fatalf("error %v (%T), want x509.UnknownAuthorityError", err, err)
		}
	})
	t.Run("plaintext client", func(t *testing.T) {
		nc, err := nats.Connect(strings.Replace(ts.URL(), "tls://", "nats://", 1), base...)
		if err == nil {
			nc.Close()
			t.Fatal("plaintext client connected to a TLS server")
		}
		// nats.go upgrades to TLS when the server requires it, and then
		// cannot verify the server without the CA.
		var unknown x509.UnknownAuthorityError
		if !errors.As(err, &unknown) {
			t.Fatalf("error %v (%T), want x509.UnknownAuthorityError", err, err)
		}
	})

	ms := Start(t, Options{MTLS: true})
	t.Run("mtls without client certificate", func(t *testing.T) {
		c := ms.ClientTLS()
		c.Certificates = nil
		nc, err := nats.Connect(ms.URL(), append([]nats.Option{nats.Secure(c)}, base...)...)
		if err == nil {
			nc.Close()
			t.Fatal("connected to an mTLS server without a client certificate")
		}
		// Under TLS 1.3 the client may finish its side of the handshake
		// before the server rejects it, so its error varies; the server
		// says why.
		waitLog(t, ms, "TLS handshake error: tls: client didn't provide a certificate")
	})
	t.Run("mtls with a certificate of another CA", func(t *testing.T) {
		other := Start(t, Options{MTLS: true})
		c := ms.ClientTLS()
		c.Certificates = other.ClientTLS().Certificates
		nc, err := nats.Connect(ms.URL(), append([]nats.Option{nats.Secure(c)}, base...)...)
		if err == nil {
			nc.Close()
			t.Fatal("connected to an mTLS server with a foreign client certificate")
		}
		waitLog(t, ms, "x509: certificate signed by unknown authority")
	})
}

// waitLog waits up to 5s for text to appear in s's log.
func waitLog(t *testing.T, s *Server, text string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		log, err := os.ReadFile(s.LogFile())
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(log), text) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("server log lacks %q:\n%s", text, log)
		}
	}
}

// TestKillRestartReconnect kills the server under a connected client with
// a subscription, restarts it on the same port and checks that the client
// reconnects by itself and the subscription receives again. It logs how
// long the restart and the reconnection took.
func TestKillRestartReconnect(t *testing.T) {
	for _, m := range []struct {
		name string
		opts Options
	}{
		{"plain", Options{}},
		{"mtls-userpass", Options{MTLS: true, User: "kv", Password: "s3cret"}},
	} {
		t.Run(m.name, func(t *testing.T) {
			s := Start(t, m.opts)
			url, pid := s.URL(), s.PID()
			disconnected := make(chan struct{}, 1)
			reconnected := make(chan time.Time, 1)
			opts := append(credentials(s),
				nats.Timeout(5*time.Second),
				nats.MaxReconnects(-1),
				nats.ReconnectWait(20*time.Millisecond),
				nats.ReconnectJitter(0, 0),
				nats.DisconnectErrHandler(func(*nats.Conn, error) {
					select {
					case disconnected <- struct{}{}:
					default:
					}
				}),
				nats.ReconnectHandler(func(*nats.Conn) {
					select {
					case reconnected <- time.Now():
					default:
					}
				}))
			nc, err := nats.Connect(url, opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer nc.Close()
			pub := connect(t, s) // no reconnect: it dies with the server
			sub, err := nc.SubscribeSync("natstest.restart")
			if err != nil {
				t.Fatal(err)
			}
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			roundTrip(t, pub, sub, "natstest.restart")

			killed := time.Now()
			s.Kill()
			if s.PID() != 0 {
				t.Fatal("PID() non-zero after Kill")
			}
			if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
				t.Fatalf("process %d still exists after Kill (kill -0: %v)", pid, err)
			}
			select {
			case <-disconnected:
			case <-time.After(10 * time.Second):
				t.Fatal("client did not notice the server was killed")
			}
			if _, err := net.DialTimeout("tcp", s.Addr(), time.Second); err == nil {
				t.Fatal("something still accepts on the port after Kill")
			}

			restart := time.Now()
			s.Restart(t)
			ready := time.Now()
			if s.URL() != url {
				t.Fatalf("URL after restart %s, want %s", s.URL(), url)
			}
			if s.PID() == 0 || s.PID() == pid {
				t.Fatalf("PID after restart %d (before %d)", s.PID(), pid)
			}
			var at time.Time
			select {
			case at = <-reconnected:
			case <-time.After(15 * time.Second):
				t.Fatalf("client did not reconnect within 15s of the restart (status %v)", nc.Status())
			}
			// The client may reconnect before Restart has seen the server
			// ready (Restart polls), so both are measured from the kill.
			t.Logf("Restart took %v; after the kill: server accepting again %v, client reconnected %v",
				ready.Sub(restart).Round(time.Millisecond), ready.Sub(killed).Round(time.Millisecond),
				at.Sub(killed).Round(time.Millisecond))
			if err := nc.Flush(); err != nil {
				t.Fatal(err)
			}
			roundTrip(t, connect(t, s), sub, "natstest.restart")
		})
	}
}

// TestStop checks that Stop ends the process gracefully, is idempotent,
// and that Restart after Stop serves again.
func TestStop(t *testing.T) {
	s := Start(t, Options{Token: "tok"})
	pid := s.PID()
	if pid == 0 {
		t.Fatal("PID() is 0 for a running server")
	}
	closed := make(chan struct{})
	nc := connect(t, s, nats.ClosedHandler(func(*nats.Conn) { close(closed) }))
	s.Stop()
	s.Stop()
	if s.PID() != 0 {
		t.Fatal("PID() non-zero after Stop")
	}
	if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("process %d still exists after Stop (kill -0: %v)", pid, err)
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatalf("client not closed after Stop (status %v)", nc.Status())
	}
	log, err := os.ReadFile(s.LogFile())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(log), "Server Exiting") {
		t.Fatalf("log shows no graceful exit:\n%s", log)
	}
	s.Restart(t)
	connect(t, s).Close()
}

// TestListensOnLoopbackOnly lists every socket the server process holds
// (from /proc) and checks that its only listener is the client port on
// 127.0.0.1: no monitor, cluster, leafnode, websocket or MQTT port.
func TestListensOnLoopbackOnly(t *testing.T) {
	s := Start(t, Options{MTLS: true, User: "kv", Password: "s3cret"})
	inodes := socketInodes(t, s.PID())
	if len(inodes) == 0 {
		t.Fatal("server process holds no sockets")
	}
	var listeners []string
	for _, f := range []string{"tcp", "tcp6", "udp", "udp6"} {
		for _, e := range procNet(t, f) {
			if !inodes[e.inode] || (strings.HasPrefix(f, "tcp") && e.state != "0A") {
				continue
			}
			listeners = append(listeners, f+" "+e.local)
		}
	}
	want := "tcp 127.0.0.1:" + strings.TrimPrefix(s.Addr(), "127.0.0.1:")
	if len(listeners) != 1 || listeners[0] != want {
		t.Fatalf("listeners %v, want only [%s]", listeners, want)
	}
	// Starting (and probing readiness) logged no error.
	s.Stop()
	log, err := os.ReadFile(s.LogFile())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(log), "[ERR]") {
		t.Fatalf("error in the server's log:\n%s", log)
	}
}

func socketInodes(t *testing.T, pid int) map[string]bool {
	t.Helper()
	fds, err := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
	if err != nil {
		t.Fatal(err)
	}
	inodes := map[string]bool{}
	for _, fd := range fds {
		l, err := os.Readlink(fd)
		if err == nil && strings.HasPrefix(l, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	return inodes
}

type procNetEntry struct{ local, state, inode string }

// procNet parses /proc/net/{tcp,tcp6,udp,udp6}.
func procNet(t *testing.T, name string) []procNetEntry {
	t.Helper()
	f, err := os.Open("/proc/net/" + name)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []procNetEntry
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) < 10 {
			continue
		}
		out = append(out, procNetEntry{local: hexAddr(t, fs[1]), state: fs[3], inode: fs[9]})
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// hexAddr turns /proc/net's "0100007F:1F90" into "127.0.0.1:8080" (IPv4
// and IPv6 in host byte order, 32 bits at a time).
func hexAddr(t *testing.T, s string) string {
	t.Helper()
	h, p, ok := strings.Cut(s, ":")
	port, err := strconv.ParseUint(p, 16, 16)
	if !ok || err != nil || len(h)%8 != 0 {
		t.Fatalf("bad /proc/net address %q", s)
	}
	ip := make(net.IP, 0, len(h)/2)
	for i := 0; i < len(h); i += 8 {
		w, err := strconv.ParseUint(h[i:i+8], 16, 32)
		if err != nil {
			t.Fatalf("bad /proc/net address %q", s)
		}
		ip = append(ip, byte(w), byte(w>>8), byte(w>>16), byte(w>>24))
	}
	return net.JoinHostPort(ip.String(), strconv.Itoa(int(port)))
}

func TestOptionsValidate(t *testing.T) {
	for _, c := range []struct {
		o  Options
		ok bool
	}{
		{Options{}, true},
		{Options{User: "u", Password: "p", TLS: true}, true},
		{Options{Token: "t", MTLS: true}, true},
		{Options{User: "u"}, false},
		{Options{Password: "p"}, false},
		{Options{User: "u", Password: "p", Token: "t"}, false},
		{Options{Token: "a\nb"}, false},
		{Options{User: "u", Password: "$2a$11$abc"}, false},
		{Options{Nkey: true, TLS: true}, true},
		{Options{Nkey: true, Token: "t"}, false},
		{Options{Nkey: true, User: "u", Password: "p"}, false},
	} {
		err := c.o.validate()
		if (err == nil) != c.ok || (err != nil && !errors.Is(err, ErrOptions)) {
			t.Errorf("%+v: validate() = %v, want ok=%v", c.o, err, c.ok)
		}
	}
}

func TestQuote(t *testing.T) {
	for in, want := range map[string]string{
		"":        `""`,
		"abc":     `"abc"`,
		`a"b\c`:   `"a\"b\\c"`,
		"é":       `"\xc3\xa9"`,
		"$x {} #": `"$x {} #"`,
	} {
		if got := quote(in); got != want {
			t.Errorf("quote(%q) = %s, want %s", in, got, want)
		}
	}
}
