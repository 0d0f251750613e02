package policy

import (
	"errors"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

func TestRegistry(t *testing.T) {
	r := Builtin()
	for _, n := range []string{"round_robin", "least_loaded", "random", "weighted", "kvbandit", "kvbandit_blocks"} {
		p, err := r.New(n, Deps{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Name() != n {
			t.Fatalf("policy %q reports name %q", n, p.Name())
		}
	}
	// kvbandit_blocks is the block cost whatever the config says.
	cfg := DefaultConfig()
	d := Deps{Config: &cfg}
	if p, err := r.New("kvbandit_blocks", d); err != nil || p.Name() != "kvbandit_blocks" {
		t.Fatalf("kvbandit_blocks: %v %v", p, err)
	}
	if err := r.Register("random", func(Deps) (routing.Policy, error) { return nil, nil }); err == nil {
		t.Fatal("duplicate registration accepted")
	}
	if _, err := r.New("nope", Deps{}); !errors.Is(err, ErrUnknownPolicy) {
		t.Fatalf("err = %v", err)
	}
}

// TestConfigCoversWeighted: the weighted policy's parameters are defaulted
// and validated with the others.
func TestConfigCoversWeighted(t *testing.T) {
	c := DefaultConfig()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if w := c.Weighted; w.PrefixWeight != 3 || w.QueueWeight != 2 || w.KVCacheWeight != 2 {
		t.Fatalf("weighted defaults = %+v", w)
	}
	c.Weighted.QueueWeight = -1
	if err := c.Validate(); err == nil {
		t.Fatal("negative weighted.queue_weight accepted")
	}
	if _, err := Builtin().New("weighted", Deps{Config: &c}); err == nil {
		t.Fatal("weighted built with an invalid config")
	}
}
