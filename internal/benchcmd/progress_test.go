package benchcmd

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var agenticSmall = []string{"--format", "agentic", "--workers", "2", "--policy", "round_robin,kvbandit",
	"--sessions", "40", "--turns", "8", "--session-rate", "20", "--think-time", "1s", "--input-len", "50", "--output-len", "8"}

// TestBenchProgressOffUnlessTerminal: the test's stderr is no terminal, so
// bench is silent there unless --progress forces it; --quiet wins.
func TestBenchProgressOffUnlessTerminal(t *testing.T) {
	t.Parallel()
	// A real file: an *os.File that is not a character device.
	f, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if isTerminal(f) || isTerminal(&bytes.Buffer{}) {
		t.Fatal("a file or a buffer taken for a terminal")
	}
	var out bytes.Buffer
	if err := Run(t.Context(), agenticSmall, &out, f, nil); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(f.Name()); len(b) != 0 {
		t.Fatalf("progress on a file without --progress:\n%s", b)
	}

	_, errOut, err := run(t, append(agenticSmall, "--progress")...)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(errOut), "\n")
	if len(lines) < 2 || lines[0] != "bench: 0 of 2 policies done; ETA -" ||
		!strings.HasPrefix(lines[len(lines)-1], "bench: 2 policies × 320 requests replayed in ") || strings.Contains(errOut, "\r") {
		t.Fatalf("--progress stderr:\n%s", errOut)
	}

	if _, errOut, err := run(t, append(agenticSmall, "--progress", "--quiet")...); err != nil || errOut != "" {
		t.Fatalf("--quiet: %v\n%s", err, errOut)
	}
}

// TestBenchProgressLine: per running policy its requests routed, the
// policies done, and an ETA from the overall rate; on a terminal the line
// is redrawn in place.
func TestBenchProgressLine(t *testing.T) {
	t.Parallel()
	now := time.Unix(1000, 0)
	var buf bytes.Buffer
	p := newBenchProgress(&buf, false, true, []string{"kv", "kvbandit", "random"}, 1000, func() time.Time { return now })
	p.every = time.Hour // draws only when asked
	p.start()
	p.arrivedFunc(0)(1000)
	p.done(0)
	p.arrivedFunc(1)(500)
	now = now.Add(10 * time.Second)
	// 1500 of 3000 requests in 10s: 10s left.
	if got, want := p.line(), "bench: kvbandit 500/1000; 1 of 3 policies done; ETA 10s"; got != want {
		t.Fatalf("line %q, want %q", got, want)
	}
	p.tty = true
	p.draw()
	p.arrivedFunc(1)(1000)
	p.done(1)
	p.draw()
	p.close()
	out := buf.String()
	for _, want := range []string{
		"bench: 0 of 3 policies done; ETA -\n",
		"\rbench: kvbandit 500/1000; 1 of 3 policies done; ETA 10s",
		"\rbench: 2 of 3 policies done; ETA 5s                ", // padded over the longer line
		"\rbench: 3 policies × 1000 requests replayed in 10s",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%q", want, out)
		}
	}
	if newBenchProgress(&buf, false, false, []string{"kv"}, 1, nil) != nil || newBenchProgress(&buf, true, true, []string{"kv"}, 1, nil) != nil {
		t.Fatal("progress on without a terminal or --progress, or with --quiet")
	}
}

// TestBenchHeaderBeforeRun: the trace header is written before the
// policies run (here they never finish: the context is cancelled).
func TestBenchHeaderBeforeRun(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	var out, errOut bytes.Buffer
	err := Run(ctx, agenticSmall, &out, &errOut, nil)
	if err == nil || !strings.HasPrefix(out.String(), "trace agentic: 40 sessions") || strings.Contains(out.String(), "TTFT p50") {
		t.Fatalf("err %v, stdout:\n%s", err, out.String())
	}
}
