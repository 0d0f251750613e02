package app

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvbandit/kvbandit/routing/engine"
)

// TestServeIndexesCPUTier: vLLM with its OffloadingConnector publishes the
// GPU's BlockStored, the CPU's location-only BlockStored of the same block
// hashes, then the GPU's BlockRemoved of one; serve's index keeps both
// tiers, and /metrics and /debug/endpoints show the blocks per medium.
func TestServeIndexesCPUTier(t *testing.T) {
	pub := zmq4.NewPub(t.Context())
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	cfgPath := filepath.Join(t.TempDir(), "c.yaml")
	os.WriteFile(cfgPath, []byte(fmt.Sprintf("endpoints:\n- address: 127.0.0.1:8001\n  kv_events: tcp://%s\n", pub.Addr())), 0o644)
	base := serveConfig(t, cfgPath)

	tokens := make([]any, 32)
	for i := range tokens {
		tokens[i] = uint32(i + 1)
	}
	hashes := []any{uint64(11), uint64(12)}
	payload, _ := msgpack.Marshal([]any{1.0, []any{
		[]any{"BlockStored", hashes, nil, tokens, 16, nil, "GPU", nil},
		[]any{"BlockStored", hashes, nil, []any{}, 0, nil, "CPU", nil, nil, 0, nil, nil},
		[]any{"BlockRemoved", []any{uint64(12)}, "GPU"},
	}, 0})
	frames := [][]byte{[]byte("kv@127.0.0.1@m"), binary.BigEndian.AppendUint64(nil, 0), payload}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if err := pub.Send(zmq4.NewMsgFrom(frames...)); err != nil {
			t.Fatal(err)
		}
		body := get(t, base+"/metrics")
		if strings.Contains(body, `kvbandit_index_tier_blocks{medium="cpu"} 2`) && strings.Contains(body, `kvbandit_index_entries{mode="event"} 1`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the CPU tier never reached the index:\n%s", grepLines(body, "kvbandit_index", "kvbandit_kv_events"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	var dbg struct {
		Endpoints []struct {
			Address  string            `json:"address"`
			KVBlocks engine.TierBlocks `json:"kv_blocks"`
		} `json:"endpoints"`
	}
	if err := json.Unmarshal([]byte(get(t, base+"/debug/endpoints")), &dbg); err != nil {
		t.Fatal(err)
	}
	if len(dbg.Endpoints) != 1 || dbg.Endpoints[0].KVBlocks != (engine.TierBlocks{GPU: 1, CPU: 2}) {
		t.Fatalf("/debug/endpoints: %+v, want gpu 1, cpu 2", dbg.Endpoints)
	}
}
