package benchcmd

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/internal/cmdline"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// run runs `kvbandit bench` with args (the flags after the command name)
// and returns its stdout and stderr.
func run(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	var out, errw bytes.Buffer
	err := Run(t.Context(), args, &out, &errw, nil)
	return out.String(), errw.String(), err
}

// TestConfigLoader: --config goes through the caller's loader, and a file
// it refuses is a usage error naming the flag.
func TestConfigLoader(t *testing.T) {
	t.Parallel()
	var got string
	load := func(path string) (ConfigFile, error) {
		got = path
		return ConfigFile{}, errors.New("bad file")
	}
	var out, errw bytes.Buffer
	err := Run(t.Context(), []string{"--format", "agentic", "--config", "serve.yaml"}, &out, &errw, load)
	if got != "serve.yaml" || !errors.Is(err, cmdline.ErrUsage) || !strings.Contains(err.Error(), "--config: bad file") {
		t.Fatalf("loader got %q, err %v", got, err)
	}
}

// writeMooncake writes a small Mooncake trace: n requests, every one
// sharing a first block, pairs sharing a second one.
func writeMooncake(t *testing.T, n int, extra ...string) string {
	t.Helper()
	var b strings.Builder
	for i := range n {
		fmt.Fprintf(&b, `{"timestamp": %d, "input_length": %d, "output_length": %d, "hash_ids": [0, %d, %d]}`+"\n",
			i*50, 1100+i%7*100, 20+i%5, 1+i/2, 1000+i)
	}
	for _, e := range extra {
		b.WriteString(e + "\n")
	}
	path := filepath.Join(t.TempDir(), "trace.jsonl")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestBenchMooncake(t *testing.T) {
	t.Parallel()
	path := writeMooncake(t, 60, "not json")
	dir := t.TempDir()
	jsonOut, png := filepath.Join(dir, "out.json"), filepath.Join(dir, "ttft.png")
	out, errOut, err := run(t, "--trace", path, "--format", "mooncake", "--workers", "3",
		"--policy", "round_robin,kv,kvbandit,no_such_policy", "--speed-factors", "1,1,0.5", "--rate-scale", "2",
		"--kv-blocks", "256", "--json", jsonOut, "--plot", png)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	for _, want := range []string{"TTFT p50", "round_robin", "kvbandit", "infinite cache", "finite cache", "rate scale 2"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for _, want := range []string{`skipping policy "no_such_policy"`, "skipped 1 of 61 lines", "line 61:"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
	rep := readReport(t, jsonOut)
	if rep.Requests != 60 || len(rep.Policies) != 3 || rep.Bounds.Infinite <= 0 || rep.Bounds.Finite > rep.Bounds.Infinite {
		t.Fatalf("report %+v", rep)
	}
	for _, p := range rep.Policies {
		if p.Served != 60 || p.TTFTP50 <= 0 || p.TTFTP50 > p.TTFTP99 || p.HitRate > rep.Bounds.Infinite+1e-9 || len(p.RequestsPerWorker) != 3 || p.Imbalance < 1 {
			t.Errorf("%s: %+v", p.Policy, p)
		}
	}
	for _, f := range []string{png, filepath.Join(dir, "ttft-queue.png")} {
		if st, err := os.Stat(f); err != nil || st.Size() == 0 {
			t.Errorf("plot %s: %v", f, err)
		}
	}
}

func TestBenchAgentic(t *testing.T) {
	t.Parallel()
	out, errOut, err := run(t, "--format", "agentic", "--workers", "4", "--policy", "round_robin,kvbandit",
		"--sessions", "12", "--turns", "4", "--session-rate", "4", "--think-time", "2s", "--input-len", "100", "--output-len", "20")
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	if !strings.Contains(out, "affinity") || !strings.Contains(out, "48 requests") {
		t.Errorf("output:\n%s", out)
	}
}

func TestBenchAzure(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "azure.csv")
	csv := "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:51.1,1200,3\n"
	if err := os.WriteFile(path, []byte(csv), 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, err := run(t, "--trace", path, "--format", "azure", "--workers", "2", "--policy", "least_loaded")
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	if !strings.Contains(out, "3 requests") || !strings.Contains(out, "least_loaded") {
		t.Errorf("output:\n%s", out)
	}
}

func TestBenchUsageErrors(t *testing.T) {
	t.Parallel()
	good := writeMooncake(t, 3)
	bad := writeMooncake(t, 1, "{}")
	empty := filepath.Join(t.TempDir(), "empty.jsonl")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	azure := filepath.Join(t.TempDir(), "azure.csv")
	if err := os.WriteFile(azure, []byte("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args  []string
		usage bool
		want  string
	}{
		{[]string{"--trace", good, "--workers", "0"}, true, "at least one worker"},
		{[]string{"--trace", good, "--workers", "2", "--speed-factors", "1"}, true, "1 values for 2 workers"},
		{[]string{"--trace", good, "--workers", "2", "--speed-factors", "1,0"}, true, "must be a number > 0"},
		{[]string{"--trace", good, "--workers", "2", "--speed-factors", "1,-2"}, true, "must be a number > 0"},
		{[]string{"--trace", good, "--format", "sharegpt"}, true, "--format"},
		{[]string{"--format", "mooncake"}, true, "--trace is required"},
		{[]string{"--trace", filepath.Join(t.TempDir(), "missing")}, true, "no such file"},
		{[]string{"--trace", good, "--policy", "nope"}, true, "no known policy"},
		{[]string{"--trace", good, "--rate-scale", "-1"}, true, "--rate-scale"},
		{[]string{"--trace", good, "--bogus"}, true, "bogus"},
		{[]string{"--trace", empty}, false, "empty trace"},
		{[]string{"--trace", azure}, true, "azure.csv looks like an azure trace, not mooncake: run with --format azure"},
		{[]string{"--trace", good, "--format", "azure"}, true, "looks like a mooncake trace, not azure: run with --format mooncake"},
		{[]string{"--trace", t.TempDir()}, false, "is a directory"},
		{[]string{"--trace", bad, "--strict"}, false, "line 2: missing timestamp"},
		{[]string{"--format", "agentic", "--session-rate", "-1"}, true, "session rate"},
		{[]string{"--trace", good, "--replicas", "0"}, true, "--replicas 0"},
		{[]string{"--trace", good, "--replicas", "65"}, true, "--replicas 65"},
		{[]string{"--trace", good, "--replicas", "2", "--sync", "etcd"}, true, "--sync"},
		{[]string{"--trace", good, "--replicas", "2", "--sync-delay", "-1ms"}, true, "--sync-delay"},
		{[]string{"--trace", good, "--scrape-interval", "-1s"}, true, "--scrape-interval"},
		{[]string{"--trace", good, "--workers", "2", "--speed-schedule", "10s:2:0.5"}, true, "worker \"2\": want 0 to 1"},
		{[]string{"--trace", good, "--speed-schedule", "10s:1"}, true, "want T:W:S"},
		{[]string{"--trace", good, "--speed-schedule", "10s:1:-1"}, true, "must be a number >= 0"},
		{[]string{"--trace", good, "--speed-schedule", "20s:1:0.5,10s:1:1"}, true, "in order"},
		{[]string{"--trace", good, "--speed-schedule", "soon:1:0.5"}, true, "not a duration"},
	} {
		_, errOut, err := run(t, append([]string{"--policy", "round_robin"}, c.args...)...)
		if err == nil || errors.Is(err, cmdline.ErrUsage) != c.usage || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: err %v (usage %v), want %q\n%s", c.args, err, errors.Is(err, cmdline.ErrUsage), c.want, errOut)
		}
	}
}

// TestBenchRealMooncake replays the first 500 requests of the Mooncake
// conversation trace with every default policy.
func TestBenchRealMooncake(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("replays a real trace")
	}
	src, err := os.Open("../../traces/mooncake/conversation_trace.jsonl")
	if err != nil {
		t.Fatalf("bundled trace (traces/README.md): %v", err)
	}
	defer src.Close()
	path := filepath.Join(t.TempDir(), "head.jsonl")
	dst, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(src)
	sc.Buffer(nil, 1<<20)
	for i := 0; i < 500 && sc.Scan(); i++ {
		fmt.Fprintln(dst, sc.Text())
	}
	if err := dst.Close(); err != nil {
		t.Fatal(err)
	}
	jsonOut := filepath.Join(t.TempDir(), "out.json")
	out, errOut, err := run(t, "--trace", path, "--format", "mooncake", "--json", jsonOut)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	t.Log("\n" + out)
	rep := readReport(t, jsonOut)
	if rep.Requests != 500 || len(rep.Policies) < 6 {
		t.Fatalf("%d requests, %d policies", rep.Requests, len(rep.Policies))
	}
	byName := map[string]policySummary{}
	for _, p := range rep.Policies {
		if p.Failed != 0 || p.HitRate > rep.Bounds.Infinite+1e-9 {
			t.Errorf("%s: %+v", p.Policy, p)
		}
		byName[p.Policy] = p
	}
	// Prefix-aware routing must find more cache than blind spreading.
	if byName["kvbandit"].HitRate <= byName["round_robin"].HitRate {
		t.Errorf("kvbandit hit rate %.3f <= round_robin %.3f", byName["kvbandit"].HitRate, byName["round_robin"].HitRate)
	}
}

// readReport reads the --json report bench wrote to path.
func readReport(t *testing.T, path string) benchReport {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var rep benchReport
	if err := json.Unmarshal(b, &rep); err != nil {
		t.Fatal(err)
	}
	return rep
}

// benchJSON runs bench with args and returns its --json report with the
// wall-clock fields zeroed.
func benchJSON(t *testing.T, args ...string) (benchReport, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "out.json")
	out, errOut, err := run(t, append(args[:len(args):len(args)], "--json", path)...)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	rep := readReport(t, path)
	for i := range rep.Policies {
		rep.Policies[i].WallSec, rep.Policies[i].DecisionsSec = 0, 0
	}
	return rep, out
}

// TestBenchOneReplicaIsToday: --replicas 1 (whatever --sync says) gives
// the run without the flag, figure for figure.
func TestBenchOneReplicaIsToday(t *testing.T) {
	t.Parallel()
	args := []string{"--format", "agentic", "--workers", "4", "--policy", "kv,kvbandit,thompson",
		"--sessions", "16", "--turns", "4", "--session-rate", "4", "--think-time", "2s", "--input-len", "200", "--output-len", "40"}
	today, out := benchJSON(t, args...)
	one, outOne := benchJSON(t, append(args, "--replicas", "1", "--sync", "nats", "--sync-delay", "5ms")...)
	if !reflect.DeepEqual(today, one) {
		t.Fatalf("--replicas 1 differs:\n%+v\n%+v", today, one)
	}
	if strings.Contains(outOne, "replicas") || strings.Contains(outOne, "msgs/decision") || strings.Count(out, "\n") != strings.Count(outOne, "\n") {
		t.Fatalf("one replica's table is not today's:\n%s\n%s", out, outOne)
	}
}

func TestBenchReplicas(t *testing.T) {
	t.Parallel()
	args := []string{"--format", "agentic", "--workers", "4", "--policy", "kvbandit", "--replicas", "4",
		"--sessions", "16", "--turns", "4", "--session-rate", "4", "--think-time", "2s", "--input-len", "200", "--output-len", "40"}
	nats, out := benchJSON(t, append(args, "--sync", "nats", "--scrape-interval", "1s")...)
	for _, want := range []string{"4 replicas, sync nats (delay 2ms)", "load scraped every 1s", "msgs/decision", "affinity"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	p := nats.Policies[0]
	entered := 0
	for _, n := range p.EnteredPerReplica {
		entered += n
	}
	if nats.Replicas != 4 || nats.Sync != "nats" || nats.SyncDelaySec != 0.002 || nats.ScrapeIntervalSec != 1 ||
		len(p.EnteredPerReplica) != 4 || entered != 64 || p.ItemsPerDecision != 4 || p.MessagesPerDecision <= 0 || p.MessagesPerDecision > 4 || p.SyncErrors != 0 {
		t.Fatalf("report %+v, policy %+v", nats, p)
	}
	none, out := benchJSON(t, append(args, "--sync", "none")...)
	if strings.Contains(out, "msgs/decision") || !strings.Contains(out, "4 replicas, sync none\n") || none.Policies[0].ItemsPerDecision != 0 {
		t.Fatalf("sync none:\n%s\n%+v", out, none.Policies[0])
	}
}

// TestBenchSessionIDsAlone: sessions that send only their id (--no-totals)
// stay on their worker under kvbandit, even with prompts too short to
// leave a cached block to follow (before, the prefix store saw no session
// without a total: 51% of turns stayed).
func TestBenchSessionIDsAlone(t *testing.T) {
	t.Parallel()
	jsonOut := filepath.Join(t.TempDir(), "out.json")
	out, errOut, err := run(t, "--format", "agentic", "--no-totals", "--workers", "4", "--policy", "kvbandit",
		"--sessions", "12", "--turns", "6", "--session-rate", "4", "--think-time", "2s", "--input-len", "8", "--output-len", "20",
		"--system-prompt-len", "-1", "--json", jsonOut)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	if !strings.Contains(out, "session ids without totals") {
		t.Errorf("output:\n%s", out)
	}
	rep := readReport(t, jsonOut)
	if len(rep.Policies) != 1 || rep.Policies[0].Affinity < 0.85 {
		t.Fatalf("kvbandit affinity with session ids alone: %+v", rep.Policies)
	}
}
