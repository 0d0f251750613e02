package simworker

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/extproc/openai"
	"github.com/kvbandit/kvbandit/routing/sim"
)

func (s *Server) handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { s.complete(w, r, openai.KindChat) })
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) { s.complete(w, r, openai.KindCompletion) })
	mux.HandleFunc("GET /v1/models", s.models)
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /metrics", s.metrics)
	return mux
}

// apiError writes an OpenAI-style error, as vLLM's server does.
func apiError(w http.ResponseWriter, status int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": status}})
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func usageOf(prompt, cached, completion int) *usage {
	u := &usage{PromptTokens: prompt, CompletionTokens: completion, TotalTokens: prompt + completion}
	u.PromptTokensDetails.CachedTokens = cached
	return u
}

// words are the synthetic content, one per generated token.
var words = [...]string{"the", "router", "keeps", "each", "session", "on", "a", "warm", "cache", "and", "spreads", "new", "work", "across", "idle", "workers"}

func word(i int) string { return words[i%len(words)] + " " }

func (s *Server) complete(w http.ResponseWriter, r *http.Request, kind openai.Kind) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		apiError(w, http.StatusRequestEntityTooLarge, "BadRequestError", err.Error())
		return
	}
	req, err := openai.Parse(kind, body)
	if err != nil {
		apiError(w, http.StatusBadRequest, "BadRequestError", err.Error())
		return
	}
	if req.Model != s.cfg.Model {
		apiError(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", req.Model))
		return
	}
	tokens := extproc.EstimateTokens(req)
	if len(tokens) == 0 {
		apiError(w, http.StatusBadRequest, "BadRequestError", "empty prompt")
		return
	}
	out := req.MaxTokens
	finish := "length"
	if out == 0 {
		out, finish = s.cfg.DefaultMaxTokens, "stop"
	}
	c, err := s.do(r.Context(), &sim.Request{Tokens: tokens, OutputLen: out, Model: req.Model})
	if err != nil {
		apiError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", err.Error())
		return
	}
	// Wait for the model to accept it (or refuse: too long for the cache).
	for {
		p := c.progress()
		if p.err != nil {
			status := http.StatusServiceUnavailable
			if errors.Is(p.err, sim.ErrInvalidRequest) {
				status = http.StatusBadRequest
			}
			apiError(w, status, "BadRequestError", p.err.Error())
			return
		}
		if p.accepted {
			break
		}
		select {
		case <-c.notify:
		case <-r.Context().Done():
			return
		}
	}
	s.mu.Lock()
	s.nextID++
	id := s.nextID
	s.mu.Unlock()
	rs := response{kind: kind, model: req.Model, created: time.Now().Unix(), prompt: len(tokens), finish: finish}
	if kind == openai.KindChat {
		rs.id = fmt.Sprintf("chatcmpl-sim-%d", id)
	} else {
		rs.id = fmt.Sprintf("cmpl-sim-%d", id)
	}
	if req.Stream {
		s.stream(w, r, c, &rs, req.IncludeUsage)
		return
	}
	var p progress
	for !p.done {
		if p, err = s.wait(r.Context(), c, p.generated); err != nil {
			if r.Context().Err() == nil {
				apiError(w, http.StatusServiceUnavailable, "ServiceUnavailableError", err.Error())
			}
			return
		}
	}
	var text strings.Builder
	for i := range p.generated {
		text.WriteString(word(i))
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(rs.full(text.String(), usageOf(rs.prompt, p.cached, p.generated)))
}

// response is what every chunk of one response shares.
type response struct {
	kind    openai.Kind
	id      string
	model   string
	created int64
	prompt  int
	finish  string
}

func (rs *response) object(chunk bool) string {
	switch {
	case rs.kind == openai.KindChat && chunk:
		return "chat.completion.chunk"
	case rs.kind == openai.KindChat:
		return "chat.completion"
	}
	return "text_completion"
}

func (rs *response) envelope(chunk bool, choices []map[string]any, u *usage) map[string]any {
	m := map[string]any{"id": rs.id, "object": rs.object(chunk), "created": rs.created, "model": rs.model, "choices": choices}
	if u != nil {
		m["usage"] = u
	}
	return m
}

func (rs *response) full(text string, u *usage) map[string]any {
	choice := map[string]any{"index": 0, "finish_reason": rs.finish, "logprobs": nil}
	if rs.kind == openai.KindChat {
		choice["message"] = map[string]any{"role": "assistant", "content": text}
	} else {
		choice["text"] = text
	}
	return rs.envelope(false, []map[string]any{choice}, u)
}

// chunk is one SSE chunk's choice: text for the delta, finish set on the
// last one, role on the first (chat).
func (rs *response) chunk(text string, first bool, finish any) map[string]any {
	choice := map[string]any{"index": 0, "finish_reason": finish, "logprobs": nil}
	if rs.kind == openai.KindChat {
		delta := map[string]any{"content": text}
		if first {
			delta["role"] = "assistant"
		}
		if finish != nil {
			delta = map[string]any{}
		}
		choice["delta"] = delta
	} else {
		choice["text"] = text
	}
	return rs.envelope(true, []map[string]any{choice}, nil)
}

// stream writes the response as server-sent events, one chunk per token as
// the model generates it, then a finish chunk, the usage chunk when asked,
// and [DONE].
func (s *Server) stream(w http.ResponseWriter, r *http.Request, c *call, rs *response, includeUsage bool) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	flusher, _ := w.(http.Flusher)
	flush := func() {
		if flusher != nil {
			flusher.Flush()
		}
	}
	flush()
	send := func(v any) bool {
		b, err := json.Marshal(v)
		if err != nil {
			return false
		}
		_, err = fmt.Fprintf(w, "data: %s\n\n", b)
		return err == nil
	}
	sent := 0
	var p progress
	var err error
	for !p.done {
		if p, err = s.wait(r.Context(), c, sent); err != nil {
			if r.Context().Err() == nil {
				// The stream has started: report the error in-band, as
				// vLLM does.
				send(map[string]any{"error": map[string]any{"message": err.Error(), "type": "ServiceUnavailableError", "code": http.StatusServiceUnavailable}})
				flush()
			}
			return
		}
		for ; sent < p.generated; sent++ {
			if !send(rs.chunk(word(sent), sent == 0, nil)) {
				return
			}
		}
		flush()
	}
	send(rs.chunk("", false, rs.finish))
	if includeUsage {
		send(rs.envelope(true, []map[string]any{}, usageOf(rs.prompt, p.cached, p.generated)))
	}
	io.WriteString(w, "data: [DONE]\n\n")
	flush()
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": []map[string]any{{
		"id": s.cfg.Model, "object": "model", "created": s.start.Unix(), "owned_by": "kvbandit-simworker", "root": s.cfg.Model,
		"max_model_len": s.cfg.Worker.KVBlocks * s.cfg.Worker.BlockSize,
	}}})
}

// metrics writes the Prometheus text exposition with vLLM's metric names.
func (s *Server) metrics(w http.ResponseWriter, _ *http.Request) {
	s.mu.Lock()
	m := s.met
	s.mu.Unlock()
	if s.pub != nil {
		m.kvDropped = s.pub.dropped.Load()
	}
	lbl := fmt.Sprintf(`model_name=%q,engine="0"`, s.cfg.Model)
	var b strings.Builder
	metric := func(name, typ, help string, labels string, v any) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n%s{%s} %v\n", name, help, name, typ, name, labels, v)
	}
	metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", lbl, m.running)
	metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", lbl, m.waiting)
	metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", lbl, m.kvUsage)
	metric("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.", lbl, m.queries)
	metric("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.", lbl, m.hits)
	metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", lbl, m.prompt)
	metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", lbl, m.generation)
	metric("vllm:request_success_total", "counter", "Count of successfully processed requests.", lbl+`,finished_reason="length"`, m.success)
	metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig.",
		fmt.Sprintf(`block_size="%d",enable_prefix_caching="True",engine="0",num_gpu_blocks="%d"`, s.cfg.Worker.BlockSize, s.cfg.Worker.KVBlocks), 1)
	if s.pub != nil {
		metric("simworker_kv_event_batches_dropped_total", "counter", "KV event batches dropped because the send queue was full.", fmt.Sprintf("model_name=%q", s.cfg.Model), m.kvDropped)
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	io.WriteString(w, b.String())
}
