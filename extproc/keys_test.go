package extproc_test

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvbandit/kvbandit/extproc"
	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
	"github.com/kvbandit/kvbandit/routing/kvindex"
	"github.com/kvbandit/kvbandit/routing/policy/roundrobin"
	"github.com/kvbandit/kvbandit/tokenizer/models"
	"github.com/kvbandit/kvbandit/tokenizer/tokenizertest"
)

// keyed is what the engine saw of one decision.
type keyed struct {
	tokens  []uint32
	keys    routing.BlockKeys
	seed    uint64
	hashed  int
	overlap int
	est     bool
}

// TestPrefixCacheKeysServingPath sends two growing chat conversations (one
// with a cache_salt) through the ext_proc server with the Qwen3 tokenizer and
// its prefix cache, as `kvbandit serve` wires them, to an engine with one
// endpoint. Every decision's prompt must come with block keys that the
// engine used (it hashed no block: fails if keys were not passed or did not
// fit), keys equal to AppendBlockKeys of the tokens for the request's seed
// (fails if reused keys were wrong), turns after the first must take the keys
// of the blocks they share with the turn before from the prefix cache, and each turn's overlap must be the
// blocks it shares with the turn before (inserted by that turn's decision).
func TestPrefixCacheKeysServingPath(t *testing.T) {
	dir := tokenizertest.Require(t, "qwen3/tokenizer.json", "qwen3/tokenizer_config.json")
	treg := models.New(models.Config{Default: filepath.Join(dir, "qwen3")}, slog.New(slog.DiscardHandler))
	if _, err := treg.For("qwen3"); err != nil { // loaded now, not within the tokenizer timeout
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		seen []keyed
		cur  keyed
	)
	e := engine.Must(roundrobin.New(), engine.Options{SyncIndex: true}, engine.Deps{
		Logger: slog.New(slog.DiscardHandler),
		OnDecision: func(r *routing.Request, d *routing.Decision) {
			mu.Lock()
			cur = keyed{tokens: r.Tokens, keys: r.Keys, seed: kvindex.Seed(r.LoRA, r.CacheSalt), overlap: d.Overlap, est: r.Estimated}
			mu.Unlock()
		},
		OnTimings: func(tm engine.Timings) {
			mu.Lock()
			cur.hashed = tm.HashedBlocks
			seen = append(seen, cur)
			mu.Unlock()
		},
	})
	t.Cleanup(e.Close)
	if err := e.Update(routing.EndpointSet{Endpoints: []routing.Endpoint{{Key: "10.0.0.1:8000"}}}); err != nil {
		t.Fatal(err)
	}
	srv := extproc.NewServer(extproc.Config{ResponseProcessing: true}, extproc.Deps{
		Picker:    e,
		Tokenizer: extproc.ModelTokenizer{Registry: treg, KeyBlockSize: e.KeyBlockSize},
		Logger:    slog.New(slog.DiscardHandler),
		Registry:  prometheus.NewRegistry(),
	})
	client, stop := startServer(t, srv)
	defer stop()

	exchange := func(body string) {
		t.Helper()
		s, err := client.Process(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		send(t, s, reqHeaders("/v1/chat/completions", false, filterv3.ProcessingMode_FULL_DUPLEX_STREAMED))
		send(t, s, reqBody(body, true))
		recv(t, s) // the decision
		recv(t, s) // the body
		send(t, s, respHeaders("200"))
		recv(t, s)
		send(t, s, respBody(sseContent+sseUsage, true))
		recv(t, s)
		if _, err := s.Recv(); err == nil {
			t.Fatal("stream not closed after the response")
		}
	}
	const turns = 6
	for _, salt := range []string{"", "tenant-a"} {
		var msgs []map[string]string
		for turn := range turns {
			msgs = append(msgs, map[string]string{"role": "user", "content": text(salt, turn, "question")})
			b, err := json.Marshal(map[string]any{"model": "qwen3", "stream": true, "cache_salt": salt, "messages": msgs})
			if err != nil {
				t.Fatal(err)
			}
			before := treg.CacheStats()[filepath.Join(dir, "qwen3")]
			exchange(string(b))
			after := treg.CacheStats()[filepath.Join(dir, "qwen3")]
			mu.Lock()
			d := seen[len(seen)-1]
			var prev keyed
			if turn > 0 {
				prev = seen[len(seen)-2]
			}
			mu.Unlock()
			if d.est {
				t.Fatalf("salt %q turn %d: the request was routed on estimated tokens", salt, turn)
			}
			want := kvindex.AppendBlockKeys(nil, d.tokens, routing.DefaultBlockSize, d.seed)
			if d.keys.BlockSize != routing.DefaultBlockSize || d.keys.Seed != d.seed || !slices.Equal(d.keys.Keys, want) {
				t.Fatalf("salt %q turn %d: the request's keys (%d at block size %d) are not AppendBlockKeys' %d", salt, turn, len(d.keys.Keys), d.keys.BlockSize, len(want))
			}
			if d.hashed != 0 {
				t.Fatalf("salt %q turn %d: the engine hashed %d blocks", salt, turn, d.hashed)
			}
			reused, hashed := after.KeysReused-before.KeysReused, after.KeysHashed-before.KeysHashed
			if reused+hashed != int64(len(want)) {
				t.Fatalf("salt %q turn %d: %d keys reused + %d hashed for a prompt of %d blocks", salt, turn, reused, hashed, len(want))
			}
			if turn > 0 {
				shared := 0
				for shared < min(len(prev.tokens), len(d.tokens)) && prev.tokens[shared] == d.tokens[shared] {
					shared++
				}
				if d.overlap != shared/routing.DefaultBlockSize {
					t.Errorf("salt %q turn %d: overlap %d blocks, the prompt shares %d with the turn before", salt, turn, d.overlap, shared/routing.DefaultBlockSize)
				}
				// The blocks of the turn before come from the cache, up to
				// its last stored chunk.
				if reused+2 < int64(shared/routing.DefaultBlockSize) {
					t.Errorf("salt %q turn %d: %d keys came from the prefix cache, the prompt shares %d blocks with the turn before", salt, turn, reused, shared/routing.DefaultBlockSize)
				}
			}
			msgs = append(msgs, map[string]string{"role": "assistant", "content": text(salt, turn, "answer")})
			t.Logf("salt %q turn %d: %d tokens, %d keys reused, %d hashed, overlap %d", salt, turn, len(d.tokens), reused, hashed, d.overlap)
		}
	}
}

// text is a few KB of varied prose for a conversation's message.
func text(salt string, turn int, role string) string {
	var b strings.Builder
	for i := range 40 {
		fmt.Fprintf(&b, "In %s's %s number %d, point %d: the %d quick brown foxes jump over %d lazy dogs near the river.\n", salt+"conversation", role, turn, i, turn*i+3, i*i)
	}
	return b.String()
}
