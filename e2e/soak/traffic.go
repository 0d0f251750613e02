package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// tenantHeader is kvbandit's --tenant-header in the soak.
const tenantHeader = "x-tenant"

// headerEndpoint is the standalone proxy's response header naming the
// endpoint that served the request.
const headerEndpoint = "x-kvbandit-endpoint"

// words build prompts; systemPrompts are shared prefixes, so requests
// overlap in the KV index as agent traffic does.
var words = strings.Fields(`the a router cache prefix token worker gateway envoy latency batch session
agent tool call result plan step answer question context window memory block hash index score
load queue decode prefill request response stream chunk model weight sample reward learn`)

func systemPrompt(i int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "You are assistant number %d. ", i)
	for j := range 40 + 40*(i%4) {
		b.WriteString(words[(i*13+j*7)%len(words)])
		b.WriteByte(' ')
	}
	return b.String()
}

func sentence(rng *rand.Rand, n int) string {
	var b strings.Builder
	for range n {
		b.WriteString(words[rng.IntN(len(words))])
		b.WriteByte(' ')
	}
	return b.String()
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// chatRequest is the body of a chat completion.
func chatRequest(modelName string, msgs []message, stream bool, maxTokens int, extra map[string]any) []byte {
	m := map[string]any{"model": modelName, "messages": msgs, "max_tokens": maxTokens}
	if stream {
		m["stream"] = true
		m["stream_options"] = map[string]any{"include_usage": true}
	}
	for k, v := range extra {
		m[k] = v
	}
	b, _ := json.Marshal(m) // plain values: cannot fail
	return b
}

func completionRequest(prompt string, stream bool, maxTokens int) []byte {
	m := map[string]any{"model": model, "prompt": prompt, "max_tokens": maxTokens}
	if stream {
		m["stream"] = true
	}
	b, _ := json.Marshal(m)
	return b
}

// reply is what a client read back.
type reply struct {
	status int
	header http.Header
	body   []byte
}

// maxReply bounds what a client reads of one response.
const maxReply = 8 << 20

// post sends a POST to base+path and reads the whole response (bounded).
func (e *env) post(ctx context.Context, base, path string, body []byte, hdr map[string]string) (reply, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	req.Header.Set("content-type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := e.http.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxReply))
	r := reply{status: resp.StatusCode, header: resp.Header, body: b}
	if err != nil {
		return r, fmt.Errorf("reading the response: %w", err)
	}
	return r, nil
}

// expect200 checks a completion: 200, and for SSE the final [DONE].
func expect200(r reply, err error, stream bool) result {
	if err != nil {
		return failf("%s", errText(err))
	}
	if r.status != http.StatusOK {
		return failf("status %d: %s", r.status, errorCode(r.body))
	}
	if stream && !bytes.Contains(r.body, []byte("data: [DONE]")) {
		return failf("SSE response without data: [DONE]")
	}
	if !stream && !bytes.Contains(r.body, []byte(`"choices"`)) {
		return failf("200 without choices: %s", shorten(string(r.body), 60))
	}
	return ok()
}

// expectStatus checks that the answer is one of want.
func expectStatus(r reply, err error, want ...int) result {
	if err != nil {
		return failf("%s", errText(err))
	}
	for _, w := range want {
		if r.status == w {
			return ok()
		}
	}
	return failf("status %d (want %v): %s", r.status, want, errorCode(r.body))
}

// errorCode is the OpenAI error body's code (or type), else a snippet.
func errorCode(body []byte) string {
	var e struct {
		Error struct {
			Code any    `json:"code"`
			Type string `json:"type"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &e) == nil && (e.Error.Code != nil || e.Error.Type != "") {
		if e.Error.Code != nil {
			return fmt.Sprint(e.Error.Code)
		}
		return e.Error.Type
	}
	return shorten(string(body), 60)
}

// errText strips addresses and ports that vary from one error to the next.
func errText(err error) string {
	s := err.Error()
	if errors.Is(err, context.DeadlineExceeded) {
		return "no answer within the request timeout"
	}
	for _, p := range []string{"Post ", "Get "} {
		if strings.HasPrefix(s, p) {
			if i := strings.Index(s, ": "); i > 0 {
				s = s[i+2:]
			}
		}
	}
	return s
}

func (e *env) tenant(rng *rand.Rand) map[string]string {
	return map[string]string{tenantHeader: fmt.Sprintf("tenant-%d", rng.IntN(4))}
}

func (e *env) chatMessages(rng *rand.Rand) []message {
	return []message{
		{Role: "system", Content: systemPrompt(rng.IntN(8))},
		{Role: "user", Content: sentence(rng, 5+rng.IntN(40))},
	}
}

// ---- normal traffic -------------------------------------------------------------

func (e *env) chat(base string, stream bool) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		body := chatRequest(model, e.chatMessages(rng), stream, 4+rng.IntN(60), nil)
		r, err := e.post(ctx, base, "/v1/chat/completions", body, e.tenant(rng))
		res := expect200(r, err, stream)
		if res.kind == resultOK && base == e.proxyURL {
			if ep := r.header.Get(headerEndpoint); !e.isWorker(ep) {
				return failf("proxy answered from %q, not a worker", ep)
			}
		}
		return res
	}
}

func (e *env) completion(base string, stream bool) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		prompt := systemPrompt(rng.IntN(8)) + sentence(rng, 5+rng.IntN(60))
		r, err := e.post(ctx, base, "/v1/completions", completionRequest(prompt, stream, 4+rng.IntN(60)), e.tenant(rng))
		return expect200(r, err, stream)
	}
}

// agent runs one multi-turn session: every turn resends the growing
// history with the session's prefix hints (headers, or nvext.agent_hints
// in the body).
func (e *env) agent(base string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		turns := 3 + rng.IntN(4)
		id := fmt.Sprintf("agent-%016x", rng.Uint64())
		msgs := e.chatMessages(rng)
		hdr := e.tenant(rng)
		var extra map[string]any
		if rng.IntN(3) == 0 {
			extra = map[string]any{"nvext": map[string]any{"agent_hints": map[string]any{
				"prefix_id": id, "total_requests": turns, "osl": 64, "iat": 200}}}
		} else {
			hdr["x-prefix-id"] = id
			hdr["x-prefix-total-requests"] = strconv.Itoa(turns)
			hdr["x-prefix-osl"] = []string{"LOW", "MEDIUM", "HIGH", "300"}[rng.IntN(4)]
			hdr["x-prefix-iat"] = []string{"LOW", "MEDIUM", "50"}[rng.IntN(3)]
			if rng.IntN(4) == 0 {
				hdr["x-request-priority"] = strconv.Itoa(rng.IntN(3))
			}
		}
		for turn := range turns {
			r, err := e.post(ctx, base, "/v1/chat/completions", chatRequest(model, msgs, false, 8+rng.IntN(40), extra), hdr)
			if res := expect200(r, err, false); res.kind != resultOK {
				res.reason = fmt.Sprintf("turn %d: %s", turn+1, res.reason)
				return res
			}
			var c struct {
				Choices []struct {
					Message message `json:"message"`
				} `json:"choices"`
			}
			if json.Unmarshal(r.body, &c) != nil || len(c.Choices) == 0 {
				return failf("turn %d: unreadable completion", turn+1)
			}
			msgs = append(msgs, message{Role: "assistant", Content: c.Choices[0].Message.Content},
				message{Role: "user", Content: sentence(rng, 3+rng.IntN(20))})
			select {
			case <-ctx.Done():
				return failf("turn %d: %s", turn+1, errText(ctx.Err()))
			case <-time.After(time.Duration(20+rng.IntN(200)) * time.Millisecond):
			}
		}
		return ok()
	}
}

// ---- clients that go away, and bad requests --------------------------------------

// cancelBody declares a whole body, sends part of it and goes away.
func (e *env) cancelBody(base string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		body := chatRequest(model, e.chatMessages(rng), false, 16, nil)
		cut := 1 + rng.IntN(len(body)-1)
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		pr, pw := io.Pipe()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", pr)
		if err != nil {
			return failf("%v", err)
		}
		req.ContentLength = int64(len(body))
		req.Header.Set("content-type", "application/json")
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = pw.Write(body[:cut])
			select {
			case <-ctx.Done():
			case <-time.After(time.Duration(20+rng.IntN(400)) * time.Millisecond):
			}
			cancel()
			pw.CloseWithError(context.Canceled)
		}()
		resp, err := e.http.Do(req)
		wg.Wait()
		if err != nil {
			return ok() // went away, as intended
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, maxReply))
		if resp.StatusCode >= 500 && resp.StatusCode != http.StatusServiceUnavailable {
			return failf("status %d before the client went away: %s", resp.StatusCode, errorCode(b))
		}
		return ok()
	}
}

// cancelStream starts a long SSE generation, reads a little and goes away.
func (e *env) cancelStream(base string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		body := chatRequest(model, e.chatMessages(rng), true, 2000, nil)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
		if err != nil {
			return failf("%v", err)
		}
		req.Header.Set("content-type", "application/json")
		resp, err := e.http.Do(req)
		if err != nil {
			return failf("%s", errText(err))
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b, _ := io.ReadAll(io.LimitReader(resp.Body, maxReply))
			return failf("status %d: %s", resp.StatusCode, errorCode(b))
		}
		sc := bufio.NewScanner(resp.Body)
		want := 1 + rng.IntN(20)
		for got := 0; got < want; {
			if !sc.Scan() {
				return failf("stream ended after %d of %d chunks: %v", got, want, sc.Err())
			}
			if strings.HasPrefix(sc.Text(), "data: ") {
				got++
			}
		}
		return ok() // cancel() goes away mid-stream
	}
}

func (e *env) unknownModel(base string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		name := fmt.Sprintf("no-such-model-%d", rng.IntN(1000))
		r, err := e.post(ctx, base, "/v1/chat/completions", chatRequest(name, e.chatMessages(rng), rng.IntN(2) == 0, 8, nil), nil)
		return expectStatus(r, err, http.StatusNotFound)
	}
}

var invalidBodies = []string{
	`{"model":"sim-model","messages":[{"role":"user","content":"cut here`,
	`not json at all`,
	`{"messages":[{"role":"user","content":"no model"}]}`,
	`{"model":12,"messages":[]}`,
	`{"model":"sim-model","messages":"not a list"}`,
	`[1,2,3]`,
	`{"model":"sim-model","messages":[{"role":"user","content":"x"}]}}}`,
	"{\"model\":\"sim-model\",\"prompt\":\"\xff\xfe invalid utf-8\"",
}

func (e *env) invalidJSON(base string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		path := []string{"/v1/chat/completions", "/v1/completions"}[rng.IntN(2)]
		r, err := e.post(ctx, base, path, []byte(invalidBodies[rng.IntN(len(invalidBodies))]), nil)
		return expectStatus(r, err, http.StatusBadRequest)
	}
}

// oversizedBody is a valid chat request larger than --max-body-bytes,
// built once and shared read-only.
func (e *env) oversizedBody() []byte {
	e.bigOnce.Do(func() {
		n := int(e.maxBody) + 64<<10
		var b bytes.Buffer
		b.Grow(n + 128)
		b.WriteString(`{"model":"sim-model","messages":[{"role":"user","content":"`)
		for b.Len() < n {
			b.WriteString("padding ")
		}
		b.WriteString(`"}]}`)
		e.big = b.Bytes()
	})
	return e.big
}

func (e *env) oversized(base string) func(context.Context, *rand.Rand) result {
	return func(ctx context.Context, rng *rand.Rand) result {
		r, err := e.post(ctx, base, "/v1/chat/completions", e.oversizedBody(), nil)
		if err != nil && isReset(err) {
			// The server answered and closed while the body was still being
			// written: the client saw the reset, not the status.
			return skipped("connection closed while sending the body")
		}
		return expectStatus(r, err, http.StatusRequestEntityTooLarge)
	}
}

func isReset(err error) bool {
	s := err.Error()
	return strings.Contains(s, "connection reset") || strings.Contains(s, "broken pipe") || strings.Contains(s, "EOF")
}
