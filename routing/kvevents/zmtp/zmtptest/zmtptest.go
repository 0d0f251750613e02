// Package zmtptest runs real ZeroMQ peers for tests of the zmtp package
// and its users: libzmq through Debian's python3-zmq (what vLLM uses, via
// pyzmq), shaped like vLLM's KV-event publisher.
package zmtptest

import (
	"bufio"
	_ "embed"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

//go:embed zmqpeer.py
var script []byte

// Python is the interpreter with python3-zmq. Debian's, not the first
// python3 on PATH, which may be a pyenv build without pyzmq.
const Python = "/usr/bin/python3"

// Peer is a running libzmq peer (see zmqpeer.py for its commands).
type Peer struct {
	t     testing.TB
	cmd   *exec.Cmd
	stdin interface {
		Write([]byte) (int, error)
		Close() error
	}
	// PubEndpoint and ReplayEndpoint are what the peer bound or connected.
	PubEndpoint, ReplayEndpoint string

	mu    sync.Mutex
	cond  *sync.Cond
	lines []string
	done  bool

	stop  sync.Once
	syncs int
}

// Start runs a libzmq peer with args ("--bind", "--connect", endpoint,
// "--replay", "--xpub", "--hb-ivl", ms, ...) and waits until it is ready.
// It fails the test, rather than skipping it, when Python lacks pyzmq:
// install Debian's python3-zmq.
func Start(t testing.TB, args ...string) *Peer {
	t.Helper()
	if out, err := exec.Command(Python, "-c", "import zmq; print(zmq.zmq_version())").CombinedOutput(); err != nil {
		t.Fatalf("%s cannot import zmq (%v: %s): the libzmq interop tests need Debian's python3-zmq (apt-get install -y python3-zmq)",
			Python, err, strings.TrimSpace(string(out)))
	}
	path := filepath.Join(t.TempDir(), "zmqpeer.py")
	if err := os.WriteFile(path, script, 0o600); err != nil {
		t.Fatal(err)
	}
	p := &Peer{t: t, cmd: exec.Command(Python, append([]string{"-u", path}, args...)...)}
	p.cond = sync.NewCond(&p.mu)
	stdin, err := p.cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.stdin = stdin
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	p.cmd.Stderr = &stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.mu.Lock()
			p.lines = append(p.lines, sc.Text())
			p.cond.Broadcast()
			p.mu.Unlock()
		}
		p.mu.Lock()
		p.done = true
		p.cond.Broadcast()
		p.mu.Unlock()
	}()
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() && stderr.Len() > 0 {
			t.Logf("zmqpeer stderr:\n%s", stderr.String())
		}
	})
	p.Wait("ready", 20*time.Second)
	for _, l := range p.Lines() {
		if e, ok := strings.CutPrefix(l, "pub "); ok {
			p.PubEndpoint = e
		}
		if e, ok := strings.CutPrefix(l, "replay "); ok {
			p.ReplayEndpoint = e
		}
	}
	return p
}

// Lines returns what the peer has printed so far.
func (p *Peer) Lines() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.lines...)
}

// Wait waits for an output line starting with prefix and returns it.
func (p *Peer) Wait(prefix string, timeout time.Duration) string {
	p.t.Helper()
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() {
		p.mu.Lock()
		p.cond.Broadcast()
		p.mu.Unlock()
	})
	defer timer.Stop()
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		for _, l := range p.lines {
			if strings.HasPrefix(l, prefix) {
				return l
			}
		}
		if p.done || time.Now().After(deadline) {
			p.t.Fatalf("zmqpeer: no %q line within %v (exited: %v); output: %q", prefix, timeout, p.done, p.lines)
		}
		p.cond.Wait()
	}
}

// Send sends one command line (see zmqpeer.py).
func (p *Peer) Send(fields ...string) {
	p.t.Helper()
	if _, err := fmt.Fprintln(p.stdin, strings.Join(fields, " ")); err != nil {
		p.t.Fatalf("zmqpeer: %v", err)
	}
}

// Publish publishes a KV-event message [topic, seq, payload] and buffers
// it for replay; with buffered, it only buffers it (a lost message).
func (p *Peer) Publish(seq uint64, topic string, payload []byte, bufferOnly bool) {
	p.t.Helper()
	verb := "pub"
	if bufferOnly {
		verb = "buffer"
	}
	p.Send(verb, fmt.Sprint(seq), hex.EncodeToString([]byte(topic)), hexOrEmpty(payload))
}

// Sync waits until the peer has carried out every command sent before.
func (p *Peer) Sync() {
	p.t.Helper()
	p.syncs++
	word := fmt.Sprintf("s%d", p.syncs)
	p.Send("sync", word)
	p.Wait("sync "+word, 20*time.Second)
}

// Raw publishes the frames as they are.
func (p *Peer) Raw(frames ...[]byte) {
	p.t.Helper()
	f := []string{"raw"}
	for _, fr := range frames {
		f = append(f, hexOrEmpty(fr))
	}
	p.Send(f...)
}

// hexOrEmpty encodes a frame for the script, which reads "-" as an empty
// frame (an empty word would vanish when the line is split).
func hexOrEmpty(b []byte) string {
	if len(b) == 0 {
		return "-"
	}
	return hex.EncodeToString(b)
}

// Stop asks the peer to quit and waits for it (killing it after 5 s).
func (p *Peer) Stop() { p.stop.Do(p.doStop) }

func (p *Peer) doStop() {
	_, _ = fmt.Fprintln(p.stdin, "quit")
	_ = p.stdin.Close()
	done := make(chan struct{})
	go func() {
		_ = p.cmd.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}
