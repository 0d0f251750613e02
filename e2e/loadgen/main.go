// Command loadgen sends the side-by-side benchmark's open-loop ext_proc load
// (package e2e/extprocload: one FULL_DUPLEX_STREAMED stream per request,
// distinct chat bodies) to one endpoint picker and prints what it measured.
// It is how a picker is profiled under that load:
//
//	kvbandit serve --endpoints 127.0.0.1:8001,127.0.0.1:8002 --grpc-addr 127.0.0.1:9002 --pprof &
//	go run ./e2e/loadgen -addr 127.0.0.1:9002 -rate 2000 -seconds 20 -size 4096 &
//	go tool pprof -top 'http://127.0.0.1:9090/debug/pprof/profile?seconds=10'
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/kvbandit/kvbandit/e2e/extprocload"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:9002", "the picker's ext_proc address (plaintext gRPC)")
	rate := flag.Float64("rate", 2000, "open-loop arrivals per second")
	secs := flag.Float64("seconds", 10, "how long requests are started")
	size := flag.Int("size", 4096, "body size in bytes")
	model := flag.String("model", "test-model", "the bodies' model")
	first := flag.Int("first", 0, "number of the first body (bodies are distinct; use a new range to avoid repeating prompts)")
	flag.Parse()
	if *rate <= 0 || *secs <= 0 || *size < 64 {
		fmt.Fprintln(os.Stderr, "loadgen: -rate and -seconds must be positive, -size at least 64")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	n := int(*rate * *secs)
	res, err := extprocload.Run(ctx, extprocload.Config{Addr: *addr, Rate: *rate, Duration: time.Duration(*secs * float64(time.Second)),
		Bodies: extprocload.ChatBodiesFrom(*first, n, *size, *model)})
	if err != nil {
		fmt.Fprintln(os.Stderr, "loadgen:", err)
		os.Exit(1)
	}
	fmt.Printf("sent %d ok %d dropped %d errors %v\n%.0f req/s, p50 %v, p99 %v\n", res.Sent, res.OK, res.Dropped, res.Errors,
		res.Throughput(), res.Quantile(0.5), res.Quantile(0.99))
	if res.OK != res.Sent {
		os.Exit(1)
	}
}
