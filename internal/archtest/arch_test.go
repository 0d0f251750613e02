// Package archtest checks kvbandit's import boundaries (docs/architecture.md):
// routing never imports extproc, tokenizer imports neither, routing,
// extproc and tokenizer import nothing under internal/ (which sits above
// them), the routing vocabulary imports no other routing package but
// routing/slots, the engine imports none of the packages that sit above it,
// and no package named util, common or helpers exists; and that `make help`
// lists every documented Makefile target.
package archtest

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/kvbandit/kvbandit"

type pkg struct {
	ImportPath string
	Imports    []string
	Name       string
}

func TestImportBoundaries(t *testing.T) {
	out, err := exec.Command("go", "list", "-json", module+"/...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	rules := []struct{ from, forbidden string }{
		{module + "/routing", module + "/extproc"},
		{module + "/routing", module + "/internal/app"},
		{module + "/tokenizer", module + "/routing"},
		{module + "/tokenizer", module + "/extproc"},
		{module + "/extproc", module + "/internal/app"},
		// internal/ sits above the product's packages: they never import it.
		{module + "/routing", module + "/internal"},
		{module + "/extproc", module + "/internal"},
		{module + "/tokenizer", module + "/internal"},
		// The engine sits below the packages that feed or drive it.
		{module + "/routing/engine", module + "/routing/policy"},
		{module + "/routing/engine", module + "/routing/sync"},
		{module + "/routing/engine", module + "/routing/discovery"},
		{module + "/routing/engine", module + "/routing/scrape"},
		{module + "/routing/engine", module + "/routing/sim"},
		{module + "/routing/engine", module + "/routing/kvevents"},
	}
	// The vocabulary (the routing package itself, not its sub-packages)
	// imports no other package of the module but routing/slots.
	vocabulary := map[string]bool{module + "/routing/slots": true}
	n := 0
	for dec.More() {
		var p pkg
		if err := dec.Decode(&p); err != nil {
			t.Fatal(err)
		}
		n++
		for _, seg := range strings.Split(p.ImportPath, "/") {
			switch seg {
			case "util", "utils", "common", "helpers":
				t.Errorf("%s: grab-bag package name %q", p.ImportPath, seg)
			}
		}
		if p.ImportPath == module+"/routing" {
			for _, imp := range p.Imports {
				if strings.HasPrefix(imp, module+"/") && !vocabulary[imp] {
					t.Errorf("the routing vocabulary imports %s", imp)
				}
			}
		}
		for _, r := range rules {
			if p.ImportPath != r.from && !strings.HasPrefix(p.ImportPath, r.from+"/") {
				continue
			}
			for _, imp := range p.Imports {
				if imp == r.forbidden || strings.HasPrefix(imp, r.forbidden+"/") {
					t.Errorf("%s imports %s", p.ImportPath, imp)
				}
			}
		}
	}
	if n < 5 {
		t.Fatalf("go list returned only %d packages", n)
	}
}
