package livebench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing"
)

// Timing of the fake server's stream, in the spirit of a real one: a role
// chunk at once, the first token after firstToken, the next ones every
// tokenGap, then a finish chunk, usage and [DONE].
const (
	firstToken = 60 * time.Millisecond
	tokenGap   = 25 * time.Millisecond
	tokens     = 4
)

// sseServer answers chat completions on 127.0.0.1. The x-prefix-id
// header picks a behaviour: "" streams normally, "hold" streams after
// holding the answer 300 ms, "500" fails, "empty" streams no content,
// "error" streams an error event, "garbage" a chunk that is not JSON,
// "hangup" closes the connection, "hang" never answers.
type sseServer struct {
	*httptest.Server
	mu       sync.Mutex
	start    time.Time
	arrivals []time.Duration
	served   int // handlers returned
}

func (s *sseServer) servedCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.served
}

func newSSEServer(t *testing.T) *sseServer {
	s := &sseServer{start: time.Now()}
	s.Server = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.Close)
	return s
}

func (s *sseServer) serve(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.arrivals = append(s.arrivals, time.Since(s.start))
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.served++
		s.mu.Unlock()
	}()
	var body struct {
		Stream bool `json:"stream"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil || !body.Stream {
		http.Error(w, "want a streaming JSON body", http.StatusBadRequest)
		return
	}
	mode := r.Header.Get("x-prefix-id")
	switch mode {
	case "500":
		http.Error(w, "boom", http.StatusInternalServerError)
		return
	case "hangup":
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
		return
	case "hang":
		<-r.Context().Done()
		return
	case "hold":
		time.Sleep(300 * time.Millisecond)
	}
	w.Header().Set("Content-Type", "text/event-stream")
	f := w.(http.Flusher)
	send := func(data string) {
		fmt.Fprintf(w, "data: %s\n\n", data)
		f.Flush()
	}
	send(`{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`)
	fmt.Fprint(w, ": keep-alive comment\n\n")
	switch mode {
	case "empty":
		send(`{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`)
		send("[DONE]")
		return
	case "error":
		send(`{"error":{"message":"overloaded","code":503}}`)
		send("[DONE]")
		return
	case "garbage":
		send(`{"choices": [`)
		return
	}
	time.Sleep(firstToken)
	for i := range tokens {
		if i > 0 {
			time.Sleep(tokenGap)
		}
		send(fmt.Sprintf(`{"choices":[{"index":0,"delta":{"content":"tok%d "}}]}`, i))
	}
	send(`{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`)
	send(fmt.Sprintf(`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}`, tokens))
	send("[DONE]")
}

// work is a workload of requests at the given times, with the given
// x-prefix-id behaviours.
func work(at []time.Duration, modes ...string) []Request {
	reqs := make([]Request, len(at))
	for i := range at {
		reqs[i] = Request{Index: i, At: at[i], Tokens: []uint32{1, 2, 3}, MaxTokens: tokens, Model: "m"}
		if i < len(modes) {
			reqs[i].Hints = routing.Hints{PrefixID: modes[i]}
		}
	}
	return reqs
}

// TestMeasure: TTFT, ITL and E2E measured against a stream with known
// delays (a role chunk at once must not count as the first token).
func TestMeasure(t *testing.T) {
	s := newSSEServer(t)
	c := &Client{URL: s.URL + "/v1/chat/completions"}
	run, err := c.Run(context.Background(), work([]time.Duration{0, 0, 0}))
	if err != nil {
		t.Fatal(err)
	}
	const slack = 50 * time.Millisecond // scheduling on 2 shared cores, -race
	for _, r := range run.Results {
		if !r.OK() {
			t.Fatalf("request %d failed: %s: %s", r.Index, r.Reason, r.Detail)
		}
		if r.TTFT < firstToken || r.TTFT > firstToken+slack {
			t.Errorf("request %d: TTFT %v, want %v (+%v)", r.Index, r.TTFT, firstToken, slack)
		}
		if len(r.ITL) != tokens-1 || r.Chunks != tokens {
			t.Fatalf("request %d: %d ITL gaps, %d chunks: want %d, %d", r.Index, len(r.ITL), r.Chunks, tokens-1, tokens)
		}
		var sum time.Duration
		for _, g := range r.ITL {
			sum += g
		}
		if want := (tokens - 1) * tokenGap; sum < want-20*time.Millisecond || sum > want+slack {
			t.Errorf("request %d: ITL %v sum to %v, want %v", r.Index, r.ITL, sum, want)
		}
		if end := r.TTFT + sum; r.E2E < end || r.E2E > end+slack {
			t.Errorf("request %d: E2E %v, want just after the last token at %v", r.Index, r.E2E, end)
		}
		if r.Status != 200 || r.PromptTokens != 3 || r.OutputTokens != tokens {
			t.Errorf("request %d: status %d, usage %d/%d", r.Index, r.Status, r.PromptTokens, r.OutputTokens)
		}
	}
	sum := Summarize(run)
	if sum.Succeeded != 3 || sum.Failed != 0 || sum.TTFTP50Ms < ms(firstToken) || sum.ITLP90Ms < ms(tokenGap)/2 {
		t.Errorf("summary %+v", sum)
	}
}

// TestOpenLoop: requests leave at their times although the server holds
// every answer longer than the gap between them.
func TestOpenLoop(t *testing.T) {
	s := newSSEServer(t)
	at := []time.Duration{0, 100 * time.Millisecond, 200 * time.Millisecond, 300 * time.Millisecond}
	c := &Client{URL: s.URL}
	s.mu.Lock()
	s.start = time.Now()
	s.mu.Unlock()
	run, err := c.Run(context.Background(), work(at, "hold", "hold", "hold", "hold"))
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range run.Results {
		if !r.OK() {
			t.Fatalf("request %d failed: %s: %s", i, r.Reason, r.Detail)
		}
		if r.Sent < at[i] || r.Sent > at[i]+30*time.Millisecond {
			t.Errorf("request %d sent at %v, want %v", i, r.Sent, at[i])
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, a := range s.arrivals {
		if a > at[i]+60*time.Millisecond {
			t.Errorf("request %d reached the server at %v, want about %v", i, a, at[i])
		}
	}
	if want := 300*time.Millisecond + 300*time.Millisecond + firstToken; run.Elapsed < want || run.Elapsed > want+300*time.Millisecond {
		t.Errorf("elapsed %v, want about %v (open loop: the answers overlap)", run.Elapsed, want)
	}
}

// TestFailures: every kind of failure is counted with its reason.
func TestFailures(t *testing.T) {
	s := newSSEServer(t)
	modes := []string{"500", "empty", "error", "garbage", "hangup", "hang", ""}
	c := &Client{URL: s.URL, Timeout: 400 * time.Millisecond}
	run, err := c.Run(context.Background(), work(make([]time.Duration, len(modes)), modes...))
	if err != nil {
		t.Fatal(err)
	}
	want := []Reason{ReasonStatus, ReasonNoContent, ReasonStream, ReasonStream, ReasonTransport, ReasonTimeout, ""}
	for i, r := range run.Results {
		if r.Reason != want[i] {
			t.Errorf("mode %q: reason %q (%s), want %q", modes[i], r.Reason, r.Detail, want[i])
		}
	}
	if run.Results[0].Status != 500 {
		t.Errorf("mode 500: status %d", run.Results[0].Status)
	}
	sum := Summarize(run)
	if sum.Failed != 6 || sum.Succeeded != 1 || sum.Failures[ReasonStream] != 2 || sum.Failures[ReasonTimeout] != 1 {
		t.Errorf("summary %+v", sum)
	}
}

// TestInFlightLimit: a request due while MaxInFlight are in flight is not
// sent and fails; one due after a slot frees is sent.
func TestInFlightLimit(t *testing.T) {
	s := newSSEServer(t)
	c := &Client{URL: s.URL, MaxInFlight: 1}
	run, err := c.Run(context.Background(), work([]time.Duration{0, 50 * time.Millisecond, 800 * time.Millisecond}, "hold"))
	if err != nil {
		t.Fatal(err)
	}
	got := []Reason{run.Results[0].Reason, run.Results[1].Reason, run.Results[2].Reason}
	if got[0] != "" || got[1] != ReasonInFlight || got[2] != "" {
		t.Errorf("reasons %q, want success, %q, success", got, ReasonInFlight)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := len(s.arrivals); n != 2 {
		t.Errorf("the server saw %d requests, want 2", n)
	}
}

// TestCancel: canceling the context stops the run promptly, failing the
// request in flight and the unsent ones as canceled.
func TestCancel(t *testing.T) {
	s := newSSEServer(t)
	c := &Client{URL: s.URL}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(400*time.Millisecond, cancel)
	t0 := time.Now()
	run, err := c.Run(ctx, work([]time.Duration{0, 0, time.Hour}, "hang", ""))
	if d := time.Since(t0); d > 1500*time.Millisecond {
		t.Errorf("Run returned %v after the start, want soon after the cancel at 400ms", d)
	}
	if !errors.Is(err, context.Canceled) {
		t.Errorf("err %v, want context.Canceled", err)
	}
	got := []Reason{run.Results[0].Reason, run.Results[1].Reason, run.Results[2].Reason}
	if got[0] != ReasonCanceled || got[1] != "" || got[2] != ReasonCanceled || run.Results[2].Sent != 0 {
		t.Errorf("reasons %q, want canceled, success, canceled (not sent)", got)
	}
}

// fakeClock jumps to every time the client sleeps until, once the
// server has answered the requests sent before (so that their sends are
// stamped at their own time).
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	sleeps int
	served func() int
}

func (f *fakeClock) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

func (f *fakeClock) SleepUntil(ctx context.Context, t time.Time) error {
	for f.served() < f.sleeps {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		time.Sleep(time.Millisecond)
	}
	f.sleeps++
	f.mu.Lock()
	defer f.mu.Unlock()
	if t.After(f.now) {
		f.now = t
	}
	return ctx.Err()
}

// TestClockInjected: the client paces and stamps with its Clock: hours
// of virtual schedule run at once, each request sent exactly on time.
func TestClockInjected(t *testing.T) {
	s := newSSEServer(t)
	clk := &fakeClock{now: time.Unix(1e9, 0), served: s.servedCount}
	at := []time.Duration{0, time.Hour, 2 * time.Hour}
	c := &Client{URL: s.URL, Clock: clk}
	run, err := c.Run(context.Background(), work(at))
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range run.Results {
		if !r.OK() || r.Sent != at[i] || r.TTFT != 0 {
			t.Errorf("request %d: %s, sent %v, TTFT %v: want success sent at %v by the fake clock", i, r.Reason, r.Sent, r.TTFT, at[i])
		}
	}
	if run.Elapsed != 2*time.Hour || !run.Start.Equal(time.Unix(1e9, 0)) {
		t.Errorf("start %v, elapsed %v", run.Start, run.Elapsed)
	}
}

// TestEntries: with several URLs each request goes to one of them, every
// entry gets some of the requests, and the same seed sends the same
// request to the same entry again.
func TestEntries(t *testing.T) {
	var servers []*sseServer
	var urls []string
	for range 3 {
		s := newSSEServer(t)
		servers = append(servers, s)
		urls = append(urls, s.URL)
	}
	at := make([]time.Duration, 30)
	c := &Client{URLs: urls, Seed: 7}
	if _, err := c.Run(context.Background(), work(at)); err != nil {
		t.Fatal(err)
	}
	counts := make([]int, len(servers))
	for i, s := range servers {
		s.mu.Lock()
		counts[i] = len(s.arrivals)
		s.mu.Unlock()
		if counts[i] == 0 {
			t.Errorf("entry %d got no request of 30: %v", i, counts)
		}
	}
	if counts[0]+counts[1]+counts[2] != 30 {
		t.Errorf("entries got %v requests, want 30 in all", counts)
	}
	for i := range 30 {
		if c.entry(i) != (&Client{URLs: urls, Seed: 7}).entry(i) {
			t.Fatalf("request %d: a different entry with the same seed", i)
		}
	}
	if _, err := (&Client{URL: "x", URLs: urls}).Run(context.Background(), nil); err == nil {
		t.Error("URL and URLs together: no error")
	}
}
