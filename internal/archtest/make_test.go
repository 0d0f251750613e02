package archtest

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// TestMakeHelpListsEveryTarget: every Makefile target with a "## " comment
// appears in `make help` (a target regex without digits once hid e2e).
func TestMakeHelpListsEveryTarget(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("make not installed")
	}
	raw, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	documented := regexp.MustCompile(`(?m)^([^\s:#=]+):[^=\n]*## `).FindAllStringSubmatch(string(raw), -1)
	if len(documented) == 0 {
		t.Fatal("no documented targets found in the Makefile")
	}
	out, err := exec.CommandContext(t.Context(), "make", "-s", "-C", "../..", "help").Output()
	if err != nil {
		t.Fatalf("make help: %v", err)
	}
	listed := map[string]bool{}
	for _, line := range strings.Split(regexp.MustCompile(`\x1b\[[0-9;]*m`).ReplaceAllString(string(out), ""), "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			listed[f[0]] = true
		}
	}
	for _, m := range documented {
		if !listed[m[1]] {
			t.Errorf("make help does not list %q", m[1])
		}
	}
}
