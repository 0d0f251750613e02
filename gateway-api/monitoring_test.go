package gatewayapi_test

// The chart's Grafana dashboard and Prometheus alerting rules
// (charts/kvbandit/files), checked by Debian's promtool: the rules parse
// (promtool check rules), each alert fires and stays quiet when it should
// (promtool test rules, testdata/rules_test.yaml), every dashboard query
// parses, and every metric either names is one kvbandit defines. The e2e
// suite (e2e/monitoring_test.go) runs the same queries on a real Prometheus
// scraping a live kvbandit. Nothing is skipped: without promtool the test
// fails (tools/debs.sh installs it).

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

const (
	rulesFile     = "charts/kvbandit/files/rules.yaml"
	rulesTestFile = "testdata/rules_test.yaml"
	dashboardFile = "charts/kvbandit/files/dashboard.json"
)

// ruleFile is the part of a Prometheus rule file the tests read.
type ruleFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert string `yaml:"alert"`
			Expr  string `yaml:"expr"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// dashboard is the part of the Grafana dashboard JSON the tests read.
type dashboard struct {
	Panels []struct {
		Type    string `json:"type"`
		Title   string `json:"title"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
}

func promtool(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool (Debian's prometheus package) is needed: run tools/debs.sh: %v", err)
	}
	return bin
}

func TestPrometheusRules(t *testing.T) {
	bin := promtool(t)
	run(t, bin, "check", "rules", rulesFile)
	// promtool resolves the test file's rule_files from its directory.
	cmd := exec.Command(bin, "test", "rules", filepath.Base(rulesTestFile))
	cmd.Dir = filepath.Dir(rulesTestFile)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool test rules %s: %v\n%s", rulesTestFile, err, out)
	}

	var rules ruleFile
	readYAML(t, rulesFile, &rules)
	var tests struct {
		RuleFiles []string `yaml:"rule_files"`
		Tests     []struct {
			AlertRuleTest []struct {
				Alertname string `yaml:"alertname"`
				ExpAlerts []any  `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	readYAML(t, rulesTestFile, &tests)
	if !slices.Equal(tests.RuleFiles, []string{"../" + rulesFile}) {
		t.Errorf("%s tests %v, want [../%s]", rulesTestFile, tests.RuleFiles, rulesFile)
	}
	firing, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				firing[a.Alertname] = true
			} else {
				quiet[a.Alertname] = true
			}
		}
	}
	alerts := alertNames(t, rules)
	for _, want := range []string{"KvbanditNoEndpoints", "KvbanditSyncDegraded", "KvbanditErrorRatio", "KvbanditQueueSaturated", "KvbanditKVEventsUntrusted"} {
		if !slices.Contains(alerts, want) {
			t.Errorf("%s has no alert %s", rulesFile, want)
		}
	}
	for _, a := range alerts {
		if !firing[a] || !quiet[a] {
			t.Errorf("alert %s: %s tests it firing %v, not firing %v; want both", a, rulesTestFile, firing[a], quiet[a])
		}
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if _, ok := splitThreshold(r.Expr); !ok {
				t.Errorf("alert %s: expr %q is not \"<query> <comparison> <number>\" (the e2e suite queries the left side)", r.Alert, r.Expr)
			}
		}
	}
	checkMetricNames(t, rulesFile, readFile(t, rulesFile))
}

func TestDashboardQueries(t *testing.T) {
	bin := promtool(t)
	var d dashboard
	raw := readFile(t, dashboardFile)
	if err := json.Unmarshal([]byte(raw), &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	var titles []string
	var rec strings.Builder
	rec.WriteString("groups:\n- name: dashboard\n  rules:\n")
	n := 0
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		titles = append(titles, p.Title)
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			n++
			// A recording rule per query: promtool check rules parses it.
			q, _ := json.Marshal(dashboardQuery(tg.Expr, "1m"))
			fmt.Fprintf(&rec, "  - record: dashboard_query_%d\n    expr: %s\n", n, q)
		}
	}
	for _, want := range []string{"Request rate", "Errors", "Decision latency p50 / p99", "Queue depth", "Cache hit ratio",
		"In-flight per endpoint", "Speed factor per endpoint", "Sync degraded and peers", "P/D decisions"} {
		if !slices.Contains(titles, want) {
			t.Errorf("%s has no panel %q (panels %q)", dashboardFile, want, titles)
		}
	}
	f := filepath.Join(t.TempDir(), "dashboard-queries.yaml")
	if err := os.WriteFile(f, []byte(rec.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	run(t, bin, "check", "rules", f)
	checkMetricNames(t, dashboardFile, raw)
}

// dashboardQuery is a dashboard query with its Grafana variables
// replaced: every instance, rate windows of window.
func dashboardQuery(expr, window string) string {
	return strings.NewReplacer(`"$instance"`, `".*"`, "$__rate_interval", window).Replace(expr)
}

// alertNames lists the alert names of a rule file.
func alertNames(t *testing.T, rules ruleFile) []string {
	t.Helper()
	var names []string
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			names = append(names, r.Alert)
		}
	}
	return names
}

var thresholdRE = regexp.MustCompile(`(?s)^(.*\S)\s*(==|!=|>=|<=|>|<)\s*[0-9][0-9.e+-]*\s*$`)

// splitThreshold is an alert expression without its trailing comparison.
func splitThreshold(expr string) (string, bool) {
	m := thresholdRE.FindStringSubmatch(expr)
	if m == nil {
		return "", false
	}
	return m[1], true
}

var metricRE = regexp.MustCompile(`\bkvbandit_[a-z0-9_]+`)

// checkMetricNames fails for a kvbandit_ metric named in text that no Go
// file of kvbandit (internal, extproc, routing) defines.
func checkMetricNames(t *testing.T, src, text string) {
	t.Helper()
	var code strings.Builder
	for _, dir := range []string{"../internal", "../extproc", "../routing"} {
		err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return err
			}
			b, err := os.ReadFile(p)
			code.Write(b)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, m := range slices.Compact(slices.Sorted(slices.Values(metricRE.FindAllString(text, -1)))) {
		name := m
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if n, ok := strings.CutSuffix(m, suffix); ok && strings.Contains(code.String(), `"`+n+`"`) {
				name = n
			}
		}
		if !strings.Contains(code.String(), `"`+name+`"`) {
			t.Errorf("%s names %s, which kvbandit does not define", src, m)
		}
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	if err := yaml.Unmarshal([]byte(readFile(t, path)), v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
