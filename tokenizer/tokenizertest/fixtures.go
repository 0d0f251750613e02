// Package tokenizertest locates the tokenizer test fixtures (vendor
// vocabularies, chat templates and Hugging Face's node oracle), which are
// downloaded by `make fixtures` and never committed. It is for tests only.
package tokenizertest

import (
	"os"
	"path/filepath"
	"testing"
)

// Dir is the fixtures directory: $KVBANDIT_FIXTURES, or
// ~/.cache/kvbandit/fixtures.
func Dir(t testing.TB) string {
	t.Helper()
	if d := os.Getenv("KVBANDIT_FIXTURES"); d != "" {
		return d
	}
	home, err := os.UserHomeDir()
	if err != nil {
		t.Fatalf("no home directory (%v): set KVBANDIT_FIXTURES or run make fixtures", err)
	}
	return filepath.Join(home, ".cache", "kvbandit", "fixtures")
}

// Require returns Dir and fails the test (it never skips) when any of the
// files, relative to it, is missing.
func Require(t testing.TB, files ...string) string {
	t.Helper()
	dir := Dir(t)
	for _, f := range files {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Fatalf("fixture %s missing in %s: run make fixtures (tokenizer/testdata/fixtures.sh and tokenizer/chat/testdata/fixtures.sh)", f, dir)
		}
	}
	return dir
}
