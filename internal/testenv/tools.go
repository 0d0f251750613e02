// Package testenv runs the real third-party servers the tests need (etcd,
// nats-server, kube-apiserver, …) and is the one place that finds their
// binaries and starts and stops their processes. The servers themselves
// live in its sub-packages (etcdenv, natsenv, kubeenv); this package holds
// what they share:
//
//   - [Tool] finds a binary: the path in KVBANDIT_<NAME> when set (the e2e
//     suite builds them outside its network namespace and passes them in),
//     otherwise built or found in the content-keyed cache by tools/build.sh.
//     A binary that cannot be had fails the test; it never skips.
//   - [FreePort] picks a free port on [Loopback] (127.0.0.1), the only
//     address the servers listen on.
//   - [Start] starts a process (killed if the test binary dies), and
//     [Process.Stop] and [Process.Kill] stop it by its PID and wait until it
//     is reaped.
//   - [Log] collects a process's output; [NewCA] issues throwaway TLS
//     certificates.
//
// It is for tests only.
package testenv

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// modulePath is the module whose go.mod marks the repository root.
const modulePath = "github.com/kvbandit/kvbandit"

// Loopback is the only address the servers listen on.
const Loopback = "127.0.0.1"

// Tool returns the path of the named tools binary (etcd, kube-apiserver,
// helm, nats-server, llm-d-inference-sim, epp, …): $KVBANDIT_<NAME> (upper
// case, "-" as "_") when set, otherwise the output of tools/build.sh NAME.
func Tool(t testing.TB, name string) string {
	t.Helper()
	env := "KVBANDIT_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
	if bin := os.Getenv(env); bin != "" {
		if fi, err := os.Stat(bin); err != nil || fi.IsDir() {
			t.Fatalf("testenv: %s=%q: not a file (%v)", env, bin, err)
		}
		return bin
	}
	root := RepoRoot(t)
	cmd := exec.Command("bash", filepath.Join(root, "tools", "build.sh"), name)
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("testenv: tools/build.sh %s: %v\n%s", name, err, stderr.String())
	}
	lines := strings.Fields(strings.TrimSpace(string(out)))
	if len(lines) == 0 {
		t.Fatalf("testenv: tools/build.sh %s printed no path\n%s", name, stderr.String())
	}
	bin := lines[len(lines)-1]
	if fi, err := os.Stat(bin); err != nil || fi.IsDir() {
		t.Fatalf("testenv: %s binary %q: %v", name, bin, err)
	}
	return bin
}

// RepoRoot walks up from the working directory to the go.mod of the
// kvbandit module.
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && modFileIs(data, modulePath) {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatalf("testenv: no go.mod of module %s above the working directory", modulePath)
		}
		dir = parent
	}
}

func modFileIs(data []byte, module string) bool {
	for line := range strings.SplitSeq(string(data), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`) == module
		}
	}
	return false
}

// FreePort returns a TCP port on [Loopback] that was free when asked.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", Loopback+":0")
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
