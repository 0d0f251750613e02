package engine_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvbandit/kvbandit/routing"
	"github.com/kvbandit/kvbandit/routing/engine"
)

// TestScoreAndPickCarryPredictions: a predicting policy's per-candidate
// TTFT reaches Engine.Score's scores (and their JSON, which /v1/route
// shows), and the chosen candidate's reaches the committed Decision; a
// policy that does not predict leaves them empty.
func TestScoreAndPickCarryPredictions(t *testing.T) {
	e := engineWith(t, "kvbandit", engine.Options{}, nil, fleet(3)...)
	// Load one endpoint with queued prefill: its predicted wait grows.
	busy, err := e.Pick(t.Context(), req(tokens(20000, 7)))
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Done(routing.NoUsage(routing.OutcomeCancelled))
	d, err := e.Score(t.Context(), req(tokens(2000, 1)))
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Scores) != 3 {
		t.Fatalf("scores %+v", d.Scores)
	}
	for _, s := range d.Scores {
		if s.PredictedTTFTMs <= 0 || s.PrefillMs <= 0 || s.PredictedTTFTMs < s.WaitMs+s.PrefillMs-0.01 {
			t.Fatalf("score %+v", s)
		}
		if s.Endpoint == busy.Endpoint && s.WaitMs <= d.Predicted.Wait.Seconds()*1000 {
			t.Fatalf("the busy endpoint's wait %.1f ms is not above the chosen one's %v", s.WaitMs, d.Predicted.Wait)
		}
	}
	if d.Predicted.TTFT <= 0 || d.Endpoint == busy.Endpoint {
		t.Fatalf("decision %+v", d)
	}
	b, _ := json.Marshal(d.Scores[0])
	for _, k := range []string{"predicted_ttft_ms", "wait_ms", "prefill_ms"} {
		if !strings.Contains(string(b), k) {
			t.Fatalf("JSON %s lacks %s", b, k)
		}
	}
	p, err := e.Pick(t.Context(), req(tokens(2000, 1)))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Done(routing.NoUsage(routing.OutcomeCancelled))
	if p.Predicted.TTFT <= 0 {
		t.Fatalf("committed decision without its prediction: %+v", p.Predicted)
	}

	kv := engineWith(t, "kv", engine.Options{}, nil, fleet(2)...)
	d, err = kv.Score(t.Context(), req(tokens(100, 1)))
	if err != nil {
		t.Fatal(err)
	}
	b, _ = json.Marshal(d.Scores)
	if d.Predicted != (routing.Prediction{}) || strings.Contains(string(b), "predicted_ttft_ms") {
		t.Fatalf("kv predicted: %+v %s", d.Predicted, b)
	}
}
