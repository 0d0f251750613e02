package extproc_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"

	"github.com/kvbandit/kvbandit/extproc"
)

// heapAlloc returns the live heap after a full collection.
func heapAlloc() uint64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// hostileHeaders is a chat request's headers message padded the way a
// hostile ext_proc client (or a data plane with raised header limits)
// could: a long path, request id and prefix id, many unknown x-prefix-*
// headers and many unrelated headers. Per stream it is 96 KiB, of which
// 80 KiB were kept for the stream's whole life before the header bounds
// (every x-prefix-* value, the path, the request id).
func hostileHeaders() *extprocv3.ProcessingRequest {
	pad := func(n int) []byte { return []byte(strings.Repeat("z", n)) }
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte("POST")},
		{Key: ":path", RawValue: append([]byte("/v1/chat/completions?pad="), pad(16<<10)...)},
		{Key: "x-request-id", RawValue: pad(16 << 10)},
		{Key: "x-prefix-id", RawValue: pad(16 << 10)},
		{Key: "x-prefix-osl", RawValue: []byte("LOW")},
	}
	for i := range 16 {
		hs = append(hs,
			&corev3.HeaderValue{Key: fmt.Sprintf("x-prefix-junk-%d", i), RawValue: pad(2 << 10)},
			&corev3.HeaderValue{Key: fmt.Sprintf("x-unrelated-%d", i), RawValue: pad(1 << 10)},
		)
	}
	return &extprocv3.ProcessingRequest{
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: hs}}},
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, ResponseBodyMode: filterv3.ProcessingMode_FULL_DUPLEX_STREAMED},
	}
}

// TestMemoryBudgetHostileStreams is the ext_proc channel's memory budget:
// 500 streams each send hostile request headers (see hostileHeaders) and a
// 64 KiB chat body in 4 KiB chunks against a 4 MiB buffer budget.
//
//   - With every stream open and holding its first chunk, the heap grows by
//     less than 24 MiB (about 7 MiB measured): what a stream keeps from its
//     headers is bounded (the code before the bounds kept 40 MiB of header
//     values more here, about 47 MiB in all).
//   - Streams that would push the buffered bytes over the budget get 503
//     server_busy; the others are routed, and with them open the heap still
//     grows by less than 32 MiB (the budget, its copies, per-stream state).
//   - When every stream has ended, the budget's total is back to 0.
func TestMemoryBudgetHostileStreams(t *testing.T) {
	if testing.Short() {
		t.Skip("memory budget: 500 streams")
	}
	const (
		streams      = 500
		budget       = 4 << 20
		chunk        = 4 << 10
		firstPhaseMB = 24
		routedMB     = 32
	)
	// grpc-go's client keeps every message it sent for transparent retries
	// until the server's first reply (here a 1 MiB pooled buffer per
	// stream, even with retries disabled); Envoy keeps nothing of the kind,
	// and the budget is about the server, so the replay buffer is turned
	// off.
	h := newHarness(t, extproc.Config{ResponseProcessing: true, MaxBodyBytes: 1 << 20, MaxBufferedBytes: budget, DecisionTimeout: 5 * time.Minute, StreamHeaderTimeout: 5 * time.Minute}, nil,
		grpc.WithDefaultCallOptions(grpc.MaxRetryRPCBufferSize(1)))
	stopDrain := make(chan struct{})
	defer close(stopDrain)
	go func() { // outcomes arrive by the dozen; the harness channel holds 16
		for {
			select {
			case <-h.doneC:
			case <-stopDrain:
				return
			}
		}
	}()
	headers := hostileHeaders()
	body := chatBody(64 << 10)
	var chunks []*extprocv3.ProcessingRequest
	for off := 0; off < len(body); off += chunk {
		end := min(off+chunk, len(body))
		chunks = append(chunks, reqBody(string(body[off:end]), end == len(body)))
	}
	buffered := func() float64 { return metricValue(t, h.reg, "kvbandit_buffered_body_bytes", nil) }

	base := heapAlloc()

	// Phase 1: every stream sends its headers and first chunk.
	ss := make([]extprocv3.ExternalProcessor_ProcessClient, streams)
	parallel(t, streams, func(i int) error {
		s, err := h.client.Process(t.Context())
		if err != nil {
			return err
		}
		ss[i] = s
		if err := s.Send(headers); err != nil {
			return err
		}
		return s.Send(chunks[0])
	})
	eventually(t, func() bool { return buffered() == streams*chunk }, "first chunks not all buffered")
	if grown := int64(heapAlloc()) - int64(base); grown > firstPhaseMB<<20 {
		t.Fatalf("%d streams holding their headers and first chunk grew the heap by %d MiB, want < %d MiB", streams, grown>>20, firstPhaseMB)
	} else {
		t.Logf("phase 1: %d streams open, heap +%.1f MiB", streams, float64(grown)/(1<<20))
	}

	// Phase 2: the rest of every body; the budget refuses the excess.
	var routed, busy atomic.Int64
	isRouted := make([]bool, streams)
	parallel(t, streams, func(i int) error {
		s := ss[i]
		for _, c := range chunks[1:] {
			if err := s.Send(c); err != nil {
				break // refused: Recv says why
			}
		}
		r, err := s.Recv()
		if err != nil {
			return fmt.Errorf("stream %d: %w", i, err)
		}
		if ir := r.GetImmediateResponse(); ir != nil {
			if ir.GetStatus().GetCode() != 503 || !strings.Contains(string(ir.GetBody()), "server_busy") {
				return fmt.Errorf("stream %d: want 503 server_busy, got %v", i, ir)
			}
			busy.Add(1)
			return nil
		}
		if destination(r) == "" {
			return fmt.Errorf("stream %d: neither routed nor refused: %v", i, r)
		}
		for got := 0; got < len(body); {
			b := recvOrNil(s).GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if b == nil {
				return fmt.Errorf("stream %d: body not echoed", i)
			}
			got += len(b.GetBody())
		}
		routed.Add(1)
		isRouted[i] = true
		return nil
	})
	if routed.Load() == 0 || busy.Load() == 0 || routed.Load()+busy.Load() != streams {
		t.Fatalf("routed %d, refused %d: want both, %d in all", routed.Load(), busy.Load(), streams)
	}
	if b := buffered(); b > budget {
		t.Fatalf("buffered %v bytes over the %d budget", b, budget)
	}
	if grown := int64(heapAlloc()) - int64(base); grown > routedMB<<20 {
		t.Fatalf("%d routed streams open: heap grew by %d MiB, want < %d MiB", routed.Load(), grown>>20, routedMB)
	} else {
		t.Logf("phase 2: %d routed (open), %d refused 503 server_busy, heap +%.1f MiB", routed.Load(), busy.Load(), float64(grown)/(1<<20))
	}

	// Phase 3: the routed responses end; every byte is given back.
	parallel(t, streams, func(i int) error {
		if !isRouted[i] {
			return nil
		}
		s := ss[i]
		if err := s.Send(respHeaders("200")); err != nil {
			return err
		}
		if err := s.Send(respBody(sseContent, true)); err != nil {
			return err
		}
		for {
			if _, err := s.Recv(); err != nil {
				if errors.Is(err, io.EOF) {
					return nil
				}
				return fmt.Errorf("stream %d: %w", i, err)
			}
		}
	})
	eventually(t, func() bool { return buffered() == 0 && h.srv.Streams() == 0 }, "buffered bytes or streams left after every stream ended")
}

func recvOrNil(s extprocv3.ExternalProcessor_ProcessClient) *extprocv3.ProcessingResponse {
	r, _ := s.Recv()
	return r
}

// TestMemoryBudgetLongTenants: 200 streams send request headers whose
// tenant header (--tenant-header) is 256 KiB and one byte of body, then
// wait, as a hostile ext_proc client (or a data plane with raised header
// limits) can until --decision-timeout. The value is bounded (hashed) when
// the headers are read, so the open streams grow the heap by less than
// 16 MiB; the code before kept every value whole until the decision (50 MiB
// more here).
func TestMemoryBudgetLongTenants(t *testing.T) {
	const streams, tenantBytes, boundMB = 200, 256 << 10, 16
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	h := newHarness(t, extproc.Config{ResponseProcessing: true, TenantHeader: "x-tenant", MaxBodyBytes: 1 << 20, DecisionTimeout: 5 * time.Minute, StreamHeaderTimeout: 5 * time.Minute}, nil,
		grpc.WithDefaultCallOptions(grpc.MaxRetryRPCBufferSize(1)))
	metric := func(name string) float64 { return metricValue(t, h.reg, name, nil) }
	base := heapAlloc()
	parallel(t, streams, func(i int) error {
		// A distinct value per stream, a fresh allocation as on the wire.
		tenant := fmt.Appendf(nil, "%06d", i)
		tenant = append(tenant, strings.Repeat("t", tenantBytes)...)
		m := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
		m.GetRequestHeaders().GetHeaders().Headers = append(m.GetRequestHeaders().GetHeaders().GetHeaders(), &corev3.HeaderValue{Key: "x-tenant", RawValue: tenant})
		s, err := h.client.Process(ctx)
		if err != nil {
			return err
		}
		if err := s.Send(m); err != nil {
			return err
		}
		return s.Send(reqBody("{", false))
	})
	// Every stream's headers and first byte have been read.
	eventually(t, func() bool { return metric("kvbandit_buffered_body_bytes") == streams }, "first bytes not all buffered")
	grown := int64(heapAlloc()) - int64(base)
	t.Logf("%d streams waiting with %d KiB tenant values: heap %+.1f MiB", streams, tenantBytes>>10, float64(grown)/(1<<20))
	if grown > boundMB<<20 {
		t.Errorf("heap grew by %d MiB, want < %d MiB", grown>>20, boundMB)
	}
	cancel()
	eventually(t, func() bool { return metric("kvbandit_extproc_streams_inflight") == 0 }, "streams still open after cancel")
}
