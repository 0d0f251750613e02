package app

import (
	"errors"
	"io"
	"strings"
	"testing"
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
