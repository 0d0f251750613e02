// Command openai-sdk sends an agent session through kvbandit's standalone
// proxy (`kvbandit serve --http-addr`, or `kvbandit demo`) with the official
// OpenAI Go SDK: the same x-prefix-id on every turn keeps the session on the
// worker holding its KV cache, and the x-kvbandit-endpoint response header
// names that worker.
//
//	make demo &    # the proxy listens on 127.0.0.1:8080, model "sim-model"
//	go run ./examples/openai-sdk --base-url http://127.0.0.1:8080/v1 --model sim-model --turns 3
package main

import (
	"context"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"strconv"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
)

func main() {
	baseURL := flag.String("base-url", "http://127.0.0.1:8080/v1", "the proxy's OpenAI base URL")
	model := flag.String("model", "sim-model", "model name")
	turns := flag.Int("turns", 3, "turns in the session")
	session := flag.String("session", "sdk-example", "x-prefix-id of the session")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, *baseURL, *model, *session, *turns); err != nil {
		fmt.Fprintln(os.Stderr, "openai-sdk:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, baseURL, model, session string, turns int) error {
	client := openai.NewClient(option.WithBaseURL(baseURL), option.WithAPIKey("unused"),
		option.WithHeader("x-prefix-id", session), option.WithHeader("x-prefix-total-requests", strconv.Itoa(turns)))
	msgs := []openai.ChatCompletionMessageParamUnion{
		openai.SystemMessage("You are a travel agent. Keep answers short."),
	}
	for turn := 1; turn <= turns; turn++ {
		msgs = append(msgs, openai.UserMessage(fmt.Sprintf("Turn %d: what should I see next in Lisbon?", turn)))
		var resp *http.Response
		stream := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
			Model: model, Messages: msgs, MaxTokens: openai.Int(24),
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
		}, option.WithResponseInto(&resp))
		var acc openai.ChatCompletionAccumulator
		var usage openai.CompletionUsage
		for stream.Next() {
			chunk := stream.Current()
			acc.AddChunk(chunk)
			if chunk.Usage.PromptTokens > 0 {
				usage = chunk.Usage // the final chunk (stream_options.include_usage)
			}
		}
		if err := stream.Err(); err != nil {
			return fmt.Errorf("turn %d: %w", turn, err)
		}
		worker := ""
		if resp != nil {
			worker = resp.Header.Get("x-kvbandit-endpoint")
		}
		answer := ""
		if len(acc.Choices) > 0 {
			answer = acc.Choices[0].Message.Content
		}
		fmt.Printf("turn %d  worker %-21s  prompt %4d tokens, %4d cached  %q\n", turn, worker,
			usage.PromptTokens, usage.PromptTokensDetails.CachedTokens, answer)
		msgs = append(msgs, openai.AssistantMessage(answer))
	}
	return nil
}
