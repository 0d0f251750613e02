package app

import (
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing/policy/weighted"
)

// TestWeightedScorerWeights: the weighted policy's scorer weights come
// from the config file (weighted.prefix_weight, queue_weight,
// kv_cache_weight), and out-of-range values are refused with their key.
func TestWeightedScorerWeights(t *testing.T) {
	cfg, err := ParseConfig([]byte("weighted:\n  prefix_weight: 5\n  queue_weight: 0\n  kv_cache_weight: 1.5\n"))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := cfg.Config.Weighted, (weighted.Config{PrefixWeight: 5, QueueWeight: 0, KVCacheWeight: 1.5}); got != want {
		t.Errorf("weighted = %+v, want %+v", got, want)
	}
	if cfg, err := ParseConfig([]byte("weighted:\n  queue_weight: 4\n")); err != nil || cfg.Config.Weighted.PrefixWeight != 3 || cfg.Config.Weighted.QueueWeight != 4 {
		t.Errorf("one weight given: %+v, %v; want the others at their defaults (3, 2)", cfg.Config.Weighted, err)
	}
	for _, c := range []struct{ yaml, want string }{
		{"weighted:\n  queue_weight: -1\n", "queue_weight"},
		{"weighted:\n  prefix_weight: 0\n  queue_weight: 0\n  kv_cache_weight: 0\n", "weighted"},
		{"weighted:\n  scorer: 1\n", "weighted.scorer: unknown key"},
	} {
		if _, err := ParseConfig([]byte(c.yaml)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: err = %v, want one naming %q", c.yaml, err, c.want)
		}
	}
}
