package extproc_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"
	"sigs.k8s.io/yaml"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/clock"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/pd"
	"github.com/kvbandit/kvbandit/routing/policy"
)

var update = flag.Bool("update", false, "rewrite the golden want.textproto files")

// goldenCase is testdata/<case>/case.yaml.
type goldenCase struct {
	Description        string             `json:"description"`
	Policy             string             `json:"policy"`
	Endpoints          []routing.Endpoint `json:"endpoints"`
	MaxBodyBytes       int64              `json:"max_body_bytes"`
	ResponseProcessing *bool              `json:"response_processing"`
	TenantHeader       string             `json:"tenant_header"`
	Fallbacks          int                `json:"fallbacks"`
	// PDThresholdTokens turns P/D disaggregation on (routing/pd).
	PDThresholdTokens *int `json:"pd_threshold_tokens"`
	// StripKVTransferParams is Config.StripKVTransferParams.
	StripKVTransferParams bool `json:"strip_kv_transfer_params"`
	// HeldInFlight is the in-flight count expected once the stream has
	// ended, held because the stream ended right after its request phase
	// (a data plane without a response phase); advancing the server's
	// virtual clock past MaxNoResponseHold must then release it.
	HeldInFlight int64 `json:"held_in_flight"`
}

const separator = "\n---\n"

// TestGoldenExchanges replays each testdata case's ProcessingRequests over a
// real gRPC stream on loopback and compares every ProcessingResponse, and
// the stream's final status, with want.textproto. Regenerate with
// `go test ./extproc -run Golden -update` and review the diff.
func TestGoldenExchanges(t *testing.T) {
	dirs, err := filepath.Glob("testdata/golden/*")
	if err != nil || len(dirs) == 0 {
		t.Fatalf("no golden cases: %v", err)
	}
	for _, dir := range dirs {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			var gc goldenCase
			raw, err := os.ReadFile(filepath.Join(dir, "case.yaml"))
			if err != nil {
				t.Fatal(err)
			}
			if err := yaml.UnmarshalStrict(raw, &gc); err != nil {
				t.Fatal(err)
			}
			reqs := readMessages(t, filepath.Join(dir, "requests.textproto"), func() *extprocv3.ProcessingRequest { return &extprocv3.ProcessingRequest{} })
			got, code := runCase(t, gc, reqs)
			wantPath := filepath.Join(dir, "want.textproto")
			if *update {
				writeMessages(t, wantPath, got, code)
				return
			}
			want := readMessages(t, wantPath, func() *extprocv3.ProcessingResponse { return &extprocv3.ProcessingResponse{} })
			wantCode := readStatus(t, wantPath)
			if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
				t.Errorf("responses differ (-want +got):\n%s", diff)
			}
			if code != wantCode {
				t.Errorf("final status %q, want %q", code, wantCode)
			}
		})
	}
}

func runCase(t *testing.T, gc goldenCase, reqs []*extprocv3.ProcessingRequest) ([]*extprocv3.ProcessingResponse, string) {
	t.Helper()
	name := gc.Policy
	if name == "" {
		name = "round_robin"
	}
	rnd := routing.NewRand(1)
	pol, err := policy.Builtin().New(name, policy.Deps{Rand: rnd})
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	deps := engine.Deps{Rand: rnd, Logger: log}
	if gc.PDThresholdTokens != nil {
		if deps.PD, err = pd.New(pd.Config{ThresholdTokens: *gc.PDThresholdTokens}); err != nil {
			t.Fatal(err)
		}
	}
	e := engine.Must(pol, engine.Options{Fallbacks: gc.Fallbacks}, deps)
	defer e.Close()
	if err := e.Update(routing.EndpointSet{Source: "golden", Endpoints: gc.Endpoints}); err != nil {
		t.Fatal(err)
	}
	cfg := extproc.Config{MaxBodyBytes: gc.MaxBodyBytes, ResponseProcessing: true, TenantHeader: gc.TenantHeader, StripKVTransferParams: gc.StripKVTransferParams}
	if gc.ResponseProcessing != nil {
		cfg.ResponseProcessing = *gc.ResponseProcessing
	}
	// The server's timers run on a virtual clock, so that a hold (see
	// HeldInFlight) ends when the case says, not when real time passes.
	vc := clock.NewVirtual(time.Unix(0, 0))
	srv := extproc.NewServer(cfg, extproc.Deps{Picker: e, Logger: log, Registry: prometheus.NewRegistry(), Clock: vc})
	client, stop := startServer(t, srv)
	defer stop()

	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	s, err := client.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range reqs {
		if err := s.Send(r); err != nil {
			break // the server ended the stream early; Recv reports why
		}
	}
	_ = s.CloseSend()
	var got []*extprocv3.ProcessingResponse
	code := "OK"
	for {
		r, err := s.Recv()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				code = status.Code(err).String()
			}
			break
		}
		got = append(got, r)
	}
	// Every decision must have been released, whatever the exit path.
	if err := srv.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	var held int64
	for _, st := range e.Endpoints() {
		held += st.InFlight.Load()
	}
	if held != gc.HeldInFlight {
		t.Errorf("in-flight %d after the stream ended, want %d held", held, gc.HeldInFlight)
	}
	vc.Step(extproc.MaxNoResponseHold)
	for _, st := range e.Endpoints() {
		if n := st.InFlight.Load(); n != 0 {
			t.Errorf("%s: in-flight %d after the stream ended", st.Key, n)
		}
	}
	return got, code
}

func readMessages[M proto.Message](t *testing.T, path string, mk func() M) []M {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []M
	for i, block := range strings.Split(string(raw), separator) {
		if strings.TrimSpace(stripComments(block)) == "" {
			continue
		}
		m := mk()
		if err := prototext.Unmarshal([]byte(block), m); err != nil {
			t.Fatalf("%s block %d: %v", path, i, err)
		}
		out = append(out, m)
	}
	return out
}

func stripComments(s string) string {
	var b strings.Builder
	for _, l := range strings.Split(s, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l)
			b.WriteByte('\n')
		}
	}
	return b.String()
}

func readStatus(t *testing.T, path string) string {
	raw, _ := os.ReadFile(path)
	for _, l := range strings.Split(string(raw), "\n") {
		if s, ok := strings.CutPrefix(l, "# status: "); ok {
			return strings.TrimSpace(s)
		}
	}
	t.Fatalf("%s: no '# status:' line", path)
	return ""
}

func writeMessages(t *testing.T, path string, msgs []*extprocv3.ProcessingResponse, code string) {
	t.Helper()
	var b bytes.Buffer
	fmt.Fprintf(&b, "# Generated by `go test ./extproc -run Golden -update`; review the diff.\n# status: %s\n", code)
	opts := prototext.MarshalOptions{Multiline: true, Indent: "  "}
	for i, m := range msgs {
		if i > 0 {
			b.WriteString(separator)
		} else {
			b.WriteString("\n")
		}
		out, err := opts.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		b.Write(out)
	}
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}
