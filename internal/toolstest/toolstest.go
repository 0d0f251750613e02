// Package toolstest finds, for tests, the third-party binaries the suites
// run (etcd, kube-apiserver, helm, llm-d-inference-sim, GIE's epp): the
// path in KVBANDIT_<NAME> when set (the e2e suite builds them outside its
// network namespace and passes them in), otherwise built or found in the
// content-keyed cache by tools/build.sh. A binary that cannot be had fails
// the test; it never skips.
package toolstest

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// modulePath is the module whose go.mod marks the repository root.
const modulePath = "github.com/kvbandit/kvbandit"

// Tool returns the path of the named tools binary.
func Tool(t testing.TB, name string) string {
	t.Helper()
	env := "KVBANDIT_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
	if bin := os.Getenv(env); bin != "" {
		if fi, err := os.Stat(bin); err != nil || fi.IsDir() {
			t.Fatalf("toolstest: %s=%q: not a file (%v)", env, bin, err)
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
		t.Fatalf("toolstest: tools/build.sh %s: %v\n%s", name, err, stderr.String())
	}
	lines := strings.Fields(strings.TrimSpace(string(out)))
	if len(lines) == 0 {
		t.Fatalf("toolstest: tools/build.sh %s printed no path\n%s", name, stderr.String())
	}
	bin := lines[len(lines)-1]
	if fi, err := os.Stat(bin); err != nil || fi.IsDir() {
		t.Fatalf("toolstest: %s binary %q: %v", name, bin, err)
	}
	return bin
}

// RepoRoot walks up from the working directory to the go.mod of the
// kvbandit module.
func RepoRoot(t testing.TB) string {
	t.Helper()
	dir, err := os.Getwd()
	if err != nil {
		t.Fatalf("toolstest: %v", err)
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && modFileIs(data, modulePath) {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			t.Fatalf("toolstest: no go.mod of module %s above the working directory", modulePath)
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

// FreePort returns a free TCP port on 127.0.0.1.
func FreePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("toolstest: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Wait returns a channel closed when the started cmd has exited (its Wait
// returned): the done channel [Stop] takes.
func Wait(cmd *exec.Cmd) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	return done
}

// Stop signals a process started by a test and waits for done (closed when
// its Wait returned): sig first, then, when grace > 0 and it is still
// running after grace, SIGKILL. A nil cmd or an exited process is a no-op.
func Stop(cmd *exec.Cmd, done <-chan struct{}, sig syscall.Signal, grace time.Duration) {
	if cmd == nil {
		return
	}
	select {
	case <-done:
		return
	default:
	}
	_ = cmd.Process.Signal(sig)
	if grace > 0 {
		select {
		case <-done:
			return
		case <-time.After(grace):
			_ = cmd.Process.Kill()
		}
	}
	<-done
}
