// Package extprocload drives an ext_proc endpoint picker the way Envoy
// does, open loop: at a fixed rate, each request is one ext_proc stream
// (protocol configuration FULL_DUPLEX_STREAMED, request headers, the whole
// body with end of stream), answered when the picker's headers response
// carries a valid x-gateway-destination-endpoint. The same load, bodies
// included, can be pointed at kvbandit and at GIE's EPP to compare them.
package extprocload

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// DestinationHeader is the EPP protocol's destination header.
const DestinationHeader = "x-gateway-destination-endpoint"

// Config is one load run.
type Config struct {
	// Addr is the picker's ext_proc address (plaintext gRPC).
	Addr string
	// Rate is the open-loop arrival rate, requests per second.
	Rate float64
	// Duration is how long requests are started.
	Duration time.Duration
	// Bodies are the request bodies, used in order (cycled).
	Bodies [][]byte
	// MaxOutstanding bounds streams in flight; an arrival beyond it is
	// counted as dropped (0 = 10,000).
	MaxOutstanding int
	// Timeout bounds one stream (0 = 10 s).
	Timeout time.Duration
	// Conns is the number of HTTP/2 connections the streams are spread
	// over (0 = 4, as a few Envoy workers would).
	Conns int
}

// Result is what a run measured.
type Result struct {
	Sent, OK, Dropped int
	// Errors counts failures by kind.
	Errors map[string]int
	// Latencies of the OK requests: stream start → destination received.
	Latencies []time.Duration
	// Elapsed is the wall time from the first arrival to the last answer.
	Elapsed time.Duration
}

// Quantile returns the q-quantile (nearest rank) of the OK latencies.
func (r *Result) Quantile(q float64) time.Duration {
	if len(r.Latencies) == 0 {
		return 0
	}
	l := slices.Clone(r.Latencies)
	slices.Sort(l)
	i := int(q*float64(len(l))+0.5) - 1
	return l[min(max(i, 0), len(l)-1)]
}

// Throughput is OK answers per second of elapsed time.
func (r *Result) Throughput() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.OK) / r.Elapsed.Seconds()
}

// ChatBodies returns n distinct chat completion bodies of about size bytes
// each for model.
func ChatBodies(n, size int, model string) [][]byte {
	return ChatBodiesFrom(0, n, size, model)
}

// ChatBodiesFrom returns the chat bodies numbered first to first+n-1. Each
// body's content starts with its number, so bodies of different numbers share
// no prompt prefix beyond the message's first word, and runs that take
// disjoint ranges never repeat a prompt.
func ChatBodiesFrom(first, n, size int, model string) [][]byte {
	out := make([][]byte, n)
	words := []string{"route", "prefix", "cache", "tokens", "worker", "gateway", "envoy", "latency", "batch", "session"}
	for k := range out {
		i := first + k
		var b strings.Builder
		fmt.Fprintf(&b, `{"model":%q,"messages":[{"role":"user","content":"request %d:`, model, i)
		for j := 0; b.Len() < size-4; j++ {
			b.WriteString(" ")
			b.WriteString(words[(i*7+j*3)%len(words)])
		}
		b.WriteString(`"}]}`)
		out[k] = []byte(b.String())
	}
	return out
}

// Run sends the load and waits for every stream to end.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if cfg.Rate <= 0 || cfg.Duration <= 0 || len(cfg.Bodies) == 0 {
		return nil, errors.New("extprocload: rate, duration and bodies are required")
	}
	if cfg.MaxOutstanding <= 0 {
		cfg.MaxOutstanding = 10000
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.Conns <= 0 {
		cfg.Conns = 4
	}
	var clients []extprocv3.ExternalProcessorClient
	for range cfg.Conns {
		conn, err := grpc.NewClient(cfg.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			return nil, err
		}
		defer conn.Close()
		clients = append(clients, extprocv3.NewExternalProcessorClient(conn))
	}
	res := &Result{Errors: map[string]int{}}
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, cfg.MaxOutstanding)
	interval := time.Duration(float64(time.Second) / cfg.Rate)
	start := time.Now()
	var last time.Time
	n := int(cfg.Duration.Seconds() * cfg.Rate)
	for i := range n {
		at := start.Add(time.Duration(i) * interval)
		if d := time.Until(at); d > 0 {
			select {
			case <-ctx.Done():
				wg.Wait()
				return res, ctx.Err()
			case <-time.After(d):
			}
		}
		res.Sent++
		select {
		case sem <- struct{}{}:
		default:
			res.Dropped++
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			t0 := time.Now()
			err := one(ctx, clients[i%len(clients)], cfg.Bodies[i%len(cfg.Bodies)], cfg.Timeout)
			d := time.Since(t0)
			mu.Lock()
			defer mu.Unlock()
			if now := time.Now(); now.After(last) {
				last = now
			}
			if err != nil {
				res.Errors[errKind(err)]++
				return
			}
			res.OK++
			res.Latencies = append(res.Latencies, d)
		}()
	}
	wg.Wait()
	res.Elapsed = last.Sub(start)
	return res, nil
}

func errKind(err error) string {
	s := err.Error()
	if i := strings.IndexByte(s, ':'); i > 0 {
		return s[:i]
	}
	return s
}

// one runs a single stream: headers, body, then waits for the
// destination.
func one(ctx context.Context, c extprocv3.ExternalProcessorClient, body []byte, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	st, err := c.Process(ctx)
	if err != nil {
		return fmt.Errorf("open: %w", err)
	}
	hdrs := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")}, {Key: ":path", RawValue: []byte("/v1/chat/completions")},
		{Key: ":authority", RawValue: []byte("gateway")}, {Key: ":scheme", RawValue: []byte("http")},
		{Key: "content-type", RawValue: []byte("application/json")},
		{Key: "content-length", RawValue: fmt.Appendf(nil, "%d", len(body))},
	}}
	pc := &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED}
	if err := st.Send(&extprocv3.ProcessingRequest{ProtocolConfig: pc, Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs}}}); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	for {
		resp, err := st.Recv()
		if err != nil {
			return fmt.Errorf("recv: %w", err)
		}
		if ir := resp.GetImmediateResponse(); ir != nil {
			return fmt.Errorf("immediate %d: %s", ir.GetStatus().GetCode(), ir.GetBody())
		}
		h := resp.GetRequestHeaders()
		if h == nil {
			continue
		}
		for _, o := range h.GetResponse().GetHeaderMutation().GetSetHeaders() {
			if o.GetHeader().GetKey() != DestinationHeader {
				continue
			}
			v := string(o.GetHeader().GetRawValue())
			if v == "" {
				v = o.GetHeader().GetValue()
			}
			first, _, _ := strings.Cut(v, ",")
			if _, err := netip.ParseAddrPort(strings.TrimSpace(first)); err != nil {
				return fmt.Errorf("bad destination: %q", v)
			}
			_ = st.CloseSend()
			return nil
		}
		return errors.New("no destination: headers response without x-gateway-destination-endpoint")
	}
}
