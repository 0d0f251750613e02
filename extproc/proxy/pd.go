package proxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/kvbandit/kvbandit/extproc"
)

// PDMode says who runs the two stages of a disaggregated request
// (Decision.Prefill set).
type PDMode string

const (
	// PDModeSidecar (the default) sends the request to the decode endpoint
	// with x-prefiller-host-port; llm-d's pd-sidecar in front of the decode
	// engine runs the prefill stage.
	PDModeSidecar PDMode = "sidecar"
	// PDModeDirect makes the proxy run both stages itself: for decode
	// workers without a sidecar (vLLM with a KV transfer connector,
	// reachable directly).
	PDModeDirect PDMode = "direct"
)

// ParsePDMode parses --pd-proxy-mode ("" is sidecar).
func ParsePDMode(s string) (PDMode, error) {
	switch PDMode(s) {
	case "", PDModeSidecar:
		return PDModeSidecar, nil
	case PDModeDirect:
		return PDModeDirect, nil
	}
	return "", fmt.Errorf("%w: %q (sidecar or direct)", ErrPDMode, s)
}

// ErrPDMode: an unknown P/D mode.
var ErrPDMode = errors.New("proxy: unknown P/D mode")

// Defaults of the direct mode's prefill stage.
const (
	// DefaultPrefillTimeout bounds the prefill stage (queueing on the
	// prefill worker included); beyond it the request is served
	// aggregated.
	DefaultPrefillTimeout = 60 * time.Second
	// minPrefillResponseBytes is the least the prefill answer may hold
	// (Config.MaxPrefillResponseBytes defaults to the larger of it and
	// MaxBodyBytes: an echoing engine answers with the whole prompt).
	minPrefillResponseBytes = 1 << 20
)

// Fallback reasons (label values of kvbandit_proxy_pd_fallbacks_total).
const (
	fallbackConnect  = "connect"
	fallbackTimeout  = "timeout"
	fallbackStatus   = "status"
	fallbackTooLarge = "too_large"
	fallbackBadJSON  = "bad_json"
	fallbackNoParams = "no_kv_transfer_params"
	fallbackBody     = "bad_request_body"
	fallbackBudget   = "buffer_budget"
)

// prefillTransferParams is what the prefill stage sends as
// kv_transfer_params, as llm-d's pd-sidecar v0.4.0 does (NIXL v2
// connector): prefill only, the decode side named later.
var prefillTransferParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

var (
	jsonFalse = json.RawMessage(`false`)
	jsonOne   = json.RawMessage(`1`)
)

// errFallback carries the reason a prefill stage failed.
type errFallback struct {
	reason string
	err    error
}

func (e *errFallback) Error() string { return e.reason + ": " + e.err.Error() }
func (e *errFallback) Unwrap() error { return e.err }

func fallback(reason string, err error) error { return &errFallback{reason: reason, err: err} }

// prefillBody is the prefill stage's body: the client's JSON object with
// stream false, no stream_options, max_tokens and max_completion_tokens 1
// and kv_transfer_params asking for a remote decode.
func prefillBody(body []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil || m == nil {
		return nil, fallback(fallbackBody, fmt.Errorf("request body is not a JSON object"))
	}
	m["stream"] = jsonFalse
	delete(m, "stream_options")
	m["max_tokens"] = jsonOne
	m["max_completion_tokens"] = jsonOne
	m["kv_transfer_params"] = prefillTransferParams
	return json.Marshal(m)
}

// decodeBody is the decode stage's body: the client's JSON object with
// kv_transfer_params replaced by params (the prefill worker's).
func decodeBody(body []byte, params json.RawMessage) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil || m == nil {
		return nil, fallback(fallbackBody, fmt.Errorf("request body is not a JSON object"))
	}
	m["kv_transfer_params"] = params
	return json.Marshal(m)
}

// transferParams returns the kv_transfer_params object of a prefill
// worker's answer.
func transferParams(answer []byte) (json.RawMessage, error) {
	var a struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(answer, &a); err != nil {
		return nil, fallback(fallbackBadJSON, fmt.Errorf("prefill answer: %w", err))
	}
	if kv := bytes.TrimSpace(a.KV); len(kv) == 0 || kv[0] != '{' {
		return nil, fallback(fallbackNoParams, errors.New("prefill answer has no kv_transfer_params object"))
	}
	return a.KV, nil
}

// prefill runs the direct mode's prefill stage on the decision's prefill
// endpoint and returns the decode stage's body. Its errors are
// *errFallback, or the request context's when the client went away or
// Stop cut the request. The request ID is fresh and shared by both stages,
// as the sidecar does; the caller sets it on the decode stage.
func (x *exchange) prefill(r *http.Request, target string, body []byte, requestID string) ([]byte, error) {
	p := x.p
	pb, err := prefillBody(body)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeoutCause(x.ctx, p.cfg.PrefillTimeout, errPrefillTimeout)
	defer cancel()
	ep := string(x.d.Prefill)
	up, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+ep+target, bytes.NewReader(pb))
	if err != nil {
		return nil, fallback(fallbackConnect, err)
	}
	up.Header = outboundHeader(r)
	up.Header.Set("Content-Type", "application/json")
	up.Header.Set("X-Request-Id", requestID)
	// The answer is one JSON document, read whole: no compression to undo.
	up.Header.Del("Accept-Encoding")
	resp, err := p.rt.RoundTrip(up)
	if err != nil {
		return nil, x.prefillErr(ctx, fallbackConnect, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, fallback(fallbackStatus, fmt.Errorf("prefill endpoint %s answered %d", ep, resp.StatusCode))
	}
	limit := p.cfg.MaxPrefillResponseBytes
	if resp.ContentLength > limit {
		return nil, fallback(fallbackTooLarge, fmt.Errorf("prefill answer of %d bytes, limit %d", resp.ContentLength, limit))
	}
	// The answer is charged to the buffer budget as its bytes arrive, and
	// while it is held: a slow answer holds only what it has sent.
	answer, held, err := readCharged(resp.Body, resp.ContentLength, limit, p.budget)
	defer p.budget.Release(held)
	if err != nil {
		var fb *errFallback
		if errors.As(err, &fb) {
			return nil, err
		}
		return nil, x.prefillErr(ctx, fallbackConnect, err)
	}
	kv, err := transferParams(answer)
	if err != nil {
		return nil, err
	}
	return decodeBody(body, kv)
}

var errPrefillTimeout = errors.New("prefill stage timed out")

// prefillReadChunk is the first buffer of a prefill answer read (it grows
// by doubling, up to the limit, as bytes arrive).
const prefillReadChunk = 32 << 10

// readCharged reads r to its end, at most limit bytes, charging each chunk
// to budget as it arrives (never the declared length, never the limit
// ahead of time). It returns the bytes and how many are charged, which
// the caller releases whatever the error; too many bytes or no budget
// left are *errFallback.
func readCharged(r io.Reader, declared, limit int64, budget *extproc.Budget) ([]byte, int64, error) {
	size := int64(prefillReadChunk)
	if declared >= 0 {
		size = min(declared+1, size) // +1: EOF without growing
	}
	buf := make([]byte, 0, min(size, limit+1))
	var held int64
	for {
		if len(buf) == cap(buf) {
			grown := make([]byte, len(buf), min(2*int64(cap(buf)), limit+1))
			copy(grown, buf)
			buf = grown
		}
		n, err := r.Read(buf[len(buf):cap(buf)])
		if n > 0 {
			if !budget.Take(int64(n)) {
				return nil, held, fallback(fallbackBudget, errors.New("no buffer budget for the prefill answer"))
			}
			held += int64(n)
			buf = buf[:len(buf)+n]
			if int64(len(buf)) > limit {
				return nil, held, fallback(fallbackTooLarge, fmt.Errorf("prefill answer over %d bytes", limit))
			}
		}
		if err == io.EOF {
			return buf, held, nil
		}
		if err != nil {
			return nil, held, err
		}
	}
}

// prefillErr classifies a transport error of the prefill stage: the
// request's own end (client gone, Stop) is returned as is; the stage's
// timeout and anything else are fallbacks.
func (x *exchange) prefillErr(ctx context.Context, reason string, err error) error {
	if x.ctx.Err() != nil {
		return x.ctx.Err()
	}
	if errors.Is(context.Cause(ctx), errPrefillTimeout) {
		return fallback(fallbackTimeout, fmt.Errorf("%w after %v: %w", errPrefillTimeout, x.p.cfg.PrefillTimeout, err))
	}
	return fallback(reason, err)
}

// direct runs the prefill stage for a disaggregated decision in direct
// mode and puts the decode stage's body in body. It reports false when
// the request context ended (the caller ends the decision). On success
// the prefill endpoint is released (Decision.Prefilled); on a failure it is
// released too, the failure counted, and the request goes to the decode
// endpoint unchanged, aggregated.
func (x *exchange) direct(r *http.Request, target string, body *reqBody, up *http.Request) bool {
	p, d := x.p, x.d
	id := rand.Text()
	nb, err := x.prefill(r, target, body.bytes(), id)
	if err == nil && !body.replace(nb) {
		err = fallback(fallbackBudget, errors.New("no buffer budget for the decode stage's body"))
	}
	var fb *errFallback
	switch {
	case err == nil:
		d.Prefilled()
		up.Header.Set("X-Request-Id", id)
	case errors.As(err, &fb):
		d.ReleasePrefill()
		p.metrics.pdFallbacks.WithLabelValues(fb.reason).Inc()
		p.log.Debug("prefill stage failed; serving aggregated", "prefill", string(d.Prefill), "decode", string(d.Endpoint), "reason", fb.reason, "err", fb.err)
	default:
		return false
	}
	return true
}
