// Command agent-client is an example agent that sends one multi-turn
// session through kvbandit (its standalone proxy, or Envoy in front of
// kvbandit's ext_proc server) with routing hints, so that the whole session
// can be kept on the worker that holds its KV cache.
//
// Every request of the session carries the same x-prefix-id and the number
// of requests the agent plans to send (x-prefix-total-requests), the
// expected output length (x-prefix-osl) and the expected time between
// requests (x-prefix-iat). kvbandit reads them (or the same values from
// nvext.agent_hints in the body) to decide how sticky to be.
//
// Its defaults match `make demo` (the proxy on 127.0.0.1:8080, model
// sim-model): run the demo in one shell and
//
//	go run ./examples/agent-client
//
// in another. Through Envoy, name its listener and your model:
//
//	go run ./examples/agent-client --base-url http://127.0.0.1:8081 --model Qwen/Qwen3-8B --turns 4
//
// It prints, per turn, the worker that served (the proxy's
// x-kvbandit-endpoint response header; Envoy's shipped configs do not name
// it to clients, so "-" there) with the prompt and cached tokens, or the
// status and error body.
package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"time"
)

// headerEndpoint names the endpoint that served, on kvbandit's standalone
// proxy's responses.
const headerEndpoint = "x-kvbandit-endpoint"

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatRequest struct {
	Model     string    `json:"model"`
	Messages  []message `json:"messages"`
	MaxTokens int       `json:"max_tokens,omitempty"`
}

type chatResponse struct {
	Choices []struct {
		Message message `json:"message"`
	} `json:"choices"`
	Usage struct {
		PromptTokens        int `json:"prompt_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "agent-client:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("agent-client", flag.ContinueOnError)
	base := fs.String("base-url", "http://127.0.0.1:8080", "kvbandit's standalone proxy (make demo's), or an Envoy listener")
	model := fs.String("model", "sim-model", "model name (make demo's simulated workers serve sim-model)")
	turns := fs.Int("turns", 4, "requests in the session")
	think := fs.Duration("think", 200*time.Millisecond, "pause between turns")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *turns < 1 {
		return errors.New("--turns must be >= 1")
	}
	id := make([]byte, 8)
	if _, err := rand.Read(id); err != nil {
		return err
	}
	session := "agent-" + hex.EncodeToString(id)
	history := []message{{Role: "system", Content: "You are a careful coding agent. Answer briefly."}}
	client := &http.Client{Timeout: 2 * time.Minute}
	for turn := 1; turn <= *turns; turn++ {
		history = append(history, message{Role: "user", Content: fmt.Sprintf("Step %d: list the next file to inspect.", turn)})
		body, err := json.Marshal(chatRequest{Model: *model, Messages: history, MaxTokens: 64})
		if err != nil {
			return err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, *base+"/v1/chat/completions", bytes.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("content-type", "application/json")
		req.Header.Set("x-prefix-id", session)
		req.Header.Set("x-prefix-total-requests", strconv.Itoa(*turns))
		req.Header.Set("x-prefix-osl", "LOW")
		req.Header.Set("x-prefix-iat", strconv.Itoa(int(think.Milliseconds())))
		resp, err := client.Do(req)
		if err != nil {
			return fmt.Errorf("turn %d: %w", turn, err)
		}
		raw, err := io.ReadAll(io.LimitReader(resp.Body, 8<<20))
		resp.Body.Close()
		if err != nil {
			return fmt.Errorf("turn %d: %w", turn, err)
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("turn %d: status %d: %s", turn, resp.StatusCode, bytes.TrimSpace(raw))
		}
		var cr chatResponse
		if err := json.Unmarshal(raw, &cr); err != nil {
			return fmt.Errorf("turn %d: decoding the response: %w", turn, err)
		}
		answer := ""
		if len(cr.Choices) > 0 {
			answer = cr.Choices[0].Message.Content
		}
		worker := resp.Header.Get(headerEndpoint)
		if worker == "" {
			worker = "-"
		}
		fmt.Printf("turn %d: worker=%s prompt_tokens=%d cached_tokens=%d\n", turn, worker, cr.Usage.PromptTokens, cr.Usage.PromptTokensDetails.CachedTokens)
		history = append(history, message{Role: "assistant", Content: answer})
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(*think):
		}
	}
	return nil
}
