// Package etcdenv runs a real single-member etcd server (v3.7.3, built and
// cached by tools/build.sh, found by [testenv.Tool]) for tests: on
// 127.0.0.1 only, with its data in the test's temporary directory, stopped
// when the test ends. Kill and Restart (same ports, same data) let tests
// take it away from their clients. It is for tests only.
package etcdenv

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/kvbandit/kvbandit/internal/testenv"
)

// Server is one etcd process. Kill and Restart may be called from the test
// goroutine; they are not meant to race with each other.
type Server struct {
	t       testing.TB
	bin     string
	dataDir string
	client  int
	peer    int
	logs    testenv.Log

	mu   sync.Mutex
	proc *testenv.Process
}

// Start builds (or finds in the cache) the etcd binary, starts a server on
// free 127.0.0.1 ports and waits until it is healthy. The server is stopped
// (SIGTERM, then SIGKILL) when the test ends. A binary that cannot be built
// fails the test; it never skips.
func Start(t testing.TB) *Server {
	t.Helper()
	s := &Server{t: t, bin: testenv.Tool(t, "etcd"), dataDir: t.TempDir(), client: testenv.FreePort(t), peer: testenv.FreePort(t)}
	t.Cleanup(func() {
		s.stop()
		if t.Failed() {
			t.Logf("etcd output:\n%s", s.logs.String())
		}
	})
	s.start()
	return s
}

// Addr is the client address, "127.0.0.1:port".
func (s *Server) Addr() string { return testenv.Loopback + ":" + strconv.Itoa(s.client) }

// URL is the client URL, "http://127.0.0.1:port".
func (s *Server) URL() string { return "http://" + s.Addr() }

// DataDir is the server's data directory (kept across Restart).
func (s *Server) DataDir() string { return s.dataDir }

func (s *Server) start() {
	s.t.Helper()
	peer := "http://" + testenv.Loopback + ":" + strconv.Itoa(s.peer)
	proc, err := testenv.Start(s.bin, []string{
		"--name", "t",
		"--data-dir", s.dataDir,
		"--listen-client-urls", s.URL(),
		"--advertise-client-urls", s.URL(),
		"--listen-peer-urls", peer,
		"--initial-advertise-peer-urls", peer,
		"--initial-cluster", "t=" + peer,
		"--log-level", "error",
	}, &s.logs)
	if err != nil {
		s.t.Fatalf("etcdenv: %v", err)
	}
	s.mu.Lock()
	s.proc = proc
	s.mu.Unlock()
	hc := &http.Client{Timeout: time.Second}
	defer hc.CloseIdleConnections()
	if err := proc.WaitReady(30*time.Second, 20*time.Millisecond, func() (bool, error) { return s.healthy(hc) }); err != nil {
		s.t.Fatalf("etcdenv: %v\n%s", err, s.logs.String())
	}
}

// healthy asks /health whether the member has a leader.
func (s *Server) healthy(hc *http.Client) (bool, error) {
	resp, err := hc.Get(s.URL() + "/health")
	if err != nil {
		return false, err
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode == http.StatusOK && strings.Contains(string(body), `"true"`) {
		return true, nil
	}
	return false, fmt.Errorf("/health: %s %s", resp.Status, body)
}

// Kill stops the server with SIGKILL and waits for it to exit.
func (s *Server) Kill() { s.current().Kill() }

// Restart starts the server again on the same ports with the same data
// directory (after Kill, or stopping it first if it still runs) and waits
// until it is healthy.
func (s *Server) Restart() {
	s.t.Helper()
	s.stop()
	s.start()
}

// stop sends SIGTERM, then SIGKILL after 5s, and waits for the exit.
func (s *Server) stop() { s.current().Stop() }

func (s *Server) current() *testenv.Process {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc
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
		t.Fatalf("etcdenv: client: %v", err)
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
		t.Fatalf("etcdenv: get revision: %v", err)
	}
	rev := resp.Header.Revision
	if _, err := c.Compact(ctx, rev, clientv3.WithCompactPhysical()); err != nil {
		t.Fatalf("etcdenv: compact %d: %v", rev, err)
	}
	return rev
}

// String describes the server for test logs.
func (s *Server) String() string { return "etcd@" + s.Addr() }
