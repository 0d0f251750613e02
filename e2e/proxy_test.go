package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvbandit/kvbandit/e2e/worker"
)

// startProxyKvbandit runs kvbandit serve with --http-addr and returns the
// proxy's base URL.
func startProxyKvbandit(t *testing.T, endpoints []string, extra ...string) (*kvb, string) {
	t.Helper()
	addr := freeAddr(t)
	k := startKvbandit(t, endpoints, append([]string{"--http-addr", addr}, extra...)...)
	return k, "http://" + addr
}

func sdk(t *testing.T, base string, opts ...option.RequestOption) openai.Client {
	return openai.NewClient(append([]option.RequestOption{
		option.WithBaseURL(base + "/v1/"), option.WithAPIKey("sk-dummy"),
		option.WithHTTPClient(httpClient(t)), option.WithMaxRetries(0),
	}, opts...)...)
}

// TestProxySDKThroughBinary: the official OpenAI Go SDK against the real
// binary's standalone proxy, non-streaming and streaming, chat and
// completions; sessions announced with x-prefix-id stay on one worker;
// /v1/route answers without routing; every decision is released (checked
// by the harness at the end).
func TestProxySDKThroughBinary(t *testing.T) {
	ws, addrs := startWorkers(t, 3, worker.Config{CachedTokens: 2, TokenDelay: time.Millisecond})
	k, base := startProxyKvbandit(t, addrs, "--policy", "kvbandit")
	ctx := t.Context()
	c := sdk(t, base)

	res, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
		Model:     "test-model",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say this is a test")},
		MaxTokens: openai.Int(4),
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Choices[0].Message.Content != worker.Text(4) || res.Usage.PromptTokensDetails.CachedTokens != 2 {
		t.Fatalf("chat: %+v", res)
	}

	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:         "test-model",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Stream this")},
		MaxTokens:     openai.Int(6),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	var content strings.Builder
	var usage openai.CompletionUsage
	for stream.Next() {
		ch := stream.Current()
		for _, choice := range ch.Choices {
			content.WriteString(choice.Delta.Content)
		}
		if ch.JSON.Usage.Valid() && ch.Usage.TotalTokens > 0 {
			usage = ch.Usage
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	stream.Close()
	if content.String() != worker.Text(6) || usage.CompletionTokens != 6 || usage.PromptTokensDetails.CachedTokens != 2 {
		t.Fatalf("stream: %q usage %+v", content.String(), usage)
	}

	comp, err := c.Completions.New(ctx, openai.CompletionNewParams{
		Model:     "test-model",
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
		MaxTokens: openai.Int(3),
	})
	if err != nil || comp.Choices[0].Text != worker.Text(3) {
		t.Fatalf("completion: %+v %v", comp, err)
	}

	// A session announced by header stays on one worker. It announces six
	// requests: five turns, then the /v1/route below asks where the sixth
	// would go (past its announced total a request starts afresh).
	var served []string
	history := "You are an agent. "
	agent := sdk(t, base, option.WithHeader("x-prefix-id", "agent-7"), option.WithHeader("x-prefix-total-requests", "6"))
	for turn := range 5 {
		history += fmt.Sprintf("Turn %d: look up the weather in city number %d and summarise it. ", turn, turn)
		var resp *http.Response
		_, err := agent.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{
			Model:    "test-model",
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage(history)},
		}, option.WithResponseInto(&resp))
		if err != nil {
			t.Fatal(err)
		}
		served = append(served, resp.Header.Get("x-kvbandit-endpoint"))
	}
	for _, s := range served {
		if s != served[0] || s == "" {
			t.Fatalf("session spread over %v", served)
		}
	}
	byAddr(t, ws, served[0])

	// /v1/route: the endpoint the next turn would go to, with scores.
	body := fmt.Sprintf(`{"model":"test-model","messages":[{"role":"user","content":%q}]}`, history)
	r := send(t, httpClient(t), "POST", base+"/v1/route", []byte(body), map[string]string{"x-prefix-id": "agent-7"})
	var route struct {
		Endpoint      string             `json:"endpoint"`
		Scores        map[string]float64 `json:"scores"`
		OverlapBlocks int                `json:"overlap_blocks"`
		Tokens        int                `json:"tokens"`
		Predicted     map[string]struct {
			TTFT    float64 `json:"predicted_ttft_ms"`
			Wait    float64 `json:"wait_ms"`
			Prefill float64 `json:"prefill_ms"`
		} `json:"predicted"`
	}
	if r.status != 200 || json.Unmarshal(r.body, &route) != nil || route.Endpoint != served[0] || len(route.Scores) != 3 || route.Tokens == 0 {
		t.Fatalf("route: %d %s", r.status, r.body)
	}
	// kvbandit predicts every candidate's time to first token: wait + prefill.
	if len(route.Predicted) != 3 {
		t.Fatalf("route: predictions for %d candidates, want 3: %s", len(route.Predicted), r.body)
	}
	for ep, pr := range route.Predicted {
		if !(pr.TTFT > 0) || math.Abs(pr.TTFT-(pr.Wait+pr.Prefill)) > 1e-6*pr.TTFT {
			t.Errorf("route: %s predicted %+v, want TTFT = wait + prefill > 0", ep, pr)
		}
	}

	// Errors come back as the SDK's API errors.
	_, err = c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("x")}})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Code != "missing_model" {
		t.Fatalf("missing model: %v", err)
	}
	k.waitMetric(t, "kvbandit_requests_total", map[string]string{"frontend": "proxy", "path": "chat_completions", "code_class": "2xx"}, 7)
}

// TestProxyDrainOnSIGTERM: a stream in flight when SIGTERM arrives
// finishes, then kvbandit exits 0.
func TestProxyDrainOnSIGTERM(t *testing.T) {
	_, addrs := startWorkers(t, 1, worker.Config{TokenDelay: 20 * time.Millisecond})
	k, base := startProxyKvbandit(t, addrs)
	c := sdk(t, base)
	stream := c.Chat.Completions.NewStreaming(t.Context(), openai.ChatCompletionNewParams{
		Model:     "test-model",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.UserMessage("a long answer")},
		MaxTokens: openai.Int(40),
	})
	defer stream.Close()
	if !stream.Next() {
		t.Fatal(stream.Err())
	}
	k.terminate(t)
	var content strings.Builder
	for stream.Next() {
		for _, ch := range stream.Current().Choices {
			content.WriteString(ch.Delta.Content)
		}
	}
	if err := stream.Err(); err != nil || content.String() != worker.Text(40) {
		t.Fatalf("stream during drain: %v %q", err, content.String())
	}
	k.waitExit(t, 20*time.Second)
}
