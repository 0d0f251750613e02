//go:build benchlive

package e2e

// The live benchmark (issue 21): `make bench-live`. Not part of the test
// suite: it is a measurement (the suite runs TestBenchLiveSmoke). Its
// machinery is in live_test.go.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func init() {
	extraSetup = append(extraSetup, func(root, dir string) ([]string, error) {
		// A normal (non-race) build: the benchmark measures the picker's CPU.
		bin := filepath.Join(dir, "kvbandit-live")
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/kvbandit")
		cmd.Dir, cmd.Stdout, cmd.Stderr = root, os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			return nil, fmt.Errorf("building kvbandit: %w", err)
		}
		env := []string{envLiveBin + "=" + bin}
		if strings.Contains(os.Getenv("BENCH_LIVE_PICKERS"), "gie") {
			tools := exec.Command("bash", filepath.Join(root, "tools", "build.sh"), "epp")
			tools.Stderr = os.Stderr
			out, err := tools.Output()
			paths := strings.Fields(string(out))
			if err != nil || len(paths) != 1 {
				return nil, fmt.Errorf("tools/build.sh epp: %v", err)
			}
			env = append(env, envLiveEPP+"="+paths[0])
		}
		return env, nil
	})
}

// TestBenchLive runs every workload through every picker (the order
// rotating per workload), on a fresh fleet each time, and reports a table
// per workload, BENCH_LIVE_OUT and a TTFT CDF per workload. Knobs:
// BENCH_LIVE_* (readLiveKnobs).
func TestBenchLive(t *testing.T) {
	benchLive(t, readLiveKnobs(t))
}
