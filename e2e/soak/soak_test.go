package main

import (
	"regexp"
	"strings"
	"testing"
)

// A short soak of the real binary: normal traffic, a few hostile classes,
// discovery churn, worker restarts and the KV flood, with growth slack so
// wide that only the liveness rules can fail it (no crash, quiescence,
// no goroutines left behind, normal traffic served, clean SIGTERM). It
// checks the soak's own machinery end to end, under -race.
func TestShortSoak(t *testing.T) {
	if testing.Short() {
		t.Skip("builds kvbandit and runs it for 15 s")
	}
	var out, errOut strings.Builder
	code := run(t.Context(), []string{
		"--duration", "15s", "--report-every", "1s", "--workers", "3", "--bind-workers", "1", "--rate", "4",
		"--churn-every", "2s", "--restart-every", "6s", "--kv-flood-rate", "50", "--quiesce-timeout", "30s",
		"--rss-slack-mib", "4096", "--goroutine-slack", "100000",
		"--only", "spoof_proxy,traversal_proxy,abandon_extproc,forged_served,cancel_stream_envoy,unknown_model_envoy,kv_flood,discovery_churn,worker_restart",
		"--work-dir", t.TempDir(),
	}, &out, &errOut)
	t.Logf("stdout:\n%s\nstderr:\n%s", out.String(), errOut.String())
	if code != exitPass {
		t.Fatalf("exit code %d, want %d (PASS)", code, exitPass)
	}
	if rows := regexp.MustCompile(`(?m)^\s+0:00:\d\d  load `).FindAllString(out.String(), -1); len(rows) < 10 {
		t.Errorf("%d load rows, want at least 10", len(rows))
	}
	for _, class := range []string{"chat_envoy", "chat_proxy", "spoof_proxy", "forged_served", "kv_flood"} {
		m := regexp.MustCompile(`(?m)^` + class + `\s+\S+\s+(\d+)`).FindStringSubmatch(out.String())
		if m == nil || m[1] == "0" {
			t.Errorf("class %s: no successful request in the summary", class)
		}
	}
	if !strings.Contains(out.String(), "\nPASS\n") {
		t.Error("no PASS line")
	}
}
