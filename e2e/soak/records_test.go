package main

import (
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/kvbandit/kvbandit/routing/discovery"
)

// Churned endpoints files parse, keep at least 3 workers, and every bad
// record in them is skipped by discovery: an accepted one would be an
// endpoint that nobody serves on.
func TestChurnedFilesParse(t *testing.T) {
	f, err := newFleet(4, 1, 1, filepath.Join(t.TempDir(), "endpoints.json"))
	if err != nil {
		t.Fatal(err)
	}
	workers := map[string]bool{}
	for _, a := range f.httpAddrs() {
		workers[a] = true
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		present, err := f.churn(rng)
		if err != nil {
			t.Fatal(err)
		}
		data, err := os.ReadFile(f.file)
		if err != nil {
			t.Fatal(err)
		}
		set, err := discovery.ParseEndpointsFile(data, nil)
		if err != nil {
			t.Fatalf("%v\n%s", err, data)
		}
		if len(set.Endpoints) != present || present < 3 {
			t.Fatalf("%d endpoints parsed, %d present (want >= 3)", len(set.Endpoints), present)
		}
		for _, ep := range set.Endpoints {
			if !workers[string(ep.Key)] {
				b, _ := json.Marshal(ep)
				t.Fatalf("a bad record was accepted: %s", b)
			}
		}
	}
}
