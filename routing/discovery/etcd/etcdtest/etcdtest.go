// Package etcdtest runs a real single-member etcd server (v3.7.3, built and
// cached by tools/build.sh) for tests: on 127.0.0.1 only, with its data in
// the test's temporary directory, stopped when the test ends. It is for
// tests only.
package etcdtest

import (
	"bytes"
	"context"
	"github.com/kvbandit/kvbandit/internal/toolstest"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Server is one etcd process. Kill and Restart may be called from the test
// goroutine; they are not meant to race with each other.
type Server struct {
	t       testing.TB
	bin     string
	dataDir string
	client  int
	peer    int

	mu   sync.Mutex
	cmd  *exec.Cmd
	done <-chan struct{} // closed when cmd has exited
	logs bytes.Buffer
}

// Start builds (or finds in the cache) the etcd binary, starts a server on
// free 127.0.0.1 ports and waits until it is healthy. The server is stopped
// (SIGTERM, then SIGKILL) when the test ends. A binary that cannot be built
// fails the test; it never skips.
func Start(t testing.TB) *Server {
	t.Helper()
	s := &Server{t: t, bin: Binary(t), dataDir: t.TempDir(), client: toolstest.FreePort(t), peer: toolstest.FreePort(t)}
	t.Cleanup(func() {
		s.stop()
		if t.Failed() {
			s.mu.Lock()
			t.Logf("etcd output:\n%s", s.logs.String())
			s.mu.Unlock()
		}
	})
	s.start()
	return s
}

// Binary returns the path of the etcd binary (KVBANDIT_ETCD, or built
// and cached by tools/build.sh).
func Binary(t testing.TB) string {
	t.Helper()
	return toolstest.Tool(t, "etcd")
}

// Addr is the client address, "127.0.0.1:port".
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.client) }

// URL is the client URL, "http://127.0.0.1:port".
func (s *Server) URL() string { return "http://" + s.Addr() }

// DataDir is the server's data directory (kept across Restart).
func (s *Server) DataDir() string { return s.dataDir }

func (s *Server) start() {
	s.t.Helper()
	peer := "http://127.0.0.1:" + strconv.Itoa(s.peer)
	cmd := exec.Command(s.bin,
		"--name", "t",
		"--data-dir", s.dataDir,
		"--listen-client-urls", s.URL(),
		"--advertise-client-urls", s.URL(),
		"--listen-peer-urls", peer,
		"--initial-advertise-peer-urls", peer,
		"--initial-cluster", "t="+peer,
		"--log-level", "error",
	)
	s.mu.Lock()
	cmd.Stdout = &lockedWriter{mu: &s.mu, w: &s.logs}
	cmd.Stderr = cmd.Stdout
	s.mu.Unlock()
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("etcdtest: start etcd: %v", err)
	}
	done := toolstest.Wait(cmd)
	s.mu.Lock()
	s.cmd, s.done = cmd, done
	s.mu.Unlock()
	s.waitHealthy(done)
}

// waitHealthy polls /health until the member has a leader.
func (s *Server) waitHealthy(exited <-chan struct{}) {
	s.t.Helper()
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-exited:
			s.mu.Lock()
			logs := s.logs.String()
			s.mu.Unlock()
			s.t.Fatalf("etcdtest: etcd exited during startup:\n%s", logs)
		default:
		}
		resp, err := hc.Get(s.URL() + "/health")
		if err == nil {
			var b bytes.Buffer
			_, _ = b.ReadFrom(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK && strings.Contains(b.String(), `"true"`) {
				hc.CloseIdleConnections()
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	hc.CloseIdleConnections()
	s.t.Fatalf("etcdtest: etcd on %s not healthy after 30s", s.Addr())
}

// Kill stops the server with SIGKILL and waits for it to exit.
func (s *Server) Kill() {
	s.signal(syscall.SIGKILL, 0)
}

// Restart starts the server again on the same ports with the same data
// directory (after Kill, or stopping it first if it still runs) and waits
// until it is healthy.
func (s *Server) Restart() {
	s.t.Helper()
	s.stop()
	s.start()
}

// stop sends SIGTERM, then SIGKILL after 5s, and waits for the exit.
func (s *Server) stop() {
	s.signal(syscall.SIGTERM, 5*time.Second)
}

func (s *Server) signal(sig syscall.Signal, grace time.Duration) {
	s.mu.Lock()
	cmd, done := s.cmd, s.done
	s.mu.Unlock()
	toolstest.Stop(cmd, done, sig, grace)
}

// Client returns a client of the server, closed when the test ends.
func (s *Server) Client(t testing.TB) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{s.Addr()},
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		t.Fatalf("etcdtest: client: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// Compact compacts the server's history up to its current revision and
// returns that revision.
func (s *Server) Compact(t testing.TB, c *clientv3.Client) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	resp, err := c.Get(ctx, "compact-probe")
	if err != nil {
		t.Fatalf("etcdtest: get revision: %v", err)
	}
	rev := resp.Header.Revision
	if _, err := c.Compact(ctx, rev, clientv3.WithCompactPhysical()); err != nil {
		t.Fatalf("etcdtest: compact %d: %v", rev, err)
	}
	return rev
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (w *lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.w.Len() > 1<<20 {
		return len(p), nil
	}
	return w.w.Write(p)
}

// String describes the server for test logs.
func (s *Server) String() string { return "etcd@" + s.Addr() }
