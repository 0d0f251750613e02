package testenv

import (
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// StopGrace is how long [Process.Stop] waits after SIGTERM before it sends
// SIGKILL.
const StopGrace = 5 * time.Second

// Process is one run of a tool binary, started by [Start]. Its methods may
// be called from any goroutine; a nil *Process is one that has stopped.
type Process struct {
	name string // the binary's base name, for messages
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd.Wait has returned
}

// Start starts bin with args, its stdout and stderr both going to out (nil
// discards them), and reaps it when it exits. The process gets SIGKILL if
// the test binary dies first; otherwise its owner stops it with Stop or
// Kill, typically from a t.Cleanup. The caller picks its listen addresses:
// [Loopback] with [FreePort], or port 0 where the server reports what it
// chose.
func Start(bin string, args []string, out io.Writer) (*Process, error) {
	return StartEnv(bin, args, nil, out)
}

// StartEnv is [Start] with env ("KEY=value") added to the test's own
// environment.
func StartEnv(bin string, args, env []string, out io.Writer) (*Process, error) {
	cmd := exec.Command(bin, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", filepath.Base(bin), err)
	}
	p := &Process{name: filepath.Base(bin), cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// PID is the process id while the process runs, 0 once it has exited.
func (p *Process) PID() int {
	if p.Exited() {
		return 0
	}
	return p.cmd.Process.Pid
}

// Exited reports whether the process has exited and been reaped (true for
// nil).
func (p *Process) Exited() bool {
	if p == nil {
		return true
	}
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop sends SIGTERM, then SIGKILL if the process still runs after
// [StopGrace], and waits until it has exited. Stopping a stopped process
// does nothing.
func (p *Process) Stop() { p.signal(syscall.SIGTERM, StopGrace) }

// Kill sends SIGKILL and waits until the process has exited: whoever is
// connected to it sees the connection drop without a goodbye. Killing a
// stopped process does nothing.
func (p *Process) Kill() { p.signal(syscall.SIGKILL, 0) }

// signal sends sig and waits for the exit; when grace > 0 and the process
// still runs after grace, it sends SIGKILL.
func (p *Process) signal(sig syscall.Signal, grace time.Duration) {
	if p.Exited() {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	if grace > 0 {
		select {
		case <-p.done:
			return
		case <-time.After(grace):
			_ = p.cmd.Process.Kill()
		}
	}
	<-p.done
}

// WaitReady calls ready every interval until it reports done, and returns
// its error then (nil: the server is ready; non-nil: give up). A not-done
// call's error says why the server is not ready yet; the last one is part
// of the error when timeout passes first. WaitReady also fails when the
// process exits. It does not stop the process.
func (p *Process) WaitReady(timeout, interval time.Duration, ready func() (done bool, err error)) error {
	deadline := time.Now().Add(timeout)
	var last error
	for {
		if p.Exited() {
			return fmt.Errorf("%s exited during startup (%v)", p.name, p.cmd.ProcessState)
		}
		if time.Now().After(deadline) {
			if last != nil {
				return fmt.Errorf("%s (pid %d) not ready after %v: %w", p.name, p.PID(), timeout, last)
			}
			return fmt.Errorf("%s (pid %d) not ready after %v", p.name, p.PID(), timeout)
		}
		done, err := ready()
		if done {
			return err
		}
		last = err
		time.Sleep(interval)
	}
}
