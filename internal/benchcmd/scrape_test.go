package benchcmd

import (
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestScrapeFlag(t *testing.T) {
	var f scrapeFlag
	if got := f.interval("weighted"); got != gieScrapeInterval {
		t.Errorf("weighted, unset: %v, want %v", got, gieScrapeInterval)
	}
	if got := f.interval("kvbandit"); got != serveScrapeInterval {
		t.Errorf("kvbandit, unset: %v, want %v", got, serveScrapeInterval)
	}
	if f.String() != "" {
		t.Errorf("unset prints %q", f.String())
	}
	if err := f.Set("0"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"weighted", "kvbandit", "round_robin"} {
		if got := f.interval(p); got != 0 {
			t.Errorf("%s with --scrape-interval 0: %v", p, got)
		}
	}
	if err := f.Set("soon"); err == nil {
		t.Error("a non-duration is accepted")
	}
}

// TestBenchScrapeAsDeployed: without the flag the report says each policy
// is scraped as deployed, and weighted (read from scraped queues only)
// routes differently from a run with load after every change.
func TestBenchScrapeAsDeployed(t *testing.T) {
	t.Parallel()
	path := writeMooncake(t, 60, "")
	dir := t.TempDir()
	args := []string{"--trace", path, "--format", "mooncake", "--workers", "3", "--policy", "weighted", "--rate-scale", "4", "--kv-blocks", "256"}
	out, errOut, err := run(t, append(args, "--json", filepath.Join(dir, "deployed.json"))...)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	if !strings.Contains(out, "load scraped as deployed: weighted every "+gieScrapeInterval.String()) {
		t.Errorf("output lacks the scrape line:\n%s", out)
	}
	out0, errOut, err := run(t, append(args, "--scrape-interval", "0", "--json", filepath.Join(dir, "instant.json"))...)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	if strings.Contains(out0, "load scraped") {
		t.Errorf("--scrape-interval 0 reports a scrape:\n%s", out0)
	}
	deployed, instant := readReport(t, filepath.Join(dir, "deployed.json")), readReport(t, filepath.Join(dir, "instant.json"))
	if !deployed.ScrapeAsDeployed || instant.ScrapeAsDeployed {
		t.Errorf("scrape_as_deployed: %v without the flag, %v with it", deployed.ScrapeAsDeployed, instant.ScrapeAsDeployed)
	}
	if reflect.DeepEqual(deployed.Policies[0].RequestsPerWorker, instant.Policies[0].RequestsPerWorker) &&
		deployed.Policies[0].TTFTP90 == instant.Policies[0].TTFTP90 {
		t.Errorf("weighted routes the same with load every %v as after every change: %+v", gieScrapeInterval, deployed.Policies[0])
	}
}
