package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvbandit/kvbandit/internal/testenv/etcdenv"
	"github.com/kvbandit/kvbandit/routing"
)

// syncBuffer is a bytes.Buffer safe for the logger and the test to share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestRegisterFlagValidation(t *testing.T) {
	dir := t.TempDir()
	badRecord := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(badRecord, []byte("address: 10.0.0.1:80\nnot_a_field: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := []string{"--etcd-endpoints", "127.0.0.1:2379", "--address", "10.0.0.1:8000"}
	cases := map[string][]string{
		"no etcd":          {"--address", "10.0.0.1:8000"},
		"empty etcd":       {"--etcd-endpoints", " , ", "--address", "10.0.0.1:8000"},
		"no address":       {"--etcd-endpoints", "127.0.0.1:2379"},
		"bad host name":    {"--etcd-endpoints", "127.0.0.1:2379", "--address", "wor..ker:8000"},
		"no port":          {"--etcd-endpoints", "127.0.0.1:2379", "--address", "10.0.0.1"},
		"engine":           append(base[:4:4], "--engine", "tgi"),
		"role":             append(base[:4:4], "--role", "encode"),
		"negative block":   append(base[:4:4], "--block-size", "-16"),
		"negative weight":  append(base[:4:4], "--weight", "-1"),
		"label":            append(base[:4:4], "--label", "novalue"),
		"ttl":              append(base[:4:4], "--ttl", "0s"),
		"health interval":  append(base[:4:4], "--health-interval", "0s"),
		"health timeout":   append(base[:4:4], "--health-timeout", "-1s"),
		"id slash":         append(base[:4:4], "--id", "a/b"),
		"pool slash":       append(base[:4:4], "--etcd-pool", "a/b"),
		"relative prefix":  append(base[:4:4], "--etcd-prefix", "kv"),
		"cert without key": append(base[:4:4], "--etcd-cert", "c.pem"),
		"missing record":   append(base[:4:4], "--record", filepath.Join(dir, "nope.json")),
		"strict record":    append(base[:4:4], "--record", badRecord),
		"stray argument":   append(base[:4:4], "stray"),
		"unknown flag":     append(base[:4:4], "--nope"),
	}
	for name, args := range cases {
		t.Run(name, func(t *testing.T) {
			var out, errw bytes.Buffer
			err := Run(t.Context(), append([]string{"register"}, args...), &out, &errw)
			if !errors.Is(err, ErrUsage) || ExitCode(err) != 2 {
				t.Errorf("register %q: err %v (exit %d), want a usage error", args, err, ExitCode(err))
			}
		})
	}
	if _, stderr, err := run(t, "register", "-h"); err != nil || !strings.Contains(stderr, "etcd-endpoints") {
		t.Errorf("register -h: %v %q", err, stderr)
	}
	if _, stderr, _ := run(t, "help"); !strings.Contains(stderr, "register") {
		t.Errorf("help does not list register: %q", stderr)
	}
}

func TestRegisterRecordMerge(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "rec.yaml")
	yml := "address: 10.0.0.1:8000\nengine: sglang\nmodels: [a]\nblock_size: 16\nlabels: {zone: z1}\nrole: decode\n"
	if err := os.WriteFile(path, []byte(yml), 0o600); err != nil {
		t.Fatal(err)
	}
	o := &registerOptions{labels: labelFlag{"rack": "r2"}, recordFile: path,
		models: listFlag{"m1", "m2"}, engine: "vllm", address: "[::ffff:10.0.0.2]:9000", role: routing.RolePrefill}
	ep, err := o.record(map[string]bool{"model": true, "engine": true, "address": true, "role": true})
	if err != nil {
		t.Fatal(err)
	}
	want := routing.Endpoint{Key: "10.0.0.2:9000", Engine: "vllm", Models: []routing.ModelName{"m1", "m2"},
		BlockSize: 16, Labels: map[string]string{"zone": "z1", "rack": "r2"}, Role: routing.RolePrefill}
	if !ep.Equal(&want) {
		t.Errorf("record = %+v, want %+v", ep, want)
	}
	var l listFlag
	_ = l.Set("a, b")
	_ = l.Set("c")
	if l.String() != "a,b,c" {
		t.Errorf("list flag = %q", l.String())
	}
}

// TestRegisterEndToEnd runs `kvbandit register` against a real etcd and a
// worker whose /health fails until the test flips it: the record appears
// only once the worker is healthy, and cancelling the context (SIGTERM in
// main) deletes it.
func TestRegisterEndToEnd(t *testing.T) {
	srv := etcdenv.Start(t)
	cli := srv.Client(t)
	var healthy atomic.Bool
	var probes atomic.Int32
	worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
			return
		}
		probes.Add(1)
		if !healthy.Load() {
			http.Error(w, "loading", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer worker.Close()
	addr := strings.TrimPrefix(worker.URL, "http://")

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, []string{"register",
			"--etcd-endpoints", srv.Addr(), "--etcd-prefix", "/e2e", "--etcd-pool", "p",
			"--id", "w1", "--address", addr, "--model", "m1,m2", "--engine", "vllm",
			"--label", "zone=a", "--role", "decode", "--ttl", "2s", "--health-interval", "20ms",
		}, &bytes.Buffer{}, &stderr)
	}()
	const key = "/e2e/p/endpoints/w1"
	get := func() []byte {
		gctx, gcancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer gcancel()
		resp, err := cli.Get(gctx, key)
		if err != nil {
			t.Fatalf("get: %v", err)
		}
		if len(resp.Kvs) == 0 {
			return nil
		}
		return resp.Kvs[0].Value
	}

	waitUntil(t, 5*time.Second, "health probes", func() bool { return probes.Load() >= 3 })
	if v := get(); v != nil {
		t.Fatalf("registered before the worker was healthy: %s", v)
	}
	healthy.Store(true)
	var value []byte
	waitUntil(t, 10*time.Second, "record in etcd", func() bool { value = get(); return value != nil })
	var ep routing.Endpoint
	if err := json.Unmarshal(value, &ep); err != nil {
		t.Fatalf("record %s: %v", value, err)
	}
	want := routing.Endpoint{Key: routing.EndpointKey(addr), Engine: "vllm", Models: []routing.ModelName{"m1", "m2"},
		Labels: map[string]string{"zone": "a"}, Role: routing.RoleDecode}
	if !ep.Equal(&want) {
		t.Errorf("record = %+v, want %+v", ep, want)
	}
	gctx, gcancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer gcancel()
	resp, err := cli.Get(gctx, key)
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("record not under a lease: %v %v", resp, err)
	}
	lease := clientv3.LeaseID(resp.Kvs[0].Lease)

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("register: %v\n%s", err, stderr.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("register did not return after cancel")
	}
	if v := get(); v != nil {
		t.Errorf("record still there after exit: %s", v)
	}
	if ttl, err := cli.TimeToLive(gctx, lease); err != nil || ttl.TTL != -1 {
		t.Errorf("lease after exit: %v %v, want revoked", ttl, err)
	}
}

// TestRegisterGivesUpOnUnhealthyWorker checks --health-timeout and that a
// cancel while waiting exits cleanly without registering.
func TestRegisterGivesUpOnUnhealthyWorker(t *testing.T) {
	worker := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "loading", http.StatusServiceUnavailable)
	}))
	defer worker.Close()
	addr := strings.TrimPrefix(worker.URL, "http://")
	args := []string{"register", "--etcd-endpoints", "127.0.0.1:1", "--id", "w", "--address", addr,
		"--health-interval", "20ms"}
	_, _, err := run(t, append(args, "--health-timeout", "200ms")...)
	if err == nil || errors.Is(err, ErrUsage) || !strings.Contains(err.Error(), "not healthy") {
		t.Errorf("unhealthy worker: err %v, want a health timeout", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if err := Run(ctx, append(args, "--health-timeout", "0"), &bytes.Buffer{}, &bytes.Buffer{}); err != nil {
		t.Errorf("cancelled while waiting: %v, want nil", err)
	}
}

func waitUntil(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
