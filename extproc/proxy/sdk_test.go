package proxy_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvbandit/kvbandit/e2e/worker"
	"github.com/kvbandit/kvbandit/routing"
)

// The official OpenAI Go SDK as the proxy's client.

func sdkClient(f *fixture, opts ...option.RequestOption) openai.Client {
	return openai.NewClient(append([]option.RequestOption{
		option.WithBaseURL(f.url + "/v1/"),
		option.WithAPIKey("sk-dummy"),
		option.WithHTTPClient(f.client),
		option.WithMaxRetries(0),
	}, opts...)...)
}

func TestProxySDKChat(t *testing.T) {
	f := newFixture(t, options{workers: 2, wcfg: worker.Config{CachedTokens: 4}})
	c := sdkClient(f)
	res, err := c.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
		Model:     "test-model",
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be brief."), openai.UserMessage("Say this is a test")},
		MaxTokens: openai.Int(4),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Choices) != 1 || res.Choices[0].Message.Content != worker.Text(4) {
		t.Fatalf("choices %+v", res.Choices)
	}
	if res.Usage.CompletionTokens != 4 || res.Usage.PromptTokensDetails.CachedTokens != 4 {
		t.Errorf("usage %+v", res.Usage)
	}
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeSuccess || o.CompletionTokens != 4 || o.CachedTokens != 4 {
		t.Errorf("outcome %+v", o)
	}
}

func TestProxySDKChatStreaming(t *testing.T) {
	const n = 5
	f := newFixture(t, options{workers: 2, wcfg: worker.Config{CachedTokens: 1, TokenDelay: 10 * time.Millisecond}})
	c := sdkClient(f, option.WithHeader("x-prefix-id", "sdk-session"))
	stream := c.Chat.Completions.NewStreaming(t.Context(), openai.ChatCompletionNewParams{
		Model:         "test-model",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Stream this")},
		MaxTokens:     openai.Int(n),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	defer stream.Close()
	var acc openai.ChatCompletionAccumulator
	var content strings.Builder
	chunks := 0
	var usage openai.CompletionUsage
	for stream.Next() {
		ch := stream.Current()
		acc.AddChunk(ch)
		chunks++
		for _, choice := range ch.Choices {
			content.WriteString(choice.Delta.Content)
		}
		if ch.JSON.Usage.Valid() && ch.Usage.CompletionTokens > 0 {
			if len(ch.Choices) != 0 {
				t.Errorf("usage chunk has choices: %+v", ch.Choices)
			}
			usage = ch.Usage
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if content.String() != worker.Text(n) || chunks < n+1 {
		t.Fatalf("content %q in %d chunks", content.String(), chunks)
	}
	if usage.CompletionTokens != n || usage.PromptTokens <= 0 || usage.PromptTokensDetails.CachedTokens != 1 {
		t.Errorf("final usage chunk %+v", usage)
	}
	if len(acc.Choices) != 1 || acc.Choices[0].Message.Content != worker.Text(n) {
		t.Errorf("accumulated %+v", acc.Choices)
	}
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeSuccess || o.CompletionTokens != n || o.CachedTokens != 1 || o.TTFT <= 0 {
		t.Errorf("outcome %+v", o)
	}
}

func TestProxySDKCompletions(t *testing.T) {
	f := newFixture(t, options{workers: 1})
	c := sdkClient(f)
	res, err := c.Completions.New(t.Context(), openai.CompletionNewParams{
		Model:     "test-model",
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
		MaxTokens: openai.Int(3),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Choices) != 1 || res.Choices[0].Text != worker.Text(3) || res.Usage.CompletionTokens != 3 {
		t.Fatalf("completion %+v", res)
	}
	o := f.out.wait(t, 1)[0]
	if o.Kind != routing.OutcomeSuccess || o.CompletionTokens != 3 {
		t.Errorf("outcome %+v", o)
	}
}

// TestProxySDKErrors: the SDK decodes the proxy's OpenAI-style errors.
func TestProxySDKErrors(t *testing.T) {
	f := newFixture(t, options{workers: 1, models: true})
	c := sdkClient(f)
	_, err := c.Chat.Completions.New(t.Context(), openai.ChatCompletionNewParams{
		Model:    "no-such-model",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("hi")},
	})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" || apiErr.Type != "invalid_request_error" {
		t.Fatalf("err %v", err)
	}
}
