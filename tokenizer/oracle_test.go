package tokenizer

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/kvbandit/kvbandit/tokenizer/tokenizertest"
)

// The oracle tests compare Encode with Hugging Face tokenizers@0.23.2 (run
// under node by testdata/oracle.js) on testdata/corpus.json plus long texts
// generated from it. Fixtures are fetched by testdata/fixtures.sh.

var oracleModels = []string{"qwen3", "llama3_1", "llama2"}

func fixturesDir(t testing.TB) string {
	t.Helper()
	files := make([]string, len(oracleModels))
	for i, m := range oracleModels {
		files[i] = filepath.Join(m, "tokenizer.json")
	}
	return tokenizertest.Require(t, files...)
}

var loadCache sync.Map // path -> *BPE; loading takes ~0.3 s

func loadModel(t testing.TB, name string) *BPE {
	t.Helper()
	p := filepath.Join(fixturesDir(t), name)
	if v, ok := loadCache.Load(p); ok {
		return v.(*BPE)
	}
	tok, err := Load(p)
	if err != nil {
		t.Fatalf("Load(%s): %v", p, err)
	}
	loadCache.Store(p, tok)
	return tok
}

func baseCorpus(t testing.TB) []string {
	t.Helper()
	data, err := os.ReadFile("testdata/corpus.json")
	if err != nil {
		t.Fatal(err)
	}
	var texts []string
	if err := json.Unmarshal(data, &texts); err != nil {
		t.Fatal(err)
	}
	return texts
}

// longTexts generates n texts of 20–50 KB by mixing corpus entries with a seeded
// generator, so the corpus stays small in git but covers long inputs.
func longTexts(base []string, seed uint64, n int) []string {
	r := rand.New(rand.NewPCG(seed, 0x6b7662616e646974))
	seps := []string{" ", "\n", "\n\n", "\t", "", "\r\n", ". ", "  "}
	var out []string
	for range n {
		size := 20<<10 + r.IntN(30<<10)
		var b strings.Builder
		for b.Len() < size {
			b.WriteString(base[r.IntN(len(base))])
			b.WriteString(seps[r.IntN(len(seps))])
		}
		out = append(out, b.String())
	}
	return out
}

func oracleCorpus(t testing.TB) []string {
	base := baseCorpus(t)
	return append(base, longTexts(base, 1, 6)...)
}

// runOracle returns the HF ids for texts, computed by node.
func runOracle(t *testing.T, tokenizerJSON string, texts []string) [][]uint32 {
	t.Helper()
	dir := fixturesDir(t)
	in := filepath.Join(t.TempDir(), "texts.json")
	data, err := json.Marshal(texts)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(in, data, 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), "node", "testdata/oracle.js", tokenizerJSON, in)
	cmd.Env = append(os.Environ(), "NODE_PATH="+filepath.Join(dir, "oracle", "node_modules"))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("oracle: %v\n%s\nrun tokenizer/testdata/fixtures.sh", err, stderr.String())
	}
	var ids [][]uint32
	if err := json.Unmarshal(out, &ids); err != nil {
		t.Fatalf("oracle output: %v", err)
	}
	if len(ids) != len(texts) {
		t.Fatalf("oracle returned %d results for %d texts", len(ids), len(texts))
	}
	return ids
}

func TestOracle(t *testing.T) {
	texts := oracleCorpus(t)
	for _, name := range oracleModels {
		t.Run(name, func(t *testing.T) {
			tok := loadModel(t, name)
			want := runOracle(t, filepath.Join(fixturesDir(t), name, "tokenizer.json"), texts)
			ok := 0
			for i, text := range texts {
				got, err := tok.Encode(t.Context(), text)
				if err != nil {
					t.Fatalf("text %d: %v", i, err)
				}
				if d := firstDiff(got, want[i]); d >= 0 {
					lo := max(0, d-3)
					t.Errorf("text %d (%.60q, %d bytes): first difference at id %d: got %v, want %v",
						i, text, len(text), d, got[lo:min(len(got), d+4)], want[i][lo:min(len(want[i]), d+4)])
					continue
				}
				ok++
			}
			t.Logf("%s: %d/%d texts match the HF oracle", name, ok, len(texts))
		})
	}
}

func firstDiff(a, b []uint32) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}
