package extproc_test

import (
	"context"
	"log/slog"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/policy/kvbandit"
	"github.com/kvbandit/kvbandit/routing/prefixstate"
)

// TestSessionHeaderGivesSessions: with SessionHeaders naming a header of
// the operator's choice (--session-header x-session-id), nine requests of
// one session, carrying only that header (no total), all go to one of
// four workers under the kvbandit policy; with the default (x-prefix-id)
// the same header is not a session and the requests spread.
func TestSessionHeaderGivesSessions(t *testing.T) {
	for _, tc := range []struct {
		name    string
		headers []string
		sticky  bool
	}{
		{"custom", []string{"x-session-id"}, true},
		{"second of two", []string{"x-absent", "X-Session-Id"}, true},
		{"default", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			seen := routeSession(t, extproc.Config{ResponseProcessing: true, SessionHeaders: tc.headers}, 9)
			if tc.sticky && len(seen) != 1 {
				t.Fatalf("nine requests of one session went to %d workers: %v", len(seen), seen)
			}
			if !tc.sticky && len(seen) == 1 {
				t.Fatalf("requests without a configured session header all went to %v", seen)
			}
		})
	}
}

// routeSession sends n chat requests with x-session-id: s1 through an
// ext_proc server in front of a kvbandit engine over four idle workers and
// counts where they went.
func routeSession(t *testing.T, cfg extproc.Config, n int) map[string]int {
	t.Helper()
	store, err := prefixstate.New(prefixstate.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(store.Close)
	pol, err := kvbandit.New(kvbandit.DefaultConfig(), kvbandit.FromStore(store, nil))
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	eng := engine.Must(pol, engine.Options{}, engine.Deps{Logger: log, Rand: routing.NewRand(3)})
	t.Cleanup(eng.Close)
	if err := eng.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}, {Key: "10.0.0.2:8000"}, {Key: "10.0.0.3:8000"}, {Key: "10.0.0.4:8000"}}}); err != nil {
		t.Fatal(err)
	}
	srv := extproc.NewServer(cfg, extproc.Deps{Picker: eng, Logger: log})
	client, stop := startServer(t, srv)
	t.Cleanup(stop)
	seen := map[string]int{}
	for range n {
		ctx, cancel := context.WithCancel(t.Context())
		s, err := client.Process(ctx)
		if err != nil {
			t.Fatal(err)
		}
		m := reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED)
		hs := m.GetRequestHeaders().GetHeaders()
		hs.Headers = append(hs.Headers, &corev3.HeaderValue{Key: "x-session-id", RawValue: []byte("s1")})
		send(t, s, m)
		send(t, s, reqBody(chat, true))
		seen[destination(recv(t, s))]++
		cancel()
		// One turn after the other, as a chat session sends them: the
		// cancelled decision's load is released before the next turn.
		eventually(t, func() bool {
			for _, st := range eng.Endpoints() {
				if st.InFlight.Load() != 0 {
					return false
				}
			}
			return true
		}, "the cancelled decision still in flight")
	}
	return seen
}
