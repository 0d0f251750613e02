package kvevents

import (
	"slices"
	"testing"
	"time"

	"github.com/kvbandit/kvbandit/routing/kvevents/zmtp/zmtptest"
)

// vllmBatch is a map-encoded batch (what current vLLM sends: msgspec
// structs without array_like) of one BlockStored with engine hash h.
func vllmBatch(t *testing.T, h uint64, parent any) []byte {
	return pack(t, map[string]any{"ts": 1.0, "events": []any{map[string]any{
		"type": "BlockStored", "block_hashes": []any{h}, "parent_block_hash": parent,
		"token_ids": anyInts(toks(4, int(h))), "block_size": 4, "lora_id": nil, "medium": "GPU", "lora_name": nil,
	}}, "data_parallel_rank": 0})
}

// TestLibzmqPublisherWithReplay: a libzmq PUB and replay ROUTER shaped
// like vLLM's ZmqEventPublisher (bound, the subscriber connects); two
// batches never reach the subscriber, which fills the gap from the
// replay socket and stays exact.
func TestLibzmqPublisherWithReplay(t *testing.T) {
	peer := zmtptest.Start(t, "--bind", "--replay")
	r := &recorder{}
	s := subscribe(t, Config{Address: peer.PubEndpoint, ReplayAddress: peer.ReplayEndpoint}, r)
	batches := []any{nil, uint64(10), uint64(11), uint64(12)}
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().Messages == 0 { // PUB drops what it sends before the subscription
		if time.Now().After(deadline) {
			t.Fatal("the subscriber never joined")
		}
		peer.Publish(0, "kv@127.0.0.1:8000@m", vllmBatch(t, 10, nil), false)
		peer.Sync()
		time.Sleep(5 * time.Millisecond)
	}
	peer.Publish(1, "kv@127.0.0.1:8000@m", vllmBatch(t, 11, batches[1]), true) // lost
	peer.Publish(2, "kv@127.0.0.1:8000@m", vllmBatch(t, 12, batches[2]), true) // lost
	peer.Publish(3, "kv@127.0.0.1:8000@m", vllmBatch(t, 13, batches[3]), false)
	eventually(t, "4 messages", func() bool { return s.Stats().Messages == 4 })
	peer.Wait("replay 1", 5*time.Second)

	events, trust, resyncs := r.snapshot()
	var hashes []uint64
	for _, ev := range events {
		hashes = append(hashes, ev.Blocks[0].EngineHash)
	}
	if !slices.Equal(hashes, []uint64{10, 11, 12, 13}) {
		t.Errorf("applied %v, want 10..13 in order", hashes)
	}
	if !slices.Equal(trust, []bool{true}) || resyncs != 1 {
		t.Errorf("trust %v, resyncs %d; want [true], 1", trust, resyncs)
	}
	if st := s.Stats(); st.Replays != 1 || st.ReplayFailures != 0 || st.Gaps != 1 || !st.Trusted {
		t.Errorf("stats %+v", st)
	}
}

// TestLibzmqPublisherConnects: a libzmq PUB that connects to a bound SUB
// (vLLM with a non-wildcard endpoint, as llm-d-inference-sim does).
func TestLibzmqPublisherConnects(t *testing.T) {
	r := &recorder{}
	s := subscribe(t, Config{Address: "tcp://127.0.0.1:0", Bind: true}, r)
	peer := zmtptest.Start(t, "--connect", "tcp://"+s.Addr().String())
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().Messages == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the subscriber never got a message")
		}
		peer.Publish(0, "kv@127.0.0.1:8000@m", vllmBatch(t, 10, nil), false)
		peer.Sync()
		time.Sleep(5 * time.Millisecond)
	}
	peer.Publish(1, "kv@127.0.0.1:8000@m", vllmBatch(t, 11, uint64(10)), false)
	eventually(t, "2 messages", func() bool { return s.Stats().Messages == 2 })
	if st := s.Stats(); !st.Trusted || st.Gaps != 0 || st.Connections != 1 {
		t.Errorf("stats %+v", st)
	}
}
