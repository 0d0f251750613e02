// Package natsenv runs a real nats-server (v2.15.2, built and cached by
// tools/build.sh, found by [testenv.Tool]) for tests: client port only, on
// 127.0.0.1 only (no HTTP monitor, cluster, gateway, leafnode, websocket or
// MQTT listener, no JetStream), with plain, user/password, token or nkey
// authentication and optionally TLS or mutual TLS from a throwaway CA. Its
// configuration, certificates and log live in the test's temporary
// directory, and it is stopped when the test ends. Kill and Restart (on the
// same port, with the same certificates) let tests break the connection of
// their clients. It is for tests only.
package natsenv

import (
	"bufio"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/kvbandit/kvbandit/internal/testenv"
)

// Options choose how clients must authenticate. The zero value is a plain
// server that accepts anyone.
type Options struct {
	// User and Password require this user/password pair (both or neither).
	User, Password string
	// Token requires this authorization token (not with User).
	Token string
	// Nkey requires the nkey user generated for this server; clients
	// sign with its seed (NkeySeedFile). Not with User or Token.
	Nkey bool
	// TLS requires TLS; the server's certificate (IP SAN 127.0.0.1) is
	// signed by a CA generated for this server (see ClientTLS, TLSFiles).
	TLS bool
	// MTLS requires TLS and a client certificate signed by that CA
	// (implies TLS).
	MTLS bool
}

// ErrOptions is returned (wrapped) for contradictory Options.
var ErrOptions = errors.New("natsenv: invalid options")

func (o Options) validate() error {
	if (o.User == "") != (o.Password == "") {
		return fmt.Errorf("%w: User and Password go together", ErrOptions)
	}
	if o.Token != "" && o.User != "" {
		return fmt.Errorf("%w: Token and User/Password are exclusive", ErrOptions)
	}
	if o.Nkey && (o.Token != "" || o.User != "") {
		return fmt.Errorf("%w: Nkey, Token and User/Password are exclusive", ErrOptions)
	}
	for _, v := range []string{o.User, o.Password, o.Token} {
		for _, r := range v {
			if r < 0x20 || r == 0x7f {
				return fmt.Errorf("%w: control character in a credential", ErrOptions)
			}
		}
	}
	if strings.HasPrefix(o.Password, "$2") || strings.HasPrefix(o.Token, "$2") {
		// nats-server would take it for a bcrypt hash.
		return fmt.Errorf("%w: a credential starting with $2 is read as a bcrypt hash", ErrOptions)
	}
	return nil
}

// startTimeout bounds how long a start or restart may take to accept
// connections.
const (
	startTimeout = 30 * time.Second
	maxLogReport = 64 << 10
)

// Server is one nats-server process. Its methods may be called from any
// goroutine, but Stop, Kill and Restart are not meant to race with each
// other.
type Server struct {
	t    testing.TB
	bin  string
	dir  string
	name string // server_name, unique per Server: proves who answers on the port
	opts Options
	pki  *pki // nil without TLS
	// nkeyPub and nkeySeed are the nkey user's public key and seed file
	// (Options.Nkey).
	nkeyPub, nkeySeed string

	mu   sync.Mutex
	port int // 0 until the first start picked one
	proc *testenv.Process
}

// Start builds (or finds in the cache) the nats-server binary, starts it on
// a free 127.0.0.1 port chosen by the server itself and waits until it
// accepts connections. It is stopped (SIGTERM, then SIGKILL) when the test
// ends; if the test failed, its log is printed. A binary that cannot be
// built or a server that does not come up fails the test; it never skips.
func Start(t testing.TB, opts Options) *Server {
	t.Helper()
	if err := opts.validate(); err != nil {
		t.Fatal(err)
	}
	if opts.MTLS {
		opts.TLS = true
	}
	var id [6]byte
	_, _ = rand.Read(id[:])
	s := &Server{t: t, bin: testenv.Tool(t, "nats-server"), dir: t.TempDir(), name: "natsenv-" + hex.EncodeToString(id[:]), opts: opts}
	if opts.TLS {
		p, err := newPKI(s.dir)
		if err != nil {
			t.Fatalf("natsenv: TLS material: %v", err)
		}
		s.pki = p
	}
	if opts.Nkey {
		if err := s.newNkey(); err != nil {
			t.Fatalf("natsenv: nkey: %v", err)
		}
	}
	t.Cleanup(func() {
		s.Stop()
		if t.Failed() {
			t.Logf("nats-server log (%s):\n%s", s.LogFile(), s.logTail())
		}
	})
	if err := s.start(); err != nil {
		t.Fatalf("natsenv: %v\nnats-server log:\n%s", err, s.logTail())
	}
	return s
}

// Addr is the client address, "127.0.0.1:port"; the port stays the same
// across Restart.
func (s *Server) Addr() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return net.JoinHostPort(testenv.Loopback, strconv.Itoa(s.port))
}

// URL is the client URL: nats://127.0.0.1:port, or tls://127.0.0.1:port
// when the server requires TLS.
func (s *Server) URL() string {
	if s.opts.TLS {
		return "tls://" + s.Addr()
	}
	return "nats://" + s.Addr()
}

// Options returns the server's options (with TLS set when MTLS is).
func (s *Server) Options() Options { return s.opts }

// ClientTLS returns a new client TLS configuration that trusts the
// server's CA and, for an mTLS server, presents the client certificate; nil
// when the server does not use TLS.
func (s *Server) ClientTLS() *tls.Config {
	if s.pki == nil {
		return nil
	}
	c := &tls.Config{RootCAs: s.pki.pool, ServerName: testenv.Loopback, MinVersion: tls.VersionTLS12}
	if s.opts.MTLS {
		c.Certificates = []tls.Certificate{s.pki.client}
	}
	return c
}

// TLSFiles returns the paths of the CA and, for an mTLS server, of the
// client certificate and key; the zero value when the server does not use
// TLS.
func (s *Server) TLSFiles() TLSFiles {
	if s.pki == nil {
		return TLSFiles{}
	}
	f := TLSFiles{CA: s.pki.files.CA}
	if s.opts.MTLS {
		f.ClientCert, f.ClientKey = s.pki.files.ClientCert, s.pki.files.ClientKey
	}
	return f
}

// NkeySeedFile is the path of the nkey user's seed file (what
// nats.NkeyOptionFromSeed and kvbandit's sync.nats.nkey_file read); empty
// without Options.Nkey.
func (s *Server) NkeySeedFile() string { return s.nkeySeed }

// ClientOptions are the nats.go options that authenticate to the server:
// its user/password, token or nkey seed, and its TLS (with the client
// certificate for mTLS).
func (s *Server) ClientOptions() []nats.Option {
	var opts []nats.Option
	switch o := s.opts; {
	case o.User != "":
		opts = append(opts, nats.UserInfo(o.User, o.Password))
	case o.Token != "":
		opts = append(opts, nats.Token(o.Token))
	case o.Nkey:
		opt, err := nats.NkeyOptionFromSeed(s.nkeySeed)
		if err != nil {
			s.t.Fatalf("natsenv: nkey seed: %v", err)
		}
		opts = append(opts, opt)
	}
	if c := s.ClientTLS(); c != nil {
		opts = append(opts, nats.Secure(c))
	}
	return opts
}

// newNkey makes the nkey user and writes its seed file.
func (s *Server) newNkey() error {
	kp, err := nkeys.CreateUser()
	if err != nil {
		return err
	}
	pub, err := kp.PublicKey()
	if err != nil {
		return err
	}
	seed, err := kp.Seed()
	if err != nil {
		return err
	}
	s.nkeyPub, s.nkeySeed = pub, filepath.Join(s.dir, "user.nk")
	return os.WriteFile(s.nkeySeed, seed, 0o600)
}

// PID is the running server's process id, 0 when it is not running.
func (s *Server) PID() int { return s.current().PID() }

// LogFile is the path of the server's log (stdout and stderr of every run,
// appended across restarts).
func (s *Server) LogFile() string { return filepath.Join(s.dir, "nats-server.log") }

// Stop sends SIGTERM to the server, then SIGKILL if it is still running
// after 5s, and waits for it to exit. Stopping a stopped server does
// nothing.
func (s *Server) Stop() { s.current().Stop() }

// Kill sends SIGKILL to the server and waits for it to exit: its clients
// see the connection drop without a goodbye.
func (s *Server) Kill() { s.current().Kill() }

// Restart stops the server if it still runs, starts it again on the same
// port with the same options and certificates, and waits until it accepts
// connections. Failures fail t.
func (s *Server) Restart(t testing.TB) {
	t.Helper()
	s.Stop()
	if err := s.start(); err != nil {
		t.Fatalf("natsenv: restart: %v\nnats-server log:\n%s", err, s.logTail())
	}
}

// String describes the server for test logs.
func (s *Server) String() string { return "nats-server@" + s.Addr() }

func (s *Server) current() *testenv.Process {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc
}

// start writes the configuration, starts the process and waits until it
// accepts connections.
func (s *Server) start() error {
	s.mu.Lock()
	port := s.port
	s.mu.Unlock()
	portsDir := filepath.Join(s.dir, "ports")
	if err := os.MkdirAll(portsDir, 0o700); err != nil {
		return err
	}
	conf := filepath.Join(s.dir, "nats-server.conf")
	if err := os.WriteFile(conf, []byte(s.config(port, portsDir)), 0o600); err != nil {
		return err
	}
	logf, err := os.OpenFile(s.LogFile(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	proc, err := testenv.Start(s.bin, []string{"-c", conf}, logf)
	logf.Close() // the child has its own descriptor
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.proc = proc
	s.mu.Unlock()

	got, err := s.waitReady(proc, portsDir, port)
	if err != nil {
		proc.Kill()
		return err
	}
	s.mu.Lock()
	s.port = got
	s.mu.Unlock()
	return nil
}

// config is the server's configuration: port -1 lets the server pick a
// free port on its first start (no window in which another process can
// take it); restarts name the port it picked. Everything that would listen
// besides the client port is left unconfigured, so it stays off.
func (s *Server) config(port int, portsDir string) string {
	if port == 0 {
		port = -1
	}
	var b strings.Builder
	fmt.Fprintf(&b, "server_name: %s\n", quote(s.name))
	fmt.Fprintf(&b, "host: %s\nport: %d\n", quote(testenv.Loopback), port)
	fmt.Fprintf(&b, "ports_file_dir: %s\n", quote(portsDir))
	b.WriteString("max_payload: 1048576\n") // the default, stated: the sync protocol's message bound
	b.WriteString("http_port: 0\n")         // no monitoring endpoint
	switch {
	case s.opts.User != "":
		fmt.Fprintf(&b, "authorization {\n  user: %s\n  password: %s\n}\n", quote(s.opts.User), quote(s.opts.Password))
	case s.opts.Token != "":
		fmt.Fprintf(&b, "authorization {\n  token: %s\n}\n", quote(s.opts.Token))
	case s.opts.Nkey:
		fmt.Fprintf(&b, "authorization {\n  users: [ { nkey: %s } ]\n}\n", quote(s.nkeyPub))
	}
	if s.pki != nil {
		fmt.Fprintf(&b, "tls {\n  cert_file: %s\n  key_file: %s\n  timeout: 2\n", quote(s.pki.server.cert), quote(s.pki.server.key))
		if s.opts.MTLS {
			fmt.Fprintf(&b, "  ca_file: %s\n  verify: true\n", quote(s.pki.files.CA))
		}
		b.WriteString("}\n")
	}
	return b.String()
}

// quote writes v as a double-quoted string of nats-server's configuration
// language, whose only escapes are \" \\ \t \n \r and \xXX.
func quote(v string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(v); i++ {
		switch c := v[i]; {
		case c == '"' || c == '\\':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20 || c >= 0x7f:
			fmt.Fprintf(&b, `\x%02x`, c)
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// portsInfo is the ports file nats-server writes once its listeners are up.
type portsInfo struct {
	Nats       []string `json:"nats"`
	Monitoring []string `json:"monitoring"`
	Cluster    []string `json:"cluster"`
	Profile    []string `json:"profile"`
	WebSocket  []string `json:"websocket"`
}

// waitReady waits for the process's ports file, checks that it lists only
// one client listener on 127.0.0.1 (and the expected port on a restart),
// then waits until a connection there gets this server's INFO. It returns
// the port.
func (s *Server) waitReady(proc *testenv.Process, portsDir string, want int) (int, error) {
	pid := proc.PID()
	port := 0
	err := proc.WaitReady(startTimeout, 20*time.Millisecond, func() (bool, error) {
		if port == 0 {
			p, err := readPorts(portsDir, pid)
			if err != nil {
				return true, err
			}
			if p != 0 && want != 0 && p != want {
				return true, fmt.Errorf("nats-server listens on port %d, want %d", p, want)
			}
			port = p
		}
		if port == 0 {
			return false, errors.New("no ports file yet")
		}
		if !s.probe(port) {
			return false, errors.New("not accepting connections")
		}
		return true, nil
	})
	return port, err
}

// readPorts returns the client port from pid's ports file, 0 while the file
// is not written yet.
func readPorts(dir string, pid int) (int, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*_"+strconv.Itoa(pid)+".ports"))
	if err != nil || len(files) == 0 {
		return 0, err
	}
	data, err := os.ReadFile(files[0])
	if err != nil || len(data) == 0 {
		return 0, nil // being written
	}
	var pi portsInfo
	if err := json.Unmarshal(data, &pi); err != nil {
		return 0, nil // being written
	}
	if len(pi.Monitoring)+len(pi.Cluster)+len(pi.Profile)+len(pi.WebSocket) > 0 || len(pi.Nats) != 1 {
		return 0, fmt.Errorf("nats-server listens on more than its one client port: %s", data)
	}
	u := pi.Nats[0]
	_, hostport, ok := strings.Cut(u, "://")
	host, p, err := net.SplitHostPort(hostport)
	if !ok || err != nil || host != testenv.Loopback {
		return 0, fmt.Errorf("nats-server client listener %q is not on 127.0.0.1", u)
	}
	port, err := strconv.Atoi(p)
	if err != nil || port <= 0 || port > 65535 {
		return 0, fmt.Errorf("nats-server client listener %q: bad port", u)
	}
	return port, nil
}

// probe connects to the port and reports whether this server (by name)
// sends its INFO there. The probe closes before CONNECT, which the server
// does not log above debug level.
func (s *Server) probe(port int) bool {
	c, err := net.DialTimeout("tcp", net.JoinHostPort(testenv.Loopback, strconv.Itoa(port)), time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReaderSize(io.LimitReader(c, 64<<10), 4096).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "INFO ") {
		return false
	}
	var info struct {
		Name string `json:"server_name"`
	}
	if json.Unmarshal([]byte(strings.TrimSpace(line[len("INFO "):])), &info) != nil || info.Name != s.name {
		return false
	}
	if s.pki != nil {
		// Finish the TLS handshake the server starts after its INFO, so
		// that probing does not log a handshake error.
		return tls.Client(c, s.ClientTLS()).Handshake() == nil
	}
	return true
}

// logTail returns the last 64 KiB of the log.
func (s *Server) logTail() string {
	f, err := os.Open(s.LogFile())
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > maxLogReport {
		_, _ = f.Seek(-maxLogReport, io.SeekEnd)
	}
	data, _ := io.ReadAll(io.LimitReader(f, maxLogReport))
	return string(data)
}
