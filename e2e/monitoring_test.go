package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/kvbandit/kvbandit/internal/simworker"
	"github.com/kvbandit/kvbandit/internal/testenv"
	simmodel "github.com/kvbandit/kvbandit/routing/sim"
)

// The chart's dashboard and alert rules on a real Prometheus (issue 23):
// Debian's prometheus scrapes a live kvbandit (an active-active replica on
// nats-server, the admission queue on, two simulated vLLM workers with KV
// events) every second and evaluates the rules; after some traffic and two
// scrapes, every dashboard query and every alert expression without its
// threshold returns data through Prometheus's HTTP API, and every rule
// evaluates without error.

const (
	monitoringDir = "../gateway-api/charts/kvbandit/files"
	promScrape    = time.Second
)

func TestMonitoringOnPrometheus(t *testing.T) {
	prom, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatalf("prometheus (Debian's prometheus package) is needed: run tools/debs.sh: %v", err)
	}
	rulesPath, err := filepath.Abs(filepath.Join(monitoringDir, "rules.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	k, proxyURL := startMonitoredKvbandit(t)
	promURL := startPrometheus(t, prom, k.metricsAddr, rulesPath)

	sendMonitoringTraffic(t, proxyURL)
	trafficEnd := time.Now()
	waitScrapes(t, promURL, trafficEnd, 2)

	for _, q := range dashboardQueries(t) {
		if n := promQuery(t, promURL, q); n == 0 {
			t.Errorf("dashboard query returns no data: %s", q)
		}
	}
	alerts := ruleQueries(t, rulesPath)
	for name, q := range alerts {
		if n := promQuery(t, promURL, q); n == 0 {
			t.Errorf("alert %s: %s returns no data", name, q)
		}
	}
	checkRulesHealthy(t, promURL, len(alerts))
}

// startMonitoredKvbandit runs kvbandit (policy kvbandit, the proxy front
// end, the admission queue, sync over NATS) in front of two simulated
// workers that publish KV events; it returns the proxy's base URL.
func startMonitoredKvbandit(t *testing.T) (*kvb, string) {
	t.Helper()
	nats := startSyncNATS(t)
	var recs []map[string]any
	for range 2 {
		sw, err := simworker.New(simworker.Config{Addr: freeAddr(t), KVEventsAddr: "tcp://127.0.0.1:0", SpeedUp: 50,
			Worker: simmodel.WorkerConfig{BlockSize: 16, KVBlocks: 4096}})
		if err != nil {
			t.Fatal(err)
		}
		if err := sw.Start(t.Context()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sw.Close() })
		recs = append(recs, map[string]any{"address": sw.Addr(), "engine": "vllm", "models": []string{simworker.DefaultModel},
			"block_size": 16, "kv_events": sw.KVEventsAddr()})
	}
	cfg := map[string]any{"endpoints": recs,
		// A threshold no test request reaches: the queue exists, nothing waits.
		"router": map[string]any{"queue_threshold": 100},
		"sync":   map[string]any{"nats": map[string]any{"user": syncNATSUser, "password": syncNATSPassword}}}
	b, err := json.Marshal(cfg) // JSON is YAML
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "kvbandit.yaml")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	httpAddr := freeAddr(t)
	k := startKvbandit(t, nil, "--policy", "kvbandit", "--config", path, "--sync-nats", nats.URL(), "--replica-id", "replica-0",
		"--http-addr", httpAddr, "--scrape-interval", "200ms")
	return k, "http://" + httpAddr
}

// startPrometheus runs prometheus on 127.0.0.1, scraping target every
// second and evaluating the rules file; it is stopped by its PID at the
// end of the test.
func startPrometheus(t *testing.T, bin, target, rules string) string {
	t.Helper()
	dir := t.TempDir()
	conf := fmt.Sprintf("global:\n  scrape_interval: %s\n  evaluation_interval: %s\nrule_files:\n- %q\nscrape_configs:\n- job_name: kvbandit\n  static_configs:\n  - targets: [%q]\n",
		promScrape, promScrape, rules, target)
	confPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(confPath, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	log := &testenv.Log{}
	p, err := testenv.Start(bin, []string{"--config.file=" + confPath, "--storage.tsdb.path=" + filepath.Join(dir, "data"),
		"--web.listen-address=" + addr, "--log.level=warn"}, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("prometheus output:\n%s", log)
		}
	})
	base := "http://" + addr
	err = p.WaitReady(30*time.Second, 100*time.Millisecond, func() (bool, error) {
		resp, err := http.Get(base + "/-/ready")
		if err != nil {
			return false, nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, nil
	})
	if err != nil {
		t.Fatalf("prometheus not ready: %v\n%s", err, log)
	}
	return base
}

// sendMonitoringTraffic sends chat requests that share a prefix, requests
// of two sessions, and one bad request, through the proxy.
func sendMonitoringTraffic(t *testing.T, base string) {
	t.Helper()
	c := httpClient(t)
	prefix := strings.Repeat("You are a careful assistant who answers in one line. ", 8)
	for i := range 12 {
		body := fmt.Sprintf(`{"model":%q,"max_tokens":8,"messages":[{"role":"user","content":%q}]}`,
			simworker.DefaultModel, prefix+"question "+strconv.Itoa(i))
		hdr := map[string]string{"x-prefix-id": "session-" + strconv.Itoa(i%2)}
		if r := send(t, c, http.MethodPost, base+"/v1/chat/completions", []byte(body), hdr); r.status != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
	}
	if r := send(t, c, http.MethodPost, base+"/v1/chat/completions", []byte(`{"model":`), nil); r.status != http.StatusBadRequest {
		t.Fatalf("bad request: %d %s, want 400", r.status, r.body)
	}
}

// waitScrapes waits until Prometheus has scraped kvbandit n times since
// after.
func waitScrapes(t *testing.T, base string, after time.Time, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	err := poll(ctx, func() (bool, string) {
		secs := int(time.Since(after).Seconds())
		if secs < 1 {
			return false, "waiting"
		}
		v, err := promScalar(base, fmt.Sprintf(`count_over_time(up{job="kvbandit"}[%ds]) and on() min_over_time(up{job="kvbandit"}[%ds]) == 1`, secs, secs))
		return err == nil && v >= float64(n), fmt.Sprintf("%v scrapes in the last %d s (%v)", v, secs, err)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// dashboardQueries are the chart dashboard's queries, its variables
// replaced (every instance, 30 s rate windows).
func dashboardQueries(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(monitoringDir, "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Templating struct {
			List []struct {
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	r := strings.NewReplacer(`"$instance"`, `".*"`, "$__rate_interval", "30s")
	var qs []string
	// A variable's label_values(series, label): the series must exist.
	for _, v := range d.Templating.List {
		if m := labelValuesRE.FindStringSubmatch(v.Definition); m != nil {
			qs = append(qs, m[1])
		}
	}
	for _, p := range d.Panels {
		for _, tg := range p.Targets {
			qs = append(qs, r.Replace(tg.Expr))
		}
	}
	if len(qs) < 20 {
		t.Fatalf("the dashboard has %d queries", len(qs))
	}
	return qs
}

var labelValuesRE = regexp.MustCompile(`^label_values\((.+),\s*\w+\)$`)

var thresholdRE = regexp.MustCompile(`(?s)^(.*\S)\s*(==|!=|>=|<=|>|<)\s*[0-9][0-9.e+-]*\s*$`)

// ruleQueries maps each alert of the rules file to its expression
// without the trailing threshold.
func ruleQueries(t *testing.T, path string) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	if err := yaml.Unmarshal(raw, &f); err != nil {
		t.Fatal(err)
	}
	qs := map[string]string{}
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			m := thresholdRE.FindStringSubmatch(r.Expr)
			if m == nil {
				t.Fatalf("alert %s: expr %q does not end in a threshold", r.Alert, r.Expr)
			}
			qs[r.Alert] = m[1]
		}
	}
	if len(qs) < 5 {
		t.Fatalf("%s has %d alerts", path, len(qs))
	}
	return qs
}

// promResult is the part of an /api/v1/query answer the suite reads.
type promResult struct {
	Status string `json:"status"`
	Error  string `json:"error"`
	Data   struct {
		ResultType string `json:"resultType"`
		Result     []struct {
			Metric map[string]string `json:"metric"`
			Value  [2]any            `json:"value"`
		} `json:"result"`
	} `json:"data"`
}

func promGet(base, query string) (promResult, error) {
	var r promResult
	resp, err := http.Get(base + "/api/v1/query?query=" + url.QueryEscape(query))
	if err != nil {
		return r, err
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return r, err
	}
	if r.Status != "success" {
		return r, fmt.Errorf("%s: %s", query, r.Error)
	}
	return r, nil
}

// promQuery is the number of series an instant query returns.
func promQuery(t *testing.T, base, query string) int {
	t.Helper()
	r, err := promGet(base, query)
	if err != nil {
		t.Errorf("query %s: %v", query, err)
		return 0
	}
	return len(r.Data.Result)
}

// promScalar is the value of a query's first series (0 without one).
func promScalar(base, query string) (float64, error) {
	r, err := promGet(base, query)
	if err != nil || len(r.Data.Result) == 0 {
		return 0, err
	}
	s, _ := r.Data.Result[0].Value[1].(string)
	return strconv.ParseFloat(s, 64)
}

// checkRulesHealthy waits until Prometheus has evaluated every rule and
// checks none failed.
func checkRulesHealthy(t *testing.T, base string, want int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 15*time.Second)
	defer cancel()
	err := poll(ctx, func() (bool, string) {
		resp, err := http.Get(base + "/api/v1/rules")
		if err != nil {
			return false, err.Error()
		}
		defer resp.Body.Close()
		var r struct {
			Data struct {
				Groups []struct {
					Rules []struct {
						Name           string `json:"name"`
						Health         string `json:"health"`
						LastError      string `json:"lastError"`
						LastEvaluation string `json:"lastEvaluation"`
					} `json:"rules"`
				} `json:"groups"`
			} `json:"data"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
			return false, err.Error()
		}
		n := 0
		for _, g := range r.Data.Groups {
			for _, rule := range g.Rules {
				if rule.Health != "ok" {
					return false, fmt.Sprintf("rule %s: health %q %s", rule.Name, rule.Health, rule.LastError)
				}
				n++
			}
		}
		return n == want, fmt.Sprintf("%d of %d rules evaluated", n, want)
	})
	if err != nil {
		t.Error(err)
	}
}
