package app

import (
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

func TestConfigTierWeights(t *testing.T) {
	c, err := ParseConfig(nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.Router.TierWeights != routing.DefaultTierWeights() {
		t.Fatalf("default tier weights %+v", c.Router.TierWeights)
	}
	c, err = ParseConfig([]byte("router:\n  tier_weights:\n    cpu: 0.5\n"))
	if err != nil {
		t.Fatal(err)
	}
	if w := c.Router.TierWeights; w != (routing.TierWeights{GPU: 1, CPU: 0.5, Disk: 0.25}) {
		t.Fatalf("partial override: %+v", w)
	}
	if o := c.engineOptions(0); o.TierWeights != c.Router.TierWeights {
		t.Fatalf("engine options carry %+v", o.TierWeights)
	}
	for _, bad := range []string{
		"router:\n  tier_weights:\n    cpu: 1.5\n",
		"router:\n  tier_weights:\n    disk: 0.9\n",
		"router:\n  tier_weights:\n    gpu: 0\n    cpu: 0\n    disk: 0\n",
	} {
		if _, err := ParseConfig([]byte(bad)); err == nil || !strings.Contains(err.Error(), "tier_weights") {
			t.Errorf("%q: error %v does not name tier_weights", bad, err)
		}
	}
	if _, err := ParseConfig([]byte("router:\n  tier_weights:\n    nvme: 0.1\n")); err == nil || !strings.Contains(err.Error(), "nvme") {
		t.Errorf("unknown tier accepted: %v", err)
	}
}
