package policy

import (
	"errors"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
)

func TestRegistry(t *testing.T) {
	r := Builtin()
	for _, n := range []string{"round_robin", "least_loaded", "random"} {
		p, err := r.New(n, Deps{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Name() != n {
			t.Fatalf("policy %q reports name %q", n, p.Name())
		}
	}
	if err := r.Register("random", func(Deps) (routing.Policy, error) { return nil, nil }); err == nil {
		t.Fatal("duplicate registration accepted")
	}
	if _, err := r.New("nope", Deps{}); !errors.Is(err, ErrUnknownPolicy) {
		t.Fatalf("err = %v", err)
	}
}
