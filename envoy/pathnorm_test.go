package envoy_test

import (
	"path/filepath"
	"testing"

	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"

	"github.com/kvbandit/kvbandit/envoy"
)

// TestConfigsNormalisePaths: every HTTP connection manager in the shipped
// configs and in what envoy.Render produces (`kvbandit envoy-config`)
// normalises the path before ext_proc and routing see it, merges slashes,
// and refuses encoded slashes, so kvbandit and the worker classify and serve
// the same path.
func TestConfigsNormalisePaths(t *testing.T) {
	configs := map[string][]byte{}
	files, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		configs[f] = readFile(t, f)
	}
	for _, mode := range []envoy.BodyMode{envoy.FullDuplex, envoy.Buffered} {
		out, err := envoy.Render(envoy.ExampleOptions(mode))
		if err != nil {
			t.Fatal(err)
		}
		configs["Render("+mode.String()+")"] = out
	}
	for name, y := range configs {
		hcms := 0
		for _, l := range decode(t, y).GetStaticResources().GetListeners() {
			for _, fc := range l.GetFilterChains() {
				for _, f := range fc.GetFilters() {
					var hcm hcmv3.HttpConnectionManager
					if f.GetTypedConfig().UnmarshalTo(&hcm) != nil {
						continue
					}
					hcms++
					if !hcm.GetNormalizePath().GetValue() || !hcm.GetMergeSlashes() ||
						hcm.GetPathWithEscapedSlashesAction() != hcmv3.HttpConnectionManager_REJECT_REQUEST {
						t.Errorf("%s: listener %s: normalize_path %v, merge_slashes %v, path_with_escaped_slashes_action %v; want true, true, REJECT_REQUEST",
							name, l.GetName(), hcm.GetNormalizePath().GetValue(), hcm.GetMergeSlashes(), hcm.GetPathWithEscapedSlashesAction())
					}
				}
			}
		}
		if hcms == 0 {
			t.Errorf("%s: no HTTP connection manager", name)
		}
	}
}
