package proxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sync"
	"time"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/hints"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// forward routes and proxies one request whose cleaned path is clean.
func (p *Proxy) forward(w http.ResponseWriter, r *http.Request, clean string, kind openai.Kind, path string) {
	// The decision deadline runs from the request headers, as on the
	// ext_proc path: it covers the body read and the pick.
	deadline := time.Now().Add(p.cfg.DecisionTimeout)
	w, r, span := p.tracer.StartHTTP(w, r, clean)
	defer span.End(0)
	if p.stopCtx.Err() != nil {
		p.fail(w, path, errStopped)
		return
	}
	// ctx ends when the client goes away or Stop cuts the request.
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	unhook := context.AfterFunc(p.stopCtx, func() { cancel(context.Cause(p.stopCtx)) })
	defer unhook()

	body, err := p.readBody(w, r, deadline)
	if err != nil {
		closeUnread(w, r)
		p.fail(w, path, err)
		return
	}
	defer body.release()
	target := (&url.URL{Path: clean, RawQuery: r.URL.RawQuery}).RequestURI()
	req, err := p.build(ctx, r, target, kind, body.bytes())
	if err != nil {
		p.fail(w, path, err)
		return
	}
	pctx, cancelPick := context.WithDeadlineCause(ctx, deadline, extproc.ErrDecisionTimeout)
	pickStart := p.clk.Now()
	d, err := p.engine.Pick(pctx, &req)
	cancelPick()
	span.Decision(req.Arrival, pickStart, p.clk.Now(), d, err)
	if err != nil {
		if ctx.Err() != nil {
			if p.stopCtx.Err() == nil {
				p.metrics.request(path, 0) // the client went away while queued
				return
			}
			err = errStopped
		}
		p.fail(w, path, err)
		return
	}
	p.metrics.tokensRouted.Add(float64(req.TokenCount))
	x := &exchange{p: p, d: d, ctx: ctx, span: span}
	defer func() { p.metrics.request(path, x.reply) }()
	defer x.recoverEnd()
	x.run(w, r, target, body)
}

// readBody reads the request body, bounded by MaxBodyBytes, the buffer
// budget and the deadline (the decision deadline: headers → decision).
// The buffer grows with the bytes received, never with a declared
// Content-Length, and each chunk is charged to the budget as it arrives.
// The read deadline is cleared once the body has been read in full, so the
// response (a long SSE stream) is never cut; on an error it stays, which
// bounds net/http's draining of what is left of the body.
func (p *Proxy) readBody(w http.ResponseWriter, r *http.Request, deadline time.Time) (*reqBody, error) {
	rb := &reqBody{budget: p.budget}
	limit := p.cfg.MaxBodyBytes
	if r.ContentLength > limit {
		return nil, fmt.Errorf("%w: more than %d bytes", extproc.ErrBodyTooLarge, limit)
	}
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return rb, nil
	}
	rc := http.NewResponseController(w)
	// ErrNotSupported only for a ResponseWriter that is not net/http's
	// (serve always uses net/http's server).
	deadlineSet := rc.SetReadDeadline(deadline) == nil
	fail := func(err error) (*reqBody, error) {
		rb.release()
		return nil, err
	}
	size := int64(initialBodyBuffer)
	if r.ContentLength > 0 {
		size = min(r.ContentLength+1, size) // +1: EOF without growing
	}
	buf := make([]byte, 0, min(size, limit+1))
	for {
		if len(buf) == cap(buf) {
			grown := make([]byte, len(buf), min(2*int64(cap(buf)), limit+1))
			copy(grown, buf)
			buf = grown
		}
		n, err := r.Body.Read(buf[len(buf):cap(buf)])
		if n > 0 {
			if !p.budget.Take(int64(n)) {
				return fail(fmt.Errorf("%w: request body of %s", extproc.ErrBufferBudget, r.URL.Path))
			}
			rb.held += int64(n)
			buf = buf[:len(buf)+n]
			if int64(len(buf)) > limit {
				return fail(fmt.Errorf("%w: more than %d bytes", extproc.ErrBodyTooLarge, limit))
			}
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			var ne net.Error
			if errors.Is(err, os.ErrDeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
				return fail(fmt.Errorf("%w: request body not received within %v (%d bytes arrived)", extproc.ErrDecisionTimeout, p.cfg.DecisionTimeout, len(buf)))
			}
			var mbe *http.MaxBytesError
			if errors.As(err, &mbe) {
				return fail(fmt.Errorf("%w: more than %d bytes", extproc.ErrBodyTooLarge, limit))
			}
			return fail(&extproc.Rejection{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "body_read_error", Err: err})
		}
	}
	if deadlineSet {
		_ = rc.SetReadDeadline(time.Time{})
	}
	rb.b = buf
	return rb, nil
}

// build parses, reads hints and tokenizes: the routing.Request for body.
func (p *Proxy) build(ctx context.Context, r *http.Request, target string, kind openai.Kind, body []byte) (routing.Request, error) {
	req := routing.Request{ID: r.Header.Get("X-Request-Id"), Path: target, Arrival: p.clk.Now()}
	if p.cfg.TenantHeader != "" {
		// Bounded as the ext_proc side does (prefixstate.BoundID).
		req.Tenant = prefixstate.BoundID(r.Header.Get(p.cfg.TenantHeader))
	}
	header := hints.WithSessionHeaders(func(name string) (string, bool) {
		v := r.Header.Values(name)
		if len(v) == 0 {
			return "", false
		}
		return v[0], true
	}, p.cfg.SessionHeaders)
	parsed, problems, err := extproc.ParseRequest(kind, body, header, &req)
	if err != nil {
		return req, err
	}
	if problems.Count > 0 {
		p.metrics.hintProblems.Add(float64(problems.Count))
	}
	obj, cli := hints.ResolvePriority(header, p.objectives, p.cfg.ClientPriority, &req.Hints)
	if obj != hints.ObjectiveNone {
		p.metrics.inferenceObjectives.WithLabelValues(obj).Inc()
	}
	if cli != hints.ClientKept {
		p.metrics.clientPriorities.WithLabelValues(cli).Inc()
	}
	if parsed != nil {
		reason, terr := extproc.TokenizeRequest(ctx, p.tok, p.cfg.TokenizerTimeout, parsed, body, &req)
		if reason != "" {
			if terr != nil {
				p.log.Debug("tokenizer failed; estimating", "err", terr, "model", parsed.Model)
			}
			p.metrics.tokenizerFallbacks.WithLabelValues(reason).Inc()
		}
	}
	return req, nil
}

// reqBody is a request body read by the proxy, its bytes charged to the
// buffer budget until release.
type reqBody struct {
	mu       sync.Mutex
	b        []byte
	held     int64
	budget   *extproc.Budget
	released bool
}

// bytes returns the body (nil after release).
func (rb *reqBody) bytes() []byte {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	return rb.b
}

// open returns a reader for the worker; it is the upstream request's
// GetBody, so the transport can replay the body on a fresh connection
// until release.
func (rb *reqBody) open() (io.ReadCloser, error) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if rb.released {
		return nil, errBodyReleased
	}
	u := &upstreamBody{}
	u.r.Reset(rb.b)
	return u, nil
}

// release gives the bytes back to the budget and forgets them: the body is
// no longer needed once the worker has answered (or could not be reached).
// It is idempotent.
func (rb *reqBody) release() {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	rb.budget.Release(rb.held)
	rb.held, rb.b, rb.released = 0, nil, true
}

// replace swaps the body for b (the direct P/D mode's decode stage body),
// charging b to the budget; false, body unchanged, when the budget has no
// room for it.
func (rb *reqBody) replace(b []byte) bool {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if rb.released || !rb.budget.Take(int64(len(b))) {
		return false
	}
	rb.budget.Release(rb.held)
	rb.b, rb.held = b, int64(len(b))
	return true
}

// shrink swaps the body for b, no longer than it (the body with a field
// removed), and gives the bytes saved back to the budget.
func (rb *reqBody) shrink(b []byte) {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if rb.released || int64(len(b)) > rb.held {
		return
	}
	rb.budget.Release(rb.held - int64(len(b)))
	rb.b, rb.held = b, int64(len(b))
}

var errBodyReleased = errors.New("proxy: request body already released")
