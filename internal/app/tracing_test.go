package app

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	stdlog "log"
	"log/slog"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel"

	"github.com/kvbandit/kvbandit/extproc/tracing"
)

// TestServeRejectsBadTracingEnv: a bad OTEL_* value stops serve at start-up
// with a usage error (exit code 2) that names the variable.
func TestServeRejectsBadTracingEnv(t *testing.T) {
	for k, v := range map[string]string{
		"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
		"OTEL_TRACES_SAMPLER":         "sometimes",
		"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318",
	} {
		t.Run(k, func(t *testing.T) {
			t.Setenv(k, v)
			err := Run(t.Context(), []string{"serve", "--grpc-addr", "127.0.0.1:0", "--health-addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--endpoints", "127.0.0.1:1"}, io.Discard, io.Discard)
			if !errors.Is(err, ErrUsage) || !strings.Contains(err.Error(), k) || ExitCode(err) != 2 {
				t.Fatalf("serve with %s=%q: %v (exit %d), want a usage error naming %s", k, v, err, ExitCode(err), k)
			}
		})
	}
}

// TestOTelErrorsGoThroughTheLogger: a failed span export is logged by the
// injected logger (so --log-format json applies), not by Go's log package.
func TestOTelErrorsGoThroughTheLogger(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := l.Addr().String()
	l.Close() // nothing listens there: every export fails
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+dead)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	t.Setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "200")
	t.Setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
	var plain bytes.Buffer
	stdlog.SetOutput(&plain)
	defer stdlog.SetOutput(os.Stderr)
	logs := &syncBuffer{}
	tr, err := newTracer(t.Context(), slog.New(slog.NewJSONHandler(logs, nil)))
	if err != nil || tr == nil {
		t.Fatalf("newTracer: %v, %v", tr, err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		_ = tr.Shutdown(ctx)
		otel.SetErrorHandler(otel.ErrorHandlerFunc(func(error) {}))
	}()
	span := tr.StartStream(&tracing.Carrier{}, time.Now(), "/v1/chat/completions", "r1")
	span.End(200)
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(logs.String(), "tracing: OpenTelemetry error") {
		if time.Now().After(deadline) {
			t.Fatalf("no export error in the slog output:\n%s\nplain log:\n%s", logs, plain.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	for line := range strings.Lines(logs.String()) {
		if !json.Valid([]byte(line)) {
			t.Errorf("not JSON: %q", line)
		}
	}
}
