package app

import (
	"bytes"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestDemoExitAfterBurst runs the whole demo on loopback ports: four
// simulated workers, serve with the proxy, the burst, the summary.
func TestDemoExitAfterBurst(t *testing.T) {
	var out, errb bytes.Buffer
	start := time.Now()
	err := RunIO(t.Context(), []string{"demo", "--exit-after-burst", "--sessions", "6", "--turns", "3",
		"--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0", "--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"},
		strings.NewReader(""), &out, &errb)
	if err != nil {
		t.Fatalf("demo: %v\nstdout:\n%s\nstderr:\n%s", err, out.String(), errb.String())
	}
	if ExitCode(err) != 0 {
		t.Fatalf("exit code %d", ExitCode(err))
	}
	s := out.String()
	t.Logf("demo took %v:\n%s", time.Since(start), s)
	for _, name := range []string{"worker-1", "worker-2", "worker-3", "worker-4"} {
		if !regexp.MustCompile(`(?m)^` + name + ` +127\.0\.0\.1:\d+ `).MatchString(s) {
			t.Errorf("summary lacks a row for %s", name)
		}
	}
	m := regexp.MustCompile(`KV hit rate: ([0-9.]+)%`).FindStringSubmatch(s)
	if m == nil {
		t.Fatal("no KV hit rate in the summary")
	}
	if rate, _ := strconv.ParseFloat(m[1], 64); rate <= 0 {
		t.Errorf("hit rate %v%%, want > 0", rate)
	}
	for _, want := range []string{"TTFT: p50 ", "Session stickiness: ", "total "} {
		if !strings.Contains(s, want) {
			t.Errorf("summary lacks %q", want)
		}
	}
	if strings.Contains(s, "failed requests") {
		t.Errorf("some requests failed")
	}
	if strings.Contains(s, "curl ") {
		t.Errorf("--exit-after-burst printed the try-it commands")
	}
}

func TestDemoFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--speed-up", "0"},
		{"--sessions", "0"},
		{"--turns", "-1"},
		{"--no-burst", "--exit-after-burst"},
		{"--policy", "nope"},
		{"extra"},
	} {
		err := RunIO(t.Context(), append([]string{"demo"}, args...), strings.NewReader(""), &bytes.Buffer{}, &bytes.Buffer{})
		if ExitCode(err) != 2 {
			t.Errorf("demo %v: %v (exit %d), want a usage error", args, err, ExitCode(err))
		}
	}
}
