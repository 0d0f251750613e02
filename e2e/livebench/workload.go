package livebench

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/sim"
	"github.com/kvbandit/kvbandit/routing/sim/trace"
)

// Request is one chat completion of a replay.
type Request struct {
	// Index is the request's position in the workload (arrival order).
	Index int
	// At is when the request is sent, from the start of the replay.
	At time.Duration
	// Tokens are the trace tokens of the prompt; each renders as one word
	// (see [Text]). The slice may be shared with other requests.
	Tokens []uint32
	// MaxTokens is the trace's output length, sent as max_tokens with
	// ignore_eos, so the server generates exactly that many tokens.
	MaxTokens int
	// Model is the body's model.
	Model string
	// Hints are sent as x-prefix-* headers when PrefixID is set.
	Hints routing.Hints
}

// Prompt is the request's user message: the text of its tokens.
func (r *Request) Prompt() string { return Text(r.Tokens) }

// chatBody is the JSON body of a streaming chat completion. The
// llm-d-inference-sim (v0.10.2) honours ignore_eos (it then generates
// max_tokens tokens) and ignores min_tokens, which is not sent.
type chatBody struct {
	Model         string        `json:"model"`
	Messages      []chatMessage `json:"messages"`
	MaxTokens     int           `json:"max_tokens"`
	IgnoreEOS     bool          `json:"ignore_eos"`
	Stream        bool          `json:"stream"`
	StreamOptions streamOptions `json:"stream_options"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// Body is the request's JSON body: one user message holding the prompt,
// max_tokens and ignore_eos, stream with usage.
func (r *Request) Body() ([]byte, error) {
	return json.Marshal(chatBody{
		Model:         r.Model,
		Messages:      []chatMessage{{Role: "user", Content: r.Prompt()}},
		MaxTokens:     max(r.MaxTokens, 1),
		IgnoreEOS:     true,
		Stream:        true,
		StreamOptions: streamOptions{IncludeUsage: true},
	})
}

// Header returns the request's hint headers (x-prefix-id,
// x-prefix-total-requests, x-prefix-osl in tokens, x-prefix-iat in ms),
// or an empty header when it has no prefix id. Content-Type is not set.
func (r *Request) Header() http.Header {
	h := http.Header{}
	hi := r.Hints
	if hi.PrefixID == "" {
		return h
	}
	h.Set(hints.HeaderPrefixID, hi.PrefixID)
	if hi.TotalRequests > 0 {
		h.Set(hints.HeaderTotalRequests, strconv.Itoa(hi.TotalRequests))
	}
	if v := levelValue(hi.OSLTokens, hi.OSL); v != "" {
		h.Set(hints.HeaderOSL, v)
	}
	if v := levelValue(hi.IATMillis, hi.IAT); v != "" {
		h.Set(hints.HeaderIAT, v)
	}
	return h
}

// levelValue is the raw number when known, else the level's name.
func levelValue(raw int, l routing.Level) string {
	if raw > 0 {
		return strconv.Itoa(raw)
	}
	return l.String()
}

// Options shape a workload from a trace.
type Options struct {
	// Window keeps the requests that arrive in the first Window of the
	// trace (trace time, from its first arrival, before RateScale); 0
	// keeps all.
	Window time.Duration
	// RateScale compresses time: send times are divided by it (2 sends
	// twice as fast). 0 means 1.
	RateScale float64
	// Grid is the trace's timestamp grid: every arrival is moved to a
	// uniformly random point of its grid cell [t, t+Grid). 0 detects the
	// grid ([DetectGrid]); negative keeps arrivals as they are.
	Grid time.Duration
	// Seed seeds the spreading.
	Seed uint64
	// Limit keeps only the first Limit requests; 0 keeps all.
	Limit int
	// Model overrides the requests' model when set.
	Model string
	// StripHints drops every hint (no x-prefix-* header is sent).
	StripHints bool
	// Strict makes the first bad trace line fatal (readers only);
	// otherwise bad lines are skipped and counted in the trace.Report.
	Strict bool
}

func (o Options) validate() error {
	var errs []error
	if o.Window < 0 {
		errs = append(errs, fmt.Errorf("window %v: must be >= 0", o.Window))
	}
	if o.RateScale < 0 || math.IsNaN(o.RateScale) || math.IsInf(o.RateScale, 0) {
		errs = append(errs, fmt.Errorf("rate scale %v: must be > 0", o.RateScale))
	}
	if o.Limit < 0 {
		errs = append(errs, fmt.Errorf("limit %d: must be >= 0", o.Limit))
	}
	return errors.Join(errs...)
}

// Workload is a replay: requests sorted by send time.
type Workload struct {
	Requests []Request
	// Grid is the grid the arrivals were spread over (0: none).
	Grid time.Duration
}

// Span is the send time of the last request.
func (w Workload) Span() time.Duration {
	if len(w.Requests) == 0 {
		return 0
	}
	return w.Requests[len(w.Requests)-1].At
}

// spreadSalt keeps the spreading stream apart from other seeded streams.
const spreadSalt = 0x7370_7265_6164_2121

// FromTrace turns trace requests (any order; routing/sim/trace readers
// give arrival order) into a workload: it keeps the first opt.Window of
// trace time, spreads arrivals over their grid cell, shifts the first
// cell to 0, divides by opt.RateScale, and keeps opt.Limit requests.
// Tokens and hint values are shared with reqs, not copied.
func FromTrace(reqs []sim.Request, opt Options) (Workload, error) {
	if err := opt.validate(); err != nil {
		return Workload{}, err
	}
	reqs = slices.Clone(reqs)
	slices.SortStableFunc(reqs, func(a, b sim.Request) int { return cmp.Compare(a.Arrival, b.Arrival) })
	if len(reqs) == 0 {
		return Workload{}, trace.ErrEmpty
	}
	first := reqs[0].Arrival
	if opt.Window > 0 {
		n, _ := slices.BinarySearchFunc(reqs, first+opt.Window, func(r sim.Request, t time.Duration) int {
			return cmp.Compare(r.Arrival, t)
		})
		reqs = reqs[:n]
	}
	arrivals := make([]time.Duration, len(reqs))
	for i, r := range reqs {
		arrivals[i] = r.Arrival - first
	}
	grid := opt.Grid
	if grid == 0 {
		grid = DetectGrid(arrivals)
	}
	if grid > 0 {
		Spread(arrivals, grid, rand.New(rand.NewPCG(opt.Seed, spreadSalt)))
	}
	scale := opt.RateScale
	if scale == 0 {
		scale = 1
	}
	out := make([]Request, len(reqs))
	for i, r := range reqs {
		out[i] = Request{
			At:        time.Duration(float64(arrivals[i]) / scale),
			Tokens:    r.Tokens,
			MaxTokens: max(r.OutputLen, 1),
			Model:     cmp.Or(opt.Model, r.Model),
		}
		if !opt.StripHints {
			out[i].Hints = r.Hints
		}
	}
	slices.SortStableFunc(out, func(a, b Request) int { return cmp.Compare(a.At, b.At) })
	if opt.Limit > 0 && len(out) > opt.Limit {
		out = out[:opt.Limit:opt.Limit]
	}
	for i := range out {
		out[i].Index = i
	}
	return Workload{Requests: out, Grid: max(grid, 0)}, nil
}

// Agentic generates routing/sim/trace's agentic sessions and turns them
// into a workload. Their hints (prefix id = session, total requests,
// output length, think time) become x-prefix-* headers unless
// opt.StripHints. Arrivals are not on a grid, so opt.Grid is normally 0
// (detection finds none).
func Agentic(cfg trace.AgenticConfig, opt Options) (Workload, error) {
	reqs, err := trace.Agentic(cfg)
	if err != nil {
		return Workload{}, err
	}
	return FromTrace(reqs, opt)
}
