// Package archtest checks kvbandit's import boundaries: routing never
// imports extproc, tokenizer imports neither, and no package named util,
// common or helpers exists.
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
	}
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
