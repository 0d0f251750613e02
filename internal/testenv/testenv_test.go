package testenv

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"net"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// gone reports whether no process has the id any more.
func gone(pid int) bool { return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) }

// TestStopKill stops processes with Stop (one ignores SIGTERM, so Stop falls
// back to SIGKILL after StopGrace) and Kill, and checks they are gone.
func TestStopKill(t *testing.T) {
	for _, c := range []struct {
		name, script string
		stop         func(*Process)
		within       time.Duration
	}{
		{"stop", "exec sleep 60", (*Process).Stop, StopGrace},
		{"stop-ignoring-sigterm", "trap '' TERM; while :; do sleep 0.05; done", (*Process).Stop, 2 * StopGrace},
		{"kill", "trap '' TERM; exec sleep 60", (*Process).Kill, StopGrace},
	} {
		t.Run(c.name, func(t *testing.T) {
			var out Log
			p, err := Start("/bin/sh", []string{"-c", c.script}, &out)
			if err != nil {
				t.Fatal(err)
			}
			pid := p.PID()
			if pid == 0 || p.Exited() {
				t.Fatalf("PID %d, Exited %v for a running process", pid, p.Exited())
			}
			time.Sleep(100 * time.Millisecond) // let sh set its trap
			begin := time.Now()
			c.stop(p)
			if d := time.Since(begin); d > c.within {
				t.Errorf("stopping took %v", d)
			}
			if p.PID() != 0 || !p.Exited() || !gone(pid) {
				t.Fatalf("after stopping: PID %d, Exited %v, gone %v", p.PID(), p.Exited(), gone(pid))
			}
			p.Stop() // idempotent
			p.Kill()
		})
	}
	var nilProc *Process
	nilProc.Stop()
	nilProc.Kill()
	if nilProc.PID() != 0 || !nilProc.Exited() {
		t.Fatal("nil Process is not stopped")
	}
}

func TestWaitReady(t *testing.T) {
	p, err := Start("/bin/sh", []string{"-c", "echo up; exec sleep 60"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Kill()
	n := 0
	if err := p.WaitReady(5*time.Second, time.Millisecond, func() (bool, error) { n++; return n == 3, nil }); err != nil || n != 3 {
		t.Fatalf("ready on the 3rd call: err %v after %d calls", err, n)
	}
	stop := errors.New("wrong listener")
	if err := p.WaitReady(5*time.Second, time.Millisecond, func() (bool, error) { return true, stop }); !errors.Is(err, stop) {
		t.Fatalf("giving up: %v", err)
	}
	why := errors.New("no ports file yet")
	err = p.WaitReady(50*time.Millisecond, time.Millisecond, func() (bool, error) { return false, why })
	if !errors.Is(err, why) || !strings.Contains(err.Error(), "sh (pid") {
		t.Fatalf("timeout: %v", err)
	}

	var out Log
	q, err := Start("/bin/sh", []string{"-c", "echo bye; exit 3"}, &out)
	if err != nil {
		t.Fatal(err)
	}
	err = q.WaitReady(5*time.Second, time.Millisecond, func() (bool, error) { return false, nil })
	if err == nil || !strings.Contains(err.Error(), "exited during startup (exit status 3)") {
		t.Fatalf("exit during startup: %v", err)
	}
	if out.String() != "bye\n" {
		t.Fatalf("output %q", out.String())
	}
}

func TestStartMissingBinary(t *testing.T) {
	if _, err := Start("/nonexistent/tool", nil, nil); err == nil {
		t.Fatal("started a missing binary")
	}
}

func TestLogBounded(t *testing.T) {
	var l Log
	chunk := make([]byte, 64<<10)
	for range 40 {
		if n, err := l.Write(chunk); n != len(chunk) || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}
	if n := len(l.String()); n < maxLog || n > maxLog+len(chunk) {
		t.Fatalf("log holds %d bytes, want about %d", n, maxLog)
	}
}

func TestFreePort(t *testing.T) {
	port := FreePort(t)
	l, err := net.Listen("tcp", net.JoinHostPort(Loopback, strconv.Itoa(port)))
	if err != nil {
		t.Fatalf("port %d not free: %v", port, err)
	}
	l.Close()
}

func TestCA(t *testing.T) {
	ca, err := NewCA("testenv CA")
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.Issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "server"},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses: []net.IP{net.ParseIP(Loopback)},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := leaf.TLS.Leaf.Verify(x509.VerifyOptions{Roots: ca.Pool(), DNSName: Loopback}); err != nil {
		t.Fatalf("leaf does not verify against the CA: %v", err)
	}
	if len(ca.PEM) == 0 || len(leaf.CertPEM) == 0 || len(leaf.KeyPEM) == 0 {
		t.Fatal("missing PEM")
	}
	if k, err := NewKeyPEM(); err != nil || !strings.Contains(string(k), "EC PRIVATE KEY") {
		t.Fatalf("NewKeyPEM: %v %q", err, k)
	}
}
