// Command kvbandit is the inference router for Envoy: an ext_proc endpoint
// picker that routes OpenAI requests to vLLM and SGLang workers. See
// `kvbandit help`.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvbandit/kvbandit/internal/app"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := app.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvbandit:", err)
		os.Exit(app.ExitCode(err))
	}
}
