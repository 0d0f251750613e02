package app

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/e2e/worker"
)

// TestParseConfigErrors: malformed configs are refused with the file, the
// line and the key path of every problem (unknown keys anywhere in the
// tree, wrong types, bad YAML, duplicate keys, out-of-range values).
func TestParseConfigErrors(t *testing.T) {
	cases := []struct {
		name, yaml string
		want       []string // every line must be in the error
	}{
		{"unknown top-level key", "polcy: kv\n", []string{"config:1: polcy: unknown key"}},
		{"unknown nested key", "router:\n  block_size: 16\n  tier_weights:\n    gpu: 1\n    nvme: 0.1\n", []string{"config:5: router.tier_weights.nvme: unknown key"}},
		{"unknown key in a list element", "endpoints:\n- address: 10.0.0.1:8000\n  modles: [x]\n", []string{"config:3: endpoints[0].modles: unknown key"}},
		{"unknown key under a map value", "models:\n  llama:\n    tokenizr: /x\n", []string{`config:3: models["llama"].tokenizr: unknown key`}},
		{"unknown key in an inlined policy section", "thompson:\n  affinity:\n    bogus: 1\n", []string{"config:3: thompson.affinity.bogus: unknown key"}},
		{"every unknown key", "a: 1\nrouter:\n  b: 2\n", []string{"config:1: a: unknown key", "config:3: router.b: unknown key"}},
		{"wrong scalar type", "router:\n  block_size: sixteen\n", []string{"config:2: router.block_size: want int, got string"}},
		{"scalar for a section", "router: 5\n", []string{"config:1: router: want a mapping, got number"}},
		{"bad YAML", "router:\n  block_size: 16\n bad: [\n", []string{"config:2: "}},
		{"duplicate key", "router:\n  block_size: 16\n  block_size: 32\n", []string{`config:3: key "block_size" already set in map`}},
		{"out of range", "router:\n  queue_policy: lifo\n", []string{`config:2: router.queue_policy: want fcfs or wspt, got "lifo"`}},
		{"empty tokenizer", "models:\n  m:\n    tokenizer: \"\"\n", []string{`config:3: models["m"].tokenizer: must not be empty`}},
		{"not a mapping", "- a\n", []string{"config: cannot unmarshal array"}},
		// Two sources of endpoints: the error is on whichever comes second.
		{"endpoints then discovery", "endpoints:\n- address: 10.0.0.1:8000\ndiscovery:\n  file:\n    path: /x\n", []string{"config:4: discovery.file: give one source of endpoints", "endpoints is already set on line 1"}},
		{"discovery then endpoints", "discovery:\n  file:\n    path: /x\nendpoints:\n- address: 10.0.0.1:8000\n", []string{"config:4: endpoints: give one source of endpoints", "discovery.file is already set on line 2"}},
		{"etcd then file", "discovery:\n  etcd:\n    endpoints: [10.0.0.1:2379]\n  file:\n    path: /x\n", []string{"config:4: discovery.file: give one source", "discovery.etcd is already set on line 2"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(c.yaml))
			if err == nil || !errors.Is(err, ErrConfig) {
				t.Fatalf("err = %v, want an ErrConfig", err)
			}
			for _, w := range c.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "JSON") {
				t.Errorf("error %q speaks of JSON", err)
			}
		})
	}
	// What encoding/json accepts stays accepted: keys in another case,
	// empty files, comments only.
	for _, ok := range []string{"", "# nothing\n", "Router:\n  Block_Size: 32\n"} {
		if _, err := ParseConfig([]byte(ok)); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestConfigCheck: `kvbandit config check FILE` prints the effective
// config (defaults filled, flags applied, secrets redacted) that loads back
// to the same config, and exits non-zero with a located error for a bad
// file, a bad discovery setting or a tokenizer that cannot be loaded.
func TestConfigCheck(t *testing.T) {
	good := writeFile(t, "good.yaml", "router:\n  block_size: 32\nendpoints:\n- address: 10.0.0.1:8000\n  models: [m]\nsync:\n  nats:\n    user: u\n    password: hunter2\n")
	var out, errOut bytes.Buffer
	if err := RunIO(t.Context(), []string{"config", "check", good, "--router-temperature", "0.5"}, nil, &out, &errOut); err != nil {
		t.Fatalf("config check: %v\n%s", err, errOut.String())
	}
	s := out.String()
	for _, want := range []string{"# kvbandit config check: OK", "# discovery: static, 1 endpoints", "block_size: 32", "temperature: 0.5", "password: REDACTED"} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
	if strings.Contains(s, "hunter2") {
		t.Error("the password was printed")
	}
	back, err := ParseConfig(out.Bytes())
	if err != nil {
		t.Fatalf("printed config does not load: %v", err)
	}
	want, _ := LoadConfig(good)
	want.Router.Temperature, want.KV.Temperature = 0.5, 0.5
	back.Sync.NATS.Password = "hunter2"
	if !reflect.DeepEqual(back, want) {
		t.Errorf("printed config loads as\n%+v\nwant\n%+v", back, want)
	}

	bad := []struct {
		name string
		args []string
		code int
		want string
	}{
		{"unknown key", []string{writeFile(t, "c.yaml", "router:\n  tier_weights:\n    nvme: 1\n")}, 1, "c.yaml:3: router.tier_weights.nvme: unknown key"},
		{"missing file", []string{filepath.Join(t.TempDir(), "none.yaml")}, 1, "no such file"},
		{"bad etcd setting", []string{writeFile(t, "e.yaml", "discovery:\n  etcd:\n    endpoints: [\"\"]\n")}, 1, "discovery.etcd"},
		{"two sources", []string{good, "--endpoints", "10.0.0.2:8000"}, 1, "not both"},
		{"tokenizer missing", []string{good, "--tokenizer", filepath.Join(t.TempDir(), "nope")}, 2, "--tokenizer"},
		{"tokenizer garbage", []string{writeFile(t, "m.yaml", "models:\n  m:\n    tokenizer: "+writeFile(t, "tokenizer.json", "{not json")+"\n")}, 1, `models["m"].tokenizer`},
		{"unknown policy", []string{good, "--policy", "nope"}, 2, "--policy"},
		{"no file", nil, 2, "usage: kvbandit config check FILE"},
		{"extra arguments", []string{good, "two"}, 2, `unexpected arguments ["two"]; kvbandit config check FILE`},
		{"sync without credentials", []string{writeFile(t, "s.yaml", "sync:\n  nats:\n    servers: [nats://10.0.0.1:4222]\n")}, 2, "--sync-allow-anonymous"},
		{"--sync-nats without credentials", []string{writeFile(t, "s2.yaml", "router: {block_size: 16}\n"), "--sync-nats", "nats://10.0.0.1:4222"}, 2, "needs NATS credentials"},
	}
	for _, c := range bad {
		t.Run(c.name, func(t *testing.T) {
			var out bytes.Buffer
			err := RunIO(t.Context(), append([]string{"config", "check"}, c.args...), nil, &out, io.Discard)
			if err == nil || ExitCode(err) != c.code || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v (exit %d), want exit %d with %q", err, ExitCode(err), c.code, c.want)
			}
			if strings.Contains(err.Error(), "usage: usage:") {
				t.Errorf("err = %v: usage said twice", err)
			}
			if out.Len() != 0 {
				t.Errorf("printed %q on failure", out.String())
			}
		})
	}
}

// TestServeDryRun: serve --dry-run checks serve's own flags and config
// and exits without binding anything; a missing source of endpoints is an
// error there.
func TestServeDryRun(t *testing.T) {
	var out bytes.Buffer
	// Addresses that cannot be bound prove nothing is bound.
	args := []string{"serve", "--dry-run", "--endpoints", "10.0.0.1:8000", "--grpc-addr", "256.0.0.1:1", "--metrics-addr", "256.0.0.1:2"}
	if err := RunIO(t.Context(), args, nil, &out, io.Discard); err != nil {
		t.Fatalf("dry run: %v", err)
	}
	if !strings.Contains(out.String(), "# kvbandit config check: OK (no config file)") || !strings.Contains(out.String(), "# discovery: static, 1 endpoints") {
		t.Errorf("output:\n%s", out.String())
	}
	err := RunIO(t.Context(), []string{"serve", "--dry-run", "--config", writeFile(t, "c.yaml", "router:\n  block_size: 0\n")}, nil, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "c.yaml:2: router.block_size: must be > 0") {
		t.Errorf("bad config: %v", err)
	}
}

// TestServeBadTokenizerIsStartupError: serve refuses to start when
// --tokenizer cannot be loaded (it used to log and serve on estimates).
func TestServeBadTokenizerIsStartupError(t *testing.T) {
	w := worker.New(worker.Config{})
	if err := w.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	o := ServeOptions{Endpoints: w.Addr(), Policy: "kv", GRPCAddr: "127.0.0.1:0", HealthAddr: "127.0.0.1:0", MaxBodyBytes: 1 << 20, MaxInflight: 8,
		DecisionTimeout: 1e9, ResponseProcessing: true, LogLevel: "info", LogFormat: "text", Tokenizer: filepath.Join(t.TempDir(), "missing")}
	err := Serve(t.Context(), o, slog.New(slog.DiscardHandler), nil)
	if err == nil || !strings.Contains(err.Error(), "--tokenizer") {
		t.Fatalf("Serve = %v, want a --tokenizer start-up error", err)
	}
}
