package decisionlog_test

import (
	"bufio"
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"go.uber.org/goleak"

	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/decisionlog"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var t0 = time.UnixMilli(1_767_923_263_058)

// syncBuffer is a bytes.Buffer safe for the writer goroutine and the test.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func sampleRecords() []decisionlog.Record {
	return []decisionlog.Record{
		{
			Time: t0, TokensLen: 38, PrefixID: "auto-9e05dbb0682f458a", ReuseAfter: 0,
			ChosenWorker: "10.0.0.1:8000", OverlapChosen: 0, DecodeCost: 2, PrefillCost: 0.037109,
			IATLevel: "MEDIUM", Stickiness: 0, LoadMod: 1,
			DecisionID: "d-1", Policy: "kvbandit", Tenant: "acme", DPRank: -1, EstimatedTokens: false,
			Scores: []decisionlog.Score{{Endpoint: "10.0.0.1:8000", Score: 0.75}, {Endpoint: "10.0.0.2:8000", Score: math.NaN()}},
		},
		{
			Time: t0.Add(1500 * time.Millisecond), TokensLen: 8192, PrefixID: `quote"comma,newline` + "\n" + "tab\tend",
			ReuseAfter: 7, ChosenWorker: "[2001:db8::1]:8000", OverlapChosen: 0.5, DecodeCost: 1e-9, PrefillCost: 3e21,
			IATLevel: "LOW", Stickiness: 1, LoadMod: math.Inf(1),
			DecisionID: "d-2", Policy: "kv", Tenant: " leading space, ünïcödé \u2028", DPRank: 3, EstimatedTokens: true,
			Scores: []decisionlog.Score{{Endpoint: "[2001:db8::1]:8000/3", Score: -1.25}},
		},
		{ // zero time: stamped with the writer's clock; no scores
			TokensLen: 1, ChosenWorker: "10.0.0.3:8000", DecodeCost: math.NaN(), LoadMod: math.Inf(-1), DPRank: 0,
		},
	}
}

// stamped returns what the writer is expected to write for rs.
func stamped(rs []decisionlog.Record, now time.Time) []decisionlog.Record {
	out := append([]decisionlog.Record(nil), rs...)
	for i := range out {
		if out[i].Time.IsZero() {
			out[i].Time = now
		}
		if len(out[i].Scores) == 0 {
			out[i].Scores = nil
		}
	}
	return out
}

func parseFloat(t *testing.T, s string) float64 {
	t.Helper()
	f, err := strconv.ParseFloat(s, 64)
	if err != nil {
		t.Fatalf("float %q: %v", s, err)
	}
	return f
}

func parseInt(t *testing.T, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil {
		t.Fatalf("int %q: %v", s, err)
	}
	return n
}

func parseCSV(t *testing.T, data string) []decisionlog.Record {
	t.Helper()
	rows, err := csv.NewReader(strings.NewReader(data)).ReadAll()
	if err != nil {
		t.Fatalf("CSV: %v\n%s", err, data)
	}
	if len(rows) == 0 || strings.Join(rows[0], ",") != strings.Join(decisionlog.Columns(), ",") {
		t.Fatalf("header = %v", rows)
	}
	var out []decisionlog.Record
	for _, f := range rows[1:] {
		ms, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		est, err := strconv.ParseBool(f[15])
		if err != nil {
			t.Fatal(err)
		}
		r := decisionlog.Record{
			Time: time.UnixMilli(ms), TokensLen: parseInt(t, f[1]), PrefixID: f[2], ReuseAfter: parseInt(t, f[3]),
			ChosenWorker: f[4], OverlapChosen: parseFloat(t, f[5]), DecodeCost: parseFloat(t, f[6]),
			PrefillCost: parseFloat(t, f[7]), IATLevel: f[8], Stickiness: parseFloat(t, f[9]), LoadMod: parseFloat(t, f[10]),
			DecisionID: f[11], Policy: f[12], Tenant: f[13], DPRank: parseInt(t, f[14]), EstimatedTokens: est,
		}
		if f[16] != "" {
			for pair := range strings.SplitSeq(f[16], ";") {
				ep, score, ok := strings.Cut(pair, "=")
				if !ok {
					t.Fatalf("scores %q", f[16])
				}
				r.Scores = append(r.Scores, decisionlog.Score{Endpoint: ep, Score: parseFloat(t, score)})
			}
		}
		out = append(out, r)
	}
	return out
}

// jsonRecord mirrors the JSONL object; nil floats are JSON nulls.
type jsonRecord struct {
	TS              int64               `json:"ts_epoch_ms"`
	TokensLen       int                 `json:"tokens_len"`
	PrefixID        string              `json:"prefix_id"`
	ReuseAfter      int                 `json:"reuse_after"`
	ChosenWorker    string              `json:"chosen_worker"`
	OverlapChosen   *float64            `json:"overlap_chosen"`
	DecodeCost      *float64            `json:"decode_cost"`
	PrefillCost     *float64            `json:"prefill_cost"`
	IATLevel        string              `json:"iat_level"`
	Stickiness      *float64            `json:"stickiness"`
	LoadMod         *float64            `json:"load_mod"`
	DecisionID      string              `json:"decision_id"`
	Policy          string              `json:"policy"`
	Tenant          string              `json:"tenant"`
	DPRank          int                 `json:"dp_rank"`
	EstimatedTokens bool                `json:"estimated_tokens"`
	Scores          map[string]*float64 `json:"scores"`
}

func parseJSONL(t *testing.T, data string) []decisionlog.Record {
	t.Helper()
	num := func(p *float64) float64 {
		if p == nil {
			return math.NaN() // null stands for any non-finite value
		}
		return *p
	}
	var out []decisionlog.Record
	sc := bufio.NewScanner(strings.NewReader(data))
	for sc.Scan() {
		var j jsonRecord
		dec := json.NewDecoder(bytes.NewReader(sc.Bytes()))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&j); err != nil {
			t.Fatalf("JSON %s: %v", sc.Text(), err)
		}
		r := decisionlog.Record{
			Time: time.UnixMilli(j.TS), TokensLen: j.TokensLen, PrefixID: j.PrefixID, ReuseAfter: j.ReuseAfter,
			ChosenWorker: j.ChosenWorker, OverlapChosen: num(j.OverlapChosen), DecodeCost: num(j.DecodeCost),
			PrefillCost: num(j.PrefillCost), IATLevel: j.IATLevel, Stickiness: num(j.Stickiness), LoadMod: num(j.LoadMod),
			DecisionID: j.DecisionID, Policy: j.Policy, Tenant: j.Tenant, DPRank: j.DPRank, EstimatedTokens: j.EstimatedTokens,
		}
		// Keep the written order of the scores object.
		var raw struct{ Scores json.RawMessage }
		if err := json.Unmarshal(sc.Bytes(), &raw); err != nil {
			t.Fatal(err)
		}
		d := json.NewDecoder(bytes.NewReader(raw.Scores))
		if _, err := d.Token(); err != nil { // {
			t.Fatal(err)
		}
		for d.More() {
			k, err := d.Token()
			if err != nil {
				t.Fatal(err)
			}
			ep := k.(string)
			r.Scores = append(r.Scores, decisionlog.Score{Endpoint: ep, Score: num(j.Scores[ep])})
			var skip any
			if err := d.Decode(&skip); err != nil {
				t.Fatal(err)
			}
		}
		out = append(out, r)
	}
	return out
}

// jsonView maps every non-finite float to NaN, as a JSON null reads back.
func jsonView(rs []decisionlog.Record) []decisionlog.Record {
	fix := func(f float64) float64 {
		if math.IsInf(f, 0) {
			return math.NaN()
		}
		return f
	}
	out := make([]decisionlog.Record, len(rs))
	for i, r := range rs {
		r.OverlapChosen, r.DecodeCost, r.PrefillCost = fix(r.OverlapChosen), fix(r.DecodeCost), fix(r.PrefillCost)
		r.Stickiness, r.LoadMod = fix(r.Stickiness), fix(r.LoadMod)
		scores := make([]decisionlog.Score, len(r.Scores))
		for k, s := range r.Scores {
			scores[k] = decisionlog.Score{Endpoint: s.Endpoint, Score: fix(s.Score)}
		}
		if len(scores) == 0 {
			scores = nil
		}
		r.Scores = scores
		out[i] = r
	}
	return out
}

func TestRoundTrip(t *testing.T) {
	t.Parallel()
	tests := []struct {
		format decisionlog.Format
		parse  func(*testing.T, string) []decisionlog.Record
		view   func([]decisionlog.Record) []decisionlog.Record
	}{
		{format: decisionlog.CSV, parse: parseCSV, view: func(rs []decisionlog.Record) []decisionlog.Record { return rs }},
		{format: decisionlog.JSONL, parse: parseJSONL, view: jsonView},
	}
	for _, tt := range tests {
		t.Run(tt.format.String(), func(t *testing.T) {
			t.Parallel()
			now := t0.Add(time.Hour)
			var buf syncBuffer
			l, err := decisionlog.New(&buf, tt.format, decisionlog.Options{Clock: clock.NewVirtual(now)})
			if err != nil {
				t.Fatal(err)
			}
			in := sampleRecords()
			for _, r := range in {
				l.Record(r)
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			got := tt.parse(t, buf.String())
			want := tt.view(stamped(in, now))
			if diff := cmp.Diff(want, got, cmpopts.EquateNaNs()); diff != "" {
				t.Fatalf("round trip (-want +got):\n%s\n%s", diff, buf.String())
			}
			if s := l.Stats(); s.Written != uint64(len(in)) || s.Dropped != 0 || s.WriteErrors != 0 {
				t.Fatalf("Stats() = %+v", s)
			}
		})
	}
}

func TestNonFiniteSpelling(t *testing.T) {
	t.Parallel()
	r := decisionlog.Record{Time: t0, Scores: []decisionlog.Score{{Endpoint: "a:1", Score: math.NaN()}, {Endpoint: "b:1", Score: 2}}}
	tests := []struct {
		format decisionlog.Format
		want   string
	}{
		{decisionlog.CSV, ",a:1=NaN;b:1=2\n"},
		{decisionlog.JSONL, `"scores":{"a:1":null,"b:1":2}}` + "\n"},
	}
	for _, tt := range tests {
		var buf syncBuffer
		l, err := decisionlog.New(&buf, tt.format, decisionlog.Options{})
		if err != nil {
			t.Fatal(err)
		}
		l.Record(r)
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		if !strings.HasSuffix(buf.String(), tt.want) {
			t.Errorf("%v: got %q, want suffix %q", tt.format, buf.String(), tt.want)
		}
	}
}

// blockingWriter blocks every Write until release is closed.
type blockingWriter struct {
	entered chan struct{}
	release chan struct{}
	once    sync.Once
	buf     syncBuffer
}

func (w *blockingWriter) Write(p []byte) (int, error) {
	w.once.Do(func() { close(w.entered) })
	<-w.release
	return w.buf.Write(p)
}

func TestDropsWhenWriterBlocked(t *testing.T) {
	t.Parallel()
	vc := clock.NewVirtual(t0)
	w := &blockingWriter{entered: make(chan struct{}), release: make(chan struct{})}
	l, err := decisionlog.New(w, decisionlog.JSONL, decisionlog.Options{Buffer: 4, FlushInterval: time.Second, Clock: vc})
	if err != nil {
		t.Fatal(err)
	}
	l.Record(decisionlog.Record{DecisionID: "first"})
	waitFor(t, "the first record", func() bool { return l.Stats().Written == 1 })
	vc.Step(time.Second) // flush: the writer goroutine blocks in Write
	<-w.entered

	start := time.Now()
	for i := range 10 {
		l.Record(decisionlog.Record{DecisionID: strconv.Itoa(i)})
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Record blocked for %v", d)
	}
	if got := l.Dropped(); got != 6 {
		t.Fatalf("Dropped() = %d, want 6 (buffer of 4)", got)
	}
	close(w.release)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if got := strings.Count(w.buf.String(), "\n"); got != 5 {
		t.Fatalf("%d lines written, want 5", got)
	}
	if s := l.Stats(); s.Written != 5 || s.Dropped != 6 {
		t.Fatalf("Stats() = %+v", s)
	}
}

func TestCloseFlushesEverything(t *testing.T) {
	t.Parallel()
	const n = 2000
	var buf syncBuffer
	// The virtual clock never moves: only Close flushes.
	l, err := decisionlog.New(&buf, decisionlog.CSV, decisionlog.Options{Buffer: n, Clock: clock.NewVirtual(t0)})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		l.Record(decisionlog.Record{Time: t0, TokensLen: i})
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	rows := parseCSV(t, buf.String())
	if len(rows) != n {
		t.Fatalf("%d rows, want %d", len(rows), n)
	}
	for i, r := range rows {
		if r.TokensLen != i {
			t.Fatalf("row %d has tokens_len %d: out of order", i, r.TokensLen)
		}
	}
	l.Record(decisionlog.Record{})
	if l.Dropped() != 1 {
		t.Fatalf("a record after Close was not counted as dropped")
	}
	if err := l.Close(); err != nil {
		t.Fatalf("second Close() = %v", err)
	}
}

func TestPeriodicFlushOnInjectedClock(t *testing.T) {
	t.Parallel()
	vc := clock.NewVirtual(t0)
	var buf syncBuffer
	l, err := decisionlog.New(&buf, decisionlog.JSONL, decisionlog.Options{FlushInterval: 5 * time.Second, Clock: vc})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	for i := 1; i <= 3; i++ {
		l.Record(decisionlog.Record{Time: t0, TokensLen: i})
		waitFor(t, "the record to be buffered", func() bool { return l.Stats().Written == uint64(i) })
		if got := strings.Count(buf.String(), "\n"); got != i-1 {
			t.Fatalf("%d lines before the flush, want %d", got, i-1)
		}
		waitFor(t, "the flush timer", func() bool { _, ok := vc.NextAt(); return ok })
		vc.Step(5 * time.Second)
		waitFor(t, "the flush", func() bool { return strings.Count(buf.String(), "\n") == i })
	}
}

func TestRotation(t *testing.T) {
	t.Parallel()
	for _, format := range []decisionlog.Format{decisionlog.CSV, decisionlog.JSONL} {
		t.Run(format.String(), func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "decisions."+format.String())
			const maxBytes = 1024
			l, err := decisionlog.Open(path, format, decisionlog.Options{MaxBytes: maxBytes, Clock: clock.NewVirtual(t0)})
			if err != nil {
				t.Fatal(err)
			}
			const n = 100
			for i := range n {
				l.Record(decisionlog.Record{Time: t0, TokensLen: i, ChosenWorker: "10.0.0.1:8000", Policy: "kvbandit"})
			}
			if err := l.Close(); err != nil {
				t.Fatal(err)
			}
			if s := l.Stats(); s.Rotations == 0 || s.Written != n || s.WriteErrors != 0 {
				t.Fatalf("Stats() = %+v", s)
			}
			cur, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			old, err := os.ReadFile(path + ".1")
			if err != nil {
				t.Fatal(err)
			}
			for name, data := range map[string][]byte{"current": cur, "old": old} {
				if len(data) > maxBytes {
					t.Errorf("%s file has %d bytes, over %d", name, len(data), maxBytes)
				}
			}
			parse := parseJSONL
			if format == decisionlog.CSV {
				parse = parseCSV // also checks that each file starts with the header
			}
			oldRows, curRows := parse(t, string(old)), parse(t, string(cur))
			all := append(oldRows, curRows...)
			if len(all) == 0 || all[len(all)-1].TokensLen != n-1 {
				t.Fatalf("the newest record is not last: %+v", all[len(all)-1])
			}
			for i := 1; i < len(all); i++ {
				if all[i].TokensLen != all[i-1].TokensLen+1 {
					t.Fatalf("records out of order across files at %d", i)
				}
			}
		})
	}
}

func TestOpenAppends(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "decisions.csv")
	for i := range 2 {
		l, err := decisionlog.Open(path, decisionlog.CSV, decisionlog.Options{})
		if err != nil {
			t.Fatal(err)
		}
		l.Record(decisionlog.Record{Time: t0, TokensLen: i})
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	rows := parseCSV(t, string(data)) // fails on a second header
	if len(rows) != 2 || rows[0].TokensLen != 0 || rows[1].TokensLen != 1 {
		t.Fatalf("rows = %+v", rows)
	}
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestWriteErrorsCountedAndLoggedOnce(t *testing.T) {
	t.Parallel()
	vc := clock.NewVirtual(t0)
	var logs syncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))
	l, err := decisionlog.New(failingWriter{}, decisionlog.CSV, decisionlog.Options{Clock: vc, Logger: logger})
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 3; i++ {
		l.Record(decisionlog.Record{TokensLen: i})
		waitFor(t, "the record", func() bool { return l.Stats().Written == uint64(i) })
		waitFor(t, "the flush timer", func() bool { _, ok := vc.NextAt(); return ok })
		vc.Step(time.Second)
		waitFor(t, "the failed flush", func() bool { return l.Stats().WriteErrors == uint64(i) })
	}
	l.Record(decisionlog.Record{TokensLen: 4})
	if err := l.Close(); err == nil {
		t.Fatal("Close() = nil, want the flush error")
	}
	if s := l.Stats(); s.WriteErrors != 4 {
		t.Fatalf("Stats() = %+v, want 4 write errors", s)
	}
	if n := strings.Count(logs.String(), "decision log write failed"); n != 1 {
		t.Fatalf("logged %d times, want once:\n%s", n, logs.String())
	}
}

func TestOptionsAndFormats(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		format decisionlog.Format
		opts   decisionlog.Options
		want   string // substring of the error
	}{
		{name: "bad format", format: 0, want: "format"},
		{name: "negative buffer", format: decisionlog.CSV, opts: decisionlog.Options{Buffer: -1}, want: "Buffer"},
		{name: "negative flush interval", format: decisionlog.CSV, opts: decisionlog.Options{FlushInterval: -1}, want: "FlushInterval"},
		{name: "negative max bytes", format: decisionlog.CSV, opts: decisionlog.Options{MaxBytes: -1}, want: "MaxBytes"},
		{name: "rotation without a file", format: decisionlog.CSV, opts: decisionlog.Options{MaxBytes: 10}, want: "MaxBytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			l, err := decisionlog.New(io.Discard, tt.format, tt.opts)
			if err == nil {
				l.Close()
				t.Fatal("New() accepted invalid input")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %q does not name %s", err, tt.want)
			}
		})
	}
	if _, err := decisionlog.Open(filepath.Join(t.TempDir(), "missing", "x.csv"), decisionlog.CSV, decisionlog.Options{}); err == nil {
		t.Fatal("Open() in a missing directory succeeded")
	}
	for in, want := range map[string]decisionlog.Format{"csv": decisionlog.CSV, "CSV": decisionlog.CSV, "jsonl": decisionlog.JSONL, "ndjson": decisionlog.JSONL} {
		if got, err := decisionlog.ParseFormat(in); err != nil || got != want {
			t.Errorf("ParseFormat(%q) = %v, %v", in, got, err)
		}
	}
	if _, err := decisionlog.ParseFormat("xml"); err == nil {
		t.Error("ParseFormat(xml) succeeded")
	}
}

func TestConcurrentRecord(t *testing.T) {
	t.Parallel()
	var buf syncBuffer
	l, err := decisionlog.New(&buf, decisionlog.JSONL, decisionlog.Options{Buffer: 64, FlushInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	const goroutines, per = 16, 500
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for i := range per {
				l.Record(decisionlog.Record{TokensLen: g*per + i, Scores: []decisionlog.Score{{Endpoint: "a:1", Score: float64(i)}}})
				if i%50 == 0 {
					_ = l.Stats()
				}
			}
		})
	}
	wg.Wait()
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	s := l.Stats()
	if s.Written+s.Dropped != goroutines*per {
		t.Fatalf("Stats() = %+v, want written + dropped = %d", s, goroutines*per)
	}
	if got := len(parseJSONL(t, buf.String())); uint64(got) != s.Written {
		t.Fatalf("%d lines, %d written", got, s.Written)
	}
}

// BenchmarkRecord measures the caller's cost of Record, with the writer
// goroutine running concurrently (writing to io.Discard):
//
//   - accepted: the buffer always has room (the timer is stopped every
//     1024 records until the writer catches up, so this one runs several
//     times longer than its reported time);
//   - dropped: the writer is stuck, every record is dropped and counted;
//   - parallel: GOMAXPROCS goroutines in a tight loop, mostly dropping
//     because no writer keeps up with that (see BenchmarkEncode for the
//     writer's throughput).
//
// Run it with:
//
//	go test -run '^$' -bench Record -benchmem ./routing/decisionlog/
func BenchmarkRecord(b *testing.B) {
	r := benchRecord()
	for _, format := range []decisionlog.Format{decisionlog.CSV, decisionlog.JSONL} {
		b.Run(format.String()+"/accepted", func(b *testing.B) {
			l, err := decisionlog.New(io.Discard, format, decisionlog.Options{})
			if err != nil {
				b.Fatal(err)
			}
			// Same size as r (what the caller pays for), cheaper for the
			// writer, so that waiting for it does not dominate the run.
			small := decisionlog.Record{Time: t0, ChosenWorker: "10.0.0.3:8000"}
			b.ReportAllocs()
			for i := range b.N {
				l.Record(small)
				if i%1024 == 1023 {
					b.StopTimer()
					for l.Stats().Written < uint64(i+1) {
						time.Sleep(10 * time.Microsecond)
					}
					b.StartTimer()
				}
			}
			b.StopTimer()
			closeBench(b, l, false)
		})
		b.Run(format.String()+"/dropped", func(b *testing.B) {
			w := &blockingWriter{entered: make(chan struct{}), release: make(chan struct{})}
			vc := clock.NewVirtual(t0)
			l, err := decisionlog.New(w, format, decisionlog.Options{Buffer: 1, Clock: vc})
			if err != nil {
				b.Fatal(err)
			}
			l.Record(r)
			for l.Stats().Written < 1 {
				time.Sleep(10 * time.Microsecond)
			}
			vc.Step(time.Hour)
			<-w.entered
			l.Record(r) // fills the buffer
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				l.Record(r)
			}
			b.StopTimer()
			close(w.release)
			closeBench(b, l, true)
		})
		b.Run(format.String()+"/parallel", func(b *testing.B) {
			l, err := decisionlog.New(io.Discard, format, decisionlog.Options{})
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					l.Record(r)
				}
			})
			b.StopTimer()
			closeBench(b, l, true)
		})
	}
}

func benchRecord() decisionlog.Record {
	scores := make([]decisionlog.Score, 8)
	for i := range scores {
		scores[i] = decisionlog.Score{Endpoint: "10.0.0." + strconv.Itoa(i) + ":8000", Score: float64(i) / 8}
	}
	return decisionlog.Record{
		Time: t0, TokensLen: 4096, PrefixID: "session-42", ReuseAfter: 3, ChosenWorker: "10.0.0.3:8000",
		OverlapChosen: 0.5, DecodeCost: 12, PrefillCost: 0.25, IATLevel: "LOW", Stickiness: 1, LoadMod: 0.9,
		DecisionID: "d-1", Policy: "kvbandit", Tenant: "acme", DPRank: -1, Scores: scores,
	}
}

func closeBench(b *testing.B, l *decisionlog.Log, reportDrops bool) {
	b.Helper()
	if err := l.Close(); err != nil {
		b.Fatal(err)
	}
	if s := l.Stats(); reportDrops {
		b.ReportMetric(float64(s.Dropped)/float64(s.Written+s.Dropped), "dropped/op")
	} else if s.Dropped != 0 {
		b.Fatalf("%d records dropped", s.Dropped)
	}
}
