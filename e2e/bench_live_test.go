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
	"slices"
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
		// A picker needs its tool, and so does its replicated row (gie-x3).
		pickers := strings.Split(os.Getenv("BENCH_LIVE_PICKERS"), ",")
		for _, tool := range []struct{ picker, name, env, hint string }{
			{"gie", "epp", envLiveEPP, ""},
			{"llmd", "llmd-epp", envLiveLLMD, "; it needs cgo and libzmq3-dev: run make tools-llmd once"},
		} {
			if !slices.ContainsFunc(pickers, func(p string) bool { return p == tool.picker || strings.HasPrefix(p, tool.picker+"-") }) {
				continue
			}
			path, err := buildTool(root, tool.name)
			if err != nil {
				return nil, fmt.Errorf("%w%s", err, tool.hint)
			}
			env = append(env, tool.env+"="+path)
		}
		return env, nil
	})
}

// buildTool builds one of the tools modules with tools/build.sh (cached
// by content) and returns the binary's path, which build.sh prints.
func buildTool(root, name string) (string, error) {
	cmd := exec.Command("bash", filepath.Join(root, "tools", "build.sh"), name)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	paths := strings.Fields(string(out))
	if err != nil || len(paths) != 1 {
		return "", fmt.Errorf("tools/build.sh %s: %v (output %q)", name, err, out)
	}
	return paths[0], nil
}

// TestBenchLive runs every workload through every picker (the order
// rotating per workload), on a fresh fleet each time, and reports a table
// per workload, BENCH_LIVE_OUT and a TTFT CDF per workload. Knobs:
// BENCH_LIVE_* (readLiveKnobs).
func TestBenchLive(t *testing.T) {
	benchLive(t, readLiveKnobs(t))
}
