package app

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing/pd"
)

// TestServeRoles: serve reads endpoint roles and pd.threshold_tokens from
// the config file; /debug/endpoints and /metrics show every endpoint's
// role.
func TestServeRoles(t *testing.T) {
	cfgPath := filepath.Join(t.TempDir(), "c.yaml")
	cfg := "pd:\n  threshold_tokens: 2048\nendpoints:\n- address: 127.0.0.1:8001\n  role: decode\n- address: 127.0.0.1:8002\n  role: prefill\n- address: 127.0.0.1:8003\n"
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	base := serveConfig(t, cfgPath)
	var dbg struct {
		Endpoints []struct {
			Address string `json:"address"`
			Role    string `json:"role"`
		} `json:"endpoints"`
	}
	if err := json.Unmarshal([]byte(get(t, base+"/debug/endpoints")), &dbg); err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, e := range dbg.Endpoints {
		got[e.Address] = e.Role
	}
	if got["127.0.0.1:8001"] != "decode" || got["127.0.0.1:8002"] != "prefill" || got["127.0.0.1:8003"] != "both" {
		t.Fatalf("/debug/endpoints roles: %v", got)
	}
	body := get(t, base+"/metrics")
	for _, want := range []string{`kvbandit_endpoint_role{endpoint="127.0.0.1:8002",role="prefill"} 1`, `kvbandit_endpoint_role{endpoint="127.0.0.1:8003",role="both"} 1`} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %s:\n%s", want, grepLines(body, "kvbandit_endpoint_role", "kvbandit_pd"))
		}
	}
}

func TestPDConfigAndFlag(t *testing.T) {
	if c := DefaultFileConfig(); c.PD.ThresholdTokens != pd.DefaultThresholdTokens {
		t.Fatalf("default threshold %d", c.PD.ThresholdTokens)
	}
	for yaml, field := range map[string]string{
		"pd:\n  threshold_tokens: -1\n":                        "pd.threshold_tokens",
		"endpoints:\n- address: 10.0.0.1:80\n  role: encode\n": "unknown role",
	} {
		if _, err := ParseConfig([]byte(yaml)); err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%q: error %v does not name %s", yaml, err, field)
		}
	}
	c, err := ParseConfig([]byte("pd:\n  threshold_tokens: 4096\n"))
	if err != nil || c.PD.ThresholdTokens != 4096 {
		t.Fatalf("file: %v %+v", err, c.PD)
	}
	o := ServeOptions{PDThresholdTokens: 100, set: map[string]string{"pd-threshold-tokens": "100"}}
	if err := o.applyFlags(c); err != nil || c.PD.ThresholdTokens != 100 {
		t.Fatalf("flag: %v %+v", err, c.PD)
	}
	if c.PD.StripKVTransferParams {
		t.Fatal("pd.strip_kv_transfer_params on by default")
	}
	if c, err := ParseConfig([]byte("pd:\n  strip_kv_transfer_params: true\n")); err != nil || !c.PD.StripKVTransferParams {
		t.Fatalf("file strip_kv_transfer_params: %v %+v", err, c.PD)
	}
	o = ServeOptions{PDStripKVTransfer: true, set: map[string]string{"pd-strip-kv-transfer-params": "true"}}
	if err := o.applyFlags(c); err != nil || !c.PD.StripKVTransferParams {
		t.Fatalf("--pd-strip-kv-transfer-params: %v %+v", err, c.PD)
	}
	o = ServeOptions{PDThresholdTokens: -5, set: map[string]string{"pd-threshold-tokens": "-5"}}
	if err := o.applyFlags(c); err == nil {
		t.Fatal("negative --pd-threshold-tokens accepted")
	}
}
