package trace

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/sim"
)

const (
	mooncakePath = "../../../traces/mooncake/conversation_trace.jsonl"
	azureConv    = "../../../traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"
	azureCode    = "../../../traces/azure-llm-2023/AzureLLMInferenceTrace_code.csv"
)

func TestMooncakeConventions(t *testing.T) {
	t.Parallel()
	in := strings.Join([]string{
		`{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]}`,  // ceil: 512 + 488
		`{"timestamp": 10, "input_length": 1000, "output_length": 5, "hash_ids": [7]}`,    // floor: 512 + 488 unique
		`{"timestamp": 20, "input_length": 1024, "output_length": 1, "hash_ids": [7, 8]}`, // exact
		`{"timestamp": 30, "input_length": 700, "output_length": 1, "hash_ids": [7]}`,     // floor again
	}, "\n")
	reqs, rep, err := ReadMooncake(strings.NewReader(in), Options{Strict: true})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Lines != 4 || rep.Skipped != 0 || len(reqs) != 4 {
		t.Fatalf("report %+v, %d requests", rep, len(reqs))
	}
	a, b, c, d := reqs[0].Tokens, reqs[1].Tokens, reqs[2].Tokens, reqs[3].Tokens
	if len(a) != 1000 || len(b) != 1000 || len(c) != 1024 || len(d) != 700 {
		t.Fatalf("lengths %d %d %d %d", len(a), len(b), len(c), len(d))
	}
	if !slices.Equal(a[:512], b[:512]) || !slices.Equal(a[:512], c[:512]) || !slices.Equal(a[:512], d[:512]) {
		t.Error("hash id 7 does not give the same tokens everywhere")
	}
	if !slices.Equal(a[512:], c[512:1000]) {
		t.Error("a partial last block is not a prefix of the full block")
	}
	if slices.Equal(a[512:], b[512:]) || slices.Equal(b[512:700], d[512:]) {
		t.Error("unhashed tails are shared between requests")
	}
	if reqs[1].Arrival != 10*time.Millisecond || reqs[0].OutputLen != 5 {
		t.Errorf("request 1: arrival %v output %d", reqs[1].Arrival, reqs[0].OutputLen)
	}
	again, _, _ := ReadMooncake(strings.NewReader(in), Options{})
	for i := range reqs {
		if !slices.Equal(reqs[i].Tokens, again[i].Tokens) {
			t.Fatal("not deterministic")
		}
	}
}

func TestMooncakeBadLines(t *testing.T) {
	t.Parallel()
	in := strings.Join([]string{
		`{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}`,
		`not json`,
		`{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2, 3]}`,
		``,
		`{"timestamp": 2, "input_length": 2000000, "output_length": 5, "hash_ids": []}`,
		`{"timestamp": 3, "input_length": -4, "output_length": 5, "hash_ids": []}`,
		`{"timestamp": 4, "output_length": 5, "hash_ids": [1]}`,
		`{"timestamp": -4, "input_length": 5, "output_length": 5, "hash_ids": [1]}`,
		`{"timestamp": 5, "input_length": 5, "output_length": -1, "hash_ids": [1]}`,
		`{"timestamp": 6, "input_length": 100, "output_length": 5, "hash_ids": [1]}`,
	}, "\n")
	reqs, rep, err := ReadMooncake(strings.NewReader(in), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 2 || rep.Lines != 9 || rep.Skipped != 7 || len(rep.Errors) != 7 {
		t.Fatalf("%d requests, report %+v", len(reqs), rep)
	}
	var le *LineError
	if !errors.As(rep.Errors[0], &le) || le.Line != 2 || !errors.Is(rep.Errors[0], ErrBadLine) {
		t.Errorf("first error %v", rep.Errors[0])
	}
	for i, want := range []string{"line 2:", "line 3: 3 hash_ids", "line 5: input length 2000000", "line 6: input length -4", "line 7: missing input_length", "line 8: timestamp", "line 9: output length -1"} {
		if !strings.HasPrefix(rep.Errors[i].Error(), want) {
			t.Errorf("error %d = %q, want prefix %q", i, rep.Errors[i], want)
		}
	}
	_, _, err = ReadMooncake(strings.NewReader(in), Options{Strict: true})
	if !errors.As(err, &le) || le.Line != 2 {
		t.Errorf("strict: %v", err)
	}
}

func TestEmptyTraces(t *testing.T) {
	t.Parallel()
	for name, read := range map[string]func(string) error{
		"mooncake": func(s string) error { _, _, err := ReadMooncake(strings.NewReader(s), Options{}); return err },
		"azure":    func(s string) error { _, _, err := ReadAzure(strings.NewReader(s), Options{}); return err },
	} {
		for _, in := range []string{"", "\n\n", "TIMESTAMP,ContextTokens,GeneratedTokens\n"} {
			if err := read(in); !errors.Is(err, ErrEmpty) && !errors.Is(err, ErrBadLine) {
				t.Errorf("%s %q: %v", name, in, err)
			}
		}
	}
	_, _, err := ReadMooncake(strings.NewReader("garbage\n"), Options{})
	if !errors.Is(err, ErrEmpty) || !strings.Contains(err.Error(), "line 1") {
		t.Errorf("all-bad trace: %v", err)
	}
}

func TestTraceOptions(t *testing.T) {
	t.Parallel()
	in := "{\"timestamp\": 2000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n" +
		"{\"timestamp\": 1000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [2]}\n" +
		"{\"timestamp\": 3000, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [3]}\n"
	reqs, _, err := ReadMooncake(strings.NewReader(in), Options{RateScale: 4, Limit: 2, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 2 || reqs[0].Arrival != 250*time.Millisecond || reqs[1].Arrival != 500*time.Millisecond || reqs[0].Model != "m" {
		t.Fatalf("%+v", reqs)
	}
	if _, _, err := ReadMooncake(strings.NewReader(in), Options{RateScale: -1}); err == nil {
		t.Error("negative rate scale accepted")
	}
}

func TestAzure(t *testing.T) {
	t.Parallel()
	in := "TIMESTAMP,ContextTokens,GeneratedTokens\r\n" +
		"2023-11-16 18:15:46.6805900,374,44\r\n" +
		"2023-11-16 18:15:50.9951690,396,109\r\n" +
		"2023-11-16 18:15:51,10,0\r\n" +
		"2023-11-16 18:15:52,abc,1\r\n" +
		"2023-11-16,1,1\r\n" +
		"2023-11-16 18:15:53,2000001,1\r\n"
	reqs, rep, err := ReadAzure(strings.NewReader(in), Options{RateScale: 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 3 || rep.Lines != 6 || rep.Skipped != 3 {
		t.Fatalf("%d requests, %+v", len(reqs), rep)
	}
	if reqs[0].Arrival != 0 || reqs[1].Arrival != 2157289500*time.Nanosecond || len(reqs[1].Tokens) != 396 || reqs[1].OutputLen != 109 {
		t.Errorf("request 1: %v %d %d", reqs[1].Arrival, len(reqs[1].Tokens), reqs[1].OutputLen)
	}
	if reqs[2].OutputLen != 1 {
		t.Errorf("output length 0 read as %d, want 1", reqs[2].OutputLen)
	}
	if reqs[0].Tokens[0] == reqs[1].Tokens[0] && reqs[0].Tokens[1] == reqs[1].Tokens[1] {
		t.Error("requests share tokens")
	}
	if !strings.HasPrefix(rep.Errors[0].Error(), "line 5:") {
		t.Errorf("error %v", rep.Errors[0])
	}
	if _, _, err := ReadAzure(strings.NewReader("a,b\n1,2\n"), Options{}); !errors.Is(err, ErrBadLine) {
		t.Errorf("bad header: %v", err)
	}
}

func TestRealTraces(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("reads the shared traces")
	}
	for _, c := range []struct {
		path string
		read func(*os.File) (int, Report, error)
		n    int
	}{
		{mooncakePath, func(f *os.File) (int, Report, error) {
			r, rep, err := ReadMooncake(f, Options{Strict: true})
			return len(r), rep, err
		}, 12031},
		{azureConv, func(f *os.File) (int, Report, error) {
			r, rep, err := ReadAzure(f, Options{Strict: true})
			return len(r), rep, err
		}, 19366},
		{azureCode, func(f *os.File) (int, Report, error) {
			r, rep, err := ReadAzure(f, Options{Strict: true})
			return len(r), rep, err
		}, 8819},
	} {
		f, err := os.Open(c.path)
		if err != nil {
			t.Fatalf("bundled trace (traces/README.md): %v", err)
		}
		n, _, err := c.read(f)
		f.Close()
		if err != nil || n != c.n {
			t.Errorf("%s: %d requests, %v; want %d", c.path, n, err, c.n)
		}
	}
}

func TestAgentic(t *testing.T) {
	t.Parallel()
	cfg := AgenticConfig{Sessions: 20, Turns: 4, Tenants: 2, SystemPrompts: 2, SystemPromptLen: 100, InputLen: 50, OutputLen: 40, Seed: 3}
	reqs, err := Agentic(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 80 {
		t.Fatalf("%d requests", len(reqs))
	}
	bySession := map[string][]int{}
	for i, r := range reqs {
		if i > 0 && r.Arrival < reqs[i-1].Arrival {
			t.Fatal("not sorted by arrival")
		}
		if r.Hints.TotalRequests != 4 || r.Hints.OSLTokens != r.OutputLen || r.Hints.IATMillis != 10000 {
			t.Fatalf("hints %+v", r.Hints)
		}
		bySession[r.Hints.PrefixID] = append(bySession[r.Hints.PrefixID], i)
	}
	if len(bySession) != 20 {
		t.Fatalf("%d sessions", len(bySession))
	}
	for id, idx := range bySession {
		for k := 1; k < len(idx); k++ {
			prev, cur := reqs[idx[k-1]], reqs[idx[k]]
			grow := len(cur.Tokens) - len(prev.Tokens) - prev.OutputLen
			if !slices.Equal(prev.Tokens, cur.Tokens[:len(prev.Tokens)]) || grow < 25 || grow > 75 {
				t.Fatalf("session %s turn %d does not extend the history (grew %d)", id, k, grow)
			}
			if cur.Arrival-prev.Arrival != 10*time.Second || cur.Tenant != prev.Tenant {
				t.Fatalf("session %s turn %d: gap %v tenant %q/%q", id, k, cur.Arrival-prev.Arrival, prev.Tenant, cur.Tenant)
			}
		}
	}
	again, _ := Agentic(cfg)
	for i := range reqs {
		if !slices.Equal(reqs[i].Tokens, again[i].Tokens) || reqs[i].Arrival != again[i].Arrival {
			t.Fatal("not deterministic")
		}
	}
	if _, err := Agentic(AgenticConfig{SessionRate: -1}); err == nil {
		t.Error("negative rate accepted")
	}
	if _, err := Agentic(AgenticConfig{InputLen: 2 * MaxTokens}); err == nil {
		t.Error("absurd length accepted")
	}
}

func FuzzMooncakeLine(f *testing.F) {
	f.Add([]byte(`{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}`))
	f.Add([]byte(`{"timestamp": 1.5, "input_length": 512, "output_length": 0, "hash_ids": [9]}`))
	f.Add([]byte(`{"timestamp": 1e300, "input_length": 1, "output_length": 1, "hash_ids": [-1]}`))
	f.Add([]byte(`{} {}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		req, err := ParseMooncakeLine(line, 1)
		if err != nil {
			return
		}
		if len(req.Tokens) == 0 || len(req.Tokens) > MaxTokens || req.OutputLen < 1 || req.Arrival < 0 {
			t.Fatalf("accepted %q as %d tokens, output %d, arrival %v", line, len(req.Tokens), req.OutputLen, req.Arrival)
		}
	})
}

func FuzzAzureLine(f *testing.F) {
	sc := bufio.NewScanner(strings.NewReader("2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:51,10,0\n,,\n2023-11-16 18:15:51,-1,99999999999999999999\n"))
	for sc.Scan() {
		f.Add([]byte(sc.Text()))
	}
	f.Fuzz(func(t *testing.T, line []byte) {
		_, req, err := ParseAzureLine(line, 1)
		if err != nil {
			return
		}
		if len(req.Tokens) == 0 || len(req.Tokens) > MaxTokens || req.OutputLen < 1 {
			t.Fatalf("accepted %q as %d tokens, output %d", line, len(req.Tokens), req.OutputLen)
		}
	})
}

func TestBounds(t *testing.T) {
	t.Parallel()
	a := appendTokens(nil, saltUnique, 1, 0, 40) // 10 blocks of 4
	b := appendTokens(nil, saltUnique, 2, 0, 40)
	c := append(append([]uint32(nil), a[:20]...), b[:20]...)
	reqs := []sim.Request{{Tokens: a}, {Tokens: b}, {Tokens: a}, {Tokens: c}}
	got := ComputeBounds(reqs, 4, 12)
	// infinite: a again hits 36 (the last block is capped), c hits 20.
	if want := 56.0 / 160; got.Infinite != want {
		t.Errorf("infinite %v, want %v", got.Infinite, want)
	}
	// finite (12 blocks): after a, b the cache holds b's 10 blocks and a's
	// first 2; a hits 8, then holds a (10) + b's first 2; c hits 20.
	if want := 28.0 / 160; got.Finite != want {
		t.Errorf("finite %v, want %v", got.Finite, want)
	}
}

func TestDetect(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		head, want string
	}{
		{`{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}` + "\n", FormatMooncake},
		{"\n\n  {\"timestamp\": 0", FormatMooncake}, // blank lines, a cut first line
		{"TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,374,44\n", FormatAzure},
		{"\xef\xbb\xbftimestamp,contexttokens,generatedtokens", FormatAzure}, // BOM, lower case, no newline
		{"2023-11-16 18:15:46.6805900,374,44\n", ""},                         // no header: ReadAzure wants one
		{"a,b,c\n", ""},
		{"", ""},
		{"\n \n", ""},
		{"\x00\x01binary", ""},
	} {
		if got := Detect([]byte(c.head)); got != c.want {
			t.Errorf("Detect(%q) = %q, want %q", c.head, got, c.want)
		}
	}
}

// TestTraceJitter: --arrival-jitter spreads a burst stamped at one instant
// over [t, t+jitter) of trace time, before the rate scale, sorted again,
// the same for the same seed; 0 keeps the stamps.
func TestTraceJitter(t *testing.T) {
	t.Parallel()
	var in strings.Builder
	for i := range 200 {
		fmt.Fprintf(&in, "{\"timestamp\": %d, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [%d]}\n", 3000*(i/10), i)
	}
	read := func(o Options) []sim.Request {
		t.Helper()
		reqs, _, err := ReadMooncake(strings.NewReader(in.String()), o)
		if err != nil {
			t.Fatal(err)
		}
		return reqs
	}
	plain := read(Options{RateScale: 2})
	spread := read(Options{RateScale: 2, Jitter: 3 * time.Second, JitterSeed: 7})
	distinct := map[time.Duration]bool{}
	for i, r := range spread {
		distinct[r.Arrival] = true
		if i > 0 && r.Arrival < spread[i-1].Arrival {
			t.Fatalf("request %d arrives before %d: not sorted", i, i-1)
		}
	}
	if len(distinct) < 190 {
		t.Errorf("%d distinct arrivals of 200 after jitter", len(distinct))
	}
	if last := spread[len(spread)-1].Arrival; last < plain[len(plain)-1].Arrival || last >= plain[len(plain)-1].Arrival+1500*time.Millisecond {
		t.Errorf("last arrival %v: want within [%v, +1.5 s) (3 s of trace time at rate scale 2)", last, plain[len(plain)-1].Arrival)
	}
	if again := read(Options{RateScale: 2, Jitter: 3 * time.Second, JitterSeed: 7}); again[17].Arrival != spread[17].Arrival || again[17].Tokens[0] != spread[17].Tokens[0] {
		t.Error("the same seed gave another spread")
	}
	if _, _, err := ReadMooncake(strings.NewReader(in.String()), Options{Jitter: -1}); err == nil {
		t.Error("negative jitter accepted")
	}
}

// With NoTotals a session's requests carry its id and no total.
func TestAgenticNoTotals(t *testing.T) {
	for _, noTotals := range []bool{false, true} {
		reqs, err := Agentic(AgenticConfig{Sessions: 3, Turns: 4, NoTotals: noTotals, Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range reqs {
			if want := map[bool]int{false: 4, true: 0}[noTotals]; r.Hints.PrefixID == "" || r.Hints.TotalRequests != want {
				t.Fatalf("NoTotals %v: hints %+v, want a prefix id and total %d", noTotals, r.Hints, want)
			}
		}
	}
}
