package app

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"
)

// TestServeAppliesKVEvents: an endpoint configured with kv_events is fed
// from a real ZMQ publisher (vLLM's wire format) into the index.
func TestServeAppliesKVEvents(t *testing.T) {
	pub := zmq4.NewPub(t.Context())
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	cfgPath := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfgPath, []byte(fmt.Sprintf("endpoints:\n- address: 127.0.0.1:8001\n  kv_events: tcp://%s\n", pub.Addr())), 0o644)

	metrics := serveConfig(t, cfgPath) + "/metrics"

	tokens := make([]any, 32)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	ev := []any{"BlockStored", []any{uint64(11), uint64(12)}, nil, tokens, 16, nil, "GPU", nil}
	payload, _ := msgpack.Marshal([]any{1.0, []any{ev}, 0})
	frames := [][]byte{[]byte("kv@127.0.0.1@m"), binary.BigEndian.AppendUint64(nil, 0), payload}

	deadline := time.Now().Add(10 * time.Second)
	for {
		// PUB/SUB drops what is sent before the subscription arrives:
		// repeat (repeats count as duplicates) until the index has it.
		if err := pub.Send(zmq4.NewMsgFrom(frames...)); err != nil {
			t.Fatal(err)
		}
		body := get(t, metrics)
		if strings.Contains(body, `kvbandit_index_entries{mode="event"} 2`) && strings.Contains(body, `kvbandit_kv_events_trusted{endpoint="127.0.0.1:8001"} 1`) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("events never reached the index:\n%s", grepLines(body, "kvbandit_index_entries", "kvbandit_kv_events"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// serveConfig runs Serve with the config file on loopback ports until the
// test ends, and returns the admin base URL.
func serveConfig(t *testing.T, cfgPath string, edit ...func(*ServeOptions)) string {
	t.Helper()
	listen := func() net.Listener {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	ready := make(chan string, 1)
	ls := &Listeners{GRPC: listen(), Health: listen(), Metrics: listen(), Ready: func(_, _, m string) { ready <- m }}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	o := ServeOptions{ConfigPath: cfgPath, Policy: "kv", MaxBodyBytes: 1 << 20, MaxInflight: 8, DecisionTimeout: time.Second, DrainTimeout: 10 * time.Millisecond, StopGrace: 10 * time.Millisecond, ResponseProcessing: true, LogLevel: "info", LogFormat: "text", MetricsAddr: "x"}
	for _, e := range edit {
		e(&o)
	}
	go func() { done <- Serve(ctx, o, slog.New(slog.DiscardHandler), ls) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return "http://" + <-ready
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func grepLines(s string, prefixes ...string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		for _, p := range prefixes {
			if strings.HasPrefix(l, p) {
				out = append(out, l)
			}
		}
	}
	return strings.Join(out, "\n")
}

// TestServeExportsKVConnectionErrors: a peer that connects to a bound
// KV-event socket (kv_events_bind) and sends garbage instead of a ZMTP
// greeting is counted in kvbandit_kv_events_total{kind="connection_errors"},
// so an operator sees who hammers the socket.
func TestServeExportsKVConnectionErrors(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	kvAddr := l.Addr().String()
	l.Close()
	cfgPath := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfgPath, []byte(fmt.Sprintf("endpoints:\n- address: 127.0.0.1:8001\n  kv_events: tcp://%s\n  kv_events_bind: true\n", kvAddr)), 0o644)

	metrics := serveConfig(t, cfgPath) + "/metrics"

	want := `kvbandit_kv_events_total{endpoint="127.0.0.1:8001",kind="connection_errors"} 1`
	deadline := time.Now().Add(20 * time.Second)
	sent := false
	for {
		body := get(t, metrics)
		if strings.Contains(body, want) {
			if !strings.Contains(body, `kvbandit_kv_events_connections{endpoint="127.0.0.1:8001"} 0`) {
				t.Errorf("the garbage connection is still counted as open:\n%s", grepLines(body, "kvbandit_kv_events"))
			}
			return
		}
		if !sent {
			// The socket is bound once discovery has the endpoint.
			if c, err := net.Dial("tcp", kvAddr); err == nil {
				c.Write([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789012345678901234567890123456789012345678901234567890123"))
				io.Copy(io.Discard, c) // until kvbandit closes it
				c.Close()
				sent = true
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s:\n%s", want, grepLines(body, "kvbandit_kv_events"))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
