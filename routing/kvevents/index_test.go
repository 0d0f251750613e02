package kvevents

import (
	"slices"
	"testing"

	"github.com/kvbandit/kvbandit/routing/kvindex"
)

// Two vLLM messages (a BlockStored split across them by parent hash, bytes
// hashes) applied to a real index must match a request for the same tokens
// as hashed by the router.
func TestDecodedEventsMatchRouterKeys(t *testing.T) {
	t.Parallel()
	ix, err := kvindex.New(kvindex.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	w := ix.Worker("10.0.0.1:8000", 0)
	tk := toks(48, 5000)
	h := func(i byte) []byte { b := make([]byte, 32); b[31] = i; return b }
	msgs := [][][]byte{
		frames(t, 0, []any{1.0, []any{storedArray([]any{h(1), h(2)}, nil, tk[:32], 16)}, 0}),
		frames(t, 1, map[string]any{"ts": 1.0, "events": []any{map[string]any{
			"type": "BlockStored", "block_hashes": []any{h(3)}, "parent_block_hash": h(2),
			"token_ids": anyInts(tk[32:]), "block_size": 16, "medium": "GPU"}}}),
	}
	for _, m := range msgs {
		b, err := Decode(m)
		if err != nil {
			t.Fatal(err)
		}
		for _, ev := range b.Events {
			if err := ix.Apply(w, ev); err != nil {
				t.Fatal(err)
			}
		}
	}
	keys := kvindex.AppendBlockKeys(nil, tk, 16, kvindex.Seed("", ""))
	ms := ix.Overlaps(16, keys, nil)
	if len(ms) != 1 || ms[0].Worker != w || ms[0].Blocks != 3 {
		t.Fatalf("Overlaps = %+v, want worker %d with 3 blocks", ms, w)
	}
}

// TestIndexLimitMakesUntrusted: a Stored event that the index refuses as
// over the worker's cap leaves the view incomplete, so the endpoint is
// marked untrusted (indexed approximately on top) and the refusal counted;
// AllBlocksCleared empties the worker and makes it exact again.
func TestIndexLimitMakesUntrusted(t *testing.T) {
	ix, err := kvindex.New(kvindex.Options{MaxEventEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close()
	w := ix.Worker("w1", 0)
	r := &recorder{}
	deps := r.deps()
	deps.Apply = func(_ string, _ int, ev kvindex.Event) error { return ix.Apply(w, ev) }
	pub, addr := newPub(t)
	s, err := Subscribe(t.Context(), Config{Endpoint: "w1", Address: addr}, deps)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	join(t, pub, s, storedMsg(t, 0, 10, nil))
	send(t, pub, storedMsg(t, 1, 11, 10))
	eventually(t, "the refusal", func() bool { return s.Stats().IndexLimit == 1 })
	if _, trust, resyncs := r.snapshot(); !slices.Equal(trust, []bool{true, false}) || resyncs != 0 {
		t.Errorf("trust %v, resyncs %d; want [true false], 0", trust, resyncs)
	}
	if st := ix.Stats(); st.Entries != 1 || st.OverCapacity != 1 {
		t.Errorf("index stats %+v", st)
	}
	send(t, pub, frames(t, 2, []any{1.0, []any{[]any{"AllBlocksCleared"}}, 0}))
	eventually(t, "trusted again", func() bool { return s.Stats().Trusted })
	if st := s.Stats(); st.ApplyErrors != 0 || st.IndexLimit != 1 {
		t.Errorf("stats %+v", st)
	}
}
