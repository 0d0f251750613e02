package livebench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"
)

// Defaults of a Client.
const (
	// DefaultTimeout bounds one request, from send to last byte.
	DefaultTimeout = 5 * time.Minute
	// DefaultMaxInFlight bounds the requests in flight.
	DefaultMaxInFlight = 1024
)

// Reason classifies a failed request.
type Reason string

// Failure reasons.
const (
	// ReasonStatus: the server answered with a non-2xx status.
	ReasonStatus Reason = "status"
	// ReasonTransport: the connection failed or broke.
	ReasonTransport Reason = "transport"
	// ReasonTimeout: the request outlived Client.Timeout.
	ReasonTimeout Reason = "timeout"
	// ReasonNoContent: the stream ended without a non-empty content chunk.
	ReasonNoContent Reason = "no-content"
	// ReasonStream: the stream held an error event or a chunk that is not
	// JSON.
	ReasonStream Reason = "stream-error"
	// ReasonInFlight: not sent, MaxInFlight requests were in flight at its
	// send time.
	ReasonInFlight Reason = "in-flight-limit"
	// ReasonCanceled: the run's context was canceled before the request
	// was sent or while it was in flight.
	ReasonCanceled Reason = "canceled"
)

// Clock gives the client's time: Now stamps sends and chunks, SleepUntil
// paces the sends. Tests inject one; nil is the real clock.
type Clock interface {
	Now() time.Time
	// SleepUntil returns at t, or with ctx's error when ctx is done
	// first.
	SleepUntil(ctx context.Context, t time.Time) error
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

func (realClock) SleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Client replays a workload open-loop against an OpenAI chat completions
// endpoint: every request is sent at its time whatever the others do.
type Client struct {
	// URL is the chat completions endpoint, e.g.
	// http://127.0.0.1:8080/v1/chat/completions.
	URL string
	// URLs, when set instead of URL, are several entries to the same
	// fleet (one proxy per picker replica): each request goes to one of
	// them at random, the same one for the same request index and Seed
	// in every run.
	URLs []string
	// Seed chooses the entry of each request among URLs.
	Seed uint64
	// HTTP sends the requests; nil uses a client whose transport keeps up
	// to MaxInFlight idle connections and does not ask for compression.
	HTTP *http.Client
	// Timeout bounds each request (0: DefaultTimeout; negative: none).
	Timeout time.Duration
	// MaxInFlight bounds the requests in flight, and so the goroutines
	// (0: DefaultMaxInFlight). A request due while the bound is reached
	// is not sent and fails with ReasonInFlight.
	MaxInFlight int
	// Clock is nil for the real clock.
	Clock Clock
}

// Result is what the client measured for one request. Times are from
// the start of the run (Scheduled, Sent) or from the request's send.
type Result struct {
	// Index is the request's Index.
	Index int
	// Scheduled is the request's At; Sent when it was sent (zero when it
	// was not).
	Scheduled, Sent time.Duration
	// Status is the HTTP status (0 without an answer).
	Status int
	// TTFT is the time to the first chunk with non-empty content.
	TTFT time.Duration
	// ITL holds the gaps between successive content chunks.
	ITL []time.Duration
	// E2E is the time to the last byte of the response.
	E2E time.Duration
	// Chunks counts the content chunks.
	Chunks int
	// PromptTokens and OutputTokens are the server's usage counts (0
	// when it sent none).
	PromptTokens, OutputTokens int
	// Reason is empty on success; Detail says more.
	Reason Reason
	Detail string
}

// OK reports whether the request succeeded.
func (r *Result) OK() bool { return r.Reason == "" }

func (r *Result) fail(reason Reason, detail string) {
	r.Reason, r.Detail = reason, detail
}

// Run is the outcome of a replay.
type Run struct {
	// Start is when the replay started; Elapsed runs from Start to the
	// end of the last request.
	Start   time.Time
	Elapsed time.Duration
	// Results holds one entry per request, in the workload's order.
	Results []Result
}

// Run sends reqs (sorted by At) at their times and waits for every
// answer. When ctx is canceled it stops sending, cancels the requests in
// flight, and returns their results (unsent and interrupted requests
// fail with ReasonCanceled) with ctx's error.
func (c *Client) Run(ctx context.Context, reqs []Request) (Run, error) {
	if (c.URL == "") == (len(c.URLs) == 0) {
		return Run{}, errors.New("livebench: want URL or URLs")
	}
	clk := c.Clock
	if clk == nil {
		clk = realClock{}
	}
	limit := c.MaxInFlight
	if limit <= 0 {
		limit = DefaultMaxInFlight
	}
	hc := c.HTTP
	if hc == nil {
		hc = newHTTPClient(limit)
		defer hc.CloseIdleConnections()
	}
	results := make([]Result, len(reqs))
	for i := range reqs {
		results[i] = Result{Index: reqs[i].Index, Scheduled: reqs[i].At}
	}
	sem := make(chan struct{}, limit)
	var wg sync.WaitGroup
	start := clk.Now()
	i := 0
	for ; i < len(reqs); i++ {
		if clk.SleepUntil(ctx, start.Add(reqs[i].At)) != nil {
			break
		}
		select {
		case sem <- struct{}{}:
		default:
			results[i].fail(ReasonInFlight, fmt.Sprintf("%d requests in flight", limit))
			continue
		}
		wg.Add(1)
		go func(r *Request, res *Result) {
			defer func() { <-sem; wg.Done() }()
			c.send(ctx, hc, clk, start, r, res)
		}(&reqs[i], &results[i])
	}
	for ; i < len(reqs); i++ {
		results[i].fail(ReasonCanceled, "not sent")
	}
	wg.Wait()
	return Run{Start: start, Elapsed: clk.Now().Sub(start), Results: results}, ctx.Err()
}

// entry is the URL request index i is sent to.
func (c *Client) entry(i int) string {
	if len(c.URLs) == 0 {
		return c.URL
	}
	return c.URLs[rand.New(rand.NewPCG(c.Seed, uint64(i))).IntN(len(c.URLs))]
}

func newHTTPClient(conns int) *http.Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = conns
	tr.MaxIdleConnsPerHost = conns
	tr.DisableCompression = true
	return &http.Client{Transport: tr}
}

// send sends one request and measures its stream into res.
func (c *Client) send(ctx context.Context, hc *http.Client, clk Clock, start time.Time, r *Request, res *Result) {
	rctx, cancel := ctx, context.CancelFunc(func() {})
	switch {
	case c.Timeout == 0:
		rctx, cancel = context.WithTimeout(ctx, DefaultTimeout)
	case c.Timeout > 0:
		rctx, cancel = context.WithTimeout(ctx, c.Timeout)
	}
	defer cancel()
	body, err := r.Body()
	if err != nil {
		res.fail(ReasonTransport, "encoding the body: "+err.Error())
		return
	}
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, c.entry(r.Index), bytes.NewReader(body))
	if err != nil {
		res.fail(ReasonTransport, err.Error())
		return
	}
	req.Header = r.Header()
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	t0 := clk.Now()
	res.Sent = t0.Sub(start)
	resp, err := hc.Do(req)
	if err != nil {
		res.fail(classify(ctx, rctx, err), err.Error())
		return
	}
	defer resp.Body.Close()
	res.Status = resp.StatusCode
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
		res.fail(ReasonStatus, fmt.Sprintf("%s: %s", resp.Status, bytes.TrimSpace(msg)))
		return
	}
	err = measure(resp.Body, clk.Now, t0, res)
	switch {
	case err != nil && res.Reason == "":
		res.fail(classify(ctx, rctx, err), err.Error())
	case res.Reason == "" && res.Chunks == 0:
		res.fail(ReasonNoContent, "the stream ended without content")
	}
}

// classify names a transport-level error: the run's cancellation, the
// request's timeout, or a broken connection.
func classify(run, req context.Context, err error) Reason {
	switch {
	case run.Err() != nil:
		return ReasonCanceled
	case errors.Is(req.Err(), context.DeadlineExceeded) || errors.Is(err, context.DeadlineExceeded):
		return ReasonTimeout
	}
	return ReasonTransport
}
