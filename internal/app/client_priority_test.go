package app

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/extproc/hints"
)

// router.client_priority (allow|cap|ignore, default cap) and
// router.client_priority_max ([0, 1000], default 1000) are validated with
// the key named (config check reports the line), and --client-priority /
// --client-priority-max override them (issue 23, item 19).
func TestClientPriorityConfig(t *testing.T) {
	d := DefaultFileConfig()
	if got := d.Router.PriorityPolicy(); got != (hints.PriorityPolicy{Mode: hints.ClientPriorityCap, Max: hints.MaxPriority, HasMax: true}) {
		t.Fatalf("default %+v", got)
	}
	for yaml, want := range map[string]hints.PriorityPolicy{
		"router:\n  client_priority: ignore\n":                        {Mode: hints.ClientPriorityIgnore, Max: hints.MaxPriority, HasMax: true},
		"router:\n  client_priority: allow\n":                         {Mode: hints.ClientPriorityAllow, Max: hints.MaxPriority, HasMax: true},
		"router:\n  client_priority: cap\n  client_priority_max: 0\n": {Mode: hints.ClientPriorityCap, Max: 0, HasMax: true},
		"router:\n  client_priority_max: 20\n":                        {Mode: hints.ClientPriorityCap, Max: 20, HasMax: true},
	} {
		c, err := ParseConfig([]byte(yaml))
		if err != nil || c.Router.PriorityPolicy() != want {
			t.Errorf("%q: %+v %v, want %+v", yaml, c.Router.PriorityPolicy(), err, want)
		}
	}
	for yaml, key := range map[string]string{
		"router:\n  client_priority: deny\n":     "router.client_priority",
		"router:\n  client_priority: \"\"\n":     "router.client_priority",
		"router:\n  client_priority: 1\n":        "router.client_priority",
		"router:\n  client_priority_max: -1\n":   "router.client_priority_max",
		"router:\n  client_priority_max: 1001\n": "router.client_priority_max",
		"router:\n  client_priority_max: x\n":    "router.client_priority_max",
	} {
		_, err := ParseConfig([]byte(yaml))
		if err == nil || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), "config:2") {
			t.Errorf("%q: error %v does not name %s on line 2", yaml, err, key)
		}
	}
	c := DefaultFileConfig()
	o := ServeOptions{set: map[string]string{"client-priority": "ignore", "client-priority-max": "5"}}
	if err := o.applyFlags(&c); err != nil || c.Router.PriorityPolicy() != (hints.PriorityPolicy{Mode: hints.ClientPriorityIgnore, Max: 5, HasMax: true}) {
		t.Fatalf("flags: %v %+v", err, c.Router.PriorityPolicy())
	}
	for _, set := range []map[string]string{{"client-priority": "off"}, {"client-priority-max": "2000"}} {
		c := DefaultFileConfig()
		o := ServeOptions{set: set}
		if err := o.applyFlags(&c); err == nil {
			t.Errorf("%v accepted", set)
		}
	}
}

// TestConfigCheckClientPriority: config check reports a bad
// router.client_priority on its line and prints the effective policy.
func TestConfigCheckClientPriority(t *testing.T) {
	bad := writeFile(t, "p.yaml", "router:\n  client_priority: deny\n")
	err := RunIO(t.Context(), []string{"config", "check", bad}, nil, io.Discard, io.Discard)
	if err == nil || ExitCode(err) != 1 || !strings.Contains(err.Error(), "p.yaml:2: router.client_priority: want allow, cap or ignore") {
		t.Fatalf("err = %v (exit %d)", err, ExitCode(err))
	}
	good := writeFile(t, "g.yaml", "endpoints:\n- address: 10.0.0.1:8000\n")
	var out bytes.Buffer
	if err := RunIO(t.Context(), []string{"config", "check", good, "--client-priority", "ignore", "--client-priority-max", "0"}, nil, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"client_priority: ignore", "client_priority_max: 0"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	err = RunIO(t.Context(), []string{"config", "check", good, "--client-priority-max", "1001"}, nil, io.Discard, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "router.client_priority_max") {
		t.Fatalf("--client-priority-max 1001: %v", err)
	}
}
