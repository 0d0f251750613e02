package benchcmd

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// repoRoot is the repository root, seen from this package.
const repoRoot = "../.."

// docFiles are the Markdown files whose commands a reader copies.
func docFiles(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(repoRoot, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	return append(files, filepath.Join(repoRoot, "README.md"), filepath.Join(repoRoot, "traces", "README.md"))
}

// tracePathRE finds the file of a `--trace FILE` and any path under the
// repository's traces/ directory that a document names.
var tracePathRE = regexp.MustCompile(`--trace[ =]([^\s` + "`" + `'"]+)|(?:^|[\s` + "`" + `(])(\.?/?traces/[\w./-]*\w)`)

// TestDocumentedTracesInRepo: every trace file a document tells the reader
// to replay exists in a clone of the repository (a path relative to its
// root, not one outside it such as ../shared/traces).
func TestDocumentedTracesInRepo(t *testing.T) {
	t.Parallel()
	seen := 0
	for _, doc := range docFiles(t) {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			for _, m := range tracePathRE.FindAllStringSubmatch(line, -1) {
				p := m[1] + m[2]
				switch {
				case p == "FILE", p == "…", strings.HasPrefix(p, "-"):
					continue // a placeholder, or the flag's own description
				case filepath.IsAbs(p) || strings.HasPrefix(filepath.Clean(p), ".."):
					t.Errorf("%s:%d: %s is outside the repository; use the bundled traces/ (traces/README.md)", doc, i+1, p)
					continue
				}
				seen++
				if _, err := os.Stat(filepath.Join(repoRoot, p)); err != nil {
					t.Errorf("%s:%d: %s: %v", doc, i+1, p, err)
				}
			}
		}
	}
	if seen == 0 {
		t.Fatal("no trace path found in the docs: the pattern is broken")
	}
}

// TestBundledTraces: the bundled traces are the files their sources
// published (traces/SHA256SUMS), each with its licence and attribution.
func TestBundledTraces(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(repoRoot, "traces")
	f, err := os.Open(filepath.Join(dir, "SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	readme, err := os.ReadFile(filepath.Join(dir, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		sum, name, ok := strings.Cut(sc.Text(), "  ")
		if !ok {
			t.Fatalf("SHA256SUMS: bad line %q", sc.Text())
		}
		listed[name] = true
		if got := fileSHA256(t, filepath.Join(dir, name)); got != sum {
			t.Errorf("%s: sha256 %s, SHA256SUMS says %s", name, got, sum)
		}
		if !strings.Contains(string(readme), "`"+name+"`") {
			t.Errorf("%s: not in traces/README.md (its source and licence)", name)
		}
		if _, err := os.Stat(filepath.Join(dir, filepath.Dir(name), licenceFile[filepath.Dir(name)])); err != nil {
			t.Errorf("%s: licence file: %v", name, err)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	traces, err := filepath.Glob(filepath.Join(dir, "*", "*"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range traces {
		rel, _ := filepath.Rel(dir, p)
		if ext := filepath.Ext(rel); (ext == ".jsonl" || ext == ".csv") && !listed[rel] {
			t.Errorf("%s: bundled but not in SHA256SUMS", rel)
		}
	}
	if len(listed) == 0 {
		t.Fatal("SHA256SUMS lists no trace")
	}
}

// licenceFile is each source's licence, copied next to its traces.
var licenceFile = map[string]string{
	"mooncake":       "LICENSE-APACHE",
	"azure-llm-2023": "LICENSE",
}

func fileSHA256(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// TestBenchFlagsDocumented: every flag of kvbandit bench is in the flag
// table (or the agentic knobs) of docs/bench.md.
func TestBenchFlagsDocumented(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(filepath.Join(repoRoot, "docs", "bench.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	start, end := strings.Index(doc, "\n## Flags\n"), strings.Index(doc, "\n## Reading a trace\n")
	if start < 0 || end < start {
		t.Fatal(`docs/bench.md: no "## Flags" section before "## Reading a trace"`)
	}
	section := doc[start:end]
	var o benchOptions
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	o.addFlags(fs)
	fs.VisitAll(func(f *flag.Flag) {
		if !regexp.MustCompile("`--" + regexp.QuoteMeta(f.Name) + "[ `=]").MatchString(section) {
			t.Errorf("--%s is not in docs/bench.md's flag table", f.Name)
		}
	})
}
