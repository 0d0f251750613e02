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
	checkDemoBaseline(t, s)
}

// checkDemoBaseline checks the side-by-side summary of kvbandit and the
// round_robin baseline: every row is there, and kvbandit's KV hit rate
// and stickiness are above round_robin's.
func checkDemoBaseline(t *testing.T, s string) {
	t.Helper()
	if !strings.Contains(s, "Baseline: the same 6 sessions x 3 turns (seed 1) with --policy round_robin, on a fresh fleet") {
		t.Errorf("no baseline run announced")
	}
	if !regexp.MustCompile(`(?m)^ +kvbandit +round_robin$`).MatchString(s) {
		t.Errorf("no side-by-side header (kvbandit, round_robin)")
	}
	pct := func(row string) (kv, rr float64) {
		m := regexp.MustCompile(`(?m)^  ` + row + ` +([0-9.]+)% +([0-9.]+)%$`).FindStringSubmatch(s)
		if m == nil {
			t.Fatalf("side-by-side summary lacks the %q row", row)
		}
		kv, _ = strconv.ParseFloat(m[1], 64)
		rr, _ = strconv.ParseFloat(m[2], 64)
		return kv, rr
	}
	if kv, rr := pct("KV hit rate"); kv <= rr {
		t.Errorf("KV hit rate: kvbandit %v%%, round_robin %v%%; want kvbandit's above", kv, rr)
	}
	if kv, rr := pct("session stickiness"); kv <= rr {
		t.Errorf("session stickiness: kvbandit %v%%, round_robin %v%%; want kvbandit's above", kv, rr)
	}
	for _, row := range []string{"sessions on 1 worker", "TTFT p50 \\(model time\\)", "TTFT p90 \\(model time\\)"} {
		if !regexp.MustCompile(`(?m)^  ` + row + ` +\S+.*\S+$`).MatchString(s) {
			t.Errorf("side-by-side summary lacks the %q row", row)
		}
	}
}

// TestDemoNoBaseline: --baseline none skips the baseline run, and a
// --policy equal to the baseline says there is none.
func TestDemoNoBaseline(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--baseline", "none"}, ""},
		{[]string{"--policy", "round_robin"}, "(no baseline run: --policy is the baseline policy, round_robin)"},
	} {
		var out, errb bytes.Buffer
		args := append([]string{"demo", "--exit-after-burst", "--sessions", "2", "--turns", "2",
			"--http-addr", "127.0.0.1:0", "--grpc-addr", "127.0.0.1:0", "--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"}, tc.args...)
		if err := RunIO(t.Context(), args, strings.NewReader(""), &out, &errb); err != nil {
			t.Fatalf("demo %v: %v\nstdout:\n%s\nstderr:\n%s", tc.args, err, out.String(), errb.String())
		}
		s := out.String()
		if strings.Contains(s, "Baseline:") || strings.Contains(s, "TTFT p50 (model time)") {
			t.Errorf("demo %v ran a baseline:\n%s", tc.args, s)
		}
		if tc.want != "" && !strings.Contains(s, tc.want) {
			t.Errorf("demo %v: output lacks %q:\n%s", tc.args, tc.want, s)
		}
	}
}

func TestDemoFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--speed-up", "0"},
		{"--sessions", "0"},
		{"--turns", "-1"},
		{"--no-burst", "--exit-after-burst"},
		{"--policy", "nope"},
		{"--baseline", "nope"},
		{"extra"},
	} {
		err := RunIO(t.Context(), append([]string{"demo"}, args...), strings.NewReader(""), &bytes.Buffer{}, &bytes.Buffer{})
		if ExitCode(err) != 2 {
			t.Errorf("demo %v: %v (exit %d), want a usage error", args, err, ExitCode(err))
		}
	}
}
